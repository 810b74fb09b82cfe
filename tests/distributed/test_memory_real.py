"""The estimator against reality: model-state bytes held by real DeepSpeed on 2 CPU ranks.

One launch measures ZeRO 0, 2 and 3 in turn (bf16, AdamW, ~52M-parameter GPT-2) and each
rank reports the bytes of every tensor storage reachable from the engine (see the worker).
The estimate for 2 "GPUs" must be within 30 % here; `scripts/benchmarks/bench_memory.py` prints the
figures and targets 15 %. bf16 because that is how models are trained on accelerators: it
exercises the 16-bit weights plus fp32 master/gradient copies the formulas are about (fp32
is covered by the unit tests' formulas and can be measured with the bench script).
"""

from __future__ import annotations

import pytest

from ds_engine.memory import estimate_memory
from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]


def test_estimate_matches_measured_model_states_zero_0_2_3() -> None:
    ranks = run_workers("memory_real.py", "--stages", "0,2,3", "--precision", "bf16", nproc=2, timeout=1500)
    assert len(ranks) == 2
    stages_seen = []
    peaks: dict[int, dict] = {}
    for per_rank in zip(*(r["results"] for r in ranks)):
        first = per_rank[0]
        stage = first["stage"]
        stages_seen.append(stage)
        assert first["world_size"] == 2
        assert 45_000_000 < first["num_params"] < 60_000_000
        est = estimate_memory(
            first["num_params"],
            largest_layer_params=first["largest_layer_params"],
            num_gpus_per_node=2,
            zero_stage=stage,
            precision="bf16",
        )
        expected = est.accelerator.model_states  # no layer is gathered at the measured moments
        for r in per_rank:
            measured = r["peak"]["total"]
            ratio = measured / expected
            assert 0.7 <= ratio <= 1.3, (stage, measured, expected, r["peak"]["breakdown"])
        peaks[stage] = first["peak"]
    assert stages_seen == [0, 2, 3]
    # The partitioning is real: ZeRO-0 bf16 holds 20 bytes/param on every rank (2 weights + 2 grads
    # + 4 master + 4 fp32 grads + 8 Adam); ZeRO-2 about half; ZeRO-3 also halves the weights.
    num_params = ranks[0]["results"][0]["num_params"]
    assert peaks[0]["total"] >= 19 * num_params
    assert peaks[2]["total"] < 0.6 * peaks[0]["total"]
    assert peaks[3]["breakdown"]["params"] < 0.6 * peaks[2]["breakdown"]["params"]
