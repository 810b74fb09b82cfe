"""Periodic checkpoints, resume by itself, and saving on preemption: `Engine.autosave`.

    engine.autosave("ckpt/", every_steps=50, keep_last=2)   # after prepare; resumes if it can
    for epoch in range(train_dl.epoch, epochs):             # a resumed run continues its epoch
        for batch in train_dl: ...

`autosave` resumes from the newest *complete* checkpoint in the folder (a tag whose files do not
match what its save recorded is skipped with a warning naming it), then saves at optimizer
boundaries: every `every_steps` optimizer steps, every `every_minutes` minutes (rank 0's clock),
and once when one of `signals` reaches any rank (then every rank exits with
`PREEMPTED_EXIT_CODE`). Rotation (`keep_last`) removes older tags only after the new one is
complete.

Where it saves: the prepared training dataloader calls `after_batch` when the loop body of a
batch has returned and before the next batch is fetched. A save happens there only when that
batch was trained on, ended an accumulation window and its optimizer step was taken (the
loader position is then exactly "batches consumed", the gradients are applied and zeroed);
never at an epoch's last batch (code after the inner loop, such as an evaluation, must still
run: the next boundary saves instead). At such a boundary the ranks agree with one all_reduce
(MAX) of two small ints: the signal received by any rank, and whether rank 0's timer is due;
no collective runs at other micro-steps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_engine._io import barrier, broadcast_from_rank0, current_rank, raise_problem, world_size
from ds_engine.manifest import MANIFEST_NAME, check_manifest
from ds_engine.preemption import (
    DEFAULT_SIGNALS,
    PREEMPTED_EXIT_CODE,
    SignalFlag,
    requeue_slurm_job,
    resolve_signals,
)

if TYPE_CHECKING:
    import signal

    from ds_engine.dataloader import PreparedDataLoader
    from ds_engine.engine import Engine

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "REPORT_ENV",
    "AutoSaver",
    "newest_complete_folder",
    "newest_complete_tag",
    "start_autosave",
    "tag_problem",
]

AGREEMENT_BUDGET = 0.0025
"""The share of training time the agreement may take: rank 0 spaces agreements (every k-th
boundary, k carried in the agreement itself so every rank skips the same boundaries) so that
its measured cost stays under this share of the measured step time."""
MAX_AGREEMENT_GAP_S = 1.0
"""Agreements are never spaced further apart than this (a preemption waits at most this long
plus one step for the ranks to agree)."""

REPORT_ENV = "DS_ENGINE_PREEMPT_REPORT"
"""Set by `ds-engine launch`: the file rank 0 writes (JSON: step, folder, signal) after a
preemption save, so the launcher can say the run was preempted and saved."""


def newest_complete_tag(directory: str | os.PathLike[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete tag of a checkpoint folder, and the tags skipped on the way (with why).

    Complete: its metadata and engine state read (`resolve_checkpoint`, which also loads every
    state file through the restricted unpickler: a truncated file fails there) and every file its
    manifest lists is there with the recorded size (and CRC-32 for small files). Folders that
    look like a tag of ours (they hold a tag's metadata, engine state or manifest) but are not
    listed as complete are reported as skipped too. No process group needed; never raises for a
    damaged tag.

    Returns:
        (tag or None when there is none, [(skipped tag, reason), ...] newest first).
    """
    from ds_engine.checkpoint import (
        CHECKPOINT_META_NAME,
        ENGINE_STATE_NAME,
        _is_tag_name,
        _tags,
        resolve_checkpoint,
    )

    root = Path(directory).absolute()
    if not root.is_dir():
        return None, []
    ordered = _tags(root)  # oldest first, by the time each save recorded
    skipped: list[tuple[str, str]] = []
    try:
        subs = sorted(root.iterdir())
    except OSError:
        subs = []
    for sub in subs:
        if sub.name in ordered or not _is_tag_name(sub.name) or sub.is_symlink() or not sub.is_dir():
            continue
        ours = (CHECKPOINT_META_NAME, ENGINE_STATE_NAME, MANIFEST_NAME)
        if any(os.path.lexists(sub / name) for name in ours):
            try:
                resolve_checkpoint(root, sub.name)
                reason = "its metadata or engine state is not readable"
            except (OSError, ValueError) as exc:
                reason = str(exc)
            skipped.append((sub.name, reason))
    for tag in reversed(ordered):
        problem = tag_problem(root, tag)
        if not problem:
            return tag, skipped
        skipped.append((tag, problem))
    return None, skipped


