"""Semantics 1 and 2: accumulation syncs only at boundaries, and weights match a big-batch reference.

Each launch trains a seeded MLP and a tiny GPT-2 with GA in {1, 4} on a dataloader whose
length leaves a short last window, for 3 optimizer steps, then compares the fp32 weights
with a single-process plain-torch run that takes each window as one big batch (rtol 1e-5).
Gradient reductions are counted by wrapping torch.distributed before DeepSpeed initialises
(DDP: a counting comm hook).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers, shared_scenarios

pytestmark = pytest.mark.distributed


def _scenarios(backend: str, stages: list[int], coalesce: bool = False) -> list[dict]:
    return [
        {"model": model, "ga": ga, "backend": backend, "zero_stage": stage, "coalesce": coalesce}
        for model in ("mlp", "gpt2")
        for ga in (1, 4)
        for stage in stages
    ]


def _check_parity(results: list[dict]) -> None:
    for r in results:
        label = f"{r['backend']} zero{r['zero_stage']} {r['model']} GA={r['ga']} coalesce={r['coalesce']}"
        assert r["num_optimizer_steps"] == 3, label
        assert r["all_close"], f"{label}: max rel diff {r['max_rel_diff']:.2e}, abs {r['max_abs_diff']:.2e}"
        expected = [False] * (r["ga"] - 1) + [True]
        expected = expected * 2 + ([False] * (max(r["ga"] // 2, 1) - 1) + [True])
        assert r["boundaries"] == expected, label


DEEPSPEED = {
    "test_deepspeed_zero_0_to_3_match_the_big_batch_reference": _scenarios("deepspeed", [0, 1, 2, 3]),
    "test_deepspeed_coalesced_reduction_is_once_per_step_with_the_same_weights": _scenarios(
        "deepspeed", [2, 3], coalesce=True
    ),
}


@pytest.fixture(scope="module")
def deepspeed_runs(request: pytest.FixtureRequest) -> dict[str, list[dict]]:
    """One launch for the scenarios of both DeepSpeed tests (those selected: the quick tier
    launches ZeRO 0-3 alone)."""
    scenarios, slices = shared_scenarios(request, DEEPSPEED)
    results = run_workers("parity.py", "--scenarios", json.dumps(scenarios))[0]["results"]
    assert len(results) == len(scenarios)
    return {name: results[where] for name, where in slices.items()}


@pytest.mark.deepspeed
def test_deepspeed_zero_0_to_3_match_the_big_batch_reference(deepspeed_runs):
    results = deepspeed_runs["test_deepspeed_zero_0_to_3_match_the_big_batch_reference"]
    _check_parity(results)
    for r in results:
        per_step = r["reductions"] / r["num_optimizer_steps"]
        if r["zero_stage"] in (0, 1):
            assert per_step == 1, (
                f"zero{r['zero_stage']} {r['model']} GA={r['ga']}: {per_step} reductions/step"
            )
        elif r["ga"] > 1:
            # partitioned gradients: DeepSpeed reduces on every micro-step by design
            assert per_step > 1, r


@pytest.mark.deepspeed
def test_deepspeed_coalesced_reduction_is_once_per_step_with_the_same_weights(deepspeed_runs):
    results = deepspeed_runs["test_deepspeed_coalesced_reduction_is_once_per_step_with_the_same_weights"]
    _check_parity(results)
    for r in results:
        assert r["reductions"] / r["num_optimizer_steps"] == 1, r
        assert not r["warnings"], r["warnings"]


def test_accelerate_fallback_matches_the_reference_and_reduces_once_per_step():
    ranks = run_workers("parity.py", "--scenarios", json.dumps(_scenarios("accelerate", [0])))
    results = ranks[0]["results"]
    _check_parity(results)
    for r in results:
        assert r["backend_name"] == "accelerate"
        assert r["reductions"] == r["num_optimizer_steps"], r


def test_accelerate_fallback_runs_zero_2_and_3_as_fsdp2_with_the_same_weights():
    """ZeRO-3 -> FSDP2 FULL_SHARD, ZeRO-2 -> SHARD_GRAD_OP on the fallback where accelerate offers
    FSDP (GPUs). On these CPU ranks the platform check is pretended (`--pretend-fsdp`, see
    `workers/_common.pretend_fsdp_platform`); torch's FSDP2 and accelerate's preparation are real.
    Reduce-scatter runs every micro-step like ZeRO-2/3, or once per step with coalescing."""
    scenarios = _scenarios("accelerate", [2, 3]) + _scenarios("accelerate", [2, 3], coalesce=True)
    ranks = run_workers("parity.py", "--pretend-fsdp", "--scenarios", json.dumps(scenarios))
    results = ranks[0]["results"]
    _check_parity(results)
    for r in results:
        label = f"zero{r['zero_stage']} {r['model']} GA={r['ga']} coalesce={r['coalesce']}"
        assert r["backend_name"] == "accelerate" and r["fsdp"], label
        assert not r["fallback_warnings"], (label, r["fallback_warnings"])
        reshard = r["fsdp_reshard_after_forward"]
        if r["zero_stage"] == 3 and r["model"] == "gpt2":
            assert any(reshard), (label, reshard)  # the transformer blocks re-shard after forward
        if r["zero_stage"] == 2:
            assert not any(reshard), (label, reshard)  # kept gathered until backward
        per_step = r["reductions"] / r["num_optimizer_steps"]
        if r["coalesce"] or r["ga"] == 1:
            assert per_step == 1, (label, per_step)
        else:
            assert per_step > 1, (label, per_step)  # reduce-scatter on every micro-step
