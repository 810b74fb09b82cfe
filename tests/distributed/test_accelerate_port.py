"""Porting: an accelerate script runs under ds_engine with only its import line changed.

Each example in `tests/accelerate_examples/` (written for accelerate, by this project) runs on 2
CPU ranks (gloo) under plain accelerate, then with `from accelerate import` rewritten to
`from ds_engine import` under ds_engine (the fallback where DeepSpeed is not installed, and
DeepSpeed ZeRO-0, and ZeRO-2 through `DS_ENGINE_CONFIG`, where it is). The per-step losses must
agree within 1e-5 relative and the final learning rate must be the same.

The examples size their LR schedule from the *prepared* loader and step it once per optimizer
step (`step_scheduler_with_optimizer=False`, stepped at `sync_gradients`); the convention for
schedules sized the accelerate way (from the un-prepared loader, stepped `num_processes` times
by accelerate) is the scheduler-convention work, checked by the `accelerate_sizing` case (expected to fail
until that convention lands).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launcher import (
    ROOT,
    launch_example,
    port_accelerate_script,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLES = ROOT / "tests" / "accelerate_examples"


def _run(
    example: str,
    tmp: Path,
    flavour: str,
    *args: str,
    files: tuple[str, ...] = ("result.json",),
    config: dict[str, Any] | str | None = None,
) -> dict:
    """Run `example` as accelerate ("accelerate") or ported ("auto", "zero2": the `zero2` preset,
    as `ds-engine launch --config zero2` hands it over; `config`: that DeepSpeed JSON instead)."""
    script = EXAMPLES / example
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / flavour
    env: dict[str, str] = {}
    if flavour != "accelerate":
        script = port_accelerate_script(script, tmp)
        if flavour == "zero2" and config is None:
            config = "zero2"
        if isinstance(config, dict):
            path = tmp / "ds_config.json"
            path.write_text(json.dumps(config))
            config = str(path)
        if config is not None:
            env["DS_ENGINE_CONFIG"] = config
    phases = [(list(args), files)]
    if example == "checkpoint_example.py":  # a full run that saves a checkpoint, then a resumed one
        phases = [(list(args), ("full.json",)), ([*args, "--resume"], ("resumed.json",))]
    for phase, written in phases:
        # torch's exit-time abort is tolerated once the phase's results are written
        launch_example(script, out, *phase, env=env, files=written)
    return {name: json.loads((out / name).read_text()) for name in files}


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert len(ours["losses"]) == len(theirs["losses"]) > 0
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-7)
    assert ours["lrs"][-1] == pytest.approx(theirs["lrs"][-1], rel=1e-6, abs=1e-12)


_CASES = {
    "accumulate_example.py": ((), ("result.json",)),
    "checkpoint_example.py": ((), ("full.json", "resumed.json")),
    "handwritten_accumulation_example.py": ((), ("result.json",)),
    "metrics_tracking_example.py": ((), ("result.json",)),
    "shuffle_example.py": ((), ("result.json",)),
}
_REFERENCE_ONLY = {"deepspeed_config_example.py": ((), ("result.json",))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Plain accelerate's run of each example, once per module."""
    cache: dict[str, dict] = {}

    def get(example: str) -> dict:
        if example not in cache:
            args, files = (_CASES | _REFERENCE_ONLY)[example]
            cache[example] = _run(
                example, tmp_path_factory.mktemp("accelerate"), "accelerate", *args, files=files
            )
        return cache[example]

    return get


