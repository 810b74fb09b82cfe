"""accelerate's `Accelerator` surface over the Engine: port a script by changing its import line.

``from accelerate import Accelerator, DistributedType, ...`` becomes
``from ds_engine import Accelerator, DistributedType, ...``; the rest of the script stays as
written. `Accelerator` is an `Engine` whose constructor takes accelerate's arguments and maps
them onto Engine choices (the ZeRO stage still comes from ``ds-engine launch --config zero2`` /
the ``DS_ENGINE_CONFIG`` environment variable, or from a ``deepspeed_plugin``), plus accelerate's
names with accelerate's meanings. Where accelerate's behaviour is what the Engine fixes (the
accumulation boundary, the short last window, steps skipped on overflow), the Engine's
semantics are kept; `COMPAT` records, for every public name of `accelerate.Accelerator`,
whether it is supported, differs (and how) or does not apply, and
``scripts/tools/compat_table.py`` renders it into ``docs/accelerate_compat.md``.

Names that accelerate's own classes already mean the same way are re-exported from accelerate
(`DistributedType`, `DataLoaderConfiguration`, `DeepSpeedPlugin`, `ProjectConfiguration`,
`DummyOptim`, `set_seed`, ...). An accelerate `PartialState` is initialised on the Engine's
process group, so `accelerate.logging.get_logger` and accelerate's tracker classes work on the
DeepSpeed backend too.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, filter_trackers
from accelerate.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    find_executable_batch_size,
    set_seed,
)
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # also without DeepSpeed

from ds_engine.collectives import map_tensors
from ds_engine.config import EngineConfig
from ds_engine.dataloader import PreparedDataLoader
from ds_engine.engine import Engine
from ds_engine.scheduler import OverflowAwareScheduler
from ds_engine.tracking import JsonlTracker

SUPPORTED, DIFFERS, NOT_APPLICABLE = "supported", "differs", "not applicable"

#: Every public name of `accelerate.Accelerator` (accelerate 1.16), classified for ds_engine's
#: `Accelerator`: (status, how). "supported": same name, same meaning. "differs": the name
#: exists and works, with the difference stated. "not applicable": ds_engine has no such
#: feature; the name is absent or raises with a hint. `tests/unit/test_accelerator_surface.py`
#: fails when accelerate gains a name that is not classified here, and when a name classified
#: as supported or differs stops existing.
COMPAT: dict[str, tuple[str, str]] = {
    "accumulate": (
        DIFFERS,
        "the Engine decides the boundary (every GA micro-steps and the loader's last batch) and divides "
        "each loss by its window's real length, also for a short last window",
    ),
    "autocast": (SUPPORTED, "autocast for the configured precision (DeepSpeed casts itself)"),
    "backward": (
        DIFFERS,
        "takes no extra arguments; the loss is divided by the window length, not by GA",
    ),
    "check_trigger": (SUPPORTED, ""),
    "clear": (SUPPORTED, "alias of `free_memory`"),
    "clip_grad_norm_": (
        DIFFERS,
        "`max_norm` must equal the config's `gradient_clipping` (DeepSpeed clips inside its step); "
        "only the 2-norm; acts at boundaries",
    ),
    "clip_grad_value_": (
        SUPPORTED,
        "at boundaries, on the fallback; on DeepSpeed it raises, as accelerate does",
    ),
    "context_parallel_rank": (NOT_APPLICABLE, "no context parallelism"),
    "data_parallel_rank": (NOT_APPLICABLE, "no composable parallelism: use `process_index`"),
    "data_parallel_shard_rank": (NOT_APPLICABLE, "no composable parallelism: use `process_index`"),
    "deepspeed_plugin": (
        DIFFERS,
        "a view: `.deepspeed_config` (the final JSON after `prepare`, the configured blocks before), "
        "`.zero_stage`, `.hf_ds_config`; None on the fallback",
    ),
    "deepspeed_ulysses_dl_adapter": (NOT_APPLICABLE, "no sequence parallelism"),
    "device": (SUPPORTED, ""),
    "dispatch_batches": (SUPPORTED, "always False (map-style datasets, sharded by batch)"),
    "distributed_type": (
        SUPPORTED,
        "DEEPSPEED on the DeepSpeed backend; accelerate's own value on the fallback (MULTI_CPU, "
        "MULTI_GPU, FSDP, NO)",
    ),
    "end_training": (SUPPORTED, "finishes the trackers, then a barrier and the process group's end"),
    "even_batches": (SUPPORTED, "always True: the last global batch is completed from the epoch start"),
    "fp8_backend": (NOT_APPLICABLE, "no fp8"),
    "free_memory": (
        SUPPORTED,
        "drops the prepared objects (and the DeepSpeed engine) so `prepare` can run again",
    ),
    "gather": (SUPPORTED, ""),
    "gather_for_metrics": (
        SUPPORTED,
        "drops the samples padded into the last batch; `use_gather_object` too",
    ),
    "get_state_dict": (
        DIFFERS,
        "collective; the full dict on the main process, None on the others (ZeRO-3 gathered layer by layer)",
    ),
    "get_tracker": (SUPPORTED, ""),
    "gradient_accumulation_steps": (DIFFERS, "read-only: set it in the constructor"),
    "init_trackers": (SUPPORTED, "accelerate's own tracker classes, on the main process"),
    "is_composable_parallelism_enabled": (SUPPORTED, "True only under the fallback's FSDP2"),
    "is_fsdp2": (SUPPORTED, "True only under the fallback's FSDP2 (ZeRO-2/3 on GPUs)"),
    "is_last_process": (SUPPORTED, ""),
    "is_local_main_process": (SUPPORTED, ""),
    "is_main_process": (SUPPORTED, ""),
    "join_uneven_inputs": (NOT_APPLICABLE, "batches are always even across ranks"),
    "load_state": (
        DIFFERS,
        "a folder written by `save_state` (ds_engine's checkpoint format, which also restores the "
        "dataloader position); automatic naming picks the newest complete `checkpoint_<i>`",
    ),
    "local_main_process_first": (SUPPORTED, ""),
    "local_process_index": (SUPPORTED, ""),
    "log": (SUPPORTED, "main process only"),
    "logging_dir": (SUPPORTED, ""),
    "lomo_backward": (NOT_APPLICABLE, "no LOMO optimizers"),
    "main_process_first": (SUPPORTED, ""),
    "maybe_context_parallel": (NOT_APPLICABLE, "no context parallelism"),
    "mixed_precision": (SUPPORTED, "'no', 'fp16' or 'bf16', from the resolved config"),
    "multi_device": (SUPPORTED, ""),
    "no_sync": (
        DIFFERS,
        "a no-op context: the Engine alone decides when gradients are reduced (once per optimizer "
        "step on DDP/ZeRO-0/1)",
    ),
    "non_blocking": (SUPPORTED, "batches are always moved with non_blocking=True"),
    "num_processes": (SUPPORTED, ""),
    "on_last_process": (SUPPORTED, ""),
    "on_local_main_process": (SUPPORTED, ""),
    "on_local_process": (SUPPORTED, ""),
    "on_main_process": (SUPPORTED, ""),
    "on_process": (SUPPORTED, ""),
    "optimizer_step_was_skipped": (
        SUPPORTED,
        "True when the last boundary's step was skipped (fp16 overflow, bf16 check, non-finite)",
    ),
    "pad_across_processes": (SUPPORTED, ""),
    "parallelism_config": (NOT_APPLICABLE, "no composable parallelism"),
    "pipeline_parallel_rank": (NOT_APPLICABLE, "no pipeline parallelism"),
    "prepare": (
        DIFFERS,
        "one model, one optimizer, one scheduler per Accelerator; map-style datasets only; "
        "DummyOptim/DummyScheduler need the config's optimizer/scheduler block (DeepSpeed backend) "
        'and fill its "auto" values as accelerate does; '
        "the scheduler advances only for applied optimizer steps (never on skipped ones): "
        "`num_processes` times each when sized from the un-prepared loader (accelerate's way, "
        "the default reading), once with `step_scheduler_with_optimizer=False` or "
        '`schedule_sized_from = "prepared"`',
    ),
    "prepare_data_loader": (SUPPORTED, ""),
    "prepare_model": (NOT_APPLICABLE, "prepare the model with its optimizer: `prepare(model, optimizer)`"),
    "prepare_optimizer": (
        NOT_APPLICABLE,
        "prepare the optimizer with its model: `prepare(model, optimizer)`",
    ),
    "prepare_scheduler": (SUPPORTED, "after the model and optimizer were prepared"),
    "print": (SUPPORTED, ""),
    "process_index": (SUPPORTED, ""),
    "profile": (NOT_APPLICABLE, "use torch.profiler directly"),
    "project_dir": (SUPPORTED, ""),
    "reduce": (SUPPORTED, "accelerate's own `reduce` on the Engine's process group"),
    "register_for_checkpointing": (SUPPORTED, "their state dicts go into the checkpoint's client state"),
    "register_load_state_pre_hook": (NOT_APPLICABLE, "ds_engine's checkpoint format has no per-model hooks"),
    "register_save_state_pre_hook": (NOT_APPLICABLE, "ds_engine's checkpoint format has no per-model hooks"),
    "save": (SUPPORTED, "writes on the main process only"),
    "save_iteration": (SUPPORTED, ""),
    "save_model": (
        SUPPORTED,
        "consolidated weights (safetensors, sharded past `max_shard_size`) plus the model's config.json",
    ),
    "save_state": (
        DIFFERS,
        "ds_engine's checkpoint format in the folder (`<dir>/state/` and `<dir>/latest`); automatic "
        "naming and `total_limit` rotation as in accelerate, rotating only after the new save is "
        "complete; call it at a boundary",
    ),
    "set_trigger": (SUPPORTED, ""),
    "should_save_model": (SUPPORTED, "True on the local main process"),
    "skip_first_batches": (
        DIFFERS,
        "on a prepared loader it returns the same loader, whose next iteration starts at batch n "
        "(accumulation windows stay where they were)",
    ),
    "split_batches": (SUPPORTED, "always False: `batch_size` is per process"),
    "split_between_processes": (SUPPORTED, ""),
    "sync_gradients": (SUPPORTED, ""),
    "tensor_parallel_rank": (NOT_APPLICABLE, "no tensor parallelism"),
    "torch_device_mesh": (NOT_APPLICABLE, "no composable parallelism (no device mesh)"),
    "trigger_sync_in_backward": (
        NOT_APPLICABLE,
        "the Engine already reduces at every boundary; a forced sync is not needed",
    ),
    "unscale_gradients": (NOT_APPLICABLE, "the Engine unscales inside the optimizer step"),
    "unwrap_model": (SUPPORTED, "`keep_fp32_wrapper` / `keep_torch_compile` accepted"),
    "use_distributed": (SUPPORTED, ""),
    "use_seedable_sampler": (SUPPORTED, "always True: the Engine's sampler is seeded (seed + epoch)"),
    "use_stateful_dataloader": (SUPPORTED, "always True: checkpoints hold the loader's position"),
    "verify_device_map": (SUPPORTED, ""),
    "wait_for_everyone": (SUPPORTED, ""),
}

_NOT_SET: Any = object()
_MIXED_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
_PRECISION_NAME = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}
_STATE_TAG = "state"  # the tag `save_state` writes inside its folder
_CUSTOM_KEY = "accelerate_custom_objects"


def _unsupported(argument: str, value: Any, hint: str) -> ValueError:
    return ValueError(f"ds_engine.Accelerator: `{argument}={value!r}` is not supported. HINT: {hint}")


def _ds_config_from_plugin(plugin: Any) -> dict[str, Any]:
    """A DeepSpeedPlugin's JSON, minus what accelerate adds that DeepSpeed reads as a default."""
    if isinstance(plugin, Mapping):
        if len(plugin) != 1:
            raise _unsupported(
                "deepspeed_plugin", f"{{{', '.join(map(repr, plugin))}}}", "pass one DeepSpeedPlugin"
            )
        plugin = next(iter(plugin.values()))
    config = dict(getattr(plugin, "deepspeed_config", None) or {})
    steps = config.get("steps_per_print")
    if isinstance(steps, float) and not math.isfinite(steps):
        config.pop("steps_per_print")  # accelerate's "never print"; ds_engine's default is 0 (never)
    return config


