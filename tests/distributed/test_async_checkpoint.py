"""Background checkpoint saves (`blocking=False`) on 2 real ranks, the fallback and ZeRO-2.

* Training with background saves ends bit-identical to training with blocking saves, and a
  run resumed from a background save's tag ends identical too (the files hold the state of the
  save's step, although training changed the live tensors while they were written).
* A background write that fails on rank 1 only (EROFS injected into that rank's writes) does
  not stop the save call; the next wait raises it on both ranks, naming rank 1, the file and
  the cause, and the previous tag stays the newest complete one.
* A SIGKILL while the thread writes: the restarted run resumes from the previous checkpoint,
  and its next background save replaces the dead save's staging folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed.launcher import WORKERS, run_command, run_workers, torchrun_command, worker_env

pytestmark = pytest.mark.distributed

BACKENDS = [
    "accelerate",
    pytest.param("deepspeed", marks=pytest.mark.deepspeed),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=["fallback", "zero2"])
def test_background_saves_train_identically_and_agree_on_errors(tmp_path: Path, backend: str) -> None:
    results = run_workers(
        "async_checkpoint.py",
        "--backend",
        backend,
        "--mode",
        "train",
        "--root",
        str(tmp_path / "ckpt"),
        timeout=900,
        out_dir=tmp_path / "out",
    )
    for rank, got in enumerate(results):
        assert "crash" not in got, got.get("crash")
        assert got["error"], f"rank {rank}: the failed background write was not raised"
        assert got["error"].startswith("OSError: "), got["error"]
        assert re.search(r"rank 1 failed: OSError: \[Errno 30\] Read-only file system", got["error"]), got
        assert "rng_state_rank1.pt" in got["error"] or "optim_states" in got["error"], got["error"]
        assert "'step_6' is still the newest complete one" in got["error"], got["error"]
        assert got["failing_listing"] == ["latest", "step_6"], got["failing_listing"]
        assert got["newest"] == "step_6"
        assert got["async_listing"] == ["latest", "step_2", "step_4", "step_6"], got["async_listing"]
        assert got["resumed_from"] == 4
    rank0 = results[0]
    assert rank0["async"] and rank0["async"] == rank0["blocking"], "background saves changed training"
    assert rank0["resumed"] == rank0["async"], "the background save's step_4 did not resume exactly"


@pytest.mark.parametrize("backend", BACKENDS, ids=["fallback", "zero2"])
def test_a_sigkill_during_the_background_write_resumes_from_the_previous_checkpoint(
    tmp_path: Path, backend: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    killed = run_command(
        torchrun_command(
            WORKERS / "async_checkpoint.py",
            "--out",
            str(tmp_path / "killed"),
            "--backend",
            backend,
            "--mode",
            "kill",
            "--root",
            str(root),
        ),
        timeout=600,
        env=worker_env(),
    )
    assert killed.returncode != 0
    assert (root / "killed_while_writing").read_text(), "the kill did not land inside the write"
    assert (root / "ckpt" / ".step_4.tmp").is_dir()  # the dead save's staging folder, never published
    assert (root / "ckpt" / "latest").read_text() == "step_2"
    results = run_workers(
        "async_checkpoint.py",
        "--backend",
        backend,
        "--mode",
        "resume",
        "--root",
        str(root),
        timeout=600,
        out_dir=tmp_path / "out",
    )
    for got in results:
        assert "crash" not in got, got.get("crash")
        assert got["newest"] == "step_2"
        assert got["steps"] == 2
        assert got["after"] == ["latest", "step_2", "step_4"], got["after"]