def _check(example: str, ours: dict, theirs: dict) -> None:
    if example == "checkpoint_example.py":
        for name in ("full.json", "resumed.json"):
            _same(ours[name], theirs[name])
        full, resumed = ours["full.json"], ours["resumed.json"]
        tail = len(resumed["losses"])
        assert resumed["steps"] == full["steps"] and 0 < tail < len(full["losses"])
        assert resumed["losses"] == pytest.approx(full["losses"][-tail:], rel=1e-6)  # resume is exact
    else:
        _same(ours["result.json"], theirs["result.json"])
    if example == "shuffle_example.py":  # the same samples in the same order on each rank
        assert ours["result.json"]["orders"] == theirs["result.json"]["orders"]
    if example == "metrics_tracking_example.py":
        result, expected = ours["result.json"], theirs["result.json"]
        assert result["counted"] == expected["counted"] == [13, 13]  # padding dropped
        assert result["accuracies"] == pytest.approx(expected["accuracies"])
        assert result["tracker"] == "TensorBoardTracker"
        assert result["utilities"] == expected["utilities"]
        assert result["utilities"]["padded"] == [0.0, 1.0, -1.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("example", sorted(_CASES))
def test_ported_example_matches_accelerate(example, reference, tmp_path):
    """`auto`: the fallback without DeepSpeed, DeepSpeed ZeRO-0 with it."""
    args, files = _CASES[example]
    _check(example, _run(example, tmp_path, "auto", *args, files=files), reference(example))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.deepspeed
@pytest.mark.parametrize("example", sorted(_CASES))
def test_ported_example_matches_accelerate_on_zero2(example, reference, tmp_path):
    args, files = _CASES[example]
    _check(example, _run(example, tmp_path, "zero2", *args, files=files), reference(example))


def test_schedule_sized_the_accelerate_way_ends_where_accelerate_ends(tmp_path):
    theirs = _run("accumulate_example.py", tmp_path / "theirs", "accelerate", "--accelerate-sizing")
    ours = _run("accumulate_example.py", tmp_path / "ours", "auto", "--accelerate-sizing")
    _same(ours["result.json"], theirs["result.json"])


# accelerate's `deepspeed_with_config_support` pattern: DeepSpeed's optimizer (and scheduler)
# from the config, with "auto" values filled from DummyOptim / DummyScheduler. torch_adam: the
# same AdamW arithmetic as the reference's torch AdamW.
_OPTIMIZER_BLOCK = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}


@pytest.mark.deepspeed
def test_dummy_optim_with_a_config_optimizer_block_matches_accelerate(reference, tmp_path):
    """DummyOptim (lr, weight-decay groups) + DummyScheduler(lr_scheduler_callable=...) over
    DeepSpeed's optimizer: the same losses and schedule as accelerate's run with torch AdamW."""
    config = {"zero_optimization": {"stage": 2}, "optimizer": _OPTIMIZER_BLOCK}
    ours = _run("deepspeed_config_example.py", tmp_path, "zero2", config=config)["result.json"]
    theirs = reference("deepspeed_config_example.py")["result.json"]
    assert theirs["optimizer"] == "AcceleratedOptimizer" and ours["optimizer"] == "PreparedOptimizer"
    _same(ours, theirs)
    assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-6, abs=1e-12)


@pytest.mark.deepspeed
def test_dummy_scheduler_fills_a_config_scheduler_block_as_accelerate_does(reference, tmp_path):
    """DeepSpeed's WarmupDecayLR from the config, "auto" values filled as accelerate fills them:
    warm-up from 0 to DummyOptim's lr over `warmup_num_steps`, then linear decay towards 0 at
    `total_num_steps` / num_processes (the script sizes it from the un-prepared loader, as
    accelerate's reference run does, whose schedule ends at the same optimizer step)."""
    scheduler = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_type": "linear",
        },
    }
    config = {"zero_optimization": {"stage": 2}, "optimizer": _OPTIMIZER_BLOCK, "scheduler": scheduler}
    ours = _run("deepspeed_config_example.py", tmp_path, "zero2", config=config)["result.json"]
    theirs = reference("deepspeed_config_example.py")["result.json"]
    steps = len(theirs["lrs"])
    assert len(ours["lrs"]) == len(ours["losses"]) == steps > 4
    assert theirs["lrs"][-1] == 0.0  # accelerate's torch schedule ends exactly at the last step
    lr, warmup, total = 1e-2, 4, steps  # the script's defaults; total: 64 samples / (2 ranks x 2) x 2 epochs
    # DeepSpeed's WarmupDecayLR counts its iterations from 0 at the first step: after optimizer
    # step k it is at iteration k - 1 (so its last LR is lr / (total - warmup), not 0). A total
    # left undivided (64) would decay half as fast.
    expected = [
        lr * (i / warmup if i < warmup else max(0.0, (total - i) / (total - warmup))) for i in range(steps)
    ]
    assert ours["lrs"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
