"""Saving onto a faulty disk, in one process on the accelerate fallback: a real full filesystem
and a real read-only one (small tmpfs mounts), junk beside the tags, a tag that cannot be removed.

The fault corpus (`FAULTS`) runs through both ways to save training state, `Engine.save_checkpoint`
and `Accelerator.save_state` with automatic naming and `total_limit=1`. Every fault must end in an
OSError of the right errno naming the file or folder and the cause, with a HINT, and leave the
previous checkpoint the newest complete one, which still loads. The tmpfs cases need the right to
mount (root); without it they are skipped, saying why.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ds_engine
from ds_engine._io import save_safe, write_failure
from ds_engine.checkpoint import CHECKPOINT_META_NAME, ENGINE_STATE_NAME, resolve_checkpoint
from tests.helpers import micro_step, regression_loader


# --------------------------------------------------------------------------- small filesystems
class Mounts:
    """tmpfs mounts made by one test, unmounted after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Path] = []

    def tmpfs(self, name: str, size: str = "2m", at: Path | None = None) -> Path:
        folder = at or self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("no `mount` command: the full and read-only disk cases need a small tmpfs")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); these cases need root")
        self.made.append(folder)
        return folder

    def read_only(self, folder: Path) -> None:
        done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

    def unmount_all(self) -> None:
        for folder in reversed(self.made):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    made = Mounts(tmp_path)
    yield made
    made.unmount_all()


