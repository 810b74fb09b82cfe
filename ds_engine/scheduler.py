"""Optimizer and LR-scheduler wrappers whose `step()` obeys the Engine's boundaries.

`OverflowAwareScheduler` advances exactly once per *applied* optimizer step: a call on a
non-boundary micro-step, a second call for the same optimizer step, or a call after a step
that was skipped (fp16 loss-scale overflow, non-finite gradients) is a no-op. It never
advances `num_processes` times (accelerate's "split_batches=False" trap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_engine.engine import Engine


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer as returned by `prepare`: `step`/`zero_grad` act only at boundaries.

    `param_groups`, `state` and `defaults` are the real optimizer's, so LR schedulers and
    logging keep working; `step()` asks the Engine to take the step (clipping, overflow check,
    counters) once per accumulation window.
    """

    def __init__(self, optimizer: Any, engine: Engine) -> None:  # no super().__init__: a view
        self.optimizer = optimizer
        self._engine = engine

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
        self._engine._optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients after a boundary; a no-op while accumulating."""
        self._engine._zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class OverflowAwareScheduler:
    """Wraps any torch LR scheduler; advances once per applied optimizer step.

    Args:
        scheduler: a torch `LRScheduler` (including transformers' `get_scheduler` schedules),
            or DeepSpeed's native scheduler when `engine_steps_it` is True.
        engine: the Engine whose step bookkeeping decides.
        engine_steps_it: True when the backend already advances the scheduler itself after an
            applied step (DeepSpeed's native scheduler); `step()` is then always a no-op here.
    """

    def __init__(self, scheduler: Any, engine: Engine, *, engine_steps_it: bool = False) -> None:
        self.scheduler = scheduler
        self._engine = engine
        self._engine_steps_it = engine_steps_it
        self._last_stepped_for = 0  # the applied-step count this scheduler last advanced for
        self.num_steps = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule if an optimizer step was just applied and not yet counted."""
        engine = self._engine
        if self._engine_steps_it:
            return
        if not engine.sync_gradients or engine.step_was_skipped:
            return
        if engine.num_optimizer_steps == self._last_stepped_for:
            return  # already advanced for this optimizer step
        self._last_stepped_for = engine.num_optimizer_steps
        self.num_steps += 1
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state and "last_stepped_for" in state:
            self.scheduler.load_state_dict(state["scheduler"])
            self._last_stepped_for = int(state["last_stepped_for"])
            self.num_steps = int(state.get("num_steps", 0))
        else:  # a bare torch scheduler state
            self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        # Everything else (optimizer, last_epoch, base_lrs, ...) is the wrapped scheduler's.
        if name in ("scheduler", "_engine"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"OverflowAwareScheduler({self.scheduler!r})"
