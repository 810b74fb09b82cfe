"""Preemption signals: a handler that only records the signal, and the Slurm requeue.

The handler never raises and never saves: it sets a flag. The Engine reads the flag at the next
optimizer boundary, where the ranks agree on it (`ds_engine.autosave`), so every rank saves
the same step together, and a second signal during that save changes nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

__all__ = ["DEFAULT_SIGNALS", "PREEMPTED_EXIT_CODE", "SignalFlag", "requeue_slurm_job", "resolve_signals"]

PREEMPTED_EXIT_CODE = 143
"""The status a preempted run exits with after its checkpoint is saved: 128 + SIGTERM, what a
process killed by SIGTERM reports to a shell, Slurm and Kubernetes."""

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM",)
"""The signals `autosave` treats as a preemption unless told otherwise."""

_REFUSED = {"SIGKILL", "SIGSTOP", "SIGINT"}


def resolve_signals(signals: Iterable[str | int | signal.Signals] | str | None) -> tuple[signal.Signals, ...]:
    """Turn names ("SIGTERM", "USR1") or numbers into signals, checked.

    Raises:
        ValueError: An unknown signal, or one that cannot or should not be caught (SIGKILL and
            SIGSTOP cannot; SIGINT stays Ctrl-C).
    """
    if signals is None:
        return ()
    if isinstance(signals, (str, int)):
        signals = (signals,)
    found: list[signal.Signals] = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            allowed = ", ".join(s for s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, s))
            raise ValueError(
                f"`signals` holds {item!r}, which is no signal of this platform; allowed: signal names "
                f"or numbers such as {allowed}. HINT: signals=('SIGTERM', 'SIGUSR1')."
            ) from None
        if sig.name in _REFUSED:
            raise ValueError(
                f"`signals` holds {sig.name}, which autosave does not catch (SIGKILL and SIGSTOP cannot be "
                "caught; SIGINT stays Ctrl-C's interrupt); allowed: SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, ... "
                "HINT: signals=('SIGTERM', 'SIGUSR1')."
            )
        if sig not in found:
            found.append(sig)
    return tuple(found)


class SignalFlag:
    """Records that one of `signals` arrived; the previous handlers come back on `restore()`."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self.received: int = 0
        """The last signal received (its number), 0 for none."""
        self.count = 0
        """How many of the signals arrived."""
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Catch the signals (main thread only).

        Raises:
            RuntimeError: Called outside the main thread, where Python cannot set handlers.
        """
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"`autosave` catches {', '.join(s.name for s in self.signals)} and must be called from "
                "the main thread (Python sets signal handlers there only). HINT: call it from the "
                "script's main thread, or pass signals=() to save periodically without catching signals."
            )
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: no I/O, no exception (a second signal during the save must not stop it).
        self.received = signum
        self.count += 1

    @property
    def requested(self) -> bool:
        return self.count > 0

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def requeue_slurm_job(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> str:
    """Ask Slurm to requeue this job (`scontrol requeue $SLURM_JOB_ID`); what happened, in words.

    Never raises: a preempted run still exits with its checkpoint saved when the requeue fails.
    """
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: SLURM_JOB_ID is not set (not a Slurm job)"
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        return f"not requeued: `scontrol` is not on PATH (Slurm job {job})"
    try:
        done = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`scontrol requeue {job}` failed: {exc}"
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[:300]
        warnings.warn(
            f"ds_engine: `scontrol requeue {job}` exited with {done.returncode}: {detail}", stacklevel=2
        )
        return f"`scontrol requeue {job}` exited with {done.returncode}: {detail}"
    return f"requeued Slurm job {job}"
