"""Checkpoint files are opened as regular files only: never through a link, never a FIFO or device.

`restricted_load` (ds_engine's reads) and the restricted scope (DeepSpeed's own `torch.load`
calls) both refuse a symbolic link, a FIFO and a device by name, at once: opening a FIFO
blocks until a writer comes (forever, or on 2 ranks until the 30-minute collective timeout),
and a device never ends. A folder stays the `IsADirectoryError` it always was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ds_engine.safety import UnsafeCheckpointError, check_regular_file, restricted_load, restricted_torch_load


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, path)
    return path


def _both(path: Path) -> list[str]:
    """The errors of `restricted_load` and of a `torch.load` inside the restricted scope."""
    errors = []
    with pytest.raises(UnsafeCheckpointError) as direct:
        restricted_load(path)
    errors.append(str(direct.value))
    with restricted_torch_load(), pytest.raises(UnsafeCheckpointError) as scoped:
        torch.load(path, weights_only=False)  # as DeepSpeed asks
    errors.append(str(scoped.value))
    return errors


@pytest.mark.timeout(60)  # an open FIFO would block forever: fail instead
def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "mp_rank_00_model_states.pt"
    os.mkfifo(fifo)
    for error in _both(fifo):
        assert error.startswith(f"refusing to read `{fifo}`: it is a FIFO (named pipe), not a regular file; ")
        assert "HINT: remove it, or put the real file in its place." in error


def test_a_link_is_refused_even_to_a_good_file(tmp_path: Path, good: Path) -> None:
    link = tmp_path / "link.pt"
    link.symlink_to(good)
    for error in _both(link):
        assert error.startswith(f"refusing to read `{link}`: it is a symbolic link; ")
        assert (
            "HINT: if you trust the file it points to, replace the link by a copy of it (`cp -L`)." in error
        )
    assert torch.equal(restricted_load(good)["w"], torch.ones(2))  # the control


@pytest.mark.timeout(60)
def test_a_device_is_refused(tmp_path: Path) -> None:
    for error in _both(Path("/dev/zero")):
        assert error.startswith("refusing to read `/dev/zero`: it is a character device, not a regular file")


def test_a_folder_and_a_missing_file_keep_their_os_errors(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        restricted_load(tmp_path)
    with pytest.raises(FileNotFoundError):
        restricted_load(tmp_path / "missing.pt")
    with pytest.raises(IsADirectoryError):
        check_regular_file(tmp_path)
