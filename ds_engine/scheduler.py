"""Optimizer and LR-scheduler wrappers whose `step()` obeys the Engine's boundaries.

`OverflowAwareScheduler` advances exactly once per *applied* optimizer step: a call on a
non-boundary micro-step, a second call for the same optimizer step, or a call after a step
that was skipped (fp16 loss-scale overflow, non-finite gradients) is a no-op. By default
it calls the wrapped scheduler's `step()` once then; a schedule sized from the un-prepared
dataloader (accelerate's convention, which steps a prepared scheduler `num_processes` times per
optimizer step) is stepped `steps_per_optimizer_step` times instead, so it ends where its author
expects (the Engine decides which, see `Engine.prepare`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ds_engine.step_state import StepState


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer as returned by `prepare`: `step`/`zero_grad` act only at boundaries.

    `param_groups`, `state` and `defaults` are the real optimizer's, so LR schedulers and
    logging keep working; `step()` asks the Engine to take the step (clipping, overflow check,
    counters) once per accumulation window.

    Args:
        optimizer: the backend's optimizer (DeepSpeed's wrapper, or accelerate's).
        step: the Engine's step decision, called by `step()`.
        zero_grad: the Engine's zero_grad decision, called by `zero_grad()`.
        step_state: the Engine's step state (`is_overflow` reads it); None: never skipped.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        step: Callable[[], None],
        zero_grad: Callable[[], None],
        step_state: StepState | None = None,
    ) -> None:  # no super().__init__: a view
        self.optimizer = optimizer
        self._step = step
        self._zero_grad = zero_grad
        self._step_state = step_state

    @property
    def is_overflow(self) -> bool:
        """True when the last optimizer step was skipped (fp16 loss-scale overflow, DeepSpeed's
        bf16 check, non-finite gradients): accelerate's DeepSpeed optimizer attribute.

        The prepared scheduler already stands still on such a step, so the accelerate idiom
        ``if not optimizer.is_overflow: lr_scheduler.step()`` advances it exactly once per
        applied step as well (never twice, never on a skipped one).
        """
        return bool(self._step_state is not None and self._step_state.step_was_skipped)

    @property
    def step_was_skipped(self) -> bool:
        """accelerate's `AcceleratedOptimizer.step_was_skipped`: the same as `is_overflow`."""
        return self.is_overflow

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return getattr(self.optimizer, "defaults", {})

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Take the optimizer step if this micro-step is an accumulation boundary."""
        if closure is not None:
            raise ValueError(
                "`optimizer.step(closure)` is not supported by ds_engine. HINT: call "
                "`engine.backward(loss)` and then `optimizer.step()` without a closure."
            )
        self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients after a boundary; a no-op while accumulating."""
        self._zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


def is_scheduler(obj: Any) -> bool:
    """True for an LR scheduler `prepare` accepts: a callable `step` and `get_last_lr` (or a torch
    `LRScheduler`)."""
    return callable(getattr(obj, "step", None)) and (
        hasattr(obj, "get_last_lr") or isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
    )


