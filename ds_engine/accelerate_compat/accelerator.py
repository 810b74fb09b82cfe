"""accelerate's `Accelerator` surface over the Engine: port a script by changing its import line.

``from accelerate import Accelerator, DistributedType, ...`` becomes
``from ds_engine import Accelerator, DistributedType, ...``; the rest of the script stays as
written. `Accelerator` is an `Engine` whose constructor takes accelerate's arguments and maps
them onto Engine choices (`ds_engine.accelerate_compat.constructor`; the ZeRO stage still comes
from ``ds-engine launch --config zero2`` / the ``DS_ENGINE_CONFIG`` environment variable, or
from a ``deepspeed_plugin``), plus accelerate's names with accelerate's meanings. Where
accelerate's behaviour is what the Engine fixes (the accumulation boundary, the short last
window, steps skipped on overflow), the Engine's semantics are kept; `COMPAT`
(`ds_engine.accelerate_compat.compat`) records every difference.

An accelerate `PartialState` is initialised on the Engine's process group, so
`accelerate.logging.get_logger` and accelerate's tracker classes work on the DeepSpeed backend
too.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # also without DeepSpeed

from ds_engine.accelerate_compat import state_folders
from ds_engine.accelerate_compat.compat import SEMANTICS_NOTE
from ds_engine.accelerate_compat.constructor import NOT_SET, map_arguments
from ds_engine.accelerate_compat.trackers import find_tracker, select_trackers, start_trackers
from ds_engine.accelerate_compat.views import AcceleratorStateView, DeepSpeedPluginView
from ds_engine.autosave import newest_complete_folder
from ds_engine.collectives import map_tensors
from ds_engine.config import EngineConfig
from ds_engine.dataloader import PreparedDataLoader
from ds_engine.engine import Engine
from ds_engine.scheduler import OverflowAwareScheduler, is_scheduler

_PRECISION_NAME = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}


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

    `rng_types` is accepted and changes nothing: a loader prepared here shuffles in accelerate's
    order (its default `rng_types=["generator"]`: rank 0's generator on every rank), and the
    process RNGs are left alone (seed them with `set_seed`).
    `ds_engine.accelerate_compat.constructor.ARGUMENTS` says what each argument becomes.
    """

    default_schedule_reading = "unprepared"

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = NOT_SET,
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
        setup = map_arguments(
            device_placement=device_placement,
            split_batches=split_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            dataloader_config=dataloader_config,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            rng_types=rng_types,
            log_with=log_with,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
            config=config,
            choices=choices,
            environ=os.environ,
            cuda_available=torch.cuda.is_available(),
        )
        self.dataloader_config = setup.dataloader_config
        self.step_scheduler_with_optimizer = setup.step_scheduler_with_optimizer
        self.project_configuration = state_folders.project_configuration(project_dir, project_config)
        self.log_with = select_trackers(log_with, self.logging_dir) if log_with is not None else []
        self.trackers: list[Any] = []
        self._custom_objects: list[Any] = []
        self._trigger = False
        self._logs_to_folder = False  # `log_to` was called: `log` writes there too

        super().__init__(setup.config, backend=backend, **setup.choices)
        if not self.step_scheduler_with_optimizer:
            # accelerate then steps a prepared scheduler once per call, never num_processes times
            self.schedule_sized_from = "prepared"
        # accelerate forms the process group at construction, and its logging / trackers need a
        # PartialState: initialise one on the Engine's group (it adopts the existing group).
        self.ensure_process_group()
        PartialState(cpu=not torch.cuda.is_available())
        if self.is_main_process:
            logging.getLogger("ds_engine").info(SEMANTICS_NOTE)

    # ================================================================= facts
    @property
    def _backend_capabilities(self) -> Any:
        """The backend, read for the capabilities `Backend` declares (`distributed_type`,
        `is_fsdp2`, `supports_clip_grad_value`, `unscale_gradients`) and nothing else."""
        return self.backend_capabilities

    @property
    def distributed_type(self) -> DistributedType:
        """accelerate's name for the run: DEEPSPEED, or the fallback's (MULTI_CPU, MULTI_GPU, FSDP, NO)."""
        return DistributedType[self._backend_capabilities.distributed_type]

    @property
    def mixed_precision(self) -> str:
        return _PRECISION_NAME[self.config.precision]

    @property
    def state(self) -> AcceleratorStateView:
        return AcceleratorStateView(self)

    @property
    def deepspeed_plugin(self) -> DeepSpeedPluginView | None:
        """The run's DeepSpeed config as accelerate's plugin shows it; None when DeepSpeed does not run."""
        return DeepSpeedPluginView(self) if self.distributed_type == DistributedType.DEEPSPEED else None

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def multi_device(self) -> bool:
        return self.use_distributed and self.device.type != "cpu"

    @property
    def is_fsdp2(self) -> bool:
        return self._backend_capabilities.is_fsdp2

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
        return False

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
        late = [o for o in rest if self._is_late_scheduler(o)]
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

    def _is_late_scheduler(self, obj: Any) -> bool:
        """A scheduler handed to `prepare` on its own, after the model and optimizer were prepared."""
        return is_scheduler(obj) and not isinstance(obj, torch.optim.Optimizer) and self.model is not None

    def _check_dummies(self, optims: list[Any], scheds: list[Any]) -> None:
        eff = self.config
        hint = (
            "put an `optimizer` / `scheduler` block in the DeepSpeed config (DS_ENGINE_CONFIG or "
            "deepspeed_plugin), or pass a torch optimizer / scheduler"
        )
        if self.distributed_type != DistributedType.DEEPSPEED:
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
        if self.model is None or self.optimizer is None:
            raise ValueError(
                "ds_engine.Accelerator.prepare_scheduler: prepare the model and optimizer first. HINT: "
                "accelerator.prepare(model, optimizer, scheduler) in one call."
            )
        if self.lr_scheduler is not None:
            raise ValueError("ds_engine trains one scheduler per Accelerator; one is prepared already.")
        return super().prepare(scheduler)

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
        if not self._backend_capabilities.supports_clip_grad_value:
            raise RuntimeError(
                "DeepSpeed does not support `clip_grad_value_` (accelerate raises too). HINT: use "
                "`clip_grad_norm_` with the config's `gradient_clipping`."
            )
        if not self.sync_gradients:
            return
        self._backend_capabilities.unscale_gradients()
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

        self._join_group("gather_for_metrics(...)")
        data = gather_object(input_data)
        remaining = self._remaining_samples()
        return data[:remaining] if remaining is not None else data

    def _remaining_samples(self) -> int | None:
        """Real samples in the gathered last batch of the loader in progress (None mid-epoch)."""
        loader = self.current_loader
        return None if loader is None else loader.last_batch_real_samples()

    def _join_group(self, call: str) -> None:
        """Form (or join) the process group accelerate's collectives use; after `end_training` the
        one error, naming `accelerator.<call>`."""
        self.step.refuse_if_ended(f"accelerator.{call}")
        self.ensure_process_group()

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """accelerate's `reduce` ("sum", "mean", "none"; nested structures) on this process group."""
        from accelerate.utils import reduce

        self._join_group("reduce(...)")
        return reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        from accelerate.utils import pad_across_processes

        self._join_group("pad_across_processes(...)")
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
        self.step.refuse_if_ended("accelerator.save_state(...)")
        if kwargs:
            raise TypeError(
                f"save_state got {sorted(kwargs)}; ds_engine's checkpoints take no extra arguments."
            )
        pc = self.project_configuration
        if pc.automatic_checkpoint_naming:
            target = state_folders.automatic_folder(pc)
            self.wait_for_everyone()
        elif output_dir is None:
            raise ValueError("save_state() needs an output_dir unless automatic_checkpoint_naming is on.")
        else:
            target = Path(output_dir).expanduser()
        client = {state_folders.CUSTOM_KEY: [obj.state_dict() for obj in self._custom_objects]}
        existed = target.exists()
        try:
            self.save_checkpoint(target, tag=state_folders.STATE_TAG, client_state=client)
        except BaseException:
            # every rank raises (the save agrees on failures); the folder this call made goes
            if pc.automatic_checkpoint_naming and not existed and self.is_main_process:
                state_folders.remove_unfinished(target)
            raise
        if pc.automatic_checkpoint_naming:
            pc.iteration += 1
            if self.is_main_process and pc.total_limit is not None:
                state_folders.rotate_states(target.parent, keep=int(pc.total_limit), newest=target)
        return str(target)

    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: Any = None, **kwargs: Any
    ) -> None:
        """Restore a `save_state` folder (under automatic naming the newest `checkpoint_<i>` that holds
        a complete saved state). Collective."""
        self.step.refuse_if_ended("accelerator.load_state(...)")
        if kwargs or load_kwargs:
            raise TypeError("load_state takes no extra arguments in ds_engine.")
        pc = self.project_configuration
        if input_dir is not None:
            source = Path(input_dir).expanduser()
            if not source.is_dir():
                raise ValueError(f"Tried to find {source} but folder does not exist")
        elif pc.automatic_checkpoint_naming and self.project_dir is not None:
            base = state_folders.checkpoints_folder(self.project_dir)
            # the newest whose files match what its save recorded (a damaged one is skipped, warned)
            newest = newest_complete_folder(state_folders.complete_states(base), state_folders.STATE_TAG)
            if newest is None:
                raise state_folders.no_complete_state(base)
            source = newest
        else:
            raise ValueError("load_state() needs an input_dir unless automatic_checkpoint_naming is on.")
        client = self.load_checkpoint(source, tag=state_folders.STATE_TAG)
        saved = list(client.get(state_folders.CUSTOM_KEY, []))
        if len(saved) != len(self._custom_objects):
            raise ValueError(
                f"{source} holds {len(saved)} registered objects, {len(self._custom_objects)} are "
                "registered. "
                "HINT: register_for_checkpointing the same objects as the run that saved it."
            )
        for obj, state in zip(self._custom_objects, saved):
            obj.load_state_dict(state)
        if pc.automatic_checkpoint_naming:
            iteration = state_folders.iteration_after(source)
            if iteration is not None:
                pc.iteration = iteration

    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop every prepared object (and the DeepSpeed engine) so `prepare` can start afresh."""
        from accelerate.utils import release_memory

        self.release()
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
        start_trackers(
            self.trackers, self.log_with, project_name, self.logging_dir, config, init_kwargs or {}
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (accelerate's object; its inner one with `unwrap`)."""
        return find_tracker(self.trackers, name, unwrap)

    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Log `values` to every tracker, on the main process only (and to `log_to`'s folder, if set)."""
        if not self.is_main_process:
            return
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(dict(values), step=step, **log_kwargs.get(tracker.name, {}))
        if self._logs_to_folder:
            super().log(values, step=step)

    def log_to(
        self,
        directory: str | os.PathLike[str],
        *,
        tensorboard: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """`Engine.log_to`: `log` then writes into `directory` too, beside the trackers."""
        super().log_to(directory, tensorboard=tensorboard, config=config)
        self._logs_to_folder = True

    def end_training(self) -> None:
        """Finish the trackers, then wait for every process and end the process group."""
        for tracker in self.trackers:
            tracker.finish()
        self._logs_to_folder = False
        super().end_training()


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(_only_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_only_tensors(v) for v in data)
    return False
