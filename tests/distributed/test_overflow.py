"""Overflow: the scheduler advances exactly once per applied optimizer step.

Non-finite gradients are injected on rank 0 only (loss * inf) in optimizer windows 2 and 3
of 8, so both ranks must agree to skip. fp16 runs the real DeepSpeed loss scaler (CPU fp16
enabled for the test by patching `CPU_Accelerator.is_fp16_supported`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.distributed.launcher import exit_probes, run_workers, shared_scenarios

pytestmark = pytest.mark.distributed

INJECT = [2, 3]
STEPS = 8


def _launch(scenarios: list[dict]) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="ds_engine_overflow_"))
    results = run_workers("overflow.py", "--scenarios", json.dumps(scenarios), out_dir=out)[0]["results"]
    # several Engines ran in each process; none left its process group to finalization
    assert exit_probes(out) == [False, False]
    assert len(results) == len(scenarios)
    return results


def _no_errors(results: list[dict]) -> list[dict]:
    for r in results:
        assert "error" not in r, f"{r}\n{r.get('tb')}"
    return results


def _run(scenarios: list[dict]) -> list[dict]:
    return _no_errors(_launch(scenarios))


def _check_skips(r: dict) -> None:
    label = f"{r['backend']} zero{r.get('zero_stage', 0)} {r['precision']}"
    records = r["records"]
    assert len(records) == STEPS, label
    assert [rec["skipped"] for rec in records] == [i in INJECT for i in range(STEPS)], label
    assert r["num_skipped_steps"] == len(INJECT), label
    assert r["num_optimizer_steps"] == STEPS - len(INJECT), label
    assert r["params_finite"], label
    # the LR holds still across skipped steps and then continues exactly where it stopped
    lrs = [rec["lr"] for rec in records]
    for i in INJECT:
        assert lrs[i] == lrs[i - 1], f"{label}: LR moved on skipped step {i}: {lrs}"
    for rec in records:
        if not rec["skipped"]:
            assert isinstance(rec["grad_norm"], float), f"{label}: grad norm {rec['grad_norm']}"


def _hf_linear_lrs(r: dict) -> None:
    # transformers' linear schedule, 2 warm-up steps of 8, peak 1e-3, evaluated at applied steps
    applied = 0
    for rec in r["records"]:
        applied += not rec["skipped"]
        expected = 1e-3 * (applied / 2 if applied < 2 else max(0.0, (STEPS - applied) / (STEPS - 2)))
        assert rec["lr"] == pytest.approx(expected), r["records"]
    assert r["scheduler_steps"] == r["num_optimizer_steps"]


def _lambda_lrs(r: dict) -> None:
    # LambdaLR(1/(k+1)) from lr 1e-3: after the n-th applied step the LR is 1e-3/(n+1)
    applied = 0
    for rec in r["records"]:
        applied += not rec["skipped"]
        assert rec["lr"] == pytest.approx(1e-3 / (applied + 1)), r["records"]
    assert r["scheduler_steps"] == r["num_optimizer_steps"] == r["last_epoch"]


ZERO_0_TO_3 = [
    {
        "backend": "deepspeed",
        "zero_stage": stage,
        "precision": precision,
        "inject": INJECT,
        "ga": 2,
        "steps": STEPS,
        "hysteresis": 2,
        "initial_scale_power": 8,
    }
    for stage in (0, 1, 2, 3)
    for precision in ("fp16", "bf16")
]
CLIP_AND_SCHEDULES = [
    {
        "backend": "deepspeed",
        "zero_stage": stage,
        "precision": "fp16",
        "inject": INJECT,
        "ga": 4,
        "steps": STEPS,
        "clip": 1.0,
        "hf_schedule": True,
    }
    for stage in (0, 2)
] + [
    {
        "backend": "deepspeed",
        "zero_stage": 2,
        "precision": "bf16",
        "inject": INJECT,
        "ga": 2,
        "steps": STEPS,
        "ds_scheduler": True,
    },
    # fp32 ZeRO-0 clips inside DeepSpeed's step, which has no overflow check of its own there
    {
        "backend": "deepspeed",
        "zero_stage": 0,
        "precision": "fp32",
        "inject": INJECT,
        "ga": 4,
        "steps": STEPS,
        "clip": 1.0,
        "hf_schedule": True,
    },
    {
        "backend": "deepspeed",
        "zero_stage": 0,
        "precision": "fp32",
        "inject": INJECT,
        "ga": 2,
        "steps": STEPS,
        "clip": 1.0,
        "ds_scheduler": True,
    },
]


@pytest.fixture(scope="module")
def deepspeed_runs(request: pytest.FixtureRequest) -> dict[str, list[dict]]:
    """One launch for the DeepSpeed scenarios of both DeepSpeed tests (those selected)."""
    scenarios, slices = shared_scenarios(
        request,
        {
            "test_deepspeed_fp16_and_bf16_skip_steps_and_hold_the_schedule_on_zero_0_to_3": ZERO_0_TO_3,
            "test_deepspeed_clip_with_ga4_fp16_and_hf_schedules_and_native_scheduler": CLIP_AND_SCHEDULES,
        },
    )
    results = _launch(scenarios)
    return {name: results[where] for name, where in slices.items()}


@pytest.mark.deepspeed
def test_deepspeed_fp16_and_bf16_skip_steps_and_hold_the_schedule_on_zero_0_to_3(deepspeed_runs):
    results = deepspeed_runs["test_deepspeed_fp16_and_bf16_skip_steps_and_hold_the_schedule_on_zero_0_to_3"]
    assert len(results) == len(ZERO_0_TO_3)
    for r in _no_errors(results):
        _check_skips(r)
        _lambda_lrs(r)
        scales = [rec["loss_scale"] for rec in r["records"]]
        if r["precision"] == "bf16":
            assert scales == [None] * STEPS
            continue
        assert scales[0] == 256.0
        if r["zero_stage"] == 0:
            # DeepSpeed's fused FP16_Optimizer (ZeRO-0) halves on every overflow: no hysteresis
            assert scales[2:4] == [128.0, 64.0], scales
        else:
            # ZeRO 1-3 loss scaler with hysteresis=2: the first overflow spends the hysteresis,
            # the second consecutive one halves the scale
            assert scales[2:4] == [256.0, 128.0], scales
        assert scales[4:] == [scales[3]] * (STEPS - 4), scales  # window 1000: no growth yet


@pytest.mark.deepspeed
def test_deepspeed_clip_with_ga4_fp16_and_hf_schedules_and_native_scheduler(deepspeed_runs):
    results = _no_errors(
        deepspeed_runs["test_deepspeed_clip_with_ga4_fp16_and_hf_schedules_and_native_scheduler"]
    )
    assert len(results) == len(CLIP_AND_SCHEDULES)
    for r in results:
        _check_skips(r)
    for r in (results[0], results[1], results[3]):
        _hf_linear_lrs(r)
    for r in results[3:]:  # fp32 ZeRO-0: skipped inside DeepSpeed's step(), where it clips
        assert r["clip_norm_kept"] and r["deepspeed_skipped_steps"] == len(INJECT), r
    for native in (results[2], results[4]):
        # DeepSpeed's WarmupLR (4 linear warm-up steps to 1e-3) advanced once per applied step
        assert native["last_epoch"] == native["num_optimizer_steps"] - 1  # its counter starts at -1
        assert native["records"][-1]["lr"] == pytest.approx(1e-3)


def test_fallback_skips_non_finite_steps_and_holds_the_schedule():
    scenarios = [
        {"backend": "accelerate", "precision": precision, "inject": INJECT, "ga": 2, "steps": STEPS}
        for precision in ("fp32", "bf16", "fp16")
    ] + [
        {
            "backend": "accelerate",
            "precision": "fp16",
            "inject": INJECT,
            "ga": 4,
            "steps": STEPS,
            "clip": 1.0,
            "hf_schedule": True,
        }
    ]
    results = _run(scenarios)
    for r in results:
        _check_skips(r)
        assert r["backend_name"] == "accelerate"
    for r in results[:3]:
        _lambda_lrs(r)
    _hf_linear_lrs(results[3])