def schedule_length(scheduler: Any) -> int | None:
    """The number of `step()` calls a schedule is sized for, where the scheduler says so.

    transformers' `get_*_schedule_with_warmup` keep it in the `functools.partial` of their
    `LambdaLR` (`num_training_steps`; warmup + stable + decay for warmup-stable-decay); torch's
    `OneCycleLR` has `total_steps`, `CosineAnnealingLR` `T_max`, `LinearLR` / `PolynomialLR`
    `total_iters`. None for anything else (a custom lambda, a constant schedule).
    """
    for fn in getattr(scheduler, "lr_lambdas", None) or []:
        keywords = getattr(fn, "keywords", None) or {}
        if isinstance(keywords.get("num_training_steps"), int):
            return int(keywords["num_training_steps"])
        parts = ("num_warmup_steps", "num_stable_steps", "num_decay_steps")
        if all(isinstance(keywords.get(k), int) for k in parts):
            return sum(int(keywords[k]) for k in parts)
    for name in ("total_steps", "T_max", "total_iters"):
        value = getattr(scheduler, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def schedule_reading(
    scheduler: Any,
    *,
    sized_from: str,
    world: int,
    ga: int,
    loader_lengths: tuple[int, int] | None,
    default: str,
    caller: str = "engine",
    owner: str = "Engine",
) -> tuple[int, int, str]:
    """How many times a prepared scheduler steps per applied optimizer step (`Engine.prepare`).

    Args:
        scheduler: The user's LR scheduler (its length is read where it exposes one).
        sized_from: "auto", "prepared" or "unprepared" (`Engine.schedule_sized_from`).
        world: The number of processes.
        ga: gradient_accumulation_steps.
        loader_lengths: (batches of the un-prepared training dataloader, batches per process), or
            None without a training dataloader.
        default: The reading applied when the length does not decide (`default_schedule_reading`).
        caller: What the script calls the Engine ("engine", "accelerator"), for the messages.
        owner: The Engine's class name, for the message.

    Returns:
        (steps per applied optimizer step, log level, the log line; "" when nothing is said).

    Raises:
        ValueError: A `sized_from` other than the three readings.
    """
    import logging

    if sized_from not in ("auto", "prepared", "unprepared"):
        raise ValueError(
            f"`{caller}.schedule_sized_from = {sized_from!r}`; allowed: 'auto', 'prepared', "
            "'unprepared'. HINT: 'unprepared' when num_training_steps came from "
            "len(dataloader) before `prepare` (accelerate's scripts), else 'prepared'."
        )
    if world == 1:
        return 1, logging.INFO, ""  # both readings agree
    if sized_from != "auto":
        return (world if sized_from == "unprepared" else 1), logging.INFO, ""
    total = schedule_length(scheduler)
    chosen, guess = default, True
    only_chosen_fits = False  # is the length whole epochs of the reading applied, and not the other?
    if total is None:
        why = "its length is unknown"
    elif loader_lengths is None:
        why = "no dataloader was prepared"
    else:
        unprepared_len, prepared_len = loader_lengths

        def fits(batches: int) -> bool:  # whole epochs of `batches / GA` optimizer steps
            per_epoch = {math.ceil(batches / ga), batches // ga} - {0}
            return any(total >= n and total % n == 0 for n in per_epoch)

        by = {"prepared": fits(prepared_len), "unprepared": fits(unprepared_len)}
        sizes = f"{unprepared_len} batches un-prepared, {prepared_len} per process, GA {ga}"
        if ga == 1:
            # a loop accumulating by hand (`loss / gas`, step every gas batches) sizes its
            # schedule as len / gas, which may look like either reading: never decide from it
            why = (
                f"at gradient_accumulation_steps=1 its length ({total} steps; {sizes}) does not "
                "tell (the loop may accumulate by hand, `loss / gas`, with any gas)"
            )
        else:
            if by["prepared"] != by["unprepared"]:
                chosen, guess = ("unprepared" if by["unprepared"] else "prepared"), False
            reading = (
                f"is whole epochs of the {chosen} dataloader only"
                if not guess
                else ("fits both readings" if by["prepared"] else "fits neither reading")
            )
            why = f"its length ({total} steps) {reading} ({sizes})"
        only_chosen_fits = by[chosen] and not by["unprepared" if chosen == "prepared" else "prepared"]
    if guess:
        why += f"; the default reading of {owner}"
    per_step = world if chosen == "unprepared" else 1
    # a warning where the reading applied is a guess the length does not single out
    level = logging.WARNING if guess and not only_chosen_fits else logging.INFO
    message = (
        f"ds_engine: the LR schedule is read as sized from the {chosen} dataloader, so it advances "
        f"{per_step} time(s) per applied optimizer step on {world} processes: {why}. HINT: set "
        f"`{caller}.schedule_sized_from = {'prepared' if chosen == 'unprepared' else 'unprepared'!r}` "
        "before `prepare` for the other reading."
    )
    return per_step, level, message


class OverflowAwareScheduler:
    """Wraps any torch LR scheduler; advances once per applied optimizer step.

    Args:
        scheduler: a torch `LRScheduler` (including transformers' `get_scheduler` schedules),
            or DeepSpeed's native scheduler when `engine_steps_it` is True.
        state: the Engine's step state, which decides.
        engine_steps_it: True when the backend already advances the scheduler itself after an
            applied step (DeepSpeed's native scheduler); `step()` is then always a no-op here.
    """

    def __init__(
        self,
        scheduler: Any,
        state: StepState,
        *,
        engine_steps_it: bool = False,
        steps_per_optimizer_step: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self._state = state
        self._engine_steps_it = engine_steps_it
        self._last_stepped_for = 0  # the applied-step count this scheduler last advanced for
        self.num_steps = 0
        """Applied optimizer steps this scheduler advanced for."""
        self.steps_per_optimizer_step = int(steps_per_optimizer_step)
        """The wrapped scheduler's `step()` calls per applied optimizer step: 1, or the number of
        processes for a schedule sized from the un-prepared dataloader (accelerate's convention)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule if an optimizer step was just applied and not yet counted."""
        state = self._state
        state.refuse_if_ended("scheduler.step()")
        if self._engine_steps_it:
            return
        if not state.boundary or state.step_was_skipped:
            return
        if state.num_optimizer_steps == self._last_stepped_for:
            return  # already advanced for this optimizer step
        self._last_stepped_for = state.num_optimizer_steps
        self.num_steps += 1
        for _ in range(self.steps_per_optimizer_step):
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def get_lr(self) -> list[float]:
        return list(self.scheduler.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "last_stepped_for": self._last_stepped_for,
            "num_steps": self.num_steps,
            "steps_per_optimizer_step": self.steps_per_optimizer_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state and "last_stepped_for" in state:
            self.scheduler.load_state_dict(state["scheduler"])
            self._last_stepped_for = int(state["last_stepped_for"])
            self.num_steps = int(state.get("num_steps", 0))
        else:  # a bare torch scheduler state
            self.scheduler.load_state_dict(state)

    def sync_optimizer_lr(self) -> None:
        """Put the restored schedule's current lr into the optimizer (as its last `step()` did)."""
        optimizer = getattr(self.scheduler, "optimizer", None)
        last = getattr(self.scheduler, "_last_lr", None)
        if optimizer is None or not last or len(last) != len(optimizer.param_groups):
            return
        for group, lr in zip(optimizer.param_groups, last):
            group["lr"] = lr

    def __getattr__(self, name: str) -> Any:
        # Everything else (optimizer, last_epoch, base_lrs, ...) is the wrapped scheduler's.
        if name in ("scheduler", "_state"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"OverflowAwareScheduler({self.scheduler!r})"
