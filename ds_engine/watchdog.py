"""Hangs named within minutes: a watchdog over the Engine's calls.

A rank stuck in a collective (the other ranks called something else, or nothing) waits for the
process group's timeout, half an hour by default, and then says little. The Engine instead marks
each of its calls (`backward`, `step`, `save_pretrained`, ...) with `Watchdog.watch`; a daemon
thread notices a call that has made no progress for `hang_timeout_s` and then:

1. writes, to stderr, one line naming this rank, the call and the optimizer step, what every
   other rank was last doing (read from the process group's store, where each rank's watchdog
   publishes its current call every few seconds), a hint when the pattern is a known misuse
   (a collective called on one rank only, one rank leaving the loop early), and the Python stack
   of every thread (`faulthandler`);
2. tells the other ranks through the store, so that they dump their stacks too;
3. ends the process with `HANG_EXIT_CODE`, so the launcher stops (or restarts) the run.

Time spent between Engine calls (the user's own evaluation, data loading) never counts: only a
call that does not return does. The store is optional: without one (a process group formed
without MASTER_ADDR/MASTER_PORT), each rank still dumps its own stack and stops.

Marking a call costs two attribute writes; the thread wakes every `poll_s` seconds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = [
    "COLLECTIVE_CALLS",
    "HANG_EXIT_CODE",
    "Watchdog",
    "connect_store",
    "for_process",
    "hang_hint",
    "watched",
]

HANG_EXIT_CODE = 124
"""Exit status of a rank the watchdog stopped (as `timeout(1)` uses)."""

COLLECTIVE_CALLS = frozenset(
    {"save_pretrained", "get_state_dict", "save_checkpoint", "load_checkpoint", "gathered", "end_training"}
)
"""Engine calls that are collectives under ZeRO-3 (or always) although a user may expect them to
be local to rank 0: the usual suspects when one rank waits in one of them alone."""

_PREFIX = "ds_engine_watchdog"


def connect_store(timeout_s: float = 30.0) -> Any | None:
    """A client of the launcher's TCP store (MASTER_ADDR / MASTER_PORT), or None without one."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:  # the watchdog degrades to this rank alone
        return None


def hang_hint(call: str, others: dict[int, dict[str, Any]]) -> str:
    """What to change, from this rank's stuck `call` and the other ranks' last reported calls."""
    elsewhere = {r: s for r, s in others.items() if s.get("call") != call}
    if not elsewhere:
        return (
            "every rank is in this call: a collective inside it is waiting for a rank that left, "
            "or for data only some ranks have; see the stacks below"
        )
    names = ", ".join(
        f"rank {r} "
        + ("is not in an Engine call" if s.get("call") is None else f"is in `{s['call']}`")
        + (f" (step {s['step']})" if s.get("step") is not None else "")
        + (" and has left the training loop" if s.get("ended") or s.get("call") == "end_training" else "")
        for r, s in sorted(elsewhere.items())
    )
    if call in COLLECTIVE_CALLS:
        return (
            f"{names}. `{call}` is a collective (every rank must call it; under ZeRO-3 the weights "
            f"are gathered from every rank, and only rank 0 writes). HINT: call it on every rank, "
            f"not under `if engine.is_main_process:`"
        )
    if any(s.get("call") in COLLECTIVE_CALLS or s.get("ended") for s in elsewhere.values()):
        return (
            f"{names}. The ranks no longer run the same calls: one left the loop early or called a "
            f"collective the others did not. HINT: every rank must run the same number of steps "
            f"(decide a `break` together, e.g. from `engine.reduce(flag)`), and call "
            f"`save_pretrained` / `get_state_dict` / `save_checkpoint` on every rank"
        )
    return (
        f"{names}: the ranks are in different calls. HINT: every rank must make the same Engine "
        f"calls in the same order"
    )


