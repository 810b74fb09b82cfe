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
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from ds_engine.accelerate_compat.constructor import NOT_SET, check_dummies, dummy_values, map_arguments
from ds_engine.accelerate_compat.trackers import find_tracker, select_trackers, start_trackers
from ds_engine.accelerate_compat.views import (
    AcceleratorStateView,
    DeepSpeedPluginView,
    check_windows,
    holds,
    label,
    plan_models,
    reached_engines,
    two_trained_models,
)
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
        self._init_several_models(setup.config, backend, setup.choices)
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
            deepspeed = self.distributed_type == DistributedType.DEEPSPEED
            models = sum(isinstance(o, torch.nn.Module) for o in objects) + len(self._owner_modules())
            models += self.model is not None
            check_dummies(dummy_optim, dummy_sched, self.config, self.backend_name, deepspeed, models)
            values, params = dummy_values(
                dummy_optim, dummy_sched, self.dataloader_config.split_batches, self.num_processes
            )
            if params is not None:
                self.config_optimizer_parameters = params
            self.fill_auto(values)
        late = [o for o in rest if self._is_late_scheduler(o, rest)]
        engine_objects = [o for o in rest if not any(o is s for s in late)]
        mine, extras = plan_models(engine_objects, objects, is_scheduler, has_model=self.model is not None)
        prepared: dict[int, Any] = {}
        if mine:
            result = super().prepare(*mine)
            result = result if len(mine) > 1 else (result,)
            prepared.update({id(o): r for o, r in zip(mine, result)})
            self._own(self, mine, result, objects)
            self._loaders_seen += [r for r in result if isinstance(r, PreparedDataLoader)]
            self._check_windows()
        for model, optimizer, scheduler in extras:
            prepared.update(self._prepare_extra(objects, model, optimizer, scheduler))
        self._models_seen += sum(isinstance(o, torch.nn.Module) for o in objects)
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

    def _is_late_scheduler(self, obj: Any, call: list[Any]) -> bool:
        """A scheduler handed to `prepare` after the model and optimizer it drives were prepared."""
        driving = getattr(obj, "optimizer", None)
        if not is_scheduler(obj) or isinstance(obj, torch.optim.Optimizer) or any(driving is o for o in call):
            return False
        return id(driving) in self._owner or (self.model is not None and not self._extra_engines)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        return self.prepare(data_loader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Prepare an LR scheduler after its model and optimizer were prepared (a call of its own)."""
        if isinstance(scheduler, OverflowAwareScheduler):
            return scheduler
        engine = self._owner.get(id(getattr(scheduler, "optimizer", None)), self)
        if engine is not self:
            return engine.prepare(scheduler)
        if self.model is None or self.optimizer is None:
            raise ValueError(
                "ds_engine.Accelerator.prepare_scheduler: prepare the model and optimizer first. HINT: "
                "accelerator.prepare(model, optimizer, scheduler) in one call."
            )
        if self.lr_scheduler is not None:
            raise ValueError("ds_engine trains one scheduler per Accelerator; one is prepared already.")
        return super().prepare(scheduler)

    # ================================================================= several models
    def _init_several_models(self, config: Any, backend: str, choices: dict[str, Any]) -> None:
        """One Engine per trained model: this Accelerator's (the first), and one more for each model
        prepared beside it (trained, or inference only), sharing the process group and micro-stepping
        with the first (`accumulate`), so every model sees the same accumulation windows."""
        self._engine_setup = (config, backend, dict(choices))
        self._extra_engines: list[Engine] = []
        self._owner: dict[int, Engine] = {}  # id(model / wrapper / optimizer / scheduler) -> Engine
        self._labels: dict[int, str] = {}  # id(Engine) -> its model as the user passed it
        self._model_index: dict[int, int] = {}  # id(Engine) -> accelerate's index of its model
        self._models_seen = 0
        self._loaders_seen: list[PreparedDataLoader] = []
        self._last_engine: Engine = self  # the Engine of the last micro-step (`sync_gradients`)

    def _own(self, engine: Engine, objects: Sequence[Any], prepared: Sequence[Any], call: Any) -> None:
        """Record which Engine prepared each model / optimizer / scheduler (and its prepared forms)."""
        for obj, result in zip(objects, prepared):
            if isinstance(obj, torch.utils.data.DataLoader):
                continue
            self._owner[id(obj)] = self._owner[id(result)] = engine
            if isinstance(obj, torch.nn.Module):
                self._owner[id(engine.unwrap_model(result))] = engine
                self._labels[id(engine)] = label(obj, call)
                self._model_index[id(engine)] = self._models_seen + [
                    o for o in call if isinstance(o, torch.nn.Module)
                ].index(obj)

    def _prepare_extra(self, call: Any, model: Any, optimizer: Any, scheduler: Any) -> dict[int, Any]:
        """Prepare a model beside the first on an Engine of its own (same choices, same group)."""
        config, backend, choices = self._engine_setup
        loader = self._loaders_seen[0] if self._loaders_seen else None
        if self.config.micro_batch_size == "auto":  # DeepSpeed's triangle: the training loader's
            size = getattr(loader.for_sizing(self.config), "batch_size", None) if loader else None
            size = 1 if size is None and optimizer is None else size  # inference: a placeholder
            choices = {**choices, "micro_batch_size": size} if isinstance(size, int) else choices
        engine = Engine(config, backend=backend, **choices)
        engine.default_schedule_reading = self.default_schedule_reading
        engine.schedule_sized_from = self.schedule_sized_from
        self._extra_engines.append(engine)
        objects = [o for o in (model, optimizer, scheduler) if o is not None]
        result = engine.prepare(*objects)
        result = result if len(objects) > 1 else (result,)
        self._own(engine, objects, result, call)
        self._check_windows()
        return {id(o): r for o, r in zip(objects, result)}

    def _check_windows(self) -> None:
        if any(e.optimizer is not None for e in self._extra_engines):
            check_windows(self._loaders_seen[:1], self.gradient_accumulation_steps)  # the training loader

    def _extras(self) -> list[tuple[int, Engine]]:
        """(accelerate's model index, Engine) of every model trained beside the first."""
        return [(self._model_index[id(e)], e) for e in self._extra_engines if e.optimizer is not None]

    def _trained_engines(self) -> list[Engine]:
        own = [self] if self.optimizer is not None else []
        return own + [e for e in self._extra_engines if e.optimizer is not None]

    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-step ends an accumulation window (the optimizers step)."""
        return self._last_engine.step.boundary

    # ================================================================= training step
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """A no-op: the Engine alone decides when gradients are reduced."""
        yield

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step of every trained model (the window is the run's, as in accelerate); the
        models given are the ones whose gradient reduction waits for the boundary."""
        trained = [e for e in self._extra_engines if e.optimizer is not None]
        if not trained:
            with super().accumulate(*models):
                yield
            return
        with contextlib.ExitStack() as stack:
            for engine in (self, *trained):
                mine = [m for m in models if self._owner.get(id(m)) is engine]
                stack.enter_context(super().accumulate(*mine) if engine is self else engine.accumulate(*mine))
            self._last_engine = self
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward on the Engine(s) of the trained models whose parameters `loss` reaches.

        With several trained models the loss's graph is walked once to its parameters. One
        backward drives one Engine (under DeepSpeed one DeepSpeed engine): a loss that reaches the
        trainable parameters of two trained models is refused, naming both (freeze one for it).
        """
        trained = self._trained_engines()
        if not self._extra_engines or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return super().backward(loss, **kwargs)
        reached = reached_engines(loss, trained) or [self]
        self._last_engine = reached[0]
        if len(reached) == 1:
            engine = reached[0]
            return super().backward(loss, **kwargs) if engine is self else engine.backward(loss, **kwargs)
        raise two_trained_models([self._labels.get(id(e), "a model") for e in reached[:2]])

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> float | None:
        """`Engine.clip_grad_norm_` on the Engine of the model whose parameters are given."""
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = next((self._owner[id(m)] for m in self._owner_modules() if holds(m, given)), self)
        if engine is self:
            return super().clip_grad_norm_(given, max_norm, norm_type)
        return engine.clip_grad_norm_(given, max_norm, norm_type)

    def _owner_modules(self) -> list[torch.nn.Module]:
        return [e.unwrap_model(e.model) for e in self._extra_engines if e.model is not None]

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
        engine = self._owner.get(id(model), self)
        return super().unwrap_model(model) if engine is self else engine.unwrap_model(model)

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
        engine = self._owner.get(id(model), self)
        return (super().get_state_dict if engine is self else engine.get_state_dict)(model, **kwargs)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Consolidated weights (and the model's config) that `from_pretrained` reloads. Collective."""
        engine = self._owner.get(id(model), self)
        (self.save_pretrained if engine is self else engine.save_pretrained)(
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
        """Save everything needed to resume into `output_dir` (a ds_engine checkpoint); every model
        trained beside the first in ``model_<i>/`` inside it. Collective.

        With `ProjectConfiguration(automatic_checkpoint_naming=True)` the folder is
        ``project_dir/checkpoints/checkpoint_<iteration>`` and, once it is complete, the oldest
        complete ones beyond `total_limit` are deleted, as in accelerate (a folder that holds no
        complete saved state is never counted nor deleted). A save that fails (a full disk, say:
        an OSError on every rank naming the rank, the file and the cause) deletes nothing and
        leaves no ``checkpoint_<iteration>`` behind. Returns the folder.
        """
        return state_folders.save_state(self, output_dir, kwargs, self._extras(), self._custom_objects)

    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: Any = None, **kwargs: Any
    ) -> None:
        """Restore a `save_state` folder (under automatic naming the newest `checkpoint_<i>` that holds
        a complete saved state), every trained model's. Collective."""
        state_folders.load_state(self, input_dir, load_kwargs, kwargs, self._extras(), self._custom_objects)

    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop every prepared object (and the DeepSpeed engine) so `prepare` can start afresh."""
        from accelerate.utils import release_memory

        self.release()
        for engine in self._extra_engines:
            engine.release()
        self._extra_engines, self._last_engine = [], self
        self._owner.clear()
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
        for engine in self._extra_engines:
            engine.end_training()
        super().end_training()


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(_only_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_only_tensors(v) for v in data)
    return False
