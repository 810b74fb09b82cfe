"""The small interface the Engine talks to; one implementation per backend.

The Engine owns every decision (which micro-step is a boundary, how much to scale a loss,
when the scheduler may advance). A backend only carries those decisions out with its
library: DeepSpeed's engine, or accelerate + DDP.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_engine.config import EngineConfig, resolve_engine_config

_TEARDOWN_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group while the interpreter is still whole.

    A process that exits with a gloo group alive lets interpreter finalization race gloo's
    worker threads, which still hold tensors of finished work; the loser aborts with
    "terminate called without an active exception" (SIGABRT) after training succeeded
    (pytorch/pytorch#190489). Registered once, when a backend forms the group; a no-op when
    the user already called `Engine.end_training()` or `destroy_process_group()`.

    Only gloo groups: destroying one is local and immediate even when a peer has died. An
    NCCL group is left alone here (its communicator shutdown may wait on peers of a failed
    run, which would keep a crashed rank from exiting); `Engine.end_training()` ends it.
    """
    global _TEARDOWN_REGISTERED
    if not _TEARDOWN_REGISTERED:
        atexit.register(_destroy_process_group)
        _TEARDOWN_REGISTERED = True


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: never mask the real exit status
            if dist.get_backend() == "gloo":
                dist.destroy_process_group()


@dataclass(frozen=True)
class StepOutcome:
    """What happened at one optimizer boundary."""

    applied: bool
    """False when the step was skipped (loss-scale overflow / non-finite gradients)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None where the backend cannot tell)."""
    loss_scale: float | None
    """Current fp16 loss scale after the step (None without loss scaling)."""


class Backend(abc.ABC):
    """A training backend: process group, model wrapping, backward and optimizer step."""

    name: str = ""
    ds_engine: Any = None
    """The DeepSpeedEngine after `prepare` (None on other backends)."""

    def __init__(self, config: EngineConfig, base: dict[str, Any] | None) -> None:
        self.config = config  # the user's choices (explicit fields tracked)
        self.base = base  # the user's DeepSpeed JSON, if any
        self.effective = resolve_engine_config(config, base)  # choices after merging `base`

    # -------------------------------------------------------------- process group
    @abc.abstractmethod
    def setup_distributed(self) -> None:
        """Form the process group (idempotent)."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    # -------------------------------------------------------------- model set-up
    def init_context(self) -> contextlib.AbstractContextManager[None]:
        """Context in which models are created (ZeRO-3 partitions them at creation)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def prepare_model(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        *,
        facts: dict[str, Any],
    ) -> tuple[torch.nn.Module, Any, Any]:
        """Wrap `model` (+ its optimizer) for training.

        Returns (wrapped model, backend optimizer, backend-owned scheduler or None).
        `facts` holds what "auto" values are filled from: world_size, dataloader, model.
        """

    # -------------------------------------------------------------- training step
    def micro_step_context(
        self, model: torch.nn.Module, *, boundary: bool, window_start: bool
    ) -> contextlib.AbstractContextManager[None]:
        """Context around one micro-step's forward and backward (no_sync where needed)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, scale: float, boundary: bool) -> None:
        """Backward of `loss * scale`; gradients reduced across ranks only at a boundary."""

    @abc.abstractmethod
    def optimizer_step(self) -> StepOutcome:
        """Apply the optimizer step at a boundary (clipping, overflow check included)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear gradients after a boundary."""

    def clip_grad_norm_(self, max_norm: float) -> float | None:
        """Clip now if the backend clips outside its optimizer step; return the norm if known."""
        return None

    # -------------------------------------------------------------- utilities
    @abc.abstractmethod
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @abc.abstractmethod
    def get_state_dict(
        self, model: torch.nn.Module, *, dtype: torch.dtype | None, exclude_frozen: bool
    ) -> dict[str, torch.Tensor] | None:
        """Full state dict on rank 0, None elsewhere (collective)."""

    @property
    def ds_config(self) -> dict[str, Any] | None:
        return None

    def unhonoured_choices(self) -> list[str]:
        """Config choices this backend cannot carry out, in words (reported, never dropped)."""
        return []

    # -------------------------------------------------------------- checkpoints
    @abc.abstractmethod
    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Write model + optimizer states into `directory / tag` (collective)."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: Path, tag: str) -> dict[str, Any]:
        """Load model + optimizer states from `directory / tag` (collective); returns client_state."""
