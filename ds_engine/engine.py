"""The Engine facade: prepare / accumulate / backward / step bookkeeping / gather / save.

The Engine alone decides the gradient-accumulation boundary: micro-step ``k`` of a prepared
training dataloader is a boundary when ``(k + 1) % GA == 0`` or it is the loader's last
batch. Every loss is divided by the real length of its window (also for a short last
window), so the applied gradient is the mean over the window's micro-batches on every
backend. Backends (``ds_engine/backends``) only carry these decisions out; the Engine never
branches on which backend it runs.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import gc
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ds_engine import process_group, watchdog
from ds_engine._console import quiet_console
from ds_engine._values import env_int
from ds_engine.auto_stage import settle as settle_auto
from ds_engine.auto_values import filled_auto_blocks
from ds_engine.backends import Backend, select_backend
from ds_engine.boundary import BoundaryPolicy
from ds_engine.config import EngineConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ds_engine.config import EngineChoices
from ds_engine.dataloader import PreparedDataLoader, check_same_length_on_every_rank
from ds_engine.engine_env import CONFIG_ENV
from ds_engine.engine_generation import EngineGeneration
from ds_engine.engine_metrics import EngineMetrics
from ds_engine.engine_saving import EngineSaving
from ds_engine.guards import (
    caller_name,
    check_clip_arguments,
    check_clipped_parameters,
    check_optimizer_parameters,
    check_scheduler_alone,
    guard_direct_backward,
    refuse_backward,
    refuse_creation_in_main_process_first,
    sort_prepare_arguments,
    window_scale,
)
from ds_engine.micro_step import MicroStep, run_backward
from ds_engine.scheduler import OverflowAwareScheduler, PreparedOptimizer, is_scheduler, schedule_reading
from ds_engine.step_state import StepState

_log = logging.getLogger("ds_engine")

_is_scheduler = is_scheduler  # the name callers used before `ds_engine.scheduler.is_scheduler`


class Engine(EngineMetrics, EngineSaving, EngineGeneration):
    """One object for a DeepSpeed (or plain-accelerate) training loop.

    Args:
        config: an `EngineConfig`; a DeepSpeed JSON (path, preset name or dict) that the
            keyword choices merge into; or None (then the `DS_ENGINE_CONFIG` environment
            variable set by `ds-engine launch --config` is used, if any).
        backend: "auto" (DeepSpeed when installed and recent enough, else accelerate with a
            warning), "deepspeed" (ImportError with an install hint if missing) or "accelerate".
        **choices: `EngineConfig` fields, e.g. ``zero_stage=3, precision="bf16"``.

    Raises:
        ConfigError: for an unknown choice, a bad value, or a conflict with the JSON, before
            any process group is formed.
    """

    default_schedule_reading: str = "prepared"
    """What an LR schedule's length is read as sized from when `prepare` cannot tell (see there):
    "prepared" here; an accelerate-compatible subclass uses "unprepared" (accelerate's convention)."""

    def __init__(
        self,
        config: EngineConfig | str | os.PathLike[str] | Mapping[str, Any] | None = None,
        *,
        backend: str = "auto",
        **choices: Unpack[EngineChoices],
    ) -> None:
        quiet_console()  # rank 0 speaks; before DeepSpeed is imported (see ds_engine._console)
        if config is None and os.environ.get(CONFIG_ENV):
            config = os.environ[CONFIG_ENV]
        # The one resolution of this run, before any process group: every problem we can see
        # (bad or misspelt choices, unknown JSON keys, wrong types, conflicts with the JSON,
        # impossible stage/offload combinations, optimizer/scheduler blocks, the batch triangle
        # against the real world size) in one ConfigError. The backend reads the result and
        # never resolves again.
        from ds_engine.config import resolve_config

        process_group.adopt_host_group()  # a group the host formed without the launcher's variables
        world_size = env_int("WORLD_SIZE", 1, minimum=1)
        for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            env_int(name, 0)  # the launcher's variables, checked before any library reads them
        resolved = resolve_config(config, choices, world_size=world_size)
        backend_cls = select_backend(backend)
        self._backend = backend_cls(resolved)
        self.config: EngineConfig = settle_auto(self._backend)  # the fallback's "auto" is ZeRO-0
        """The effective high-level choices (after merging the JSON)."""
        unhonoured = self._backend.unhonoured_choices()
        if unhonoured:
            warnings.warn(
                "ds_engine: the accelerate fallback cannot honour these choices:\n  - "
                + "\n  - ".join(unhonoured),
                stacklevel=2,
            )

        self._run_log: Any = None  # ds_engine.tracking.RunLog once `log_to` was called (main process)
        self._autosaver: Any = None  # ds_engine.autosave.AutoSaver once `autosave` was called
        self.step = StepState()
        """Counters, the current window and the last boundary's outcome (`state_dict()`-able)."""
        self.in_backward = False
        """True while `backward` runs (a gradient reaching a prepared model's output is its own)."""
        self._in_accumulate = False
        self._in_main_process_first = False
        # when a micro-step ends a window, what a misuse of it is, when a step counts as skipped
        problem = self._backend.user_accumulation_problem
        self._boundary = BoundaryPolicy(self.step, problem, lambda: self._caller)
        self._model: torch.nn.Module | None = None
        self._optimizer: PreparedOptimizer | None = None
        self._scheduler: OverflowAwareScheduler | None = None
        self._dataloaders: list[PreparedDataLoader] = []
        self._place_at_end = (0, 1)  # (rank, world size) as `end_training` found them
        self.config_optimizer_parameters: Any = None
        """What DeepSpeed's config `optimizer` trains when `prepare` gets no torch optimizer:
        parameters or param groups (e.g. without weight decay on biases); None: the model's
        trainable parameters. accelerate's `DummyOptim(params)` sets it."""
        self.schedule_sized_from: str = "auto"
        """What a prepared LR scheduler's length was computed from: "auto", "prepared" (stepped
        once per applied optimizer step) or "unprepared" (`num_processes` times, accelerate's
        convention); read by `prepare`, see there."""

    # ================================================================= facts
    @property
    def backend_name(self) -> str:
        """ "deepspeed" or "accelerate"."""
        return self._backend.name

    @property
    def ds_config(self) -> dict[str, Any] | None:
        """The final DeepSpeed JSON after `prepare` (None on the fallback or before `prepare`)."""
        return self._backend.native_config()

    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-step is an accumulation boundary (the optimizer steps)."""
        return self.step.boundary

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps (forward/backward passes) taken so far."""
        return self.step.num_micro_steps

    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps applied so far (skipped steps not counted)."""
        return self.step.num_optimizer_steps

    @property
    def num_skipped_steps(self) -> int:
        """Optimizer steps skipped because of overflow / non-finite gradients."""
        return self.step.num_skipped_steps

    @property
    def step_was_skipped(self) -> bool:
        """True when the last boundary's optimizer step was skipped."""
        return self.step.step_was_skipped

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """accelerate's name for `step_was_skipped`."""
        return self.step.step_was_skipped

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm at the last boundary, before clipping."""
        return self.step.grad_norm

    @property
    def loss_scale(self) -> float | None:
        """Current fp16 loss scale (None without loss scaling)."""
        return self.step.loss_scale

    @property
    def has_unapplied_gradients(self) -> bool:
        """Gradients were accumulated since the last optimizer step (mid-window, or before `step()`)."""
        return self.step.grads_pending

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    @property
    def model(self) -> torch.nn.Module | None:
        """The prepared model (DeepSpeed's engine or the fallback's wrapper), or None before
        `prepare` got one (and after `release`)."""
        return self._model

    @property
    def current_loader(self) -> PreparedDataLoader | None:
        """The innermost prepared dataloader being iterated (its batch is the current
        micro-step's), or None outside every prepared loader's loop."""
        return self._boundary.current_loader

    @property
    def at_trained_batches(self) -> bool:
        """Every prepared loader being iterated is at a batch a micro-step trained on (see `boundary`)."""
        return self._boundary.at_trained_batches()

    @property
    def backend_capabilities(self) -> Backend:
        """The backend, to read the capabilities `Backend` declares; only the Engine drives it."""
        return self._backend

    @property
    def optimizer(self) -> PreparedOptimizer | None:
        """The prepared optimizer: the user's, or DeepSpeed's native one from the config."""
        return self._optimizer

    @property
    def lr_scheduler(self) -> OverflowAwareScheduler | None:
        """The prepared scheduler: the user's, or DeepSpeed's native one from the config."""
        return self._scheduler

    # ================================================================= processes
    @property
    def _ended(self) -> bool:
        """`end_training` ended this Engine's run."""
        return self.step.ended

    @property
    def _caller(self) -> str:
        """What the user's script calls this object: "engine", or "accelerator" on the accelerate surface."""
        return caller_name(type(self))

    def _refuse_if_ended(self, call: str) -> None:
        """The one error for `<caller>.<call>` after `end_training` (every backend alike)."""
        if self.step.ended:
            self.step.refuse_if_ended(f"{self._caller}.{call}")

    def ensure_process_group(self) -> bool:
        """Form (or join) this run's process group; True when there is one (False: one process
        without a group). Raises RuntimeError after `end_training`."""
        return self._dist("ensure_process_group()")

    def _dist(self, call: str | None = None) -> bool:
        """Form (or join) the process group; True when there is one. `call`: the user's call, for
        the error after `end_training` (default: the calling method's name)."""
        if self.step.ended:
            self._refuse_if_ended(call or f"{sys._getframe(1).f_code.co_name}(...)")
        process_group.use(self)  # a user of the shared process group until its `end_training`
        self._backend.setup_distributed()
        return process_group.is_initialized()

    @property
    def owns_process_group(self) -> bool:
        """True when ds_engine formed the current process group (`end_training` then destroys it);
        False for none or a group the host formed before the Engine (borrowed, never destroyed)."""
        return process_group.formed_here()

    @property
    def process_index(self) -> int:
        """Global rank of this process (after `end_training`: as it was)."""
        if self.step.ended:
            return self._place_at_end[0]
        return dist.get_rank() if self._dist("process_index") else 0

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its node."""
        if not self.step.ended:
            self._dist("local_process_index")
        return env_int("LOCAL_RANK", 0)

    @property
    def num_processes(self) -> int:
        """World size (after `end_training`: as it was)."""
        if self.step.ended:
            return self._place_at_end[1]
        return dist.get_world_size() if self._dist("num_processes") else 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def device(self) -> torch.device:
        """The device this rank trains on (from DeepSpeed's accelerator or accelerate's state)."""
        device = self._backend.device
        return torch.device("cpu") if device.type == "cpu" else device

    def wait_for_everyone(self) -> None:
        """Barrier across all processes."""
        if self._dist("wait_for_everyone()") and dist.get_world_size() > 1:
            with self._watch("wait_for_everyone"):
                dist.barrier()

    def _watch(self, call: str) -> contextlib.AbstractContextManager[None]:
        """Mark `call` for the hang watchdog (`hang_timeout_s`)."""
        dog = self._watchdog()
        return dog.watch(call, self.step.num_optimizer_steps) if dog is not None else contextlib.nullcontext()

    def _watchdog(self) -> watchdog.Watchdog | None:
        """This process's hang watchdog; None without a group of several ranks (yet)."""
        return watchdog.for_process(self.config.hang_timeout_s)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. dataset caching)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        self._in_main_process_first = True
        try:
            yield
        finally:
            self._in_main_process_first = False
        if self.is_main_process:
            self.wait_for_everyone()

    def end_training(self) -> None:
        """Wait for every process, then destroy the process group (accelerate's name).

        Call it last, after saving: afterwards every call that trains, saves or communicates
        (`backward`, `accumulate`, the prepared optimizer's `step` / `zero_grad` and scheduler's
        `step`, `prepare`, `save_checkpoint`, `load_checkpoint`, `get_state_dict`,
        `save_pretrained`, `gather`, ...) raises one RuntimeError, on every backend; the rank
        queries (`process_index`, `is_main_process`, `num_processes`, `print`) still answer, with
        the values the run had. Without it the
        process group is destroyed at interpreter exit anyway (a gloo group left to
        finalization can abort a finished run), but an explicit call ends the run at a point
        every rank agrees on.

        Several Engines in one process (one per model) share one process group: each call
        ends its own Engine, and the group is destroyed by the call that ends the last Engine
        still alive (an Engine the script no longer references does not count). Until then a
        call only waits for every process, so the other Engines keep communicating. A second
        call on the same Engine does nothing.

        A process group the host formed before the Engine (`torch.distributed.init_process_group`
        in the script, Ray Train) is borrowed: it is never destroyed here nor at exit, and stays
        usable afterwards (`owns_process_group` is False).
        """
        if self._ended:
            return
        self._end_saving()  # metrics log and autosave closed, a background save waited for
        self._place_at_end = process_group.place(self._place_at_end)  # `is_main_process` still answers
        self.step.ended = True
        with self._watch("end_training"):
            process_group.end_use(self, self._backend.destroy_process_group)
        watchdog.stop_process_watchdog() if not process_group.is_initialized() else None

    # ================================================================= model creation
    def init_context(self) -> contextlib.AbstractContextManager[None]:
        """Create models inside this: under ZeRO-3 parameters are partitioned at creation.

        A no-op on other stages and on the fallback. transformers is told about the ZeRO-3
        config only while the context lasts, so a later plain `from_pretrained` stays plain.
        """
        self._refuse_if_ended("init_context()")
        if self._in_main_process_first and self._backend.partitions_at_creation:
            refuse_creation_in_main_process_first(self._caller)
        process_group.use(self)  # ZeRO-3 forms the process group here
        return self._backend.init_context()

    def fill_auto(self, values: Mapping[str, Any]) -> None:
        """Fill "auto" values of the config's `optimizer` / `scheduler` blocks, before `prepare`.

        For a DeepSpeed JSON written for the HF Trainer or accelerate (`"lr": "auto"`) when no
        torch optimizer is passed to `prepare` (a torch optimizer's first param group fills them
        by itself). Only values that are "auto" change; others stay as written, as accelerate's
        `deepspeed_config_process(must_match=False)` does.

        Args:
            values: Dotted key -> value, e.g. `{"optimizer.params.lr": 3e-5,
                "scheduler.params.total_num_steps": 1000}`.

        Raises:
            ValueError: After the model was prepared, or a key outside the two blocks.
        """
        if self._model is not None:
            raise ValueError(
                "Engine.fill_auto: the model is prepared already and its DeepSpeed config is fixed. "
                "HINT: call fill_auto before prepare."
            )
        blocks = filled_auto_blocks(self.config, values)
        if blocks:
            self._backend.update_effective(**blocks)
            self.config = self._backend.effective

    # ================================================================= prepare
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order.

        Returns the prepared objects in the same order (a single object when one is given).
        "auto" values are filled from the real model, the first dataloader, the optimizer and
        the world size; dataloaders are sharded across ranks and move batches to `device`.

        A prepared LR scheduler advances only for applied optimizer steps. How far per step
        depends on what its length was computed from (`engine.schedule_sized_from`, set before
        `prepare`):

        - "prepared": the optimizer steps this run takes (`len(prepared_loader) / GA` per epoch):
          the scheduler's `step()` once per applied optimizer step;
        - "unprepared": the un-prepared dataloader (`len(loader) / GA` per epoch, as scripts
          written for accelerate do): `num_processes` times per applied step, accelerate's own
          convention, so the schedule ends where it would under accelerate (at 0 for a linear one);
        - "auto" (default): from the schedule's length where the scheduler exposes it
          (transformers' `get_*_schedule_with_warmup`: `num_training_steps`; torch's
          `OneCycleLR`, `CosineAnnealingLR`, `LinearLR`), compared at GA > 1 with the training
          dataloader's optimizer steps per epoch both ways: a length that is whole epochs of
          only one of them decides. Otherwise (a length that fits both, as it does whenever the
          data divides evenly and the epochs are a multiple of the processes; an unknown
          length; GA=1, where the loop may accumulate by hand) the class's
          `default_schedule_reading`: "prepared" for `Engine` (its documented convention),
          "unprepared" for the accelerate-compatible `Accelerator`. One log line on the main
          process says which reading was applied and why (a warning where it was the default).

        Raises:
            TypeError: An object that is not a model, optimizer, DataLoader or LR scheduler.
            ValueError: Two models (or optimizers, schedulers); an optimizer without its model, or
                one holding tensors that are not the model's parameters (before any process group
                work); a dataloader whose length differs across ranks (on every rank).
            RuntimeError: After `end_training()`.
        """
        self._refuse_if_ended("prepare(...)")
        models, optimizers, loaders, schedulers = sort_prepare_arguments(
            objects, None if self._model is None else type(self.unwrap_model(self._model)).__name__
        )
        if schedulers and not models and not optimizers and not loaders:
            return self._prepare_scheduler_alone(schedulers[0])
        if models and optimizers:
            check_optimizer_parameters(models[0], optimizers[0], caller=self._caller)
        if models:  # an "auto" stage/offload, decided from the model before any process group
            first = [next(iter(found), None) for found in (optimizers, loaders)]
            self.config = settle_auto(self._backend, models[0], *first)
        self._backend.setup_distributed()
        prepared: dict[int, Any] = {}
        for loader in loaders:
            prepared[id(loader)] = self._prepare_dataloader(loader)
        if models:
            model = models[0]
            optimizer = optimizers[0] if optimizers else None
            scheduler = schedulers[0] if schedulers else None
            facts = {
                "world_size": self.num_processes,
                "dataloader": prepared[id(loaders[0])].for_sizing(self.config) if loaders else None,
                "model": model,
                "model_parameters": self.config_optimizer_parameters,
            }
            wrapped, backend_optimizer, backend_scheduler = self._backend.prepare_model(
                model, optimizer, scheduler, facts=facts
            )
            self._model = wrapped
            hooks = functools.partial(self._backend.check_in_output_hooks, wrapped)
            guard_direct_backward(self, self.unwrap_model(wrapped), hooks)
            self._backend.guard_save_pretrained(self.unwrap_model(wrapped))
            prepared[id(model)] = wrapped
            if backend_optimizer is not None:
                self._optimizer = PreparedOptimizer(
                    backend_optimizer,
                    step=self._optimizer_step,
                    zero_grad=self._zero_grad,
                    step_state=self.step,
                )
                if optimizer is not None:
                    prepared[id(optimizer)] = self._optimizer
            if scheduler is not None:
                self._scheduler = self._wrap_scheduler(
                    scheduler, prepared[id(loaders[0])] if loaders else None
                )
                prepared[id(scheduler)] = self._scheduler
            elif backend_scheduler is not None:
                self._scheduler = OverflowAwareScheduler(backend_scheduler, self.step, engine_steps_it=True)
        result = tuple(prepared[id(o)] for o in objects)
        return result[0] if len(result) == 1 else result

    def _prepare_scheduler_alone(self, scheduler: Any) -> OverflowAwareScheduler:
        """`prepare(scheduler)` in a call of its own, after its model and optimizer were prepared."""
        check_scheduler_alone(self._optimizer is not None, self._scheduler is not None, caller=self._caller)
        self._scheduler = self._wrap_scheduler(scheduler)
        return self._scheduler

    def release(self) -> None:
        """Drop every prepared object so that a new `prepare` starts afresh (accelerate's `free_memory`).

        Forgets the prepared model, optimizer, scheduler and dataloaders (also loaders being
        iterated) and releases what the backend built for them (DeepSpeed's engine is destroyed);
        the process group and the step counters stay. Gradients not yet applied are discarded.
        """
        self._model, self._optimizer, self._scheduler = None, None, None
        self._dataloaders = []
        self._boundary.reset()
        self._backend.release()
        gc.collect()

    def _wrap_scheduler(
        self, scheduler: Any, loader: PreparedDataLoader | None = None
    ) -> OverflowAwareScheduler:
        """The prepared form of a user's LR scheduler; `loader`: the training dataloader (default:
        the first one prepared so far)."""
        if loader is None and self._dataloaders:
            loader = self._dataloaders[0]
        per_step = self._schedule_steps_per_optimizer_step(scheduler, loader)
        return OverflowAwareScheduler(scheduler, self.step, steps_per_optimizer_step=per_step)

    def _schedule_steps_per_optimizer_step(self, scheduler: Any, loader: PreparedDataLoader | None) -> int:
        """How many times the scheduler's `step()` runs per applied optimizer step (see `prepare`)."""
        world = self.num_processes
        sizes = None if loader is None else loader.schedule_lengths()
        per_step, level, message = schedule_reading(
            scheduler,
            sized_from=self.schedule_sized_from,
            world=world,
            ga=self.config.gradient_accumulation_steps,
            loader_lengths=sizes,
            default=self.default_schedule_reading,
            caller=self._caller,
            owner=type(self).__name__,
        )
        if message and self.is_main_process:
            _log.log(level, "%s", message)
        return per_step

    def _prepare_dataloader(self, loader: DataLoader) -> PreparedDataLoader:
        prepared = PreparedDataLoader(
            loader,
            num_replicas=self.num_processes,
            rank=self.process_index,
            device=self.device,
            on_batch=self._boundary.on_batch,
            on_end=self._boundary.on_loader_end,
            after_batch=self._after_batch,
            window=lambda: self.config.gradient_accumulation_steps,
        )
        check_same_length_on_every_rank(prepared, index=len(self._dataloaders), caller=self._caller)
        self._dataloaders.append(prepared)
        return prepared

    def _after_batch(self, loader: PreparedDataLoader, index: int) -> None:
        if self._autosaver is not None:  # `autosave`: save at this boundary if one is due
            self._autosaver.after_batch(loader, index)

    # ================================================================= the training step
    def windows(self, dataloader: PreparedDataLoader) -> Iterator[list[Any]]:
        """Each accumulation window of a prepared training loader, as the list of its batches.

        For losses weighted across a window: count its items first, then train each batch in
        order (`accumulate`, `backward(loss_sum, num_items=...)`, `step`); the windows are those
        of a plain loop over the loader (GA batches, its last window possibly shorter).
        """
        return self._boundary.windows(dataloader, self.config.gradient_accumulation_steps, self._caller)

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-step (forward + backward + optimizer/scheduler calls).

        Gradients are reduced across ranks only at an accumulation boundary; `optimizer.step()`,
        `scheduler.step()` and `optimizer.zero_grad()` inside it take effect only there.
        """
        return MicroStep(self, models[0] if models else None)

    def backward(self, loss: torch.Tensor, *, num_items: Any = None, **kwargs: Any) -> None:
        """Backward of `loss / window_length`; reduces gradients only at a boundary.

        Outside `accumulate`, each call is one micro-step of its own. With `num_items`, `loss` is a
        sum over items (e.g. label tokens, ``reduction="sum"``) and `num_items` the number of
        items in the whole window on all ranks together: the applied gradient is then the item
        mean of the window, whatever its length (see `windows`; docs/guarantees.md).

        Raises:
            TypeError: `loss` is not a tensor.
            ValueError: `loss` holds more than one value (reduce it first: `loss.mean()`), or
                does not require gradients.
            RuntimeError: No optimizer was prepared, after `end_training()`, or misuse of the
                accumulation window (the message says which).
        """
        if self.step.ended:
            self._refuse_if_ended("backward(loss)")
        if (
            kwargs
            or self._optimizer is None
            or not isinstance(loss, torch.Tensor)
            or loss.numel() != 1
            or not loss.requires_grad
        ):
            refuse_backward(  # raises, naming what is wrong
                loss, kwargs, self._caller, self._model, self._optimizer, self._refuse_training_while_gathered
            )
        self._refuse_training_while_gathered("engine.backward(loss)")
        step = self.step
        items_scale = (  # checked before this micro-step counts the call
            None
            if num_items is None
            else window_scale(num_items, step.window_len, lambda: self.num_processes, self._caller)
        )
        context: contextlib.AbstractContextManager[None] | None = None
        if not self._in_accumulate:
            self._begin_micro_step()  # a micro-step of its own, with its own no_sync decision
            if self._model is not None:
                context = self._backend.micro_step_context(
                    self._model, boundary=step.boundary, window_start=step.window_start
                )
                context.__enter__()
        else:
            self._boundary.check_second_backward()
        scale = 1.0 / step.window_len if items_scale is None else items_scale
        step.micro_backwards += 1
        run_backward(self, loss, scale, context, self._watchdog())
        step.grads_pending = True

    def _begin_micro_step(self) -> None:
        """Decide whether this micro-step ends an accumulation window (`BoundaryPolicy`)."""
        self._boundary.begin_micro_step(self.config.gradient_accumulation_steps)

    def _optimizer_step(self) -> None:
        if self.step.ended:
            self.step.refuse_if_ended("optimizer.step()")
        self._refuse_training_while_gathered("optimizer.step()")
        if not self._boundary.step_is_due(self._in_accumulate):
            return
        dog = self._watchdog()
        if dog is None:
            outcome = self._backend.optimizer_step()
        else:
            dog.enter("step", self.step.num_optimizer_steps)
            try:
                outcome = self._backend.optimizer_step()
            finally:
                dog.exit()
        self._boundary.record_step(
            outcome.applied, outcome.grad_norm, outcome.loss_scale, self.config.max_consecutive_skipped_steps
        )

    def _zero_grad(self) -> None:
        if self.step.ended:
            self.step.refuse_if_ended("optimizer.zero_grad()")
        if self._boundary.zero_grad_clears():
            self._backend.zero_grad()  # nothing accumulated since the last step: a plain clear
        # else: mid-window, or at the start of a boundary micro-step: keep accumulating

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> float | None:
        """Clip every trained parameter to `max_norm`, which must equal the config's `gradient_clipping`.

        DeepSpeed clips inside its optimizer step with the config's value, so a different
        `max_norm` would be silently ignored there; ds_engine refuses it on every backend.
        Returns the pre-clip global norm where it is known now (fallback), else None; after
        `optimizer.step()` the norm is always in `engine.grad_norm`.
        """
        self._refuse_if_ended("clip_grad_norm_(...)")
        check_clip_arguments(max_norm, norm_type, self.config.gradient_clipping)
        check_clipped_parameters(parameters, None if self._model is None else self.unwrap_model(self._model))
        if not self.step.boundary:
            return None
        with self._watch("clip_grad_norm_"):
            return self._backend.clip_grad_norm_(float(max_norm))

    # ================================================================= utilities
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside a DeepSpeed engine / DDP / compiled wrapper."""
        model = self._backend.unwrap_model(model)
        return getattr(model, "_orig_mod", model)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision where the backend needs one (DeepSpeed casts itself)."""
        return self._backend.autocast()

    # the saving collectives, marked for the hang watchdog
    get_state_dict = watchdog.watched("get_state_dict", EngineSaving.get_state_dict)
    save_pretrained = watchdog.watched("save_pretrained", EngineSaving.save_pretrained)
    save_checkpoint = watchdog.watched("save_checkpoint", EngineSaving.save_checkpoint)
    load_checkpoint = watchdog.watched("load_checkpoint", EngineSaving.load_checkpoint)


__all__: Sequence[str] = ("CONFIG_ENV", "Engine")
