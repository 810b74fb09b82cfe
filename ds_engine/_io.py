"""Plumbing every saving path shares: durable atomic files and folders, and rank agreement.

The bottom of the saving layers (`weights`, `consolidate`, `checkpoint` and the backends'
state files): it imports nothing from ds_engine but `safety`.

* Files and folders are written durably (fsync) and published atomically: a folder is built
  under a hidden temporary sibling and renamed into place (`publish`), so a crash never
  leaves a folder that looks complete.
* Rank helpers work with or without a process group (a process without one is rank 0 of 1).
* ds_engine's own small checkpoint files hold tensors and plain containers only: `save_safe`
  proves each loads with torch's weights-only unpickler, `load_safe` reads it back that way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ds_engine.safety import UnsafeCheckpointError, restricted_load

__all__ = [
    "any_rank_failed",
    "barrier",
    "broadcast_from_rank0",
    "current_rank",
    "dist_ready",
    "exchange",
    "fsync_dir",
    "fsync_file",
    "gather_failures",
    "listing",
    "load_safe",
    "publish",
    "raise_problem",
    "raise_rank0_failure",
    "remove_tree",
    "save_safe",
    "tmp_sibling",
    "world_size",
    "write_failure",
    "write_json",
    "write_text_atomic",
]


# --------------------------------------------------------------------------- process group
def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def current_rank() -> int:
    return torch.distributed.get_rank() if dist_ready() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if dist_ready() else 1


def barrier() -> None:
    if dist_ready() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without a process group)."""
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def raise_rank0_failure(error: BaseException | None, target: Any) -> None:
    """After rank 0 wrote `target` (collective): re-raise its own `error` on rank 0, and on the
    other ranks raise a RuntimeError naming what rank 0 failed with, so no rank goes on alone."""
    failure = broadcast_from_rank0(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"rank 0 failed to write {str(target)!r}: {failure}")


def any_rank_failed(failed: bool, group: Any = None) -> bool:
    """True on every rank when `failed` is true on any (collective over `group`, default: all)."""
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    if torch.distributed.get_backend(group) == "nccl":  # pragma: no cover - GPU runs
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())


def raise_problem(problem: tuple[str, str] | None) -> None:
    """Raise `problem` = (exception kind, message), the same on every rank that got it."""
    if problem:
        kind, message = problem
        kinds = {
            "FileNotFoundError": FileNotFoundError,
            "RuntimeError": RuntimeError,
            "UnsafeCheckpointError": UnsafeCheckpointError,
        }
        raise kinds.get(kind, ValueError)(message)


# --------------------------------------------------------------------------- durable files
def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
        fsync_file(path)


def write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fsync_file(path)


