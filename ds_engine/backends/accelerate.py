"""Plain-accelerate fallback when DeepSpeed is not installed: FSDP2 or DDP.

ZeRO stages map onto what accelerate offers on the platform:

- ``zero_stage=3`` -> FSDP2 with ``reshard_after_forward=True`` (FULL_SHARD: parameters,
  gradients and optimizer states sharded; parameters gathered per layer for compute);
- ``zero_stage=2`` -> FSDP2 with ``reshard_after_forward=False`` (SHARD_GRAD_OP: parameters
  stay gathered between forward and backward, gradients and optimizer states sharded);
- ``zero_stage`` 0/1, one process, or a platform where accelerate has no FSDP (CPU: its
  FSDP exists only for GPU-type distributed setups) -> DDP. Every choice that cannot be
  honoured is listed in the Engine's one warning.

Same Engine semantics as the DeepSpeed backend: under DDP gradients are reduced once per
optimizer step (`no_sync` on every non-boundary micro-step); under FSDP they are
reduce-scattered on every micro-step like ZeRO-2/3, or once per step with
``coalesce_grad_reduction=True`` (FSDP2's ``set_requires_gradient_sync(False)``: unsharded
gradients are kept until the boundary, trading memory for communication). The applied
gradient is the mean over the window, `gradient_clipping` is applied at every boundary, and
a step with non-finite gradients is skipped and counted (accelerate's GradScaler where it
has one, our own check where it has none, as on CPU).
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds_engine import process_group
from ds_engine._values import env_int
from ds_engine.backends.base import (
    Backend,
    Facts,
    Optimizer,
    Prepared,
    StepOutcome,
    destroy_process_group_at_exit,
)
from ds_engine.config import ResolvedConfig

#: The process group's distributed type before any FSDP plugin upgraded it (process-wide, as
#: accelerate's own state is).
_BASE_DISTRIBUTED_TYPE: Any = None


def _global_float(norm: torch.Tensor) -> float:
    """A norm as a float; FSDP's DTensor norms are partial per rank until made full."""
    full_tensor = getattr(norm, "full_tensor", None)
    return float(full_tensor() if full_tensor is not None else norm)


