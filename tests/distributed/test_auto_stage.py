"""`Engine(zero_stage="auto")` on 2 real DeepSpeed ranks (CPU, gloo): with a memory budget that
ZeRO-2's estimated peak does not fit (with the 20 % margin) and ZeRO-3's does, both ranks choose
ZeRO-3, DeepSpeed runs it, rank 0 alone logs the one decision line, and each rank's measured peak
resident memory over its baseline stays under the budget. Ranks given different budgets decide
differently: every rank stops with an error saying so.

The model is the memory-peak benchmark's 4-layer Llama decoder (21M parameters, bf16, AdamW, micro
batch 2 x 128 tokens) with `stage3_max_live_parameters` = 1M: with DeepSpeed's default ZeRO-3 keeps
a model this small gathered, and on 2 ranks its peak would then be ZeRO-2's.
"""

from __future__ import annotations

import sys

import pytest

from ds_engine import memory
from tests.distributed.launcher import ROOT, run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))
import bench_memory_peak as bench  # noqa: E402

LIVE = 10**6
MARGIN = 0.2  # the Engine's default memory_margin


def _peak(stage: int) -> int:
    return memory.estimate_peak(
        bench.model_config("decoder"),
        zero_stage=stage,
        micro_batch=bench.MICRO,
        seq_len=bench.SEQ,
        world_size=2,
        device="cpu",
        zero_init=False,  # "auto" counts the model as built: it exists when prepare decides
        stage3_max_live_parameters=LIVE,
    ).per_rank_total


def test_auto_chooses_zero_3_under_a_budget_zero_2_does_not_fit_and_stays_under_it() -> None:
    z2, z3 = _peak(2), _peak(3)
    budget = int(z2 * (1 + MARGIN)) - 10**6
    assert z3 * (1 + MARGIN) <= budget < z2 * (1 + MARGIN)
    ranks = run_workers(
        "auto_stage.py", "--budget", str(budget), "--live", str(LIVE), timeout=600, env=bench.ALLOCATOR_ENV
    )
    peaks = ", ".join(f"{r['peak'] / 1e6:.1f}" for r in ranks)
    print(
        f"budget {budget / 1e6:.1f} MB; estimated ZeRO-2 {z2 / 1e6:.1f}, ZeRO-3 {z3 / 1e6:.1f}; "
        f"measured {peaks}"
    )
    for rank in ranks:
        assert (rank["zero_stage"], rank["offload_optimizer"]) == (3, "none")
        assert rank["ds_zero"]["stage"] == 3 and rank["ds_zero"]["stage3_max_live_parameters"] == LIVE
        assert rank["finite"], rank["losses"]
        assert rank["peak"] < budget, (rank["peak"], budget)
    decided = [line for line in ranks[0]["lines"] if 'zero_stage="auto" chose' in line]
    assert len(decided) == 1 and "ZeRO-3:" in decided[0] and "ZeRO-2 needs" in decided[0]
    assert not any("auto" in line for line in ranks[1]["lines"])


def test_ranks_that_decide_differently_all_stop_and_say_why() -> None:
    """A rank whose budget differs (a GPU of another size) decides another stage: every rank stops
    with an error saying to give one budget, none trains on a set-up its peers do not run."""
    budget = int(_peak(3) * (1 + MARGIN)) + 10**6
    ranks = run_workers(
        "auto_stage.py", "--budget", str(budget), "--budget-rank1", "100GB", "--live", str(LIVE), timeout=600
    )
    for rank in ranks:
        assert "was decided differently across ranks" in rank["error"], rank
        assert "HINT: pass memory_budget=" in rank["error"]
