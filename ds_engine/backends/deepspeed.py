"""DeepSpeed backend: ZeRO 0-3 through `deepspeed.initialize`, driven by the Engine's boundaries.

DeepSpeed is imported lazily, inside methods, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ds_engine import process_group
from ds_engine._build_locks import check_no_stale_build_lock
from ds_engine._console import quiet_unless_main
from ds_engine._imports import require_deepspeed
from ds_engine._values import env_int
from ds_engine.adapters import tuner_layers_outside_zero_init
from ds_engine.backends.base import (
    Backend,
    Facts,
    Optimizer,
    Prepared,
    StepOutcome,
    destroy_process_group_at_exit,
)
from ds_engine.backends.deepspeed_engine_overrides import (
    KeptClipNorm,
    check_in_deepspeed_output_hooks,
    clip_norm_kept,
    hooks_every_output,
    local_grad_norm,
    mode_calls_return_the_model,
)
from ds_engine.config import ConfigError, ResolvedConfig
from ds_engine.ds_config import deepspeed_bucket_fallbacks, hidden_size_from_model, render_ds_config
from ds_engine.weights import WeightGather

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one serves every micro-step


def _ensure_launch_env() -> None:
    """A plain `python script.py` run is a world of one: give torch.distributed what it needs."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import socket

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class DeepSpeedBackend(Backend):
    """Runs the model through a `DeepSpeedEngine`; the Engine decides every boundary."""

    name = "deepspeed"

    def __init__(self, config: ResolvedConfig) -> None:
        require_deepspeed()
        super().__init__(config)
        # DeepSpeed calls torch.distributed APIs torch has deprecated, once per collective; the
        # warning is not the user's to act on and would flood every training log. Only warnings
        # attributed to DeepSpeed's own modules (torch warns at its caller) are silenced: the
        # user's own calls of those APIs still warn.
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.\w+` is deprecated",
            category=FutureWarning,
            module=r"deepspeed\.",
        )
        self.ds_engine: Any = None
        self._ds_config: dict[str, Any] | None = None
        self._coalesce: contextlib.ExitStack | None = None
        self._unmanaged = False  # DeepSpeed's managed_gradient_accumulation=false: step() is the boundary
        self._norm_params: tuple[Any, list[torch.nn.Parameter]] | None = None  # (module, its parameters)
        self._boundary_set: bool | None = None  # what DeepSpeed's boundary flag was last set to

    # -------------------------------------------------------------- process group
    def setup_distributed(self) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        from ds_engine.restarts import init_restarted_process_group

        if dist.is_initialized():
            return  # called on every micro-step (`num_processes`): nothing to check or form
        check_no_stale_build_lock()  # DeepSpeed loads its ops from here on: never wait on a dead build
        _ensure_launch_env()
        init_restarted_process_group(  # a group torchrun restarted: fresh rendezvous keys
            get_accelerator().communication_backend_name(), timedelta(seconds=self.effective.dist_timeout_s)
        )
        with quiet_unless_main():  # DeepSpeed prints a line per rank when it loads its comm op
            deepspeed.init_distributed(
                dist_backend=get_accelerator().communication_backend_name(),
                timeout=timedelta(seconds=self.effective.dist_timeout_s),
                verbose=False,
            )
        process_group.mark_formed()
        destroy_process_group_at_exit()

    def destroy_process_group(self) -> None:
        """Through DeepSpeed, so it also drops its cached groups (a later Engine in this process
        would otherwise reduce over the destroyed ones)."""
        import deepspeed.comm as ds_comm

        if ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            super().destroy_process_group()

    @property
    def device(self) -> torch.device:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name(env_int("LOCAL_RANK", 0))
        return torch.device(name)

    @property
    def ds_config(self) -> dict[str, Any] | None:
        return self._ds_config

    # -------------------------------------------------------------- capabilities
    @property
    def distributed_type(self) -> str:
        return "DEEPSPEED"

    @property
    def supports_clip_grad_value(self) -> bool:
        """False: DeepSpeed clips by the global norm inside its step only."""
        return False

    @property
    def partitions_at_creation(self) -> bool:
        """ZeRO-3: `zero.Init` partitions parameters as the model is created."""
        return self.effective.zero_stage == 3

    @property
    def plans_auto_stage(self) -> bool:
        """True: the memory planner chooses an "auto" stage and offload."""
        return True

    @staticmethod
    def holds_shards(module: torch.nn.Module) -> bool:
        """ZeRO-3: a partitioned parameter's local tensor is empty outside a gather."""
        return any(
            hasattr(p, "ds_id") and getattr(p, "ds_numel", p.numel()) != p.numel()
            for p in module.parameters()
        )

    def release(self) -> None:
        """Destroy and drop the DeepSpeed engine (its hooks, buffers and optimizer state)."""
        engine, self.ds_engine = self.ds_engine, None
        self._ds_config = None
        self._boundary_set = None
        self._unmanaged = False
        if self._coalesce is not None:
            self._coalesce.close()
            self._coalesce = None
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()

    # -------------------------------------------------------------- ZeRO-3 creation
    def init_context(self) -> contextlib.AbstractContextManager[None]:
        if self.effective.zero_stage != 3:
            return contextlib.nullcontext()
        return self._zero3_init_context()

    @contextlib.contextmanager
    def _zero3_init_context(self) -> Iterator[None]:
        import deepspeed
        import torch._dynamo  # noqa: F401  transformers imports it lazily; inside zero.Init
        import torch.distributed as dist  # (torch.Tensor.__new__ patched) that import fails

        check_no_stale_build_lock()  # zero.Init may build DeepSpeed's ops
        self.setup_distributed()
        # zero.Init needs a config whose batch triangle DeepSpeed accepts; the real micro
        # batch is not known yet, so build one with a placeholder that `prepare` replaces.
        known = self.effective.micro_batch_size != "auto" or "train_batch_size" in (self.base or {})
        init_config = render_ds_config(
            self._config_for(None),
            world_size=dist.get_world_size(),
            micro_batch_size=None if known else 1,
            hidden_size=1,  # placeholder for "auto" bucket sizes: zero.Init does not use them
        )
        hf_ds_config = None
        try:  # tell transformers for exactly as long as the context lasts
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            hf_ds_config = HfDeepSpeedConfig(init_config)
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass
        try:
            with contextlib.ExitStack() as stack:
                if hf_ds_config is not None:
                    stack.enter_context(_hf_zero3_creation())
                    # what transformers wraps its own zero.Init in: under bf16/fp16 zero.Init
                    # would also cast `torch.arange`, so RoPE `inv_freq` buffers lose precision
                    from transformers.integrations import deepspeed as hf_deepspeed

                    keep_arange = getattr(hf_deepspeed, "prevent_arange_dtype_change", None)
                    if keep_arange is not None:  # absent in older releases; must precede zero.Init
                        stack.enter_context(keep_arange())
                # peft's adapter layers are built whole (their init is in place: see adapters.py)
                stack.enter_context(tuner_layers_outside_zero_init())
                # after zero.Init exits: its F.linear replacement would outlive the context
                stack.callback(_restore_functional_linear)
                stack.enter_context(deepspeed.zero.Init(config_dict_or_path=init_config))
                yield
        finally:
            if hf_ds_config is not None:
                _forget_hf_deepspeed_config(hf_ds_config)

    # -------------------------------------------------------------- prepare
    def prepare_model(
        self, model: torch.nn.Module, optimizer: Optimizer | None, scheduler: Any, *, facts: Facts
    ) -> Prepared:
        import deepspeed

        check_no_stale_build_lock()  # `initialize` may build DeepSpeed's ops (CPU Adam under offload)
        self.setup_distributed()
        # No torch optimizer and no `optimizer` block: the model is prepared for inference only
        # (a frozen teacher or reference model), with no optimizer state and no gradients.
        inference_only = optimizer is None and not self.effective.optimizer
        dataloader = facts.get("dataloader")
        known = self.effective.micro_batch_size != "auto" or "train_batch_size" in (self.base or {})
        ds_config = render_ds_config(
            self._config_for(model),
            world_size=facts["world_size"],
            # an inference-only model has no training batch: DeepSpeed's triangle gets a placeholder
            micro_batch_size=1 if inference_only and dataloader is None and not known else None,
            model=model,
            dataloader=dataloader,
            optimizer=optimizer,
            inference_only=inference_only,
        )
        optimizer = self._maybe_offload_optimizer(optimizer, ds_config, scheduler)
        if optimizer is not None and "optimizer" in ds_config:
            raise ConfigError(
                f"`prepare` got a torch optimizer ({type(optimizer).__name__}) and the config has an "
                f"`optimizer` block ({ds_config['optimizer'].get('type')}); DeepSpeed would use one "
                "silently. "
                "HINT: remove one of them."
            )
        # the rendered JSON decided it (`ds_config.defers_reduction_to_step`): step() is the boundary
        self._unmanaged = not ds_config.get("managed_gradient_accumulation", True)
        params = None
        if optimizer is None:  # the config's optimizer trains these
            given = facts.get("model_parameters")
            params = list(given) if given is not None else [p for p in model.parameters() if p.requires_grad]
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params,
            config=ds_config,
            dist_init_required=False,
        )
        mode_calls_return_the_model(engine)
        self.ds_engine = engine
        self._boundary_set = None
        self._ds_config = ds_config
        if inference_only:
            return engine, None, None
        return engine, ds_optimizer, ds_scheduler

    def user_accumulation_problem(self) -> str:
        if self._unmanaged or self.ds_engine is None:
            return ""
        stage = int(self.ds_engine.zero_optimization_stage())
        if stage in (0, 3):
            return ""
        if self._coalesce is not None:
            return ""  # inside coalesce_grad_reduction: gradients stay local until the step
        why = "with overlap_comm=True" if stage == 1 else "with DeepSpeed's managed accumulation"
        return (
            f"DeepSpeed ZeRO-{stage} {why} keeps only the last backward's gradients at a boundary; "
            "at gradient_accumulation_steps=1 ds_engine defers the reduction to `step()` "
            "(managed_gradient_accumulation=false) unless overlap_comm is set on ZeRO-1 or the "
            "JSON sets managed_gradient_accumulation"
        )

    def _config_for(self, model: torch.nn.Module | None) -> ResolvedConfig:
        """The run's resolution, with DeepSpeed's bucket defaults where "auto" has no hidden size.

        A plain `nn.Module` has no `config.hidden_size` (and zero.Init has no model yet); bucket
        sizes the user did not ask for then take DeepSpeed's own defaults, by the one rule
        `build_ds_config` applies too (`ds_config.deepspeed_bucket_fallbacks`). An "auto" the
        user asked for still has to be filled. Nothing is resolved again.
        """
        if hidden_size_from_model(model) is not None:
            return self.resolved
        fill = deepspeed_bucket_fallbacks(self.config, self.base, zero_stage=int(self.effective.zero_stage))
        return self.resolved.with_effective(**fill) if fill else self.resolved

    def _maybe_offload_optimizer(
        self, optimizer: torch.optim.Optimizer | None, ds_config: dict[str, Any], scheduler: Any
    ) -> torch.optim.Optimizer | None:
        """Swap torch Adam/AdamW for DeepSpeed's CPU Adam under optimizer offload, keeping every knob."""
        zero = ds_config.get("zero_optimization", {})
        offload = zero.get("offload_optimizer", {}).get("device", "none")
        if optimizer is None or offload in (None, "none"):
            return optimizer
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ConfigError(
                f"`offload_optimizer={offload!r}` runs the optimizer on the CPU with DeepSpeed's CPU Adam; "
                f"got {type(optimizer).__name__}. HINT: use torch.optim.Adam/AdamW, or "
                "`offload_optimizer='none'`."
            )
        group0 = optimizer.param_groups[0]
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ConfigError(
                "`offload_optimizer` with `amsgrad=True`: DeepSpeed's CPU Adam has no AMSGrad. "
                "HINT: set amsgrad=False or offload_optimizer='none'."
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = [
            {k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
            for g in optimizer.param_groups
        ]
        new = DeepSpeedCPUAdam(
            groups,
            lr=group0["lr"],
            betas=tuple(group0["betas"]),
            eps=group0["eps"],
            weight_decay=group0["weight_decay"],
            adamw_mode=isinstance(optimizer, torch.optim.AdamW),
        )
        for new_group, old_group in zip(new.param_groups, optimizer.param_groups):
            for key in ("initial_lr", "lr", "betas", "eps", "weight_decay"):
                if key in old_group:
                    new_group[key] = old_group[key]
        if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer:
            scheduler.optimizer = new  # the user's schedule now drives CPU Adam's lr
        return new

    # -------------------------------------------------------------- training step
    def micro_step_context(
        self, model: torch.nn.Module, *, boundary: bool, window_start: bool
    ) -> contextlib.AbstractContextManager[None]:
        if self._unmanaged:
            return _NO_CONTEXT  # DeepSpeed's boundary is the next step()
        if self._boundary_set is not boundary:
            self._set_boundary(boundary)
        if self.effective.coalesce_grad_reduction and window_start and self._coalesce is None:
            self._enter_coalesce()
        return _NO_CONTEXT

    def _set_boundary(self, boundary: bool) -> None:
        """Set DeepSpeed's accumulation boundary flag, remembered: only a change is set (DeepSpeed
        changes the flag itself only where `coalesce_grad_reduction` ends, which forgets it)."""
        self.ds_engine.set_gradient_accumulation_boundary(boundary)
        self._boundary_set = boundary

    def check_in_output_hooks(
        self, model: torch.nn.Module, check: Callable[[], None]
    ) -> Callable[[], bool] | None:
        engine = getattr(self, "ds_engine", None)
        if engine is None or model is not engine or not hooks_every_output(engine):
            return None
        return check_in_deepspeed_output_hooks(engine, check)

    def coalesce_supported(self) -> str:
        """'' when DeepSpeed can reduce once per step here, else why not."""
        engine = self.ds_engine
        if engine.zero_optimization_stage() == 0:
            return "ZeRO-0 already reduces once per optimizer step"
        if not hasattr(engine, "coalesce_grad_reduction"):
            return "this DeepSpeed has no `coalesce_grad_reduction` (needs >= 0.19.2)"
        if not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
            return f"DeepSpeed cannot coalesce with the {type(engine.optimizer).__name__} wrapper"
        return ""

    def _enter_coalesce(self) -> None:
        reason = self.coalesce_supported()
        if reason:
            if not getattr(self, "_coalesce_warned", False):
                warnings.warn(
                    f"coalesce_grad_reduction=True ignored: {reason}; gradients are reduced "
                    "as DeepSpeed does by default.",
                    stacklevel=4,
                )
                self._coalesce_warned = True
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.ds_engine.coalesce_grad_reduction())
        self._coalesce = stack

    def backward(self, loss: torch.Tensor, *, scale: float, boundary: bool) -> None:
        engine = self.ds_engine
        if not self._unmanaged and self._boundary_set is not boundary:
            self._set_boundary(boundary)
        # Our own divisor (the real window length, also for a short last window) instead of
        # DeepSpeed's fixed division by the configured GA. Always a new tensor, even for a
        # scale of 1: DeepSpeed's forward hooks its outputs to divide their gradient by GA
        # unless `backward` marked the graph first, and it marks it through a hook on the tensor
        # it is given; handed the forward's own output (a model that returns its loss), its
        # GA hook would run first and divide a window of one by GA.
        engine.backward(loss * scale, scale_wrt_gas=False)

    def optimizer_step(self) -> StepOutcome:
        engine = self.ds_engine
        if self._coalesce is not None:
            coalesce, self._coalesce = self._coalesce, None
            self._boundary_set = None  # DeepSpeed puts back the flag it found on entering
            coalesce.close()  # one reduction pass for the whole window
        if not self._unmanaged and self._boundary_set is not True:
            self._set_boundary(True)
        own_norm: float | None = None
        kept: KeptClipNorm | None = None
        low_precision = engine.fp16_enabled() or engine.bfloat16_enabled()
        if engine.zero_optimization_stage() == 0 and not low_precision and not self._unmanaged:
            # ZeRO-0 in fp32 has no overflow check in DeepSpeed: skip a non-finite step ourselves
            # (every rank sees the same all-reduced gradients, so all ranks agree), and report
            # the global norm, which DeepSpeed keeps to itself here.
            skip = self.effective.skip_nonfinite_steps
            kept = clip_norm_kept(engine, skip_nonfinite=skip)
            if kept is None:  # no clipping in DeepSpeed's step: the norm, and the check, are ours
                own_norm = local_grad_norm(self._parameters_of(engine.module))  # all-reduced: global
                if skip and not math.isfinite(own_norm):
                    engine.zero_grad()
                    return StepOutcome(applied=False, grad_norm=own_norm, loss_scale=None)
            # else DeepSpeed computes the norm it clips by inside step(), and the step is
            # skipped there when that norm is not finite
        skipped_here, clipped_by = False, None
        try:
            engine.step()
        finally:
            if kept is not None:
                skipped_here, clipped_by = kept.finish()
        applied = bool(engine.was_step_applied()) and not skipped_here
        norm = engine.get_global_grad_norm()
        if norm is None:
            norm = clipped_by if clipped_by is not None else own_norm
        if isinstance(norm, torch.Tensor):
            norm = float(norm.item())
        loss_scale = engine._get_optimizer_loss_scale() if engine.fp16_enabled() else None
        return StepOutcome(
            applied=applied,
            grad_norm=None if norm is None else float(norm),
            loss_scale=None if loss_scale is None else float(loss_scale),
        )

    def _parameters_of(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """`module`'s parameters, listed once (walking the module tree each step costs more than
        the norm of a small model's gradients); DeepSpeed's engine fixes them at `initialize`."""
        if self._norm_params is None or self._norm_params[0] is not module:
            self._norm_params = (module, list(module.parameters()))
        return self._norm_params[1]

    def zero_grad(self) -> None:
        # DeepSpeed clears gradients inside `step()`; a second clear would be a no-op at best.
        return None

    # -------------------------------------------------------------- utilities
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from deepspeed import DeepSpeedEngine

        while isinstance(model, DeepSpeedEngine):
            model = model.module
        return model

    def native_config(self) -> dict[str, Any] | None:
        return self._ds_config

    # -------------------------------------------------------------- weights and checkpoints
    # (the work is in `deepspeed_states.py`: ZeRO gathers, fp32 masters, DeepSpeed's own files)
    def weight_gather(self) -> WeightGather:
        from ds_engine.backends.deepspeed_states import DeepSpeedGather

        return DeepSpeedGather(self.ds_engine)

    @classmethod
    def checkpoint_safe_globals(cls) -> tuple[Any, ...]:
        from ds_engine.safety import deepspeed_safe_globals

        return deepspeed_safe_globals()

    def checkpoint_metadata(self) -> dict[str, Any]:
        from ds_engine._imports import deepspeed_version

        version = deepspeed_version()
        return {
            **super().checkpoint_metadata(),
            "zero_stage": int(self.effective.zero_stage),
            "deepspeed_version": None if version is None else str(version),
        }

    def check_checkpoint(self, meta: Mapping[str, Any], tag_dir: Path) -> str:
        from ds_engine.backends.deepspeed_states import checkpoint_problem

        eff = self.effective
        return checkpoint_problem(meta, tag_dir, zero_stage=int(eff.zero_stage), precision=eff.precision)

    def checkpoint_companions(self, tag: str) -> list[str]:
        from ds_engine.backends.deepspeed_states import UNIVERSAL_SUFFIX

        return [tag + UNIVERSAL_SUFFIX]  # the universal checkpoint converted from it, if any

    def save_states(self, directory: Path, tag: str) -> None:
        from ds_engine.backends.deepspeed_states import save_deepspeed_states

        save_deepspeed_states(self.ds_engine, directory, tag, {})

    def load_states(self, directory: Path, tag: str, meta: Mapping[str, Any]) -> None:
        from ds_engine.backends.deepspeed_states import load_deepspeed_checkpoint

        load_deepspeed_checkpoint(self.ds_engine, directory, tag, meta)


@contextlib.contextmanager
def _hf_zero3_creation() -> Iterator[None]:
    """Make Hugging Face models built under our `zero.Init` start from ZeRO-0's exact weights.

    Inside our `zero.Init` every module is partitioned at the end of its own `__init__`, so the
    torch constructors (`reset_parameters`) still draw on full tensors, exactly as without ZeRO.
    What goes wrong is the model's `post_init` -> `init_weights`: it runs `_init_weights` on
    empty shards (embeddings keep N(0, 1), GPT-2 loses its scaled `c_proj` init) and draws a
    different random sequence. `from_config` takes transformers' own ZeRO-3 path instead, which
    skips the constructor draws (`no_init_weights`) and so starts from another RNG state. While
    the context lasts:

    - `PreTrainedModel.init_weights` on a partitioned model gathers each module's parameters
      (its own and its direct children's, one module at a time, as transformers'
      `initialize_weights_zero3` does) around the per-module `_initialize_weights`, so the
      init runs on full tensors, in ZeRO-0's order, on every rank (same RNG use everywhere;
      rank 0's values are kept);
    - `from_config` builds like direct construction (under our `zero.Init`, with
      transformers' nested one switched off through its own `set_zero3_state` flag).

    `from_pretrained` is untouched: its weights come from the checkpoint, and transformers
    initialises missing keys on gathered parameters itself. Older transformers releases
    without these hooks are left as they are.
    """
    try:
        from transformers import modeling_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    pretrained: Any = modeling_utils.PreTrainedModel  # patched below, hence Any
    original_init_weights = pretrained.__dict__.get("init_weights")
    original_initialize = pretrained.__dict__.get("_initialize_weights")
    original_from_config = pretrained.__dict__.get("_from_config")
    set_zero3_state: Any = getattr(modeling_utils, "set_zero3_state", None)  # absent in older releases
    if original_init_weights is None or original_initialize is None:  # pragma: no cover
        yield
        return

    def initialize_gathered(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        params = _partitioned_init_params(module, pretrained)
        if not params or getattr(module, "_is_hf_initialized", False):
            return original_initialize(self, module, *args, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            return original_initialize(self, module, *args, **kwargs)

    def init_weights(self: Any) -> Any:
        nested = pretrained.__dict__.get("_initialize_weights") is initialize_gathered
        if nested or not any(_is_partitioned(p) for p in self.parameters()):
            return original_init_weights(self)
        pretrained._initialize_weights = initialize_gathered
        try:
            return original_init_weights(self)
        finally:
            pretrained._initialize_weights = original_initialize

    pretrained.init_weights = init_weights
    patched_from_config = False
    if isinstance(original_from_config, classmethod) and set_zero3_state is not None:
        build, no_nested_init = original_from_config.__func__, set_zero3_state

        def from_config(cls: Any, config: Any, **kwargs: Any) -> Any:
            with no_nested_init():
                return build(cls, config, **kwargs)

        pretrained._from_config = classmethod(from_config)
        patched_from_config = True
    try:
        yield
    finally:
        pretrained.init_weights = original_init_weights
        if patched_from_config:
            pretrained._from_config = original_from_config


def _is_partitioned(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 parameter whose full data is not on this rank right now."""
    if not hasattr(param, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return bool(getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE)


def _partitioned_init_params(module: torch.nn.Module, pretrained: type) -> list[torch.nn.Parameter]:
    """Partitioned parameters `_init_weights(module)` may touch: its own and its direct
    children's (e.g. GPT-2's `attn.c_proj.weight`), leaving sub-models to their own init."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, pretrained):
            params.extend(child.parameters(recurse=False))
    return [p for p in params if _is_partitioned(p)]


def _forget_hf_deepspeed_config(hf_ds_config: Any) -> None:
    """Drop transformers' global reference so later `from_pretrained` calls are plain again."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    if ref is not None and ref() is hf_ds_config:
        hf_deepspeed.unset_hf_deepspeed_config()


def _restore_functional_linear() -> None:
    """Undo `zero.Init`'s replacement of `torch.nn.functional.linear`. DeepSpeed leaves its
    memory-saving ZeRO-3 linear in place for the rest of the process, so a later plain model
    would run through it (a TorchScript save of one fails). Models partitioned in the context
    train with torch's own linear, as models partitioned by `deepspeed.initialize` do."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is not original:
        torch.nn.functional.linear = original