def _map_handlers(handlers: Sequence[Any], choices: dict[str, Any]) -> None:
    for handler in handlers:
        if isinstance(handler, InitProcessGroupKwargs):
            if handler.timeout is not None:
                choices.setdefault("dist_timeout_s", int(handler.timeout.total_seconds()))
        elif isinstance(handler, GradScalerKwargs):
            power = math.log2(handler.init_scale)
            if power != int(power):
                raise _unsupported(
                    "GradScalerKwargs.init_scale", handler.init_scale, "use a power of two (2.0**16)"
                )
            choices.setdefault("initial_scale_power", int(power))
            choices.setdefault("loss_scale_window", int(handler.growth_interval))
        elif isinstance(handler, (DistributedDataParallelKwargs, ProfileKwargs)):
            pass  # DDP tuning / profiling: the Engine wraps the model itself; accepted, ignored
        elif isinstance(handler, AutocastKwargs):
            if not handler.enabled:
                raise _unsupported(
                    "AutocastKwargs.enabled", False, "choose the precision with mixed_precision='no'"
                )
        else:
            raise _unsupported(
                "kwargs_handlers",
                type(handler).__name__,
                "ds_engine maps InitProcessGroupKwargs, GradScalerKwargs, DistributedDataParallelKwargs, "
                "AutocastKwargs and ProfileKwargs; drop the others",
            )


