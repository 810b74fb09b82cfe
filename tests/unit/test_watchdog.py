"""The hang watchdog on its own: a real TCP store shared by two watchdogs standing for two ranks."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ds_engine.watchdog import HANG_EXIT_CODE, Watchdog, hang_hint


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )


def _pair(
    store: dist.TCPStore, timeout_s: float, timeout_s_rank1: float | None = None
) -> tuple[Watchdog, Watchdog, list[str], list[str]]:
    reports: list[list[str]] = [[], []]
    dogs = tuple(
        Watchdog(
            rank=r,
            world_size=2,
            timeout_s=timeout_s if r == 0 or timeout_s_rank1 is None else timeout_s_rank1,
            store=store,
            stream=io.StringIO(),
            on_hang=reports[r].append,
            poll_s=0.05,
        )
        for r in (0, 1)
    )
    return dogs[0], dogs[1], reports[0], reports[1]


def _wait(pred, limit: float = 5.0) -> None:
    end = time.monotonic() + limit
    while not pred() and time.monotonic() < end:
        time.sleep(0.02)


def test_a_call_alone_in_a_collective_is_named_with_the_fix(store: dist.TCPStore) -> None:
    # rank 1's own timeout is far away: it learns of the hang from rank 0, through the store
    r0, r1, rep0, rep1 = _pair(store, timeout_s=0.5, timeout_s_rank1=30)
    r0.start(), r1.start()
    started = time.monotonic()
    # rank 1 went on training while rank 0 saves alone
    with r1.watch("backward", step=7), r0.watch("save_pretrained", step=6):
        _wait(lambda: bool(rep0))
        _wait(lambda: bool(rep1))  # rank 1 learns of it at its next look and reports too
    elapsed = time.monotonic() - started
    r0.stop(), r1.stop()
    assert rep0 and rep1, "both ranks must report"
    assert 0.5 <= elapsed < 3, elapsed
    assert "rank 0 made no progress" in rep0[0] and "`save_pretrained` at optimizer step 6" in rep0[0]
    assert "rank 1 is in `backward` (step 7)" in rep0[0]
    assert "not under `if engine.is_main_process:`" in rep0[0]
    assert "rank 0 reported a hang" in rep1[0] and "`backward` at optimizer step 7" in rep1[0]


def test_a_rank_that_left_the_loop_is_named(store: dist.TCPStore) -> None:
    r0, r1, rep0, _ = _pair(store, timeout_s=0.4)
    r0.start(), r1.start()
    r1.stop(ended=True)  # rank 1 called end_training at step 3
    with r0.watch("step", step=4):
        _wait(lambda: bool(rep0))
    r0.stop()
    assert "has left the training loop" in rep0[0] and "decide a `break` together" in rep0[0]


def test_time_between_calls_and_calls_that_return_never_count(store: dist.TCPStore) -> None:
    r0, _, rep0, _ = _pair(store, timeout_s=0.3)
    r0.start()
    for step in range(10):  # many short calls over more than the timeout in total
        with r0.watch("backward", step=step):
            time.sleep(0.05)
    time.sleep(0.5)  # the user's own work between calls
    with r0.watch("save_pretrained"):
        for _ in range(8):  # a long call that reports progress (one more shard written)
            time.sleep(0.1)
            r0.progress()
    r0.stop()
    assert rep0 == []


def test_nested_marks_keep_the_outer_call() -> None:
    dog = Watchdog(rank=0, world_size=1, timeout_s=10)
    with dog.watch("save_pretrained", step=2), dog.watch("gathered"):
        assert dog._status()["call"] == "save_pretrained"
    assert dog._status()["call"] is None


def test_hints() -> None:
    assert "collective" in hang_hint("get_state_dict", {1: {"call": "step", "step": 3}})
    assert "every rank is in this call" in hang_hint("backward", {1: {"call": "backward"}})
    assert "rank 1 is not in an Engine call" in hang_hint("backward", {1: {"call": None}})
    left = hang_hint("step", {1: {"call": "end_training", "step": 3}})
    assert "rank 1 is in `end_training` (step 3) and has left the training loop" in left
    with pytest.raises(ValueError, match="timeout_s = 0"):
        Watchdog(rank=0, world_size=1, timeout_s=0)


def test_without_a_store_the_rank_dumps_its_stack_and_exits_with_the_hang_status() -> None:
    code = textwrap.dedent(
        """
        import threading
        from ds_engine.watchdog import Watchdog
        dog = Watchdog(rank=0, world_size=1, timeout_s=0.3, poll_s=0.05).start()
        def stuck_in_a_collective():
            threading.Event().wait(30)
        with dog.watch("backward", step=5):
            stuck_in_a_collective()
        """
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert time.monotonic() - started < 20
    assert "rank 0 made no progress" in proc.stderr and "`backward` at optimizer step 5" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr  # the faulthandler stack of the main thread


def test_the_thread_is_a_daemon_and_stops() -> None:
    dog = Watchdog(rank=0, world_size=1, timeout_s=5, poll_s=0.05).start()
    assert any(t.name == "ds_engine-watchdog" and t.daemon for t in threading.enumerate())
    dog.stop()
    assert not any(t.name == "ds_engine-watchdog" for t in threading.enumerate())