def tag_problem(directory: str | os.PathLike[str], tag: str) -> str:
    """'' when `directory/tag` is complete (its manifest matches and every state file loads), else why not."""
    from ds_engine.checkpoint import resolve_checkpoint

    root = Path(directory).absolute()
    problem = check_manifest(root / tag)
    if not problem:
        try:
            resolve_checkpoint(root, tag)
        except (OSError, ValueError) as exc:
            problem = str(exc)
    return problem


def newest_complete_folder(folders: Iterable[Path], tag: str) -> Path | None:
    """The newest of `folders` (given oldest first) whose `tag` is complete (`tag_problem`); a
    warning names each newer one skipped. What `Accelerator.load_state()` resumes from."""
    for folder in reversed(list(folders)):
        problem = tag_problem(folder, tag)
        if not problem:
            return folder
        warnings.warn(f"ds_engine: skipped checkpoint {str(folder)!r}: {problem}", stacklevel=3)
    return None


def _positive_int(name: str, value: Any, example: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}`={value!r} must be a positive int or None. HINT: {example}.")
    return int(value)


class AutoSaver:
    """The state of `Engine.autosave` (one per Engine): resume, the boundary hook, the preemption.

    Args:
        engine: The Engine (after `prepare`).
        directory: The checkpoint folder (tags ``step_<N>`` and `latest`).
        every_steps: Save every this many optimizer steps (skipped steps count); None: not by steps.
        every_minutes: Save when this many minutes passed since the last save (rank 0's clock);
            None: not by time.
        keep_last: Keep the newest this many tags (None keeps all).
        signals: Signals that mean "preempted" (names or numbers).
        requeue: After a preemption save, run `scontrol requeue $SLURM_JOB_ID` under Slurm.
        client_state: A function returning your own small state to save with every checkpoint
            (returned by `autosave` when it resumes).
        agree_every: Agree every this many boundaries (1: at every one); None: rank 0 spaces the
            agreements to at most `AGREEMENT_BUDGET` of the step time, at most
            `MAX_AGREEMENT_GAP_S` apart.
    """

    def __init__(
        self,
        engine: Engine,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        keep_last: int | None = None,
        signals: Iterable[str | int | signal.Signals] | str | None = DEFAULT_SIGNALS,
        requeue: bool = False,
        client_state: Callable[[], Mapping[str, Any]] | None = None,
        agree_every: int | None = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(
                f"`directory`={directory!r} must be a folder path (str or os.PathLike). HINT: "
                "engine.autosave('ckpt/', every_steps=50)."
            )
        self.every_steps = _positive_int("every_steps", every_steps, "every_steps=50")
        if every_minutes is not None and (
            isinstance(every_minutes, bool)
            or not isinstance(every_minutes, (int, float))
            or not math.isfinite(every_minutes)
            or every_minutes <= 0
        ):
            raise ValueError(
                f"`every_minutes`={every_minutes!r} must be a positive number of minutes or None. "
                "HINT: every_minutes=30."
            )
        self.every_minutes = None if every_minutes is None else float(every_minutes)
        self.keep_last = _positive_int("keep_last", keep_last, "keep_last=2")
        self.agree_every = _positive_int("agree_every", agree_every, "agree_every=1 (every boundary)")
        if not isinstance(requeue, bool):
            raise TypeError(f"`requeue`={requeue!r} must be True or False. HINT: requeue=True under Slurm.")
        if client_state is not None and not callable(client_state):
            raise TypeError(
                f"`client_state`={client_state!r:.60} must be a function that returns a dict (called at "
                "every save). HINT: client_state=lambda: {'best_loss': best_loss}."
            )
        self.engine = engine
        self.directory = Path(directory).absolute()
        self.requeue = requeue
        self.client_state = client_state
        self.flag = SignalFlag(resolve_signals(signals))
        self._needs_agreement = bool(self.flag.signals) or self.every_minutes is not None
        self._seen_steps = self._steps()
        self._last_saved_steps = self._seen_steps
        self._last_save_time = time.monotonic()
        self._skip = 0  # boundaries left before the next agreement (the same on every rank)
        self._boundary_at: float | None = None  # rank 0: when the last boundary was seen
        self._step_s = 0.0  # rank 0: moving average of a step's time (boundary to boundary)
        self._agree_s = 0.0  # rank 0: the fastest agreement seen (its cost without waiting)
        self.agreements = 0
        """Agreements held (all_reduce calls) so far."""
        self.agreement_seconds = 0.0
        """Time spent in them on this rank."""
        self.closed = False
        self.saves = 0
        """Checkpoints this AutoSaver wrote (periodic and preemption)."""

    # ------------------------------------------------------------------ facts
    def _steps(self) -> int:
        return int(self.engine.num_optimizer_steps + self.engine.num_skipped_steps)

    # ------------------------------------------------------------------ resume
    def resume(self) -> dict[str, Any] | None:
        """Load the newest complete checkpoint of the folder (collective); its client_state, or None.

        Rank 0 looks; every rank loads the tag it found. A skipped tag is a warning naming it.
        """
        outcome: Any = None
        if current_rank() == 0:
            try:
                outcome = (None, *newest_complete_tag(self.directory))
            except Exception as exc:  # every rank must hear it (they wait in the broadcast)
                outcome = (
                    (type(exc).__name__, f"autosave could not list {str(self.directory)!r}: {exc}"),
                    None,
                    [],
                )
        problem, tag, skipped = broadcast_from_rank0(outcome)
        raise_problem(problem)
        if current_rank() == 0:
            for name, reason in skipped:
                warnings.warn(
                    f"ds_engine: skipped checkpoint {str(self.directory / name)!r}: {reason}"
                    + (f"; resuming from {tag!r} instead." if tag else "; no complete checkpoint is left."),
                    stacklevel=3,
                )
        if tag is None:
            return None
        client = self.engine.load_checkpoint(self.directory, tag=tag)
        self._seen_steps = self._last_saved_steps = self._steps()
        self._last_save_time = time.monotonic()
        if current_rank() == 0:
            print(
                f"ds_engine: resumed from {str(self.directory / tag)!r} (optimizer step {self._steps()})",
                file=sys.stderr,
                flush=True,
            )
        return client

    # ------------------------------------------------------------------ the boundary hook
    def at_boundary(self, loader: PreparedDataLoader, index: int) -> bool:
        """Whether `after_batch` may act now: the same answer on every rank (rank-wide facts only)."""
        engine = self.engine
        if self.closed or engine.step.ended or self._steps() == self._seen_steps:
            return False  # no optimizer step since the last look: no collective
        if not engine.sync_gradients or engine.has_unapplied_gradients:
            return False
        if index + 1 >= loader.known_len():
            return False  # an epoch's last batch: the code after the inner loop runs first
        # not inside an evaluation loop over another prepared loader: positions are "batches consumed"
        return engine.at_trained_batches

    def after_batch(self, loader: PreparedDataLoader, index: int) -> None:
        """Called by a prepared loader after the loop body of batch `index` returned (every rank)."""
        if not self.at_boundary(loader, index):
            return
        steps = self._seen_steps = self._steps()
        signum, due = self._agree()
        if signum:
            self._preempt(steps, signum)
        by_steps = self.every_steps is not None and (
            steps // self.every_steps > self._last_saved_steps // self.every_steps
        )
        if by_steps or due:
            self._save(steps)

    def _agree(self) -> tuple[int, bool]:
        """At a boundary: one all_reduce (MAX) of [a signal received here, rank 0's timer due, the
        boundaries until the next agreement (rank 0's choice)], or nothing at a boundary skipped
        by the last agreement. The same answer on every rank."""
        if not self._needs_agreement:
            return 0, False
        first = current_rank() == 0
        now = time.perf_counter()
        if first:  # a step's time: from one boundary to the next
            if self._boundary_at is not None:
                step = now - self._boundary_at
                self._step_s = step if not self._step_s else 0.8 * self._step_s + 0.2 * step
            self._boundary_at = now
        if self._skip > 0:
            self._skip -= 1
            return 0, False
        signum = int(self.flag.received) if self.flag.requested else 0
        due = int(
            first
            and self.every_minutes is not None
            and time.monotonic() - self._last_save_time >= self.every_minutes * 60.0
        )
        if self.agree_every is not None:  # the user's fixed spacing, the same on every rank
            gap = self.agree_every
        else:  # rank 0's choice; alone there is no collective and no spacing
            gap = self._gap() if first and world_size() > 1 else 0
        if world_size() > 1:
            import torch.distributed as dist

            box = torch.tensor([signum, due, gap], dtype=torch.int64, device=self.engine.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            signum, due, gap = (int(v) for v in box.tolist())
        spent = time.perf_counter() - now
        # its cost is the fastest one seen: the others include waiting for a slower rank, which the
        # step's own collectives would have waited anyway
        self._agree_s = spent if not self._agree_s else min(self._agree_s, spent)
        self.agreements += 1
        self.agreement_seconds += spent
        self._skip = max(0, gap - 1)
        return signum, bool(due)

    def _gap(self) -> int:
        """Rank 0: agree every k-th boundary, k the smallest that keeps the agreement's share of
        training time under `AGREEMENT_BUDGET`, and k steps no longer than `MAX_AGREEMENT_GAP_S`."""
        if not self._step_s or not self._agree_s:
            return 1
        wanted = math.ceil(self._agree_s / (AGREEMENT_BUDGET * self._step_s))
        longest = max(1, int(MAX_AGREEMENT_GAP_S / self._step_s))
        return max(1, min(wanted, longest))

    def _save(self, steps: int) -> Path:
        client = None
        if self.client_state is not None:
            client = self.client_state()
        tag = f"step_{steps}"
        self.engine.save_checkpoint(self.directory, tag=tag, client_state=client, keep_last=self.keep_last)
        self._last_saved_steps = steps
        self._last_save_time = time.monotonic()
        self.saves += 1
        return self.directory / tag

    def _preempt(self, steps: int, signum: int) -> None:
        """Save at this step (every rank), log, requeue under Slurm if asked, exit with 143."""
        import signal as signals

        started = time.monotonic()
        try:
            name = signals.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        folder = self._save(steps)
        if current_rank() == 0:
            requeued = requeue_slurm_job() if self.requeue else ""
            print(
                f"ds_engine: preempted ({name} received): saved optimizer step {steps} to {str(folder)!r} "
                f"in {time.monotonic() - started:.1f} s; exiting with status {PREEMPTED_EXIT_CODE}"
                + (f"; {requeued}" if requeued else "")
                + ". Run the same command again to resume.",
                file=sys.stderr,
                flush=True,
            )
            report = os.environ.get(REPORT_ENV)
            if report:
                try:
                    Path(report).write_text(
                        json.dumps({"step": steps, "folder": str(folder), "signal": name}), encoding="utf-8"
                    )
                except OSError:
                    pass
        barrier()  # no rank leaves before rank 0 logged and requeued
        # the handlers stay: a late signal while the process exits is only recorded
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """Stop saving and put back the previous signal handlers (`end_training` calls it)."""
        self.closed = True
        self.flag.restore()


def start_autosave(
    engine: Engine,
    directory: str | os.PathLike[str],
    *,
    caller: str,
    current: AutoSaver | None,
    **options: Any,
) -> tuple[AutoSaver, dict[str, Any] | None]:
    """`Engine.autosave`'s implementation: check, catch the signals, resume, arm the hook.

    Args:
        engine: The Engine to save and resume.
        directory: The checkpoint folder.
        caller: What the script calls the Engine ("engine" or "accelerator"), for errors.
        current: The Engine's AutoSaver of an earlier call, if any (a second one is refused).
        options: `Engine.autosave`'s other arguments.

    Returns:
        The armed AutoSaver (the Engine calls its `after_batch`) and the resumed `client_state`
        (None when the run starts fresh).
    """
    if engine.model is None or engine.optimizer is None:
        raise RuntimeError(
            f"`{caller}.autosave` before the model and its optimizer were prepared: there is nothing to "
            f"resume into or save. HINT: call `{caller}.autosave(directory, ...)` right after "
            f"`{caller}.prepare(model, optimizer, train_dl, scheduler)`."
        )
    if engine.num_micro_steps:
        raise RuntimeError(
            f"`{caller}.autosave` after training began ({engine.num_micro_steps} micro-steps taken): "
            "resuming now would replace what this run trained. HINT: call it once, right after "
            "`prepare` and before the training loop."
        )
    if current is not None and not current.closed:
        raise RuntimeError(
            f"`{caller}.autosave` was already called for {str(current.directory)!r}; one autosave per "
            f"{caller}. HINT: call it once, right after `prepare`."
        )
    saver = AutoSaver(engine, directory, **options)
    saver.flag.install()
    try:
        client = saver.resume()
    except BaseException:
        saver.close()
        raise
    return saver, client
