"""The worker harness tolerates torch's exit-time abort only after every rank finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import _EXIT_ABORT, _aborted_after_finishing

SUMMARY = (
    "Failures:\n  exitcode  : -15 (pid: 1)  (SIGTERM)\nRoot Cause:\n  exitcode  : -6 (pid: 2)  (SIGABRT)\n"
)


def _results(out: Path, ranks: int) -> None:
    for rank in range(ranks):
        (out / f"rank{rank}.json").write_text("{}")


def test_abort_after_every_rank_finished_is_tolerated_with_a_warning(tmp_path: Path) -> None:
    _results(tmp_path, 2)
    with pytest.warns(UserWarning, match="exit-time abort"):
        assert _aborted_after_finishing(f"{_EXIT_ABORT}\n{SUMMARY}", tmp_path, 2)


@pytest.mark.parametrize(
    ("output", "written"),
    [
        (f"{_EXIT_ABORT}\n{SUMMARY}", 1),  # a rank never finished
        (SUMMARY, 2),  # SIGABRT, but not the exit-time abort
        (f"{_EXIT_ABORT}\n{SUMMARY}".replace("-15", "1"), 2),  # another rank exited with 1
        (f"[rank0]: Traceback (most recent call last):\n{_EXIT_ABORT}\n{SUMMARY}", 2),  # it raised
    ],
)
def test_any_other_failure_still_fails(tmp_path: Path, output: str, written: int) -> None:
    _results(tmp_path, written)
    assert not _aborted_after_finishing(output, tmp_path, 2)


def test_a_run_that_hangs_after_writing_its_results_is_killed_and_marked(tmp_path):
    """`run_command(finished=...)`: results written, processes still alive after the grace: killed,
    output marked EXIT_HANG; a run that never finishes still times out; a normal run is untouched."""
    import sys as _sys

    from tests.distributed.launcher import EXIT_HANG, run_command

    flag = tmp_path / "result.json"
    python = _sys.executable
    script = f"import time; print('working', flush=True); open({str(flag)!r}, 'w'); time.sleep(600)"
    hung = run_command([python, "-c", script], timeout=60, finished=flag.exists, exit_grace=1)
    assert hung.returncode == -9 and hung.stdout.endswith(EXIT_HANG) and "working" in hung.stdout
    with pytest.raises(TimeoutError, match="did not finish in 2s"):
        run_command([python, "-c", "import time; time.sleep(600)"], timeout=2, finished=lambda: False)
    normal = run_command([python, "-c", "print('ok')"], timeout=60, finished=lambda: True, exit_grace=30)
    assert normal.returncode == 0 and normal.stdout.strip() == "ok"


@pytest.mark.parametrize("mode", ["finished", "timeout"])
def test_a_helper_process_in_its_own_session_does_not_keep_the_run_waiting(tmp_path, mode):
    """A grandchild started in a new session (out of the run's process group) inherits the output
    pipe; killing the group alone left the pipe open and the read waited forever. The whole tree
    is killed: the run is judged within its limits and no process of it is left."""
    import sys as _sys
    import time as _time

    import psutil

    from tests.distributed.launcher import EXIT_HANG, run_command

    flag = tmp_path / "result.json"
    pid_file = tmp_path / "grandchild.pid"
    python = _sys.executable
    sleeper = "[sys.executable, '-c', 'import time; time.sleep(600)']"
    lines = [
        "import subprocess, sys, time",
        f"child = subprocess.Popen({sleeper}, start_new_session=True)",
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))",
        "print('working', flush=True)",
    ]
    if mode == "finished":
        lines.append(f"open({str(flag)!r}, 'w')")
    script = "\n".join([*lines, "time.sleep(600)"])
    started = _time.monotonic()
    if mode == "finished":
        hung = run_command([python, "-c", script], timeout=120, finished=flag.exists, exit_grace=1)
        assert hung.returncode == -9 and hung.stdout.endswith(EXIT_HANG) and "working" in hung.stdout
    else:
        with pytest.raises(TimeoutError, match="did not finish in 5s"):
            run_command([python, "-c", script], timeout=5, finished=lambda: False)
    assert _time.monotonic() - started < 60
    grandchild = int(pid_file.read_text())
    _time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