class AccelerateBackend(Backend):
    """Runs the model through `accelerate.Accelerator` (DDP across ranks)."""

    name = "accelerate"

    def __init__(self, config: ResolvedConfig) -> None:
        super().__init__(config)
        self.accelerator: Any = None
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self._unscaled = False
        self._clip_norm: float | None = None
        self.fsdp = False
        """True when the model is sharded with FSDP2 (ZeRO-2/3 on a platform that has it)."""

    # -------------------------------------------------------------- process group
    def _cpu_only(self) -> bool:
        return not torch.cuda.is_available()

    def _platform_offers_fsdp(self) -> bool:
        """accelerate enables FSDP only for GPU-type distributed setups (not MULTI_CPU)."""
        return not self._cpu_only()

    def _wants_fsdp(self) -> bool:
        """ZeRO-2/3 with more than one process: sharding is worth asking accelerate for."""
        return int(self.effective.zero_stage) >= 2 and env_int("WORLD_SIZE", 1, minimum=1) > 1

    def _fsdp_plugin(self) -> Any:
        """The FSDP2 plugin that mirrors the ZeRO stage (and CPU offload) of the config."""
        from accelerate.utils import FullyShardedDataParallelPlugin

        eff = self.effective
        return FullyShardedDataParallelPlugin(
            fsdp_version=2,
            # ZeRO-3 re-shards parameters after forward (FULL_SHARD); ZeRO-2 keeps them
            # gathered until backward (SHARD_GRAD_OP). Gradients/optimizer states are sharded.
            reshard_after_forward=int(eff.zero_stage) >= 3,
            cpu_offload="cpu" in (eff.offload_params, eff.offload_optimizer),
            # one FSDP unit per transformer block (`_no_split_modules`); the root otherwise
            auto_wrap_policy="transformer_based_wrap",
        )

    def _mixed_precision(self) -> str:
        precision = self.effective.precision
        if precision == "fp16" and self._cpu_only():
            return "no"  # accelerate has no fp16 autocast/GradScaler on CPU: reported, see below
        return {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}[precision]

    def setup_distributed(self) -> None:
        if self.accelerator is not None:
            return
        from datetime import timedelta

        from accelerate import Accelerator
        from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

        eff = self.effective
        handlers: list[Any] = [InitProcessGroupKwargs(timeout=timedelta(seconds=eff.dist_timeout_s))]
        if eff.precision == "fp16" and eff.loss_scale == 0:
            handlers.append(
                GradScalerKwargs(
                    init_scale=2.0**eff.initial_scale_power, growth_interval=eff.loss_scale_window
                )
            )
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType

        global _BASE_DISTRIBUTED_TYPE
        # The process group first (cpu=True is what makes accelerate form a multi-process
        # gloo group on CPU ranks), so that its distributed type is known before FSDP.
        from ds_engine.restarts import init_restarted_process_group

        formed_before = process_group.is_initialized()
        init_restarted_process_group(  # a group torchrun restarted: fresh rendezvous keys
            "nccl" if torch.cuda.is_available() and not self._cpu_only() else "gloo",
            timedelta(seconds=eff.dist_timeout_s),
        )
        partial = PartialState(cpu=self._cpu_only(), timeout=timedelta(seconds=eff.dist_timeout_s))
        if not formed_before and process_group.is_initialized():
            process_group.mark_formed()
        if partial.use_distributed:
            destroy_process_group_at_exit()
        if partial.distributed_type != DistributedType.FSDP:
            _BASE_DISTRIBUTED_TYPE = partial.distributed_type
        plugin = self._fsdp_plugin() if self._wants_fsdp() and self._platform_offers_fsdp() else None
        state = AcceleratorState._shared_state
        if state and (
            state.get("_mixed_precision") not in (None, self._mixed_precision())
            or plugin is not None
            or state.get("fsdp_plugin") is not None
        ):
            # accelerate keeps one process-wide precision and FSDP plugin; a second Engine
            # with other choices gets a fresh AcceleratorState on the same process group.
            AcceleratorState._reset_state(reset_partial_state=False)
            if _BASE_DISTRIBUTED_TYPE is not None:
                # accelerate also records FSDP in the shared PartialState; undo that so this
                # Accelerator decides afresh (FSDP only if it gets a plugin).
                PartialState._shared_state["distributed_type"] = _BASE_DISTRIBUTED_TYPE
        self.accelerator = Accelerator(
            cpu=self._cpu_only(),
            mixed_precision=self._mixed_precision(),
            kwargs_handlers=handlers,
            gradient_accumulation_steps=1,
            fsdp_plugin=plugin,
        )
        self.fsdp = self.accelerator.distributed_type == DistributedType.FSDP
        if plugin is not None and not self.fsdp:
            warnings.warn(
                f"ds_engine: accelerate did not enable FSDP for zero_stage={self.effective.zero_stage} "
                f"(distributed type {self.accelerator.distributed_type}); running DDP, every rank "
                "holds full parameters, gradients and optimizer states.",
                stacklevel=3,
            )

    def destroy_process_group(self) -> None:
        """Through DeepSpeed when it knows the group (a DeepSpeed Engine of this process formed or
        used it): it then drops its cached groups too, which a later DeepSpeed Engine would
        otherwise reduce over after they are destroyed."""
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            super().destroy_process_group()

    @property
    def device(self) -> torch.device:
        self.setup_distributed()
        return torch.device(self.accelerator.device)

    def unhonoured_choices(self) -> list[str]:
        eff, notes = self.effective, []
        fsdp = self._wants_fsdp() and self._platform_offers_fsdp()
        if eff.zero_stage == 1:
            notes.append(
                "zero_stage=1: runs as DDP, every rank holds full optimizer states (FSDP has no "
                "optimizer-only sharding)"
            )
        elif int(eff.zero_stage) >= 2 and not fsdp:
            why = (
                "accelerate offers FSDP only on GPUs"
                if not self._platform_offers_fsdp()
                else "one process has nothing to shard with"
            )
            notes.append(
                f"zero_stage={eff.zero_stage}: runs as DDP, every rank holds full parameters, "
                f"gradients and optimizer states ({why})"
            )
        if fsdp and "nvme" in (eff.offload_params, eff.offload_optimizer):
            notes.append("offload to 'nvme': FSDP offloads to CPU memory only (used instead)")
        elif fsdp and eff.offload_optimizer == "cpu" and eff.offload_params == "none":
            notes.append(
                "offload_optimizer='cpu': FSDP's CPU offload moves the parameters to CPU as well "
                "(it has no optimizer-only offload)"
            )
        if not fsdp and eff.offload_optimizer != "none":
            notes.append(f"offload_optimizer={eff.offload_optimizer!r}: the optimizer stays on the device")
        if not fsdp and eff.offload_params != "none":
            notes.append(f"offload_params={eff.offload_params!r}: parameters stay on the device")
        if eff.precision == "fp16" and self._cpu_only():
            notes.append(
                "precision='fp16': accelerate has no fp16 autocast or loss scaler on CPU, so the "
                "math is fp32; non-finite gradients are still detected and the step skipped"
            )
        if eff.precision == "fp16" and eff.loss_scale != 0:
            notes.append(f"loss_scale={eff.loss_scale} (static): torch's GradScaler is always dynamic")
        if eff.precision == "fp16" and eff.hysteresis != 2:
            notes.append(f"hysteresis={eff.hysteresis}: torch's GradScaler has no hysteresis")
        if eff.activation_checkpointing:
            notes.append("activation_checkpointing: call model.gradient_checkpointing_enable() yourself")
        return notes

    # -------------------------------------------------------------- prepare
    def prepare_model(
        self, model: torch.nn.Module, optimizer: Optimizer | None, scheduler: Any, *, facts: Facts
    ) -> Prepared:
        self.setup_distributed()
        if optimizer is None:
            block = (self.effective.optimizer or {}).get("type")
            if block is not None:
                from ds_engine.config import ConfigError

                raise ConfigError(
                    f"`prepare` got no optimizer; the accelerate fallback cannot build DeepSpeed's native "
                    f"`optimizer` block ({block!r}). HINT: pass a torch optimizer to `prepare`."
                )
            # Inference only (a frozen teacher / reference model): placed on the device with the
            # run's autocast, not wrapped in DDP (there is nothing to reduce). Under FSDP,
            # accelerate shards it as it would a trained model.
            if self.fsdp:
                self.model = self.accelerator.prepare(model)
            else:
                self.model = self.accelerator.prepare_model(model, evaluation_mode=True)
            return self.model, None, None
        model, optimizer = self.accelerator.prepare(model, optimizer)
        self.model, self.optimizer = model, optimizer
        return model, optimizer, None

    # -------------------------------------------------------------- training step
    def micro_step_context(
        self, model: torch.nn.Module, *, boundary: bool, window_start: bool
    ) -> contextlib.AbstractContextManager[None]:
        if boundary or self.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        if self.fsdp and not self.effective.coalesce_grad_reduction:
            # Like ZeRO-2/3: reduce-scatter every micro-step, keep only the gradient shard.
            return contextlib.nullcontext()
        # DDP: no all-reduce on this micro-step; FSDP2 with coalescing: no reduce-scatter
        # (set_requires_gradient_sync(False)), unsharded gradients kept until the boundary.
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, *, scale: float, boundary: bool) -> None:
        # accelerate keeps accumulation state process-wide (GradientState); another Accelerator
        # in the process may have changed it. The Engine owns accumulation: no extra division.
        self.accelerator.gradient_accumulation_steps = 1
        self.accelerator.backward(loss * scale if scale != 1.0 else loss)

    # -------------------------------------------------------------- capabilities
    @property
    def distributed_type(self) -> str:
        """From the inner `accelerate.Accelerator` (or accelerate's shared state before one exists)."""
        if self.accelerator is not None:
            kind = self.accelerator.distributed_type
        else:
            from accelerate.state import PartialState

            kind = PartialState().distributed_type
        return str(getattr(kind, "name", kind))

    @property
    def is_fsdp2(self) -> bool:
        return self.fsdp

    @staticmethod
    def holds_shards(module: torch.nn.Module) -> bool:
        """FSDP2: parameters are DTensor shards."""
        return any(hasattr(p, "full_tensor") for p in module.parameters())

    def unscale_gradients(self) -> None:
        """Unscale the fp16 GradScaler's gradients, at most once per optimizer step."""
        if not self._unscaled and self.accelerator is not None and self.optimizer is not None:
            self.accelerator.unscale_gradients(self.optimizer)
            self._unscaled = True

    def _unscale_once(self) -> None:
        self.unscale_gradients()

    def release(self) -> None:
        """Drop the prepared model and optimizer, here and in the inner `accelerate.Accelerator`."""
        if self.accelerator is not None:
            self.accelerator.free_memory()
        self.model, self.optimizer = None, None
        self._unscaled, self._clip_norm = False, None

    def _params(self) -> list[torch.nn.Parameter]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> float | None:
        if self._clip_norm is None:
            self._unscale_once()
            norm = torch.nn.utils.clip_grad_norm_(self._params(), max_norm)
            self._clip_norm = _global_float(norm)
        return self._clip_norm

    def optimizer_step(self) -> StepOutcome:
        clipping = self.effective.gradient_clipping
        if self._clip_norm is not None:
            norm = self._clip_norm
        elif clipping > 0:
            norm = self.clip_grad_norm_(clipping)  # type: ignore[assignment]
        else:
            self._unscale_once()
            params = self._params()
            grads = [p.grad for p in params if p.grad is not None]
            norm = _global_float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        scaler = self.accelerator.scaler
        if scaler is None and self.effective.skip_nonfinite_steps and not math.isfinite(norm):
            # No loss scaler here (CPU, bf16, fp32): skip ourselves, as DeepSpeed would.
            applied = False
        else:
            self.accelerator.gradient_state._set_sync_gradients(True)  # this is our boundary
            self.optimizer.step()
            applied = not bool(getattr(self.optimizer, "step_was_skipped", False))
        self._unscaled = False
        self._clip_norm = None
        loss_scale = float(scaler.get_scale()) if scaler is not None else None
        return StepOutcome(applied=applied, grad_norm=norm, loss_scale=loss_scale)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -------------------------------------------------------------- utilities
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.setup_distributed()
        return self.accelerator.unwrap_model(model)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        self.setup_distributed()
        return self.accelerator.autocast()

    # -------------------------------------------------------------- checkpoints
    # (full states, any world size: `accelerate_states.py`; weights are read by the base's
    # default gather, FSDP2 DTensor shards through `full_tensor()`)
    def save_states(self, directory: Path, tag: str) -> None:
        from ds_engine.backends.accelerate_states import save_full_states

        assert self.model is not None
        save_full_states(
            directory / tag,
            model=self.unwrap_model(self.model),
            optimizer=self.optimizer,
            scaler=self.accelerator.scaler,
        )

    def load_states(self, directory: Path, tag: str, meta: Mapping[str, Any]) -> None:
        from ds_engine.backends.accelerate_states import load_full_states

        assert self.model is not None
        load_full_states(
            directory / tag,
            model=self.unwrap_model(self.model),
            optimizer=self.optimizer,
            scaler=self.accelerator.scaler,
        )
