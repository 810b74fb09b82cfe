"""Streams (`IterableDataset`) and custom batch samplers on 2 real ranks, both backends.

The final weights equal a one-process reference that sees the same global batches (an uneven
stream end with a short last window; a length-grouped batch sampler of whole, variable batches),
a run resumed mid-epoch from a checkpoint ends on the same weights, and `gather_for_metrics`
returns every sample exactly once (see workers/data_pipelines.py).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

N = 23
WEIGHTS_ATOL = 1e-5  # fp32, a handful of SGD steps: measured <= 1e-7


def _check(results: list[list[dict]]) -> None:
    by_rank = [r["results"] for r in results]
    for scenario in zip(*by_rank):
        name = scenario[0]["name"]
        for r, result in enumerate(scenario):
            assert result["seen"] == result["expected_seen"], f"{name}: rank {r}'s batches"
            # resumed after window 1 (4 batches) of epoch 0: the rest, batch for batch
            assert result["resumed_seen"] == result["seen"][4:], f"{name}: rank {r} resumed elsewhere"
            assert result["gathered_ids"] == list(range(N)) or sorted(result["gathered_ids"]) == list(
                range(N)
            ), f"{name}: rank {r} gathered {result['gathered_ids']}"
            if result["kind"] == "batches":
                assert "different batches on different ranks" in result["refused"], result["refused"]
                assert "HINT" in result["refused"]
        steps = {result["steps"] for result in scenario}
        assert len(steps) == 1, f"{name}: ranks took different optimizer steps {steps}"
        first = scenario[0]
        assert first["trained_distance"] > 1e-3, f"{name}: did not train"
        assert first["max_abs_diff"] < WEIGHTS_ATOL, f"{name}: off the reference by {first['max_abs_diff']}"
        assert first["resume_max_abs_diff"] < WEIGHTS_ATOL, (
            f"{name}: resumed run off by {first['resume_max_abs_diff']}"
        )


def _scenarios(backend: str, stage: int, pairs: list[tuple[str, str]]) -> str:
    return json.dumps(
        [
            {
                "name": f"{backend}{stage}_{data}_{api}",
                "backend": backend,
                "zero_stage": stage,
                "data": data,
                "api": api,
            }
            for data, api in pairs
        ]
    )


def test_fallback_trains_streams_and_batch_samplers_like_one_process():
    pairs = [("stream", "accelerator"), ("batches", "engine"), ("hf_stream", "engine")]
    scenarios = _scenarios("accelerate", 0, pairs)
    _check(run_workers("data_pipelines.py", "--scenarios", scenarios, timeout=300))


@pytest.mark.deepspeed
def test_zero2_trains_streams_and_batch_samplers_like_one_process():
    scenarios = _scenarios("deepspeed", 2, [("stream", "engine"), ("batches", "accelerator")])
    _check(run_workers("data_pipelines.py", "--scenarios", scenarios, timeout=300))
