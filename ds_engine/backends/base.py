"""The small interface the Engine talks to; one implementation per backend.

The Engine owns every decision (which micro-step is a boundary, how much to scale a loss,
when the scheduler may advance). A backend only carries those decisions out with its
library: DeepSpeed's engine, or accelerate + DDP.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_engine import adapters, weights
from ds_engine.config import ResolvedConfig

_TEARDOWN_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group while the interpreter is still whole.

    A process that exits with a gloo group alive lets interpreter finalization race gloo's
    worker threads, which still hold tensors of finished work; the loser aborts with
    "terminate called without an active exception" (SIGABRT) after training succeeded
    (pytorch/pytorch#190489). Registered once, when a backend forms the group; a no-op when
    the user already called `Engine.end_training()` or `destroy_process_group()`, and for a
    group the host formed before the Engine (borrowed: its owner ends it).

    Only gloo groups: destroying one is local and immediate even when a peer has died. An
    NCCL group is left alone here (its communicator shutdown may wait on peers of a failed
    run, which would keep a crashed rank from exiting); `Engine.end_training()` ends it.
    """
    global _TEARDOWN_REGISTERED
    if not _TEARDOWN_REGISTERED:
        atexit.register(_destroy_process_group)
        _record_uncaught_exceptions_for_the_launcher()
        _TEARDOWN_REGISTERED = True


#: Words of the errors a collective raises when a peer's process has gone (gloo, NCCL, c10d):
#: such an exception is the consequence of another rank's failure, not a cause.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crash",
    "remote process exited",
    "communicator was aborted",
    "broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is how a collective reports that another rank's process went away."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return any(words in text for words in _PEER_GONE)


