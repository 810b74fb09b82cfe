"""Checkpoints written in the background: the state copied to host memory at the boundary, the
files written by a thread while training goes on.

* `deferred_writes()` -- within it (on the calling thread only), every `torch.save(obj, path)`
  and `_io.save_safe` copies `obj` to host memory (`host_copy`: tensors cloned to CPU, storage
  sharing kept, containers copied) and queues the write instead of doing it. The copy is what
  a blocking save would have written at that moment; training may change the live tensors
  right after.
* `BackgroundSave` -- runs the queued writes, then the rest of the save (the agreement across
  ranks, the atomic publish, `latest`, rotation) on one thread. Its collectives go over a
  process group of its own (gloo, CPU tensors), so they never interleave with training's.
* `wait_for_pending()` -- waits for the save in flight and raises its error, the same on
  every rank (the save's own agreement decided it). The next save, `load_checkpoint` and
  `Engine.end_training` call it.

A SIGKILL while the thread writes leaves only the hidden staging folder (`.<tag>.tmp`): the
previous tag stays the newest complete one, as with a blocking save.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ds_engine import _io

__all__ = ["BackgroundSave", "deferred_writes", "host_copy", "side_group", "wait_for_pending"]

_pending: BackgroundSave | None = None
_side_group: Any = None
_exit_hook = False


def host_copy(obj: Any, _memo: dict[Any, Any] | None = None) -> Any:
    """`obj` with every tensor copied to CPU memory and every container copied (a snapshot).

    Tensors that share a storage share the copied one (views stay views, as `torch.save` keeps
    them), so the snapshot holds one copy of each storage and the file written from it is the
    one a blocking save writes. Other objects are deep-copied.
    """
    memo: dict[Any, Any] = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        storage = obj.untyped_storage()
        key = ("storage", obj.device, storage.data_ptr(), storage.nbytes())
        copied = memo.get(key)
        if copied is None:
            copied = storage.clone() if obj.device.type == "cpu" else storage.cpu()
            memo[key] = copied
        out = torch.empty(0, dtype=obj.dtype).set_(copied, obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        memo[id(obj)] = out
        return out
    if isinstance(obj, dict):
        out_dict = copy.copy(obj)  # keeps the mapping's class (OrderedDict, ...)
        for key, value in obj.items():
            out_dict[key] = host_copy(value, memo)
        return out_dict
    if isinstance(obj, list):
        return [host_copy(value, memo) for value in obj]
    if type(obj) is tuple:
        return tuple(host_copy(value, memo) for value in obj)
    return copy.deepcopy(obj)


@contextlib.contextmanager
def deferred_writes() -> Iterator[list[Callable[[], None]]]:
    """Within (this thread only): `torch.save` to a path and `_io.save_safe` queue their writes,
    with a host copy of what they save, in the yielded list (run them in order)."""
    queue: list[Callable[[], None]] = []
    me = threading.get_ident()
    previous = torch.save  # the queued writes call it (and so does `save_safe` on the thread)

    def defer(write: Callable[[Any], None], obj: Any) -> None:
        snapshot = host_copy(obj)
        queue.append(lambda: write(snapshot))

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != me or not isinstance(f, (str, Path)):
            previous(obj, f, *args, **kwargs)
            return
        snapshot = host_copy(obj)
        queue.append(lambda: previous(snapshot, f, *args, **kwargs))

    torch.save = save
    _io.deferral.defer = defer
    try:
        yield queue
    finally:
        torch.save = previous
        _io.deferral.defer = None


def side_group() -> Any:
    """The process group background saves agree over (gloo, made on first use: collective);
    None without a process group."""
    global _side_group
    if not _io.dist_ready() or torch.distributed.get_world_size() == 1:
        return None
    if _side_group is None:
        _side_group = torch.distributed.new_group(backend="gloo")
    return _side_group


class BackgroundSave:
    """One save's remaining work on a thread: `writes` in order, then `finish(error)`.

    `finish` gets the first write error (or None), agrees on it across ranks over
    `side_group()` and publishes or raises; whatever it raises is kept for `wait`.
    """

    def __init__(
        self, writes: list[Callable[[], None]], finish: Callable[[BaseException | None], Any], error: Any
    ) -> None:
        self._writes = writes
        self._finish = finish
        self._error: BaseException | None = error
        self._raised: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ds-engine-checkpoint", daemon=True)

    def start(self) -> None:
        global _pending, _exit_hook
        if not _exit_hook:  # registered after the Engine's own: runs before its group goes
            atexit.register(_finish_at_exit)
            _exit_hook = True
        _pending = self
        self._thread.start()

    def _run(self) -> None:
        try:
            self._writes.reverse()
            while self._writes:  # each host copy goes as soon as it is written
                write = self._writes.pop()
                if self._error is None:
                    try:
                        write()
                    except BaseException as exc:  # agreed on in `finish`, raised by `wait`
                        self._error = exc
                del write
            self._finish(self._error)
        except BaseException as exc:
            self._raised = exc

    def wait(self) -> None:
        """Wait for the thread; raise what the save raised (every rank alike)."""
        global _pending
        self._thread.join()
        if _pending is self:
            _pending = None
        if self._raised is not None:
            raised, self._raised = self._raised, None
            raise raised


def _finish_at_exit() -> None:
    """At interpreter exit: let a save in flight end (published or not), and say when it failed."""
    try:
        wait_for_pending()
    except BaseException as exc:
        print(f"ds_engine: the background checkpoint save failed: {exc}", file=sys.stderr)


def wait_for_pending() -> None:
    """Wait for this process's background checkpoint save, if one is in flight, and raise its
    error (collective in effect: every rank waits at the same call)."""
    if _pending is not None:
        _pending.wait()