def write_file_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a hidden temporary sibling, fsync it and rename it to `path`: `path`
    never holds a partly written file (the temporary file is removed if `write` fails)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_file_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def listing(path: Path, limit: int = 12) -> str:
    """What a folder holds, for error messages ("a, b/, ... (N entries)")."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} entries)" if len(names) > limit else "")


# --------------------------------------------------------------------------- atomic folders
def remove_tree(path: Path) -> list[str]:
    """Remove the folder `path` as far as possible; return what could not be removed, each as
    ``"<path>: <reason>"`` (empty when all of it went). Never raises for a file it cannot remove."""
    problems: list[str] = []

    def note(_function: Any, failed: str, info: Any) -> None:
        error = info if isinstance(info, BaseException) else info[1]
        problems.append(f"{failed}: {error}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=note)
    return problems


def tmp_sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}"


def publish(tmp: Path, target: Path, *, synced: bool = False) -> None:
    """Move the finished `tmp` folder to `target`, replacing an existing one safely.

    Every file in `tmp` is fsynced first, unless the caller did (`synced=True`).
    """
    if not synced:
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(tmp)
    if target.exists():
        if exchange(tmp, target):  # one atomic swap: the final name always holds a whole folder
            shutil.rmtree(tmp, ignore_errors=True)  # `tmp` now holds the old folder
        else:  # no renameat2: two renames, and the old folder is put back if the second fails
            old = tmp_sibling(target, "old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_dir(target.parent)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return bool(result == 0)


# --------------------------------------------------------------------------- small safe files
#: Set on a thread by `_async_save.deferred_writes`: `defer(write, obj)` queues `write` of a
#: host copy of `obj` instead of `save_safe` writing now.
deferral = threading.local()


def save_safe(obj: Any, path: Path, what: str) -> None:
    """`torch.save`, then prove the file loads with `weights_only=True` (no code on load).

    Inside `_async_save.deferred_writes` (on its thread) the write is queued instead, with a
    host copy of `obj`, and these errors come from the queued write.

    Raises:
        OSError: The file could not be written (full disk, read-only folder, ...): names the
            file and the cause, with a HINT; no partial file is left.
        TypeError: `obj` holds something that cannot be loaded without running code.
    """
    defer = getattr(deferral, "defer", None)
    if defer is not None:
        defer(lambda snapshot: save_safe(snapshot, path, what), obj)
        return
    try:
        torch.save(obj, path)
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # no second copy in memory
        fsync_file(path)
    except Exception as exc:
        failure = write_failure(exc, path, what)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        if failure is not None:
            raise failure from exc
        if not isinstance(exc, (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError)):
            raise
        lines = str(exc).splitlines() or [type(exc).__name__]
        detail = next((line.split("error: ")[-1] for line in lines if "Unsupported global" in line), lines[0])
        raise TypeError(
            f"{what} holds an object that cannot be loaded without running code ({detail}); allowed: "
            "tensors, numbers, strings, None, and lists/tuples/dicts of them. HINT: convert it (e.g. "
            "numpy arrays to tensors, objects to dicts) before `save_checkpoint`."
        ) from None


#: torch's zip writer reports a failed write as a RuntimeError without the OS error behind it
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "iostream error", "file write failed")
_NEARLY_FULL = 16 * 2**20  # bytes left when a cut-short write is taken for a full disk


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # pragma: no cover


def _free_bytes(path: Path) -> int | None:
    for folder in (path.parent, *path.parent.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(folder).free
    return None  # pragma: no cover - the root is always there


def write_failure(exc: BaseException, path: Path, what: str) -> OSError | None:
    """The OSError to raise for `exc`, raised while writing `path` (`what` it holds), or None
    when `exc` is no write failure (a pickling problem, say).

    The OS error is found in the exception's chain; torch's zip writer only says ``unexpected
    pos N vs M`` (or "PytorchStreamWriter failed writing file"): that is a write cut short, taken
    for a full disk when little space is left. Call it before removing the partial file.
    """
    cause: BaseException | None = exc
    seen = 0
    while cause is not None and seen < 16:
        if isinstance(cause, OSError) and cause.errno is not None:
            return _os_failure(cause.errno, path, what)
        cause = cause.__cause__ or cause.__context__
        seen += 1
    if isinstance(exc, RuntimeError) and "strerror: " in str(exc):  # torch: "open file failed ..."
        reason = str(exc).split("strerror: ")[-1].splitlines()[0].strip()
        code = next((c for c in errno.errorcode if os.strerror(c) == reason), None)
        if code is not None:
            return _os_failure(code, path, what)
    if isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _SHORT_WRITE):
        free = _free_bytes(path)
        if free is not None and free < _NEARLY_FULL:
            return _os_failure(errno.ENOSPC, path, what, free=free)
        return _os_failure(errno.EIO, path, what, free=free, detail=str(exc).splitlines()[0])
    return None


def _os_failure(
    code: int, path: Path, what: str, *, free: int | None = None, detail: str | None = None
) -> OSError:
    free = _free_bytes(path) if free is None else free
    left = "" if free is None else f"; {_size(free)} free there"
    reason = os.strerror(code) + (f" (the write was cut short: {detail})" if detail else "")
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = "free space on that filesystem, or save to another directory"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "make the folder writable (or mount it read-write), or save to another directory"
    else:
        hint = "check that filesystem (its free space and health), or save to another directory"
    return OSError(code, f"{reason}: could not write {what} to {str(path)!r}{left}. HINT: {hint}.")


def gather_failures(error: BaseException | None, group: Any = None) -> list[tuple[int, str, int | None]]:
    """Every rank's failure, the same list on every rank (collective over `group`, default: all
    ranks): ``(rank, "Type: message", errno or None)`` for each rank whose `error` is not None,
    in rank order; [] when none failed.

    One small all_reduce when nothing failed, then one all_gather of the messages; it is also
    the ranks' meeting point, so call it where a rank that failed would otherwise wait alone.
    """
    mine = None
    if error is not None:
        mine = (f"{type(error).__name__}: {error}", getattr(error, "errno", None))
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return [] if mine is None else [(current_rank(), *mine)]
    if not any_rank_failed(mine is not None, group):
        return []
    boxes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(boxes, mine, group=group)
    return [(rank, str(box[0]), box[1]) for rank, box in enumerate(boxes) if box is not None]


def load_safe(path: Path) -> Any:
    """One of ds_engine's own files: tensors and plain containers only (`save_safe` proved it)."""
    return restricted_load(path, hint="load an older tag with `tag=...`")
