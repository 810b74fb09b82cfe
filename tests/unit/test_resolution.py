"""One resolution per run: `Engine(...)` resolves its configuration once and everything after
it (the backend, zero.Init's config, `prepare`'s DeepSpeed JSON) reads that result."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ds_engine.config as config_module
from ds_engine import Engine
from ds_engine.config import EngineConfig, ResolvedConfig
from ds_engine.ds_config import build_ds_config, render_ds_config
from tests.helpers import regression_loader, train


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts calls of the one resolution function and of its merge step."""
    counts = {"resolve_config": 0, "resolve_engine_config": 0}
    import ds_engine.backends.base  # noqa: F401  (bound there too: patched everywhere it is bound)

    for name in counts:
        real = getattr(config_module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        for module in list(sys.modules.values()):
            if (
                getattr(module, "__name__", "").startswith("ds_engine")
                and getattr(module, name, None) is real
            ):
                monkeypatch.setattr(module, name, counted)
    yield counts


def _train(engine: Engine) -> None:
    with engine.init_context():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(engine, *engine.prepare(model, optimizer, regression_loader()))


def test_accelerate_engine_and_prepare_resolve_once(resolutions: dict[str, int]) -> None:
    base = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback lists choices it cannot honour
        engine = Engine(base, backend="accelerate", gradient_accumulation_steps=2)
    _train(engine)
    assert resolutions == {"resolve_config": 1, "resolve_engine_config": 1}
    assert engine.config.zero_stage == 2 and engine.config.gradient_clipping == 1.0
    assert engine.config.gradient_accumulation_steps == 2 and engine.num_optimizer_steps == 2


@pytest.mark.deepspeed
def test_deepspeed_zero3_init_context_and_prepare_resolve_once(
    resolutions: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # DeepSpeed's ZeRO-3 engine swaps torch.nn.functional.linear process-wide and leaves it so:
    # put torch's back after this test (later tests script and save plain Linear modules)
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    engine = Engine(
        {"gradient_clipping": 1.0}, backend="deepspeed", zero_stage=3, gradient_accumulation_steps=2
    )
    try:
        _train(engine)  # zero.Init's config and prepare's config: both rendered from the one resolution
    finally:
        engine.end_training()  # later tests expect no process group
    assert resolutions == {"resolve_config": 1, "resolve_engine_config": 1}
    ds = engine.ds_config
    assert ds is not None
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_batch_size"] == 4
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"]["stage"] == 3
    # a plain nn.Module has no hidden size: DeepSpeed's own bucket defaults, by the one rule
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert engine.num_optimizer_steps == 2


def test_rendering_a_resolution_never_resolves_again(resolutions: dict[str, int]) -> None:
    resolved = config_module.resolve_config(
        {"zero_optimization": {"stage": 2}}, {"gradient_accumulation_steps": 4}, world_size=2
    )
    assert resolutions == {"resolve_config": 1, "resolve_engine_config": 1}
    out = render_ds_config(resolved, world_size=2, micro_batch_size=3, hidden_size=8)
    again = build_ds_config(resolved, world_size=2, micro_batch_size=3, hidden_size=8)
    assert resolutions == {"resolve_config": 1, "resolve_engine_config": 1}
    assert out == again and out["train_batch_size"] == 3 * 4 * 2 and out["zero_optimization"]["stage"] == 2
    # the user-facing builder resolves once when handed an unresolved EngineConfig
    user = build_ds_config(
        EngineConfig(gradient_accumulation_steps=4),
        base={"zero_optimization": {"stage": 2}},
        world_size=2,
        micro_batch_size=3,
        hidden_size=8,
    )
    assert resolutions == {"resolve_config": 2, "resolve_engine_config": 2}
    assert user == out


def test_resolved_config_is_frozen_and_keeps_choices_base_and_effective() -> None:
    base = {"zero_optimization": {"stage": 3}, "bfloat16": {"enabled": True}}
    resolved = config_module.resolve_config(base, {"gradient_clipping": 1.0}, world_size=1)
    assert isinstance(resolved, ResolvedConfig)
    assert resolved.user.explicit_fields == {"gradient_clipping"} and resolved.user.zero_stage == 0
    assert resolved.effective.zero_stage == 3 and resolved.effective.precision == "bf16"
    assert resolved.effective.explicit_fields == resolved.user.explicit_fields
    assert resolved.base == base and resolved.base is not base  # as given (legacy alias kept), a copy
    assert resolved.world_size == 1 and resolved.pending_problems == ()
    with pytest.raises(AttributeError):
        resolved.effective = EngineConfig()  # type: ignore[misc]
    changed = resolved.with_effective(reduce_bucket_size=7)
    assert changed.effective.reduce_bucket_size == 7 and resolved.effective.reduce_bucket_size == "auto"
    assert changed.user is resolved.user and changed.base is resolved.base