def _record_uncaught_exceptions_for_the_launcher() -> None:
    """Under torchrun, write an exception that ends this rank into torchrun's error file.

    The group is torn down at exit (above), which aborts the peers; a rank that raised may
    still be exiting when the launcher records a peer's abort, and torchrun then stops it with
    SIGTERM, so its exit status no longer says it raised. The error file does: `ds-engine
    launch` names the rank that raised first, and its message, as the cause. The file is
    torchrun's own format (what its ``@record`` decorator writes), plus the exact time and
    whether the exception only reports a peer that went away; one written by the script
    itself is kept.
    """
    import sys

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    previous = sys.excepthook

    def record(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        with contextlib.suppress(Exception):  # never mask the exception being reported
            if not issubclass(kind, KeyboardInterrupt) and not os.path.exists(error_file):
                import json
                import time
                import traceback

                now = time.time()
                data = {
                    "message": {
                        "message": f"{kind.__name__}: {value}",
                        "extraInfo": {
                            "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                            "timestamp": str(int(now)),
                        },
                    },
                    "ds_engine": {"time": now, "peer_failure": is_peer_failure(value)},
                }
                with open(error_file, "w", encoding="utf-8") as fp:
                    json.dump(data, fp)
        previous(kind, value, tb)

    sys.excepthook = record


def _destroy_process_group() -> None:
    import torch.distributed as dist

    from ds_engine import process_group

    if not process_group.formed_here():
        return  # none, or the host's (borrowed): its owner ends it
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: never mask the real exit status
            if dist.get_backend() == "gloo":
                dist.destroy_process_group()


#: What "auto" values are filled from: world_size, dataloader, model.
Facts = dict[str, Any]
#: (wrapped model, backend optimizer, backend-owned scheduler or None)
Prepared = tuple[torch.nn.Module, Any, Any]
Optimizer = torch.optim.Optimizer


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

    def __init__(self, config: ResolvedConfig) -> None:
        """Take the run's resolved configuration (the Engine resolves once); never resolve again.

        Args:
            config: The `ResolvedConfig` of `config.resolve_config` (its base JSON inside).
        """
        self.resolved = config
        self.config = config.user  # the user's choices (explicit fields tracked)
        self.base = config.base  # the user's DeepSpeed JSON, if any
        self.effective = config.effective  # choices after merging `base`

    def update_effective(self, **changes: Any) -> None:
        """Replace some effective choices before `prepare_model` (no new resolution)."""
        self.resolved = self.resolved.with_effective(**changes)
        self.effective = self.resolved.effective

    # -------------------------------------------------------------- process group
    @abc.abstractmethod
    def setup_distributed(self) -> None:
        """Form the process group (idempotent)."""

    def destroy_process_group(self) -> None:
        """Destroy the (initialised) world process group, and whatever the backend cached of it."""
        import torch.distributed as dist

        dist.destroy_process_group()

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    # -------------------------------------------------------------- capabilities
    @property
    def distributed_type(self) -> str:
        """The name of accelerate's `DistributedType` member this backend corresponds to
        ("DEEPSPEED", "MULTI_CPU", "MULTI_GPU", "FSDP", "NO", ...)."""
        return "NO"

    @property
    def is_fsdp2(self) -> bool:
        """True when the model is sharded with FSDP2."""
        return False

    @property
    def partitions_at_creation(self) -> bool:
        """True when `init_context` partitions parameters as models are created (collective:
        every rank must create the model there). Default: creation is local."""
        return False

    @property
    def plans_auto_stage(self) -> bool:
        """True when an "auto" ZeRO stage / offload is the memory planner's choice; False: an
        "auto" stage is ZeRO-0 and an "auto" offload none (`ds_engine.auto_stage.settle`)."""
        return False

    @property
    def supports_clip_grad_value(self) -> bool:
        """True when gradients may be clamped element-wise (`clip_grad_value_`) at a boundary."""
        return True

    def unscale_gradients(self) -> None:
        """Unscale fp16 gradients once before they are read or clipped by hand (a no-op where
        the backend's gradients are never scaled when the user sees them)."""
        return None

    def release(self) -> None:
        """Drop everything `prepare_model` built (wrapped model, optimizer, native engine), so a
        later `prepare_model` starts afresh; the process group stays. Default: nothing held."""
        return None

    # -------------------------------------------------------------- the prepared model
    @staticmethod
    def holds_shards(module: torch.nn.Module) -> bool:
        """True when some parameter of `module` holds only this rank's shard now (its own
        `state_dict()` is not whole). Default: nothing is sharded."""
        return False

    def guard_save_pretrained(self, module: torch.nn.Module) -> None:
        """Route the prepared model's own `save_pretrained` (per instance) so that only rank 0
        writes and a sharded model's partial state dict is refused (see `_save_pretrained_on_main`)."""
        if not callable(getattr(type(module), "save_pretrained", None)):
            return
        holds_shards = type(self).holds_shards  # a plain function: the model does not keep the backend

        def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            return _save_pretrained_on_main(module, holds_shards, save_directory, *args, **kwargs)

        module.__dict__["save_pretrained"] = save_pretrained

    def check_in_output_hooks(
        self, model: torch.nn.Module, check: Callable[[], None]
    ) -> Callable[[], bool] | None:
        """Run `check()` in the prepared wrapper's own hooks on its forward's outputs, before
        any gradient leaves them, where the wrapper has such hooks (DeepSpeed's engine does).

        Returns a function that says whether a forward through the wrapper is running now (its
        outputs get the wrapper's hooks, so the user's module needs no hook of its own), or
        None where the wrapper hooks nothing (the default).
        """
        return None

    # -------------------------------------------------------------- model set-up
    def init_context(self) -> contextlib.AbstractContextManager[None]:
        """Context in which models are created (ZeRO-3 partitions them at creation)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def prepare_model(
        self, model: torch.nn.Module, optimizer: Optimizer | None, scheduler: Any, *, facts: Facts
    ) -> Prepared:
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

    def user_accumulation_problem(self) -> str:
        """'' when several `backward` calls before one optimizer step add up exactly at GA=1
        (the user accumulates by hand); else why this backend cannot (the Engine refuses then)."""
        return ""

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

    def native_config(self) -> dict[str, Any] | None:
        """The config in the backend library's own format after `prepare` (DeepSpeed's JSON);
        None where the library has none, or before `prepare`."""
        return None

    def unhonoured_choices(self) -> list[str]:
        """Config choices this backend cannot carry out, in words (reported, never dropped)."""
        return []

    # -------------------------------------------------------------- weights
    def weight_gather(self) -> weights.WeightGather:
        """How this backend's parameters are read whole (`get_state_dict`, `save_pretrained`)."""
        return weights.WeightGather()

    def get_state_dict(
        self, model: torch.nn.Module, *, dtype: torch.dtype | None, exclude_frozen: bool, merged: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """Full state dict on rank 0, None elsewhere (collective). A PEFT model gives its
        adapter's entries only, or with `merged` the base model's merged state dict."""
        module = self.unwrap_model(model)
        gather = self.weight_gather()
        if adapters.is_peft_model(module):
            if merged:
                _check_merged_options(exclude_frozen)
                return adapters.merged_state_dict(module, gather=gather, dtype=dtype)
            return adapters.adapter_state_dict(module, gather=gather, dtype=dtype)
        _check_not_merged(module, merged)
        return weights.consolidated_state_dict(
            module, dtype=dtype, exclude_frozen=exclude_frozen, gather=gather
        )

    def save_pretrained(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        *,
        merged: bool = False,
        **options: Any,
    ) -> None:
        """Write `model` as a `from_pretrained` folder (collective); `options` as in
        `ds_engine.weights.save_pretrained` (tokenizer, max_shard_size, dtype, ...). A PEFT
        model writes its adapter folder only, or with `merged` the merged base model."""
        module = self.unwrap_model(model)
        gather = self.weight_gather()
        if adapters.is_peft_model(module):
            if merged:
                _check_merged_options(options.pop("exclude_frozen", False))
                adapters.save_merged(module, save_directory, gather=gather, **options)
            else:
                # the adapter is the trainable part already; one safetensors file, unsharded
                options.pop("exclude_frozen", None)
                options.pop("max_shard_size", None)
                adapters.save_adapter(module, save_directory, gather=gather, **options)
            return
        _check_not_merged(module, merged)
        weights.save_pretrained(module, save_directory, gather=gather, **options)

    # -------------------------------------------------------------- checkpoints
    @classmethod
    def checkpoint_safe_globals(cls) -> tuple[Any, ...]:
        """What the unpickler may build, beyond tensors and containers, from this backend's state files."""
        return ()

    def checkpoint_metadata(self) -> dict[str, Any]:
        """What this backend records in a tag's `ds_engine_meta.json` (beside the generic keys).

        `optimizer` is the class of the torch optimizer that trains the model ("module.Class";
        DeepSpeed's CPU Adam, which stands in for torch Adam/AdamW under optimizer offload, as
        the torch class it replaced; None before `prepare` or without an optimizer): a resume
        with another optimizer class is refused by name, not failed at its first step.
        """
        optimizer = getattr(self, "optimizer", None)  # the fallback's (accelerate's wrapper)
        if optimizer is None:  # DeepSpeed's engine holds its (ZeRO / 16-bit) wrapper
            optimizer = getattr(getattr(self, "ds_engine", None), "optimizer", None)
        for _ in range(4):  # wrappers keep the optimizer they drive as `.optimizer`
            inner = getattr(optimizer, "optimizer", None)
            if not isinstance(inner, torch.optim.Optimizer):
                break
            optimizer = inner
        kind: type | None = type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
        if kind is not None and kind.__name__ == "DeepSpeedCPUAdam":
            kind = torch.optim.AdamW if getattr(optimizer, "adam_w_mode", True) else torch.optim.Adam
        return {
            "backend": self.name,
            "precision": self.effective.precision,
            "optimizer": None if kind is None else f"{kind.__module__}.{kind.__qualname__}",
        }

    def check_checkpoint(self, meta: Mapping[str, Any], tag_dir: Path) -> str:
        """'' when this backend can load the tag `meta` (its metadata, same backend) describes,
        else the error message. Rank 0 only: no collective."""
        return ""

    def checkpoint_companions(self, tag: str) -> list[str]:
        """Folders beside tag `tag` that belong to it (caches), removed with it by `keep_last`."""
        return []

    @abc.abstractmethod
    def save_states(self, directory: Path, tag: str) -> None:
        """Write model + optimizer states into `directory / tag` (collective)."""

    @abc.abstractmethod
    def load_states(self, directory: Path, tag: str, meta: Mapping[str, Any]) -> None:
        """Load model + optimizer states from `directory / tag` (collective); `meta` is the tag's
        metadata (e.g. the world size that wrote it)."""


def _check_merged_options(exclude_frozen: bool) -> None:
    if exclude_frozen:
        raise ValueError(
            "`merged=True` with `exclude_frozen=True`: the merged model is the frozen base weights "
            "with the adapter added in, so nothing frozen can be left out. HINT: drop one of them "
            "(`merged=False` saves only the adapter)."
        )


def _check_not_merged(module: torch.nn.Module, merged: bool) -> None:
    if merged:
        raise ValueError(
            f"`merged=True` but the model ({type(module).__name__}) is not a peft `PeftModel`: there is "
            "no adapter to merge. HINT: leave `merged=False`."
        )


def _save_pretrained_on_main(
    module: Any,
    holds_shards: Callable[[torch.nn.Module], bool],
    save_directory: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A prepared model's `save_pretrained`: written by rank 0 only; refuses a sharded model's
    own (partial) state dict.

    accelerate's idiom calls ``unwrap_model(model).save_pretrained(dir,
    state_dict=engine.get_state_dict(model), save_function=engine.save)`` on every rank:
    `get_state_dict` is collective and returns the full dict on rank 0, None elsewhere, so
    every other rank would fall back to its own `state_dict()` (empty ZeRO-3 shards) and,
    on transformers releases that do not check the rank themselves, write them over rank 0's
    files. Here every rank but 0 returns at once; `is_main_process=` passed explicitly, or
    `distributed_checkpoint=True` (transformers' collective format), keep transformers' own
    behaviour.
    """
    explicit = "is_main_process" in kwargs or kwargs.get("distributed_checkpoint")
    original = type(module).save_pretrained
    if explicit:
        return original(module, save_directory, *args, **kwargs)
    state_dict = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if state_dict is None and holds_shards(module):
        if rank != 0:
            return None  # rank 0 raises below; the others have nothing to write
        raise ValueError(
            "`save_pretrained` on a model whose parameters are sharded (ZeRO-3 / FSDP) without "
            "`state_dict=`: its own state dict holds only this rank's shard. HINT: pass "
            "`state_dict=engine.get_state_dict(model)` (call it on every rank), or use "
            "`engine.save_pretrained(model, dir)`."
        )
    if rank != 0:
        return None
    return original(module, save_directory, *args, **kwargs)
