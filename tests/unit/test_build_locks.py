"""A DeepSpeed/torch op-build lock left by a killed build is named before anything waits on it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ds_engine._build_locks import check_no_stale_build_lock, extensions_root, stale_locks


def _lock(root: Path, op: str, age_s: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_only_old_locks_are_stale(tmp_path: Path) -> None:
    old = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    _lock(tmp_path, "cpu_adam", 30)  # a build running now
    assert [lock for lock, _ in stale_locks(tmp_path)] == [old]
    assert stale_locks(tmp_path / "missing") == []


def test_the_error_names_the_file_and_how_to_remove_it(tmp_path: Path) -> None:
    old = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    with pytest.raises(RuntimeError, match="left behind") as caught:
        check_no_stale_build_lock(tmp_path)
    assert f"rm {old}" in str(caught.value) and "60 min old" in str(caught.value)
    old.unlink()
    check_no_stale_build_lock(tmp_path)  # nothing left: no error


def test_the_root_is_torchs_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert Path(_get_build_directory("probe", verbose=False)).parent == extensions_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert extensions_root() == tmp_path / "ext"


@pytest.mark.deepspeed
def test_a_deepspeed_engine_stops_at_prepare_before_the_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch
    import torch.distributed as dist

    from ds_engine import Engine

    lock = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    engine = Engine(zero_stage=0, micro_batch_size=1)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match=f"rm {lock}"):
        engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not dist.is_initialized()
