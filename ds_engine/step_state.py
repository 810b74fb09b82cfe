"""The Engine's step bookkeeping as one object: counters, the current window, the last boundary.

The Engine changes it; the optimizer/scheduler wrappers read it (a scheduler advances once per
applied optimizer step); a training checkpoint saves and restores it through `state_dict()` /
`load_state_dict()`, so nothing outside the Engine touches its private fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StepState:
    """Where training is: what has been counted, and what the current micro-step is."""

    num_micro_steps: int = 0
    """Micro-steps (forward/backward passes) taken so far."""
    num_optimizer_steps: int = 0
    """Optimizer steps applied so far (skipped steps not counted)."""
    num_skipped_steps: int = 0
    """Optimizer steps skipped because of overflow / non-finite gradients."""
    step_was_skipped: bool = False
    """True when the last boundary's optimizer step was skipped."""
    grad_norm: float | None = None
    """Global gradient norm at the last boundary, before clipping."""
    loss_scale: float | None = None
    """Current fp16 loss scale (None without loss scaling)."""
    boundary: bool = True
    """The current micro-step ends an accumulation window."""
    window_len: int = 1
    """Micro-steps in the current window (shorter than GA for a short last window)."""
    window_start: bool = True
    """The current micro-step opens a window."""
    stepped: bool = False
    """The current window's optimizer step has been taken (applied or skipped)."""
    micro_backwards: int = 0
    """`engine.backward` calls in the current micro-step."""
    grads_pending: bool = False
    """Gradients were accumulated since the last optimizer step."""
    free_micro_steps: int = 0
    """Micro-steps counted without a prepared dataloader in progress (they set the boundary then)."""
    consecutive_skips: int = 0
    """Optimizer steps skipped in a row."""
    ended: bool = False
    """The Engine's run ended (`end_training`): nothing may train, save or communicate any more."""

    def refuse_if_ended(self, call: str) -> None:
        """Raise the one error every training, saving or collective call gives after `end_training`.

        Args:
            call: The call as the user wrote it, e.g. "engine.backward(loss)" or "optimizer.step()".
        """
        if self.ended:
            raise RuntimeError(
                f"`{call}` after `end_training()`: end_training() destroyed this run's process group "
                "(or, while other Engines still use it, ended this Engine's part in it), so the prepared "
                "model, optimizer, scheduler and dataloaders can no longer train, save or communicate. "
                "HINT: call `end_training()` once, as the script's last call, after the final "
                "`save_checkpoint` / `save_pretrained`."
            )

    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint keeps (a checkpoint is taken at a boundary, after the step)."""
        return {
            "counters": {
                "num_micro_steps": int(self.num_micro_steps),
                "num_optimizer_steps": int(self.num_optimizer_steps),
                "num_skipped_steps": int(self.num_skipped_steps),
                "free_micro_steps": int(self.free_micro_steps),
            },
            "step_was_skipped": bool(self.step_was_skipped),
            "grad_norm": self.grad_norm,
            "loss_scale": self.loss_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s counters; the next micro-step opens a new window."""
        counters = state["counters"]
        self.num_micro_steps = int(counters["num_micro_steps"])
        self.num_optimizer_steps = int(counters["num_optimizer_steps"])
        self.num_skipped_steps = int(counters["num_skipped_steps"])
        self.free_micro_steps = int(counters["free_micro_steps"])
        self.step_was_skipped = bool(state["step_was_skipped"])
        self.grad_norm = state["grad_norm"]
        self.loss_scale = state["loss_scale"]
        self.boundary = True
        self.stepped = False
        self.micro_backwards = 0
        self.grads_pending = False
        self.consecutive_skips = 0