def fill(folder: Path) -> Path:
    """Fill `folder`'s filesystem to the last byte; returns the filler file (remove it to free)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as stream:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    stream.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    assert shutil.disk_usage(folder).free == 0
    return filler


# --------------------------------------------------------------------------- training
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _engine() -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        engine = ds_engine.Engine(backend="accelerate")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return (engine, *engine.prepare(model, optimizer, regression_loader(16, seed=1)))


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- the fault corpus
@dataclass
class Fault:
    name: str
    make: Callable[[Mounts, Path], Callable[[], None]]  # (mounts, disk) -> undo
    errno: int
    match: str  # what the error says (re.search)


def _full(mounts: Mounts, disk: Path) -> Callable[[], None]:
    filler = fill(disk)
    return filler.unlink


def _read_only(mounts: Mounts, disk: Path) -> Callable[[], None]:
    mounts.read_only(disk)
    return lambda: None


FAULTS = [
    Fault(
        "full_disk",
        _full,
        errno.ENOSPC,
        r"rank 0 failed: OSError: \[Errno 28\] No space left on device: could not write .* to '[^']+\.pt'; "
        r"0 bytes free there\. HINT: free space on that filesystem",
    ),
    Fault(
        "read_only_folder",
        _read_only,
        errno.EROFS,
        r"rank 0 failed: OSError: \[Errno 30\] Read-only file system: cannot create '[^']+', the staging "
        r"folder of a checkpoint in '[^']+'\. HINT: make '[^']+' writable",
    ),
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_engine_save_checkpoint_on_a_faulty_disk(mounts: Mounts, fault: Fault) -> None:
    disk = mounts.tmpfs("disk")
    ckpt = disk / "ckpt"
    engine, model, optimizer, loader = _engine()
    batches = iter(loader)
    micro_step(engine, model, optimizer, next(batches))
    engine.save_checkpoint(ckpt, keep_last=1)  # step_1
    saved = _weights(model)
    micro_step(engine, model, optimizer, next(batches))
    undo = fault.make(mounts, disk)
    with pytest.raises(OSError, match=fault.match) as caught:
        engine.save_checkpoint(ckpt, keep_last=1)  # step_2
    assert caught.value.errno == fault.errno
    assert "'step_1' is still the newest complete one" in str(caught.value)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_1"]  # no staging folder, no step_2
    assert resolve_checkpoint(ckpt)[0] == "step_1"
    undo()
    again, model2, _, _ = _engine()
    again.load_checkpoint(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved))
    if fault.name == "full_disk":  # with the space back, the same save goes through and rotates
        engine.save_checkpoint(ckpt, keep_last=1)
        assert sorted(os.listdir(ckpt)) == ["latest", "step_2"]


def test_a_failed_first_save_leaves_no_folder_behind(mounts: Mounts) -> None:
    """A save into a folder it creates, failing, removes that folder again (it made it, it is empty)."""
    disk = mounts.tmpfs("disk")
    (disk / "other").mkdir()
    engine, model, optimizer, loader = _engine()
    micro_step(engine, model, optimizer, next(iter(loader)))
    filler = fill(disk)
    with pytest.raises(
        OSError, match=r"there is no complete one\): rank 0 failed: .*No space left on device"
    ):
        engine.save_checkpoint(disk / "ckpt")
    assert sorted(os.listdir(disk)) == ["filler", "other"]
    filler.unlink()
    with pytest.raises(OSError, match=r"Read-only file system: cannot create '.*ckpt'"):
        mounts.read_only(disk)
        engine.save_checkpoint(disk / "ckpt")
    assert sorted(os.listdir(disk)) == ["other"]


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _accelerator(project: Path) -> tuple:
    pc = ds_engine.ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1
    )
    acc = ds_engine.Accelerator(backend="accelerate", project_config=pc)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, regression_loader(16, seed=1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, optimizer, loader, counter


def _acc_step(acc, model, optimizer, batch, counter: Counter) -> None:
    x, y = batch
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    counter.n += 1


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_accelerator_save_state_total_limit_1_on_a_faulty_disk(mounts: Mounts, fault: Fault) -> None:
    disk = mounts.tmpfs("disk")
    acc, model, optimizer, loader, counter = _accelerator(disk)
    batches = iter(loader)
    _acc_step(acc, model, optimizer, next(batches), counter)
    assert acc.save_state().endswith("checkpoint_0")
    saved = _weights(model)
    _acc_step(acc, model, optimizer, next(batches), counter)
    undo = fault.make(mounts, disk)
    with pytest.raises(OSError, match=fault.match) as caught:
        acc.save_state()
    assert caught.value.errno == fault.errno
    # the old checkpoint was not rotated away first, and no empty checkpoint_1/ was left behind
    assert sorted(os.listdir(disk / "checkpoints")) == ["checkpoint_0"]
    assert acc.save_iteration == 1
    undo()
    fresh, model2, _, _, counter2 = _accelerator(disk)
    fresh.load_state()  # the newest complete one
    assert counter2.n == 1 and fresh.save_iteration == 1
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved))
    if fault.name == "full_disk":  # space back: the retry writes checkpoint_1, then rotates checkpoint_0
        assert acc.save_state().endswith("checkpoint_1")
        assert sorted(os.listdir(disk / "checkpoints")) == ["checkpoint_1"]


def test_load_state_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    acc, model, optimizer, loader, counter = _accelerator(tmp_path)
    batches = iter(loader)
    for _ in range(2):
        _acc_step(acc, model, optimizer, next(batches), counter)
        acc.save_state()
    # what an interrupted save of an older version, or a user, may leave: numbered, but no checkpoint
    (tmp_path / "checkpoints" / "checkpoint_7").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_9" / "state").mkdir(parents=True)
    fresh, _, _, _, counter2 = _accelerator(tmp_path)
    fresh.load_state()
    assert counter2.n == 2 and fresh.save_iteration == 2
    # total_limit counts complete checkpoints only, and removes nothing else
    _acc_step(acc, model, optimizer, next(batches), counter)
    assert acc.save_state().endswith("checkpoint_2")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_7", "checkpoint_9"]


def test_load_state_without_a_complete_checkpoint_says_so(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    acc, *_ = _accelerator(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"no complete checkpoint_<i> folder under '.*checkpoints' \(checkpoint_0 hold no complete "
        r"saved state\)\. HINT: save_state\(\) first",
    ):
        acc.load_state()


# --------------------------------------------------------------------------- keep_last
def _junk_beside_the_tags(ckpt: Path, outside: Path) -> dict[str, Path]:
    """Things in a checkpoint folder that are not tags of ours, and must survive rotation."""
    junk = {
        "notes": ckpt / "notes",
        "meta_is_a_list": ckpt / "step_0",
        "meta_is_not_json": ckpt / "step_00",
        "no_engine_state": ckpt / "step_000",
        "link_to_a_tag_elsewhere": ckpt / "step_0000",
    }
    junk["notes"].mkdir()
    (junk["notes"] / "todo.txt").write_text("keep me")
    junk["meta_is_a_list"].mkdir()
    (junk["meta_is_a_list"] / CHECKPOINT_META_NAME).write_text("[1, 2]")
    (junk["meta_is_a_list"] / ENGINE_STATE_NAME).write_bytes(b"x")
    junk["meta_is_not_json"].mkdir()
    (junk["meta_is_not_json"] / CHECKPOINT_META_NAME).write_bytes(b"\xff\xfe{")
    (junk["meta_is_not_json"] / ENGINE_STATE_NAME).write_bytes(b"x")
    junk["no_engine_state"].mkdir()
    shutil.copy(ckpt / "step_1" / CHECKPOINT_META_NAME, junk["no_engine_state"] / CHECKPOINT_META_NAME)
    shutil.copytree(ckpt / "step_1", outside / "step_1")
    junk["link_to_a_tag_elsewhere"].symlink_to(outside / "step_1")
    return junk


def test_keep_last_removes_only_our_older_tags_after_publishing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    engine, model, optimizer, loader = _engine()
    batches = iter(loader)
    micro_step(engine, model, optimizer, next(batches))
    engine.save_checkpoint(ckpt)  # step_1
    (tmp_path / "outside").mkdir()
    junk = _junk_beside_the_tags(ckpt, tmp_path / "outside")
    for _ in range(2):
        micro_step(engine, model, optimizer, next(batches))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # junk is no problem worth a warning
            engine.save_checkpoint(ckpt, keep_last=1)
    assert (ckpt / "latest").read_text() == "step_3"
    assert not (ckpt / "step_1").exists() and not (ckpt / "step_2").exists()
    assert all(path.is_symlink() or path.is_dir() for path in junk.values())
    assert (junk["notes"] / "todo.txt").read_text() == "keep me"
    assert (tmp_path / "outside" / "step_1" / ENGINE_STATE_NAME).is_file()  # not followed


def test_a_tag_rotation_cannot_remove_is_a_warning_not_a_failed_save(mounts: Mounts, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    engine, model, optimizer, loader = _engine()
    batches = iter(loader)
    micro_step(engine, model, optimizer, next(batches))
    engine.save_checkpoint(ckpt)  # step_1
    stuck = mounts.tmpfs("stuck", size="1m", at=ckpt / "step_1" / "stuck")  # rmdir of a mount point fails
    (stuck / "x").write_text("x")
    mounts.read_only(stuck)
    micro_step(engine, model, optimizer, next(batches))
    with pytest.warns(
        UserWarning,
        match=r"saved '.*step_2', but could not fully remove the older checkpoint '.*step_1' "
        r"\(keep_last=1\): .*HINT: remove it by hand",
    ):
        engine.save_checkpoint(ckpt, keep_last=1)
    assert (ckpt / "latest").read_text() == "step_2"
    assert resolve_checkpoint(ckpt)[0] == "step_2"


# --------------------------------------------------------------------------- the file writer
def test_save_safe_on_a_full_disk_is_an_oserror_not_a_pickling_error(mounts: Mounts) -> None:
    disk = mounts.tmpfs("disk", size="1m")
    fill(disk)
    target = disk / "state.pt"
    with pytest.raises(
        OSError,
        match=r"^\[Errno 28\] No space left on device: could not write the RNG state to '.*state\.pt'; "
        r"0 bytes free there\. HINT: free space on that filesystem, or save to another directory\.$",
    ) as caught:
        save_safe({"t": torch.zeros(4096)}, target, "the RNG state")
    assert caught.value.errno == errno.ENOSPC and not target.exists()


def test_save_safe_keeps_the_pickling_message_for_pickling_problems(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"`client_state` holds an object that cannot be loaded without running"
    ):
        save_safe({"f": lambda: 1}, tmp_path / "a.pt", "`client_state`")
    with pytest.raises(TypeError, match=r"cannot be loaded without running code \(.*Path"):
        save_safe({"p": Path("x")}, tmp_path / "b.pt", "`client_state`")
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


def test_torch_writer_messages_are_read_as_what_they_are(mounts: Mounts, tmp_path: Path) -> None:
    """torch reports a full disk as "unexpected pos N vs M" and a read-only one by strerror only."""
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7680 vs 7574")
    disk = mounts.tmpfs("disk", size="1m")
    fill(disk)
    full = write_failure(short, disk / "optim_states.pt", "a DeepSpeed checkpoint file")
    assert full is not None and full.errno == errno.ENOSPC
    assert "could not write a DeepSpeed checkpoint file to" in str(full) and "optim_states.pt" in str(full)
    roomy = write_failure(short, tmp_path / "x.pt", "x")  # space left: a write cut short, not "full"
    assert roomy is not None and roomy.errno == errno.EIO and "cut short: [enforce fail" in str(roomy)
    ro = RuntimeError(
        "[enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system"
    )
    read_only = write_failure(ro, tmp_path / "x.pt", "x")
    assert (
        read_only is not None
        and read_only.errno == errno.EROFS
        and "HINT: make the folder writable" in str(read_only)
    )
    assert write_failure(pickle.PicklingError("no"), tmp_path / "x.pt", "x") is None
    chained = RuntimeError("unexpected pos 1 vs 0")
    chained.__context__ = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    quota = write_failure(chained, tmp_path / "x.pt", "x")
    assert quota is not None and quota.errno == errno.EDQUOT


def test_consolidate_onto_a_full_disk_is_one_error_line_and_keeps_the_folder(
    mounts: Mounts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ds-engine consolidate` into a folder on a full filesystem: exit 2, the file and the cause
    named with a HINT (no traceback), nothing partial, the folder's own files untouched."""
    import warnings

    from ds_engine import Engine
    from ds_engine.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(backend="accelerate")
    model = torch.nn.Linear(64, 64)
    engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.end_training()
    disk = mounts.tmpfs("disk", size="64k")
    out = disk / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    fill(disk)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ds-engine: error: [Errno 28] No space left on device"), error
    assert "model.safetensors" in error and "HINT: free space" in error, error
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
