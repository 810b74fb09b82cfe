"""Engine behaviour in a single process (no launcher): backend choice, errors, boundaries."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ds_engine import ConfigError, Engine
from ds_engine._imports import is_deepspeed_available
from tests.helpers import backend_alone, regression_loader, train


def _loader(n: int = 10, batch: int = 2) -> DataLoader:
    return regression_loader(n, batch)


def _train(engine: Engine, n: int = 10) -> list[bool]:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train(engine, *engine.prepare(model, optimizer, _loader(n)))


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="backend='magic'"):
        Engine(backend="magic")


def test_unknown_choice_names_the_closest_field():
    with pytest.raises(ConfigError, match="zero_stage"):
        Engine(backend="accelerate", zero_stag=2)


def test_bad_choice_value_is_reported_before_any_process_group():
    import torch.distributed as dist

    with pytest.raises(ConfigError, match="zero_stage"):
        Engine(backend="accelerate", zero_stage=4)
    assert not dist.is_initialized()


def test_conflict_between_json_and_choice_is_an_error():
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        Engine({"zero_optimization": {"stage": 3}}, backend="accelerate", zero_stage=2)


def test_fallback_lists_every_choice_it_cannot_honour_in_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Engine(backend="accelerate", zero_stage=3, offload_optimizer="cpu", precision="fp16")
    messages = [str(w.message) for w in caught if "cannot honour" in str(w.message)]
    assert len(messages) == 1
    for expected in ("zero_stage=3", "offload_optimizer='cpu'", "precision='fp16'"):
        assert expected in messages[0]


def _fallback_notes(monkeypatch, *, fsdp_platform: bool, world: int, **choices) -> str:
    from ds_engine.backends.accelerate import AccelerateBackend

    monkeypatch.setattr(AccelerateBackend, "_platform_offers_fsdp", lambda self: fsdp_platform)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Engine(backend="accelerate", **choices)
    messages = [str(w.message) for w in caught if "cannot honour" in str(w.message)]
    assert len(messages) <= 1
    assert not dist.is_initialized()
    return messages[0] if messages else ""


def test_fallback_on_cpu_runs_zero_3_as_ddp_and_says_why(monkeypatch):
    notes = _fallback_notes(monkeypatch, fsdp_platform=False, world=2, zero_stage=3)
    assert "zero_stage=3: runs as DDP" in notes and "FSDP only on GPUs" in notes


@pytest.mark.parametrize("stage", [2, 3])
def test_fallback_where_accelerate_has_fsdp_honours_zero_2_and_3(monkeypatch, stage):
    assert "zero_stage" not in _fallback_notes(monkeypatch, fsdp_platform=True, world=2, zero_stage=stage)


def test_fallback_fsdp_lists_what_it_still_cannot_honour(monkeypatch):
    notes = _fallback_notes(monkeypatch, fsdp_platform=True, world=2, zero_stage=3, offload_optimizer="cpu")
    assert "parameters to CPU as well" in notes and "zero_stage" not in notes
    notes = _fallback_notes(monkeypatch, fsdp_platform=True, world=2, zero_stage=1)
    assert "zero_stage=1: runs as DDP" in notes and "optimizer-only sharding" in notes
    notes = _fallback_notes(monkeypatch, fsdp_platform=True, world=1, zero_stage=3)
    assert "zero_stage=3: runs as DDP" in notes and "one process" in notes


@pytest.mark.parametrize(("stage", "reshard"), [(2, False), (3, True)])
def test_fallback_fsdp_plugin_mirrors_the_zero_stage(stage, reshard):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ds_engine.backends.accelerate import AccelerateBackend
    from ds_engine.config import EngineConfig

    plugin = backend_alone(AccelerateBackend, EngineConfig.from_kwargs(zero_stage=stage))._fsdp_plugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    to_cpu = EngineConfig.from_kwargs(zero_stage=stage, offload_optimizer="cpu")
    offloading = backend_alone(AccelerateBackend, to_cpu)
    assert isinstance(offloading._fsdp_plugin().cpu_offload, CPUOffloadPolicy)


def test_boundaries_every_ga_micro_steps_and_at_the_end_of_the_loader():
    engine = Engine(backend="accelerate", gradient_accumulation_steps=4)
    # 5 batches: windows of 4 and a short last window of 1
    assert _train(engine) == [False, False, False, True, True]
    assert engine.num_optimizer_steps == 2 and engine.num_micro_steps == 5


def test_backward_outside_accumulate_counts_its_own_micro_steps():
    engine = Engine(backend="accelerate", gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    seen = []
    for _ in range(4):
        engine.backward(model(torch.ones(1, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        seen.append(engine.sync_gradients)
    assert seen == [False, True, False, True] and engine.num_optimizer_steps == 2


def test_clip_grad_norm_must_match_the_configured_clipping():
    engine = Engine(backend="accelerate", gradient_clipping=1.0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(ConfigError, match=r"gradient_clipping=1\.0"):
        engine.clip_grad_norm_(model.parameters(), 0.5)
    norm = engine.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    assert norm is not None and engine.grad_norm == pytest.approx(norm)


def test_clip_grad_norm_refuses_a_subset_of_the_parameters():
    """DeepSpeed clips every trained parameter globally: `parameters` is honoured only whole."""
    engine = Engine(backend="accelerate", gradient_clipping=1.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.ones(1, 4)).sum())
    inner = engine.unwrap_model(model)
    with pytest.raises(
        ConfigError, match=r"got 2 of the model's 3 trained parameters.*model\.parameters\(\)"
    ):
        engine.clip_grad_norm_(inner[1].parameters(), 1.0)
    with pytest.raises(ConfigError, match=r"tensors that are not its parameters"):
        engine.clip_grad_norm_([*inner.parameters(), torch.zeros(1, requires_grad=True)], 1.0)
    trained_only = [p for p in inner.parameters() if p.requires_grad]
    assert engine.clip_grad_norm_(trained_only, 1.0) is not None  # frozen ones may be left out
    assert engine.clip_grad_norm_(model.parameters(), 1.0) is not None


def test_prepare_refuses_objects_it_does_not_know():
    engine = Engine(backend="accelerate")
    with pytest.raises(TypeError, match="str"):
        engine.prepare("not a model")


def test_prepare_refuses_two_models():
    engine = Engine(backend="accelerate")
    with pytest.raises(ValueError, match="2 models"):
        engine.prepare(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))


def test_backward_before_prepare_says_what_to_do():
    engine = Engine(backend="accelerate")
    with pytest.raises(RuntimeError, match="prepare"):
        engine.backward(torch.ones(1, requires_grad=True).sum())


def test_prepare_returns_objects_in_the_order_given():
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = _loader()
    out = engine.prepare(loader, scheduler, model, optimizer)
    names = [type(o).__name__ for o in out]
    assert names[0] == "PreparedDataLoader" and names[1] == "OverflowAwareScheduler"
    assert names[3] == "PreparedOptimizer" and engine.unwrap_model(out[2]) is model
    assert engine.backend_name == "accelerate" and engine.ds_config is None


@pytest.mark.deepspeed
def test_deepspeed_backend_single_process_builds_and_exposes_its_config():
    engine = Engine(backend="deepspeed", gradient_accumulation_steps=2, gradient_clipping=1.0)
    try:
        assert _train(engine) == [False, True, False, True, True]
        assert engine.backend_name == "deepspeed"
        cfg = engine.ds_config
        assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 2
        assert cfg["train_batch_size"] == 4 and cfg["gradient_clipping"] == 1.0
        assert engine.num_optimizer_steps == 3
    finally:
        engine.end_training()


@pytest.mark.nodeepspeed
def test_without_deepspeed_auto_warns_once_and_explicit_request_says_how_to_install():
    assert not is_deepspeed_available()
    with pytest.raises(ImportError, match=r"ds-engine\[deepspeed\]"):
        Engine(backend="deepspeed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine()
    relevant = [w for w in caught if "DeepSpeed is not installed" in str(w.message)]
    assert len(relevant) == 1 and "ds-engine[deepspeed]" in str(relevant[0].message)
    assert engine.backend_name == "accelerate"


def test_non_finite_steps_are_skipped_counted_and_raise_after_the_configured_run():
    engine = Engine(backend="accelerate", max_consecutive_skipped_steps=3)
    model = torch.nn.Linear(4, 1)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        engine.backward(model(torch.ones(1, 4)).sum() * float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        assert engine.step_was_skipped
    assert engine.num_skipped_steps == 2 and engine.num_optimizer_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    engine.backward(model(torch.ones(1, 4)).sum())  # a finite step resets the run
    optimizer.step()
    optimizer.zero_grad()
    assert not engine.step_was_skipped and engine.num_optimizer_steps == 1
    for _ in range(2):
        engine.backward(model(torch.ones(1, 4)).sum() * float("nan"))
        optimizer.step()
        optimizer.zero_grad()
    engine.backward(model(torch.ones(1, 4)).sum() * float("nan"))
    with pytest.raises(FloatingPointError, match="max_consecutive_skipped_steps"):
        optimizer.step()


@pytest.mark.deepspeed
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_deepspeed_zero0_fp32_skips_non_finite_steps_and_reports_the_pre_clip_norm(clip: float) -> None:
    """fp32 ZeRO-0 has no overflow check in DeepSpeed: a NaN or inf step is skipped, the weights
    untouched; a finite one reports the global norm before clipping (DeepSpeed's own, where it
    clips) and trains exactly as clipped SGD does."""
    engine = Engine(backend="deepspeed", zero_stage=0, micro_batch_size=1, gradient_clipping=clip)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        reference = torch.nn.Linear(4, 1)
        reference.load_state_dict(model.state_dict())
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.arange(4.0).reshape(1, 4)
        for factor in (float("nan"), 1.0, float("inf"), 1.0, 1.0):
            before = [p.detach().clone() for p in model.parameters()]
            engine.backward(model(x).sum() * factor)
            optimizer.step()
            optimizer.zero_grad()
            if factor != 1.0:
                assert engine.step_was_skipped and not math.isfinite(engine.grad_norm)
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                continue
            ref_optimizer.zero_grad()
            reference(x).sum().backward()
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip or float("inf"))
            ref_optimizer.step()
            assert not engine.step_was_skipped
            assert engine.grad_norm == pytest.approx(float(expected), rel=1e-6)
            for p, r in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert engine.num_skipped_steps == 2 and engine.num_optimizer_steps == 3
    finally:
        engine.end_training()
