"""Saving into a folder that may hold other things: replace only what a save writes.

A `from_pretrained` folder is often shared: the HF Trainer's layout keeps the final model
beside `checkpoint-N/` folders, a `metrics.jsonl`, notes. As transformers' own
`save_pretrained` does, a save into an existing folder replaces the files it writes and the
stale weight files of its own naming (shards of another split, the index or single file of the
other layout, the other serialization's weights), and removes nothing else.

* `Staging(target)` -- where a save writes first: a hidden `.ds_engine-save-<pid>/new/` inside
  `target` when it exists (same filesystem, so every later move is a rename), else a hidden
  sibling. Nothing under a final name is written in place, so a full disk or a crash while
  writing leaves the previous files byte-identical.
* `Staging.publish(weights)` -- makes the staged files appear:

  - `target` absent: the staged folder is renamed into place, whole.
  - `target` holds nothing but what this save replaces (its own names, weight files matching
    `weights`, leftovers of an interrupted save): the new folder is swapped in whole
    (`_io.publish`), one atomic step.
  - otherwise, file by file, renames only: first every existing weight file of this naming
    is set aside (index or single file first), so from then on the folder holds no weights a
    loader would take; then the other new files (configs, tokenizer, sub-folders merged the
    same way); then the new shards; the new index or single file last. A crash in between
    leaves a folder `from_pretrained` refuses (no weights file), never one it loads with a
    mix of old and new weights; the previous files are then in `.ds_engine-save-<pid>/old/`.
    An error while moving puts every previous file back and names the file it failed on.

* `read_regular(path, ...)` -- a small file of a model or checkpoint folder, read only when it
  is a regular file: never through a symbolic link, never blocking on a FIFO or device.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from pathlib import Path

from ds_engine._io import fsync_dir, fsync_file, publish, tmp_sibling, write_failure
from ds_engine._values import read_regular as _read_regular
from ds_engine.safety import UnsafeCheckpointError

__all__ = ["ADAPTER_WEIGHTS", "MODEL_WEIGHTS", "STAGING_PREFIX", "Staging", "read_regular"]

#: Weight files `save_pretrained` writes, either serialization, sharded or not: transformers
#: removes stale shards of its naming on save; the single file and index are ours to replace too.
MODEL_WEIGHTS = re.compile(
    r"model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(?:-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json"
)
#: Weight files peft's `save_pretrained` writes for one adapter.
ADAPTER_WEIGHTS = re.compile(r"adapter_model\.(?:safetensors|bin)")
#: The hidden folder a save stages into inside an existing target (`<prefix><pid>`).
STAGING_PREFIX = ".ds_engine-save-"
_SHARD = re.compile(r".*-\d{5}-of-\d{5}\..*")


def _is_entry(name: str) -> bool:
    """A weight file a loader opens first (single file or index), not a shard it references."""
    return _SHARD.fullmatch(name) is None


def _is_dir(path: Path) -> bool:
    """A real folder (a symbolic link to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


class Staging:
    """Where one save writes (`folder`) before `publish` makes it appear as `target`."""

    def __init__(self, target: Path) -> None:
        self.target = target
        try:  # a link to a folder counts: the save goes into the folder it names
            into = target.is_dir()
        except OSError:  # unreadable: `start` reports it (on the writing rank, as a write error)
            into = False
        if into:
            self.root = target / f"{STAGING_PREFIX}{os.getpid()}"
            self.folder = self.root / "new"
        else:
            self.root = tmp_sibling(target, "tmp")
            self.folder = self.root

    def start(self) -> None:
        """An empty staging folder (a leftover of this process's interrupted save is removed)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)

    def discard(self) -> None:
        """Remove the staging folder; previous files a failed move could not put back are kept."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.root != self.folder:
            with contextlib.suppress(OSError):
                self.root.rmdir()  # fails, so stays, while it holds such files

    def publish(self, weights: re.Pattern[str]) -> None:
        """Make the staged files appear in `target` (see the module docstring)."""
        _fsync_tree(self.folder)
        if not os.path.lexists(self.target):
            publish(self.folder, self.target, synced=True)
            self.discard()
            return
        _check_fits(self.folder, self.target)
        if self._swap_whole(weights):
            return
        aside = self.root / "old" if self.folder != self.root else tmp_sibling(self.target, "replaced")
        _merge(self.folder, self.target, _unused(aside), weights)
        self.discard()

    def _swap_whole(self, weights: re.Pattern[str]) -> bool:
        """Replace `target` whole when it holds only what this save replaces; False otherwise."""
        target = self.target
        if target.is_symlink() or os.path.ismount(target) or not _only_replaced(self.folder, target, weights):
            return False
        whole = self.folder
        if self.folder != self.root:  # staged inside `target`: move it out beside it first
            whole = tmp_sibling(target, "tmp")
            shutil.rmtree(whole, ignore_errors=True)
            try:
                os.rename(self.folder, whole)
            except OSError:  # another filesystem beside it: moved file by file instead
                return False
        try:
            publish(whole, target, synced=True)
        except BaseException:
            shutil.rmtree(whole, ignore_errors=True)
            raise
        return True


def _unused(path: Path) -> Path:
    """`path`, or `path-<n>` when that exists (previous files an earlier failure could not put
    back are kept there: never mixed with another save's)."""
    n = 0
    while os.path.lexists(path.with_name(f"{path.name}-{n}" if n else path.name)):
        n += 1
    return path.with_name(f"{path.name}-{n}" if n else path.name)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder` (the staged save, before it is published)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fsync_file(path)
    for path in [folder, *(p for p in folder.rglob("*") if _is_dir(p))]:
        fsync_dir(path)


def _only_replaced(new: Path, old: Path, weights: re.Pattern[str]) -> bool:
    """Whether everything in `old` is replaced by `new` or is a weight file / leftover of ours."""
    for name in os.listdir(old):
        if name.startswith(STAGING_PREFIX) or weights.fullmatch(name):
            continue
        if not os.path.lexists(new / name):
            return False
        if _is_dir(old / name) and not _only_replaced(new / name, old / name, weights):
            return False
    return True


def _check_fits(new: Path, old: Path) -> None:
    """Refuse (before anything moves) a folder in `old` where the save writes a file, or the
    reverse: replacing it would remove what the save did not write."""
    for name in os.listdir(new):
        there = old / name
        if not os.path.lexists(there):
            continue
        if _is_dir(new / name) and _is_dir(there):
            _check_fits(new / name, there)
        elif _is_dir(new / name) or _is_dir(there):
            what = "a folder" if _is_dir(there) else "a file"
            writes = "a folder" if _is_dir(new / name) else "a file"
            raise FileExistsError(
                errno.EEXIST,
                f"{str(there)!r} is {what} where the save writes {writes} of that name; nothing was "
                "replaced (files not written by a save are never removed). HINT: move it away, or "
                "save to another directory.",
            )


def _merge(new: Path, target: Path, aside: Path, weights: re.Pattern[str]) -> None:
    """Move `new`'s files into `target` in the crash-safe order; undo every move on an error."""
    aside.mkdir(parents=True, exist_ok=True)
    set_aside: list[tuple[Path, Path]] = []  # (final path, where the previous entry is now)
    moved_in: list[Path] = []  # final paths that now hold a new file or folder
    touched: list[Path] = []
    at = [target]  # the final path being moved, for the error

    def put_aside(path: Path) -> None:
        place = aside / f"{len(set_aside)}-{path.name}"
        at[0] = path
        os.rename(path, place)
        set_aside.append((path, place))

    def move_in(src: Path, dst: Path) -> None:
        if os.path.lexists(dst):
            put_aside(dst)
        at[0] = dst
        os.rename(src, dst)
        moved_in.append(dst)

    def level(src_dir: Path, dst_dir: Path) -> None:
        touched.append(dst_dir)
        old = [n for n in os.listdir(dst_dir) if weights.fullmatch(n) and not _is_dir(dst_dir / n)]
        for name in sorted(old, key=lambda n: (not _is_entry(n), n)):  # the loader's entry first
            put_aside(dst_dir / name)
        names = sorted(os.listdir(src_dir))
        ours = [n for n in names if weights.fullmatch(n)]
        for name in [n for n in names if n not in ours]:
            if _is_dir(src_dir / name) and _is_dir(dst_dir / name):
                level(src_dir / name, dst_dir / name)
            else:
                move_in(src_dir / name, dst_dir / name)
        for name in sorted(ours, key=lambda n: (_is_entry(n), n)):  # shards, then the entry
            move_in(src_dir / name, dst_dir / name)

    try:
        level(new, target)
    except BaseException as exc:
        try:
            for path in reversed(moved_in):
                if _is_dir(path):
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            for path, place in reversed(set_aside):
                os.rename(place, path)
        except OSError as undo:
            raise OSError(
                undo.errno,
                f"{exc}; and putting the previous files back failed ({undo}): they are in "
                f"{str(aside)!r}. HINT: move them back into {str(target)!r} by hand",
            ) from exc
        aside.rmdir()
        failure = write_failure(exc, at[0], "the saved model's files") if isinstance(exc, OSError) else None
        if failure is not None:  # names the file and the cause, with a HINT; all put back
            raise failure from exc
        raise
    for folder in touched:
        fsync_dir(folder)
    shutil.rmtree(aside)


def read_regular(path: Path, limit: int, what: str, hint: str) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes, read without following a
    symbolic link or blocking on a FIFO (`_values.read_regular` with the folders' words).

    Raises:
        UnsafeCheckpointError: `path` is a symbolic link, a FIFO, a socket or a device (named).
        ValueError: `path` is larger than `limit` (named, with the limit).
        FileNotFoundError, IsADirectoryError, PermissionError: as `open` would.
    """
    name = str(path)

    def refuse(kind: str) -> UnsafeCheckpointError:
        if kind not in ("a symbolic link", "a FIFO (named pipe)"):
            kind = "a socket or device"
        return _refusal(name, kind, what, hint)

    def too_large(size: int) -> ValueError:
        return ValueError(f"{name!r} is larger than {limit} bytes, the most {what} may hold. HINT: {hint}.")

    return _read_regular(name, limit, refuse=refuse, too_large=too_large)


def _refusal(name: str, kind: str, what: str, hint: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to read {name!r}: it is {kind}, and {what} are read only as regular files in their "
        f"folder (a link could copy a file from elsewhere, a FIFO or device could block forever). "
        f"HINT: {hint}."
    )
