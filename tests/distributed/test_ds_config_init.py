"""The builder's output for ZeRO 0-3 initializes real DeepSpeed on 2 CPU ranks and trains one step."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]


def test_built_configs_initialize_deepspeed_for_every_stage() -> None:
    results = run_workers("ds_config_init.py", nproc=2, timeout=600)
    first = results[0]["stages"]
    for r, res in enumerate(results):
        assert res["world_size"] == 2
        assert sorted(res["stages"]) == ["0", "1", "2", "3"]
        for stage, st in res["stages"].items():
            assert st["zero_stage"] == int(stage), (r, stage)
            assert st["ds_config"]["train_batch_size"] == st["train_batch_size"] == 2 * 1 * 2
            assert st["gradient_clipping"] == 1.0 and st["global_steps"] == 1
            # one optimizer step on this rank's data lowers its loss
            assert st["loss_after"] < st["loss_before"], (r, stage, st)
    # Same seed and data: every stage starts from the same loss and takes the same step.
    for res in results:
        for stage, st in res["stages"].items():
            ref = res["stages"]["0"]
            assert st["loss_before"] == pytest.approx(ref["loss_before"], rel=1e-6), stage
            assert st["loss_after"] == pytest.approx(ref["loss_after"], rel=1e-4, abs=1e-6), stage
    # ranks see different data, so their losses differ (the step really used both shards)
    assert first["0"]["loss_before"] != results[1]["stages"]["0"]["loss_before"]
