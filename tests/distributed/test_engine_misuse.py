"""Training-call misuse on 2 CPU ranks, both backends (see `workers/engine_misuse.py`): loaders of
different lengths per rank, an optimizer over another model, a `break` then a save then a
resume, and every call after `end_training()`."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed]

BACKENDS = [pytest.param("deepspeed", marks=pytest.mark.deepspeed), "accelerate"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_misuse_on_two_ranks(backend):
    ranks = run_workers("engine_misuse.py", "--backend", backend, timeout=600)
    for r in ranks:
        assert "error" not in r, f"{r['error']}\n{r.get('tb')}"
    for r in ranks:
        # loaders whose length differs per rank: refused at prepare on every rank, naming each length
        lengths = r["lengths"]
        assert lengths["dataset"].startswith(
            "ValueError: `engine.prepare`: dataloader #0 differs across ranks"
        )
        assert "rank 0: 4 batches (32 samples), rank 1: 6 batches (48 samples)" in lengths["dataset"]
        assert "HINT: give every rank the same whole dataset" in lengths["dataset"]
        assert not lengths["prepared_model_after_error"]
        assert "rank 0: 5 batches (40 samples), rank 1: 8 batches (64 samples)" in lengths["sampler"]
        assert lengths["equal"] == [4, 12]
        # an optimizer over another model: refused at prepare on every stage; the real one trains
        for stage, case in r["foreign"].items():
            assert case["error"].startswith(
                "ValueError: `engine.prepare(model, optimizer)`: the optimizer (AdamW)"
            )
            assert "none of its 4 parameters is a parameter of the model" in case["error"], stage
            assert "shape (8, 4)" in case["error"], stage  # ZeRO-3: the full shape, not the empty shard
            assert case["steps"] == 4 and case["trained"], (stage, case)
        # a break, a save, a resume: the batches of the uninterrupted run
        assert r["resumed"] == r["whole"] and len(r["whole"]) == 12
        # after end_training: the group is gone, every call raises the same error, nothing is written
        after = r["after_end"]
        assert not after["group_alive"] and not after["written"]
        assert after["place"] == [r["rank"], 2, r["rank"] == 0]  # rank queries still answer
        for name, error in after["errors"].items():
            assert (
                error.startswith("RuntimeError: `")
                and "` after `end_training()`: end_training() destroyed" in error
            ), (
                name,
                error,
            )
            assert "HINT: call `end_training()` once" in error
    assert ranks[0]["whole"] != ranks[1]["whole"]  # each rank its own shard
