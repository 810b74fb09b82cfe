"""The process group's lifetime: who uses it, whether ds_engine formed it, and when it ends.

Several Engines of one process share the default process group. Each is a *user* from its first
call that needs the group until its `end_training`; the group is destroyed by the call that ends
the last user still alive, and only when ds_engine formed it. A group the host formed before the
Engine (torchrun scripts that call `init_process_group` themselves, Ray Train, a test harness) is
*borrowed*: the Engine uses it, never destroys it (neither in `end_training` nor at interpreter
exit), and leaves it to its owner afterwards.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = [
    "adopt_host_group",
    "end_use",
    "formed_here",
    "is_initialized",
    "mark_formed",
    "place",
    "use",
    "users",
]

#: Engines of this process that have not ended: the users of the one process group they share.
#: Weak, so an Engine the script dropped holds nothing.
_USERS: weakref.WeakSet[Any] = weakref.WeakSet()
#: True while the default process group is one ds_engine formed (a backend's `setup_distributed`).
_FORMED = False


def is_initialized() -> bool:
    """A default process group exists."""
    return dist.is_available() and dist.is_initialized()


def mark_formed() -> None:
    """Record that ds_engine just formed the default process group (called by the backends)."""
    global _FORMED
    _FORMED = is_initialized()


def formed_here() -> bool:
    """True when the current default process group was formed by ds_engine (not borrowed)."""
    return _FORMED and is_initialized()


def use(engine: Any) -> None:
    """`engine` uses the process group from now on (until `end_use`)."""
    _USERS.add(engine)


def users() -> list[Any]:
    """The Engines still using the process group."""
    return list(_USERS)


def adopt_host_group() -> None:
    """A group the host formed without the launcher's variables: set them from the group.

    `RANK` / `WORLD_SIZE` come from the group; `LOCAL_RANK` / `LOCAL_WORLD_SIZE` from the ranks
    sharing this host (one `all_gather_object` of the host names, only when they are missing).
    DeepSpeed and accelerate read these variables; variables already set are left alone.
    """
    if not is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return
    import socket

    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    local = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    os.environ.setdefault("LOCAL_RANK", str(local.index(rank)))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(len(local)))


def end_use(engine: Any, destroy: Callable[[], None]) -> None:
    """`engine` stops using the group: wait for every process, and destroy the group (through
    `destroy`) when no Engine of this process uses it any more and ds_engine formed it."""
    global _FORMED
    _USERS.discard(engine)
    if not is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    if _USERS:
        gc.collect()  # Engines dropped by the script may still sit in reference cycles
    if not _USERS and _FORMED:
        destroy()
        _FORMED = False


def place(default: tuple[int, int]) -> tuple[int, int]:
    """(rank, world size) now: from the group, else the launcher's variables, else `default`."""
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return default