class Watchdog:
    """Stops this rank, with its stack and the other ranks' last calls, when an Engine call hangs.

    Args:
        rank: This process's global rank.
        world_size: Number of ranks.
        timeout_s: Seconds a call may make no progress before it counts as a hang (> 0).
        store: A `torch.distributed.Store` shared by the ranks, or None (this rank alone).
        stream: Where the report goes (stderr).
        on_hang: Called with the report instead of ending the process (tests).
        poll_s: How often the thread looks (default: a tenth of the timeout, between 0.2 and 5 s).
        namespace: A prefix for the store keys (one per restart of the group).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: Any | None = None,
        stream: TextIO | None = None,
        on_hang: Callable[[str], None] | None = None,
        poll_s: float | None = None,
        namespace: str = "",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Watchdog: timeout_s = {timeout_s!r}; it must be > 0")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.store, self.stream, self.on_hang = store, stream, on_hang
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, timeout_s / 10))
        self._prefix = f"{_PREFIX}/{namespace}" if namespace else _PREFIX
        self._call: str | None = None
        self._step: int | None = None
        self._since = time.monotonic()
        self._depth = 0
        self.ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ marking calls
    def watch(self, call: str, step: int | None = None) -> _Mark:
        """Mark `call` (at optimizer step `step`) as in progress while the returned context lasts;
        nested marks keep the outer name."""
        return _Mark(self, call, step)

    def enter(self, call: str, step: int | None = None) -> None:
        """Mark `call` as in progress until the matching `exit` (what `watch` does, without a
        context object: for calls made on every micro-step)."""
        if self._depth == 0:
            self._call, self._step, self._since = call, step, time.monotonic()
        self._depth += 1

    def exit(self) -> None:
        """End the mark of the matching `enter`."""
        self._depth -= 1
        if self._depth == 0:
            self._call = None

    def progress(self) -> None:
        """The call in progress moved on (e.g. one more shard written): restart its clock."""
        self._since = time.monotonic()

    # ------------------------------------------------------------------ the thread
    def start(self) -> Watchdog:
        """Start the daemon thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds_engine-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, ended: bool = True) -> None:
        """Stop watching; `ended`: tell the other ranks this one left the training loop."""
        self.ended = ended
        if self._thread is not None:
            self._publish()
            self._stop.set()
            self._thread.join(timeout=self.poll_s + 1)
            self._thread = None

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self._prefix}/{what}/{self.rank if rank is None else rank}"

    def _status(self) -> dict[str, Any]:
        call = self._call
        return {
            "call": call,
            "step": self._step,
            "for_s": round(time.monotonic() - self._since, 1) if call is not None else None,
            "ended": self.ended,
        }

    def _publish(self) -> None:
        if self.store is None:
            return
        with contextlib.suppress(Exception):
            self.store.set(self._key("status"), json.dumps(self._status()))

    def _others(self) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        if self.store is None:
            return found
        for r in range(self.world_size):
            if r == self.rank:
                continue
            with contextlib.suppress(Exception):
                if self.store.check([self._key("status", r)]):
                    found[r] = json.loads(self.store.get(self._key("status", r)))
        return found

    def _peer_fired(self) -> int | None:
        if self.store is None:
            return None
        for r in range(self.world_size):
            if r == self.rank:
                continue
            with contextlib.suppress(Exception):
                if self.store.check([self._key("hang", r)]):
                    return r
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._publish()
            call = self._call
            stuck = call is not None and time.monotonic() - self._since > self.timeout_s
            peer = None if stuck else self._peer_fired()
            if stuck or (peer is not None and call is not None):
                self._fire(call, peer)
                return

    def _fire(self, call: str | None, peer: int | None) -> None:
        status = self._status()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(self._key("hang"), json.dumps(status))
        others = self._others()
        where = f"`{call}`" + (f" at optimizer step {status['step']}" if status["step"] is not None else "")
        if peer is None:
            head = (
                f"ds_engine: rank {self.rank} made no progress for {status['for_s']} s in {where} "
                f"(hang_timeout_s={self.timeout_s:g}); stopping the run. {hang_hint(call or '', others)}."
            )
        else:
            head = (
                f"ds_engine: rank {peer} reported a hang; rank {self.rank} was in {where} for "
                f"{status['for_s']} s. Its Python stacks follow."
            )
        report = head + "\n"
        stream = self.stream or sys.stderr
        with contextlib.suppress(Exception):
            stream.write(report)
            stream.write(f"--- Python stacks of rank {self.rank} ---\n")
            stream.flush()
            if self.on_hang is None:
                faulthandler.dump_traceback(file=stream, all_threads=True)
                stream.flush()
        if self.on_hang is not None:
            self.on_hang(report)
            return
        os._exit(HANG_EXIT_CODE)


class _Mark:
    """The context `Watchdog.watch` returns (a plain class: it runs on every training call)."""

    __slots__ = ("_call", "_dog", "_step")

    def __init__(self, dog: Watchdog, call: str, step: int | None) -> None:
        self._dog, self._call, self._step = dog, call, step

    def __enter__(self) -> None:
        self._dog.enter(self._call, self._step)

    def __exit__(self, *exc: object) -> None:
        self._dog.exit()


_PROCESS: Watchdog | None = None


def for_process(timeout_s: float) -> Watchdog | None:
    """This process's watchdog, started the first time a process group of several ranks exists
    and `timeout_s` > 0 (the first Engine's `hang_timeout_s` sets it); else None."""
    global _PROCESS
    if _PROCESS is not None or timeout_s <= 0:
        return _PROCESS
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    _PROCESS = Watchdog(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        timeout_s=timeout_s,
        store=connect_store(),
        namespace=f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
    ).start()
    return _PROCESS


def stop_process_watchdog() -> None:
    """Stop this process's watchdog (its process group ended): the other ranks learn it left."""
    global _PROCESS
    if _PROCESS is not None:
        _PROCESS.stop(ended=True)
        _PROCESS = None


def watched(call: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of an Engine, marked as `call` for the watchdog while it runs (the Engine's `_watch`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._watch(call):
            return method(self, *args, **kwargs)

    return run