class DeepSpeedPluginView:
    """`accelerator.state.deepspeed_plugin` on the DeepSpeed backend: the run's DeepSpeed config.

    `deepspeed_config` is the final JSON after `prepare`; before it, the configured blocks
    (`optimizer`, `scheduler`, `zero_optimization.stage`, `gradient_accumulation_steps`, precision),
    which is what scripts test (``"optimizer" in plugin.deepspeed_config``).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        final = self._engine.ds_config
        if final is not None:
            return final
        eff = self._engine.config
        config: dict[str, Any] = {
            "zero_optimization": {"stage": eff.zero_stage},
            "gradient_accumulation_steps": eff.gradient_accumulation_steps,
            "gradient_clipping": eff.gradient_clipping,
            "fp16": {"enabled": eff.precision == "fp16"},
            "bf16": {"enabled": eff.precision == "bf16"},
        }
        if eff.optimizer is not None:
            config["optimizer"] = eff.optimizer
        if eff.scheduler is not None:
            config["scheduler"] = eff.scheduler
        return config

    @property
    def zero_stage(self) -> int:
        return int(self._engine.config.zero_stage)

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self._engine.config.gradient_accumulation_steps)

    @property
    def hf_ds_config(self) -> Any:
        from accelerate.utils.deepspeed import HfDeepSpeedConfig

        return HfDeepSpeedConfig(self.deepspeed_config)

    def is_zero3_init_enabled(self) -> bool:
        return self.zero_stage == 3

    def __repr__(self) -> str:
        return f"DeepSpeedPluginView(zero_stage={self.zero_stage})"


#: Said once (main process, the "ds_engine" logger at INFO) when an Accelerator is built.
SEMANTICS_NOTE = (
    "ds_engine.Accelerator keeps ds_engine's semantics where they differ from accelerate's: "
    "gradients are reduced and applied only at accumulation boundaries (every GA micro-steps and "
    "the loader's last batch), a short last window is divided by its real length, and a skipped "
    "step (fp16 overflow, non-finite gradients) advances neither the optimizer nor the LR "
    "scheduler. Every difference: docs/accelerate_compat.md"
)


class AcceleratorStateView:
    """`accelerator.state`: accelerate's process state, with this run's facts where they differ.

    Everything accelerate's `PartialState` knows (process index, device, `main_process_first`,
    `split_between_processes`, ...) comes from it; `distributed_type`, `mixed_precision` and
    `deepspeed_plugin` describe the Engine's run.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    @property
    def distributed_type(self) -> DistributedType:
        return self._accelerator.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._accelerator.mixed_precision

    @property
    def deepspeed_plugin(self) -> DeepSpeedPluginView | None:
        return self._accelerator.deepspeed_plugin

    @property
    def use_distributed(self) -> bool:
        return self._accelerator.use_distributed

    @property
    def num_processes(self) -> int:
        return self._accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self._accelerator.process_index

    @property
    def is_fsdp2(self) -> bool:
        return self._accelerator.is_fsdp2

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(PartialState(), name)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\nDevice: {self._accelerator.device}\n"
            f"Mixed precision type: {self.mixed_precision}\n"
            + (f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n" if self.deepspeed_plugin else "")
        )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """accelerate's `skip_first_batches`: the loader's next iteration starts at batch `num_batches`.

    A loader prepared by ds_engine is returned itself (its next iteration skips, later ones do
    not, and the accumulation windows stay aligned with the epoch); any other loader goes to
    accelerate's own function.
    """
    if isinstance(dataloader, PreparedDataLoader):
        dataloader.skip_first_batches(int(num_batches))
        return dataloader
    from accelerate.data_loader import skip_first_batches as accelerate_skip

    return accelerate_skip(dataloader, num_batches=num_batches)


