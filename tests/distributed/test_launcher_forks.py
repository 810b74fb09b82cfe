"""The test launcher's fork server gives each rank what torchrun gives it, and fails, times out
and reports like torchrun (the distributed tests' ranks are forked from it unless a test needs
torchrun itself)."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.distributed.launcher import LAUNCHER_ENV, run_workers

pytestmark = pytest.mark.distributed


def test_a_forked_rank_sees_what_a_torchrun_rank_sees(tmp_path, monkeypatch):
    env = {"LAUNCH_PROBE": "passed"}
    forked = run_workers("launch_probe.py", "--sleep", "0", env=env, out_dir=tmp_path / "forked")
    monkeypatch.setenv(LAUNCHER_ENV, "torchrun")
    launched = run_workers("launch_probe.py", "--sleep", "0", env=env, out_dir=tmp_path / "torchrun")
    for rank, (mine, theirs) in enumerate(zip(forked, launched, strict=True)):
        assert mine["env"]["RANK"] == str(rank) and mine["env"]["LAUNCH_PROBE"] == "passed"
        assert mine["env"] == theirs["env"]
        assert mine["sum"] == theirs["sum"] == 3.0
        assert mine["threads"] == theirs["threads"] == 1
        assert mine["argv"][2:] == theirs["argv"][2:] == ["--sleep", "0"]
        for key in ("name", "path0", "cwd", "error_file"):
            assert mine[key] == theirs[key], key


def test_a_failing_rank_fails_the_launch_with_its_traceback_and_stops_the_other():
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        run_workers("launch_probe.py", "--fail", timeout=120)
    message = str(failed.value)
    assert "[rank1]: ValueError: the probe's rank 1 fails on purpose" in message
    assert "exitcode  : 1" in message
    assert time.monotonic() - started < 60


def test_a_launch_past_its_timeout_is_killed_and_raises(tmp_path):
    with pytest.raises(TimeoutError, match="did not finish in 5"):
        run_workers("launch_probe.py", "--sleep", "300", timeout=5, out_dir=tmp_path)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    time.sleep(1)
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
