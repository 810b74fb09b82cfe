"""The whole-peak estimate and the communication volumes against real 2-rank DeepSpeed runs on CPU.

A reduced `scripts/benchmarks/bench_memory_peak.py`: the decoder under ZeRO-0 and ZeRO-3 and the LoRA
decoder under ZeRO-2 with the optimizer offloaded, each a real torchrun launch training through the
Engine; the estimate (`estimate_peak(...).per_rank_total`) must be within 15 % of each rank's
measured peak resident memory over its baseline. The same launches, and ZeRO-1 and a ZeRO-2 run
with gradient accumulation 2, count the bytes of every `torch.distributed` collective DeepSpeed
calls in one optimizer step; `communication_per_step` must match them within 2 % (scalar
collectives such as the overflow check are what is left).
"""

from __future__ import annotations

import sys

import pytest

from ds_engine import memory
from tests.distributed.launcher import ROOT

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))
import bench_memory_peak as bench  # noqa: E402


def _expected_bytes(rank: dict, stage: int, ga: int) -> float:
    vol = memory.communication_per_step(
        rank["num_params"],
        world_size=rank["world_size"],
        gradient_accumulation_steps=ga,
        trainable_params=rank["trainable_params"],
    )
    return vol[stage].total


@pytest.mark.parametrize(
    ("kind", "setup", "ga", "check_peak"),
    [
        ("decoder", "0", 1, True),
        ("decoder", "1", 1, False),
        ("decoder", "2", 2, False),
        ("decoder", "3", 1, True),
        ("lora", "2+cpu", 1, True),
    ],
)
def test_peak_and_bytes_per_step_match_a_real_run(kind: str, setup: str, ga: int, check_peak: bool) -> None:
    stage, _ = bench.parse_setup(setup)
    ranks = bench.measure(kind, setup, ga=ga, steps=2, timeout=600)
    assert len(ranks) == 2
    estimate = bench.estimate(kind, setup)
    for rank in ranks:
        assert rank["num_params"] == estimate.states.num_params
        assert rank["trainable_params"] == estimate.states.trainable_params
        counted = rank["comm_bytes_last_step"]
        expected = _expected_bytes(rank, stage, ga)
        assert counted == pytest.approx(expected, rel=0.02), (rank["comm_bytes_by_call"], expected)
        if check_peak:
            ratio = estimate.per_rank_total / rank["peak"]
            assert 0.85 <= ratio <= 1.15, (kind, setup, ratio, estimate.terms(), rank["peak"])