class Accelerator(Engine):
    """An `Engine` that takes accelerate's constructor arguments and answers to accelerate's names.

    Arguments that ds_engine cannot honour raise a `ValueError` naming the argument and what to
    do. The ZeRO stage comes from ``ds-engine launch --config zero2`` (``DS_ENGINE_CONFIG``) or
    from `deepspeed_plugin`; Engine keyword choices (``zero_stage=2``, ``backend="accelerate"``,
    ...) may be given too.

    A prepared LR scheduler whose length does not tell which loader it was sized from is read
    as accelerate's scripts size it, from the un-prepared dataloader (it then advances
    `num_processes` times per applied optimizer step, as accelerate steps it); set
    `accelerator.schedule_sized_from = "prepared"` before `prepare` for the other reading.
    """

    default_schedule_reading = "unprepared"

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _NOT_SET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Any = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        config: EngineConfig | str | os.PathLike[str] | Mapping[str, Any] | None = None,
        backend: str = "auto",
        **choices: Any,
    ) -> None:
        choices = dict(choices)
        if not device_placement:
            raise _unsupported("device_placement", False, "drop it: prepared loaders always place batches")
        for name, value in (
            ("fsdp_plugin", fsdp_plugin),
            ("torch_tp_plugin", torch_tp_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
            ("parallelism_config", parallelism_config),
            ("dynamo_plugin", dynamo_plugin),
        ):
            if value is not None:
                raise _unsupported(
                    name,
                    type(value).__name__,
                    "drop it; choose sharding with the ZeRO stage (`ds-engine launch --config zero3`), "
                    "which the fallback maps onto FSDP2 itself",
                )
        if dynamo_backend not in (None, "no", "NO") and str(dynamo_backend).lower() != "dynamobackend.no":
            raise _unsupported("dynamo_backend", dynamo_backend, "drop it; call torch.compile yourself")
        if cpu and torch.cuda.is_available():
            raise _unsupported(
                "cpu",
                True,
                "ds_engine trains on the backend's device; hide the GPUs (CUDA_VISIBLE_DEVICES='')",
            )
        # ------------------------------------------------------------ dataloaders
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not _NOT_SET:
            self.dataloader_config.split_batches = bool(split_batches)
        dl = self.dataloader_config
        if dl.split_batches:
            raise _unsupported(
                "split_batches",
                True,
                "give the per-process batch size to the DataLoader (split_batches=False)",
            )
        if dl.dispatch_batches:
            raise _unsupported(
                "dispatch_batches", True, "use a map-style dataset; ds_engine shards it by batch"
            )
        if not dl.even_batches:
            raise _unsupported(
                "even_batches", False, "drop it; gather_for_metrics removes the padded samples"
            )
        if dl.data_seed is not None:
            raise _unsupported(
                "data_seed", dl.data_seed, "seed the DataLoader's sampler: RandomSampler(generator=...)"
            )
        # ------------------------------------------------------------ precision and accumulation
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or None
        if mixed_precision is not None:
            name = str(getattr(mixed_precision, "value", mixed_precision)).lower()
            if name not in _MIXED_PRECISION:
                raise _unsupported("mixed_precision", mixed_precision, "use 'no', 'fp16' or 'bf16'")
            choices.setdefault("precision", _MIXED_PRECISION[name])
        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError(
                    "ds_engine.Accelerator: pass `gradient_accumulation_steps` or "
                    "`gradient_accumulation_plugin`, not both (as accelerate requires)."
                )
            if not gradient_accumulation_plugin.sync_with_dataloader:
                raise _unsupported(
                    "GradientAccumulationPlugin.sync_with_dataloader",
                    False,
                    "drop it; the Engine always ends a window at the loader's last batch",
                )
            gradient_accumulation_steps = int(gradient_accumulation_plugin.num_steps)
        if gradient_accumulation_steps != 1:
            choices.setdefault("gradient_accumulation_steps", int(gradient_accumulation_steps))
        _map_handlers(kwargs_handlers or [], choices)
        # ------------------------------------------------------------ DeepSpeed config
        plugin = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins
        if plugin is not None:
            if config is not None:
                raise ValueError(
                    "ds_engine.Accelerator: `deepspeed_plugin` and `config` both give a DeepSpeed config. "
                    "HINT: pass one."
                )
            config = _ds_config_from_plugin(plugin)
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.rng_types = rng_types
        # ------------------------------------------------------------ project and trackers
        if project_config is not None:
            self.project_configuration = project_config
        else:
            self.project_configuration = ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.log_with = _trackers(log_with, self.logging_dir) if log_with is not None else []
        self.trackers: list[Any] = []
        self._custom_objects: list[Any] = []
        self._trigger = False

        super().__init__(config, backend=backend, **choices)
        if not self.step_scheduler_with_optimizer:
            # accelerate then steps a prepared scheduler once per call, never num_processes times
            self.schedule_sized_from = "prepared"
        # accelerate forms the process group at construction, and its logging / trackers need a
        # PartialState: initialise one on the Engine's group (it adopts the existing group).
        self._dist()
        PartialState(cpu=not torch.cuda.is_available())
        if self.is_main_process:
            logging.getLogger("ds_engine").info(SEMANTICS_NOTE)

    # ================================================================= facts
    @property
    def distributed_type(self) -> DistributedType:
        if self.backend_name == "deepspeed":
            return DistributedType.DEEPSPEED
        inner = getattr(self._backend, "accelerator", None)
        return inner.distributed_type if inner is not None else PartialState().distributed_type

    @property
    def mixed_precision(self) -> str:
        return _PRECISION_NAME[self.config.precision]

    @property
    def state(self) -> AcceleratorStateView:
        return AcceleratorStateView(self)

    @property
    def deepspeed_plugin(self) -> DeepSpeedPluginView | None:
        return DeepSpeedPluginView(self) if self.backend_name == "deepspeed" else None

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def multi_device(self) -> bool:
        return self.use_distributed and self.device.type != "cpu"

    @property
    def is_fsdp2(self) -> bool:
        return bool(getattr(self._backend, "fsdp", False))

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def should_save_model(self) -> bool:
        return self.is_local_main_process

    @property
    def split_batches(self) -> bool:
        return False

    @property
    def dispatch_batches(self) -> bool:
        return False

    @property
    def even_batches(self) -> bool:
        return True

    @property
    def use_seedable_sampler(self) -> bool:
        return True

    @property
    def non_blocking(self) -> bool:
        return True

    @property
    def use_stateful_dataloader(self) -> bool:
        return True

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return int(self.project_configuration.iteration)

    # ================================================================= processes
    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._on(function, lambda: PartialState().on_main_process(function))

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._on(function, lambda: PartialState().on_local_main_process(function))

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._on(function, lambda: PartialState().on_last_process(function))

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return lambda f: self.on_process(f, process_index=process_index)
        return self._on(function, lambda: PartialState().on_process(function, process_index))

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Any:
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index=local_process_index)
        return self._on(function, lambda: PartialState().on_local_process(function, local_process_index))

    @staticmethod
    def _on(function: Any, chosen: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        if not callable(function):
            raise ValueError("this decorator must be applied to a function: @accelerator.on_main_process")

        def inner(*args: Any, **kwargs: Any) -> Any:
            return chosen()(*args, **kwargs)

        return inner

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with PartialState().local_main_process_first():
            yield

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as mine:
            yield mine

    def set_trigger(self) -> None:
        """Set a flag that `check_trigger` sees on every process (e.g. early stopping on one rank)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` (collective); resets it."""
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        if self.reduce(flag, "sum").item() > 0:
            self._trigger = False
            return True
        return False

    # ================================================================= prepare
    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """Engine.prepare, plus DummyOptim / DummyScheduler and a scheduler prepared on its own."""
        dummy_optim = [o for o in objects if isinstance(o, DummyOptim)]
        dummy_sched = [o for o in objects if isinstance(o, DummyScheduler)]
        rest = [o for o in objects if not isinstance(o, (DummyOptim, DummyScheduler))]
        if dummy_optim or dummy_sched:
            self._check_dummies(dummy_optim, dummy_sched)
            self._fill_from_dummies(dummy_optim, dummy_sched)
        late = [o for o in rest if _is_late_scheduler(o, self)]
        engine_objects = [o for o in rest if not any(o is s for s in late)]
        prepared: dict[int, Any] = {}
        if engine_objects:
            result = super().prepare(*engine_objects)
            result = result if len(engine_objects) > 1 else (result,)
            prepared.update({id(o): r for o, r in zip(engine_objects, result)})
        for scheduler in late:
            prepared[id(scheduler)] = self.prepare_scheduler(scheduler)
        for dummy in dummy_optim:
            prepared[id(dummy)] = self.optimizer
        for dummy in dummy_sched:
            if dummy.lr_scheduler_callable is not None and self.lr_scheduler is None:
                prepared[id(dummy)] = self.prepare_scheduler(dummy.lr_scheduler_callable(self.optimizer))
            else:
                prepared[id(dummy)] = self.lr_scheduler
        out = tuple(prepared[id(o)] for o in objects)
        return out[0] if len(out) == 1 else out

    def _check_dummies(self, optims: list[Any], scheds: list[Any]) -> None:
        eff = self.config
        hint = (
            "put an `optimizer` / `scheduler` block in the DeepSpeed config (DS_ENGINE_CONFIG or "
            "deepspeed_plugin), or pass a torch optimizer / scheduler"
        )
        if self.backend_name != "deepspeed":
            raise ValueError(
                "ds_engine.Accelerator.prepare: DummyOptim / DummyScheduler stand for DeepSpeed's configured "
                f"optimizer and scheduler, and this run uses the {self.backend_name!r} backend. HINT: pass a "
                "torch optimizer and scheduler (or install DeepSpeed)."
            )
        if optims and eff.optimizer is None:
            raise ValueError(
                "ds_engine.Accelerator.prepare: DummyOptim but the config has no `optimizer` block. "
                f"HINT: {hint}."
            )
        for sched in scheds:
            if eff.scheduler is None and sched.lr_scheduler_callable is None:
                raise ValueError(
                    "ds_engine.Accelerator.prepare: DummyScheduler without `lr_scheduler_callable` but the "
                    f"config has no `scheduler` block. HINT: {hint}."
                )

    def _fill_from_dummies(self, optims: list[Any], scheds: list[Any]) -> None:
        """What accelerate writes into the config's "auto" values from DummyOptim / DummyScheduler.

        DummyOptim: `optimizer.params.lr` / `weight_decay`, and its `params` (groups) are what the
        config's optimizer trains. DummyScheduler (without a callable): `warmup_min_lr` 0,
        `warmup_max_lr` the optimizer's lr, `warmup_num_steps` (at least 1), and
        `total_num_steps` divided by the number of processes (accelerate's reading: the scripts
        size it from the un-prepared dataloader). Only "auto" values change.
        """
        values: dict[str, Any] = {}
        for optim in optims:
            values |= {"optimizer.params.lr": optim.lr, "optimizer.params.weight_decay": optim.weight_decay}
            self.config_optimizer_parameters = optim.params
        for sched in scheds:
            if sched.lr_scheduler_callable is not None:
                continue
            opt = sched.optimizer
            defaults = getattr(opt, "defaults", None)
            max_lr = getattr(opt, "lr", None) if defaults is None else defaults["lr"]
            if max_lr is None and optims:  # DummyScheduler(None, ...): the DummyOptim's lr
                max_lr = optims[0].lr
            values |= {
                "scheduler.params.warmup_min_lr": 0,
                "scheduler.params.warmup_num_steps": max(1, int(sched.warmup_num_steps)),
            }
            if max_lr is not None:
                values["scheduler.params.warmup_max_lr"] = max_lr
            if sched.total_num_steps is not None:
                total = int(sched.total_num_steps)
                values["scheduler.params.total_num_steps"] = (
                    total if self.dataloader_config.split_batches else math.ceil(total / self.num_processes)
                )
        self.fill_auto(values)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        return self.prepare(data_loader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Prepare an LR scheduler after its model and optimizer were prepared (a call of its own)."""
        if isinstance(scheduler, OverflowAwareScheduler):
            return scheduler
        if self._model is None or self._optimizer is None:
            raise ValueError(
                "ds_engine.Accelerator.prepare_scheduler: prepare the model and optimizer first. HINT: "
                "accelerator.prepare(model, optimizer, scheduler) in one call."
            )
        if self._scheduler is not None:
            raise ValueError("ds_engine trains one scheduler per Accelerator; one is prepared already.")
        self._scheduler = self._wrap_scheduler(scheduler)
        return self._scheduler

    # ================================================================= training step
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """A no-op: the Engine alone decides when gradients are reduced."""
        yield

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager[None]:
        if autocast_handler is not None and not getattr(autocast_handler, "enabled", True):
            return contextlib.nullcontext()
        return super().autocast()

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to [-clip_value, clip_value] at a boundary (fallback only)."""
        if self.backend_name == "deepspeed":
            raise RuntimeError(
                "DeepSpeed does not support `clip_grad_value_` (accelerate raises too). HINT: use "
                "`clip_grad_norm_` with the config's `gradient_clipping`."
            )
        if not self.sync_gradients:
            return
        unscale = getattr(self._backend, "_unscale_once", None)
        if unscale is not None:
            unscale()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        return super().unwrap_model(model)

    # ================================================================= collectives
    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather across ranks, minus the samples padded into the epoch's last batch."""
        try:
            map_tensors(input_data, lambda t: t)
            all_tensors = _only_tensors(input_data)
        except TypeError:
            all_tensors = False
        if all_tensors and not use_gather_object:
            return super().gather_for_metrics(input_data)
        from accelerate.utils import gather_object

        self._dist()
        data = gather_object(input_data)
        remaining = self._remaining_samples()
        return data[:remaining] if remaining is not None else data

    def _remaining_samples(self) -> int | None:
        """Real samples in the gathered last batch of the loader in progress (None mid-epoch)."""
        loader = self._loaders_in_progress[-1] if self._loaders_in_progress else None
        if loader is None or loader.batch_index != len(loader) - 1:
            return None
        return loader.num_samples - loader.batch_index * loader.batch_size * self.num_processes

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """accelerate's `reduce` ("sum", "mean", "none"; nested structures) on this process group."""
        from accelerate.utils import reduce

        self._dist()
        return reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        from accelerate.utils import pad_across_processes

        self._dist()
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # ================================================================= data
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return skip_first_batches(dataloader, num_batches)

    # ================================================================= saving
    def get_state_dict(
        self, model: torch.nn.Module, unwrap: bool = True, **kwargs: Any
    ) -> dict[str, torch.Tensor] | None:
        return super().get_state_dict(model, **kwargs)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Consolidated weights (and the model's config) that `from_pretrained` reloads. Collective."""
        self.save_pretrained(
            model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects' `state_dict()` with `save_state` / `load_state`."""
        bad = [
            type(o).__name__
            for o in objects
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                f"register_for_checkpointing: {', '.join(bad)} have no `state_dict` and `load_state_dict`. "
                "HINT: register only objects with both."
            )
        self._custom_objects.extend(objects)

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Save everything needed to resume into `output_dir` (a ds_engine checkpoint). Collective.

        With `ProjectConfiguration(automatic_checkpoint_naming=True)` the folder is
        ``project_dir/checkpoints/checkpoint_<iteration>`` and, once it is complete, the oldest
        complete ones beyond `total_limit` are deleted, as in accelerate (a folder that holds no
        complete saved state is never counted nor deleted). A save that fails (a full disk, say:
        an OSError on every rank naming the rank, the file and the cause) deletes nothing and
        leaves no ``checkpoint_<iteration>`` behind. Returns the folder.
        """
        self._refuse_if_ended("save_state(...)")
        if kwargs:
            raise TypeError(
                f"save_state got {sorted(kwargs)}; ds_engine's checkpoints take no extra arguments."
            )
        pc = self.project_configuration
        if pc.automatic_checkpoint_naming:
            if self.project_dir is None:
                raise ValueError(
                    "automatic_checkpoint_naming needs a project_dir. "
                    "HINT: ProjectConfiguration(project_dir=...)."
                )
            base = Path(self.project_dir) / "checkpoints"
            base.mkdir(parents=True, exist_ok=True)
            target = base / f"checkpoint_{self.save_iteration}"
            if target.exists():
                raise ValueError(
                    f"Checkpoint directory {target} ({self.save_iteration}) already exists. HINT: set "
                    "`project_config.iteration` to the iteration to start with."
                )
            self.wait_for_everyone()
        elif output_dir is None:
            raise ValueError("save_state() needs an output_dir unless automatic_checkpoint_naming is on.")
        else:
            target = Path(output_dir).expanduser()
        client = {_CUSTOM_KEY: [obj.state_dict() for obj in self._custom_objects]}
        existed = target.exists()
        try:
            self.save_checkpoint(target, tag=_STATE_TAG, client_state=client)
        except BaseException:
            # every rank raises (the save agrees on failures); the folder this call made goes
            if pc.automatic_checkpoint_naming and not existed and self.is_main_process:
                _remove_unfinished(target)
            raise
        if pc.automatic_checkpoint_naming:
            pc.iteration += 1
            if self.is_main_process and pc.total_limit is not None:
                _rotate_states(target.parent, keep=int(pc.total_limit), newest=target)
        return str(target)

    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: Any = None, **kwargs: Any
    ) -> None:
        """Restore a `save_state` folder (under automatic naming the newest `checkpoint_<i>` that holds
        a complete saved state). Collective."""
        self._refuse_if_ended("load_state(...)")
        if kwargs or load_kwargs:
            raise TypeError("load_state takes no extra arguments in ds_engine.")
        pc = self.project_configuration
        if input_dir is not None:
            source = Path(input_dir).expanduser()
            if not source.is_dir():
                raise ValueError(f"Tried to find {source} but folder does not exist")
        elif pc.automatic_checkpoint_naming and self.project_dir is not None:
            from ds_engine.autosave import newest_complete_folder

            base = Path(self.project_dir) / "checkpoints"
            folders = _complete_states(base)
            # the newest whose files match what its save recorded (a damaged one is skipped, warned)
            newest = newest_complete_folder((path for _, path in folders), _STATE_TAG)
            if newest is None:
                others = sorted(path.name for _, path in _numbered(base))
                raise FileNotFoundError(
                    f"no complete checkpoint_<i> folder under {str(base)!r}"
                    + (f" ({', '.join(others)} hold no complete saved state)" if others else "")
                    + ". HINT: save_state() first, or pass the folder to load_state(input_dir)."
                )
            source = newest
        else:
            raise ValueError("load_state() needs an input_dir unless automatic_checkpoint_naming is on.")
        client = self.load_checkpoint(source, tag=_STATE_TAG)
        saved = list(client.get(_CUSTOM_KEY, []))
        if len(saved) != len(self._custom_objects):
            raise ValueError(
                f"{source} holds {len(saved)} registered objects, {len(self._custom_objects)} are "
                "registered. "
                "HINT: register_for_checkpointing the same objects as the run that saved it."
            )
        for obj, state in zip(self._custom_objects, saved):
            obj.load_state_dict(state)
        if pc.automatic_checkpoint_naming:
            match = re.search(r"(\d+)$", source.name)
            if match:
                pc.iteration = int(match.group(1)) + 1

    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop every prepared object (and the DeepSpeed engine) so `prepare` can start afresh."""
        from accelerate.utils import release_memory

        ds_engine = getattr(self._backend, "ds_engine", None)
        if ds_engine is not None and hasattr(ds_engine, "destroy"):
            ds_engine.destroy()
            self._backend.ds_engine = None  # type: ignore[attr-defined]
        self._model, self._optimizer, self._scheduler = None, None, None
        self._dataloaders, self._loaders_in_progress = [], []
        released = release_memory(*objects)
        gc.collect()
        return list(released) if isinstance(released, (list, tuple)) else [released]

    def clear(self, *objects: Any) -> list[Any]:
        return self.free_memory(*objects)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        return any(len(getattr(m, "hf_device_map", {}) or {}) > 1 for m in model.modules())

    # ================================================================= trackers
    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Start accelerate's trackers named in `log_with` (main process only)."""
        if not self.is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for tracker in self.log_with:
            if isinstance(tracker, GeneralTracker):
                self.trackers.append(tracker)
                continue
            name = str(tracker)
            cls: Any = JsonlTracker if name == JsonlTracker.name else LOGGER_TYPE_TO_CLASS[name]
            kwargs = init_kwargs.get(str(tracker), {})
            if cls.requires_logging_directory:
                self.trackers.append(cls(project_name, self.logging_dir, **kwargs))
            else:
                self.trackers.append(cls(project_name, **kwargs))
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        if self.trackers:
            for tracker in self.trackers:
                if tracker.name == name:
                    return tracker.tracker if unwrap else tracker
            raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`.")
        return GeneralTracker(_blank=True)

    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Log `values` to every tracker, on the main process only (and to `log_to`'s folder, if set)."""
        if not self.is_main_process:
            return
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(dict(values), step=step, **log_kwargs.get(tracker.name, {}))
        if self._run_log is not None:
            super().log(values, step=step)

    def end_training(self) -> None:
        """Finish the trackers, then wait for every process and end the process group."""
        for tracker in self.trackers:
            tracker.finish()
        super().end_training()


def _trackers(log_with: Any, logging_dir: str | None) -> list[Any]:
    """accelerate's `filter_trackers`, knowing ds_engine's "jsonl" (`ds_engine.tracking.JsonlTracker`)."""
    names = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    jsonl = [t for t in names if str(t) == JsonlTracker.name]
    others = [t for t in names if str(t) != JsonlTracker.name]
    if jsonl and logging_dir is None:
        raise ValueError(
            '`log_with="jsonl"` writes metrics.jsonl into the logging directory, and none is set. HINT: '
            "pass `project_dir=` (or `ProjectConfiguration(project_dir=..., logging_dir=...)`)."
        )
    return [*jsonl[:1], *(filter_trackers(others, logging_dir) if others else [])]


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(_only_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_only_tensors(v) for v in data)
    return False


def _is_late_scheduler(obj: Any, accelerator: Accelerator) -> bool:
    """A scheduler handed to `prepare` on its own, after the model and optimizer were prepared."""
    from ds_engine.engine import _is_scheduler

    return (
        _is_scheduler(obj) and not isinstance(obj, torch.optim.Optimizer) and accelerator._model is not None
    )


def _numbered(base: Path) -> list[tuple[int, Path]]:
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        match = re.search(r"(\d+)$", child.name)
        if child.is_dir() and match:
            found.append((int(match.group(1)), child))
    return found


def _complete_states(base: Path) -> list[tuple[int, Path]]:
    """The numbered folders under `base` that hold a complete `save_state`, oldest first: what
    "newest" means for `load_state()` and what `total_limit` counts."""
    from ds_engine.checkpoint import has_complete_tag

    numbered = sorted(_numbered(base), key=lambda item: item[0])
    return [(i, path) for i, path in numbered if not path.is_symlink() and has_complete_tag(path, _STATE_TAG)]


def _remove_unfinished(target: Path) -> None:
    """Remove `target`, made by a `save_state` that failed, unless it somehow holds a complete
    state (then it is a checkpoint, and stays)."""
    from ds_engine.checkpoint import has_complete_tag

    if target.is_dir() and not target.is_symlink() and not has_complete_tag(target, _STATE_TAG):
        shutil.rmtree(target, ignore_errors=True)


def _rotate_states(base: Path, *, keep: int, newest: Path) -> None:
    """After `newest` was saved: remove the oldest complete `save_state` folders beyond `keep`
    (never `newest`, never a folder that is not a complete one); a failure is a warning."""
    import warnings

    for _, old in _complete_states(base)[: -max(keep, 1)]:
        if old == newest:
            continue
        problems: list[str] = []

        def note(_function: Any, failed: str, info: Any, found: list[str] = problems) -> None:
            found.append(f"{failed}: {info[1]}")

        shutil.rmtree(old, onerror=note)
        if problems:
            warnings.warn(
                f"ds_engine: saved {str(newest)!r}, but could not fully remove {str(old)!r} "
                f"(total_limit={keep}): {problems[0]}. HINT: remove it by hand.",
                stacklevel=3,
            )


__all__ = [
    "COMPAT",
    "Accelerator",
    "AcceleratorStateView",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedPluginView",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "LoggerType",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "find_executable_batch_size",
    "set_seed",
    "skip_first_batches",
]
