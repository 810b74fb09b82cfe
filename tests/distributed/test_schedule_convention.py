"""A schedule sized from the un-prepared or the prepared dataloader ends at LR 0 on 2 ranks.

Scripts written for accelerate size their schedule from the un-prepared dataloader
(`epochs * len(loader) / gas`) and rely on accelerate stepping a prepared scheduler
`num_processes` times per optimizer step; ds_engine's own scripts size it from the optimizer
steps the run takes. `Engine.prepare` reads which from the schedule's length where that tells
(transformers' schedules expose `num_training_steps`), else applies the class's
`default_schedule_reading` ("prepared" for Engine, "unprepared" for an accelerate-compatible
subclass) or `engine.schedule_sized_from`, and says so in one log line on the main process
(workers/schedule_convention.py). Each case: one epoch, 16 micro-batches of 2 on 2 ranks.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

CASES = [
    # sized from the prepared loader, GA=2: 4 steps, fits only the prepared reading (4 < 8 per epoch)
    {
        "name": "prepared_auto",
        "ga": 2,
        "batches": 32,
        "schedule_from": "prepared",
        "per_step": 1,
        "level": "INFO",
    },
    # sized from the un-prepared loader, uneven (31 batches): 7 fits only the un-prepared reading
    {
        "name": "unprepared_auto_uneven",
        "ga": 2,
        "batches": 31,
        "schedule_from": "unprepared",
        "per_step": 2,
        "level": "INFO",
    },
    # sized from the un-prepared loader, even: fits both; Engine's default reading is "prepared",
    # so the script says which it means
    {
        "name": "unprepared_explicit",
        "ga": 2,
        "batches": 32,
        "schedule_from": "unprepared",
        "sized_from": "unprepared",
        "per_step": 2,
        "level": None,
    },
    # the same script under an accelerate-compatible subclass: its default reading
    {
        "name": "unprepared_accelerate_default",
        "ga": 2,
        "batches": 32,
        "schedule_from": "unprepared",
        "accelerate_style": True,
        "per_step": 2,
        "level": "WARNING",
    },
    # accelerate's hand-written accumulation at GA=1 (gas 2), under the accelerate-compatible default
    {
        "name": "hand_written_accelerate_default",
        "ga": 1,
        "gas": 2,
        "batches": 32,
        "schedule_from": "unprepared",
        "accelerate_style": True,
        "per_step": 2,
        "level": "WARNING",
    },
    # ds_engine's own GA=1 scripts (hand-written or not): Engine's default reading
    {
        "name": "hand_written_engine_default",
        "ga": 1,
        "gas": 2,
        "batches": 32,
        "schedule_from": "prepared",
        "per_step": 1,
        "level": "WARNING",
    },
]


def test_schedules_sized_either_way_end_at_zero_after_the_last_optimizer_step():
    cases = [{**c, "backend": "accelerate"} for c in CASES]
    ranks = run_workers("schedule_convention.py", "--cases", json.dumps(cases))
    for r, other in zip(ranks[0]["results"], ranks[1]["results"]):
        label = r["name"]
        assert r["got_per_step"] == r["per_step"], (label, r["got_per_step"], r["log"])
        lrs = r["lrs"]
        assert len(lrs) == r["optimizer_steps"] == 8, (label, lrs)  # 16 micro-steps per rank, 2 per step
        assert lrs[-1] == 0.0 and lrs[-2] > 0.0, (label, lrs)  # ends at 0, at the last step and not before
        assert r["got_per_step"] == other["got_per_step"], label
        assert other["log"] == [], label  # the main process alone says it
        if r["level"] is None:
            assert r["log"] == [], (label, r["log"])
        else:
            assert len(r["log"]) == 1 and r["log"][0].startswith(r["level"]), (label, r["log"])
            reading = "unprepared" if r["per_step"] == 2 else "prepared"
            assert f"sized from the {reading} dataloader" in r["log"][0], (label, r["log"])
            assert "schedule_sized_from" in r["log"][0], (label, r["log"])
