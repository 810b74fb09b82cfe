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
import copy
import gc
import logging
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ds_engine import process_group
from ds_engine._console import quiet_console
from ds_engine._values import env_int
from ds_engine.backends import select_backend
from ds_engine.boundary import BoundaryPolicy
from ds_engine.collectives import all_gather_cat, iter_tensors, map_tensors
from ds_engine.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ds_engine.config import EngineChoices
from ds_engine.dataloader import PreparedDataLoader
from ds_engine.generation import any_gathered as _any_gathered
from ds_engine.generation import gathered as _gathered
from ds_engine.generation import generate as _generate
from ds_engine.generation import is_gathered as _is_gathered
from ds_engine.scheduler import OverflowAwareScheduler, PreparedOptimizer, is_scheduler, schedule_length
from ds_engine.step_state import StepState

_log = logging.getLogger("ds_engine")

#: Engines of this process that have not ended (`end_training`): see `ds_engine.process_group`.
_GROUP_USERS = process_group._USERS
#: Checkpoint folder (absolute) -> the Engine that saves into it (one folder per Engine).
_CHECKPOINT_DIRS: weakref.WeakValueDictionary[str, Engine] = weakref.WeakValueDictionary()

#: Environment variable `ds-engine launch --config` uses to hand a config to `Engine()`.
CONFIG_ENV = "DS_ENGINE_CONFIG"


_is_scheduler = is_scheduler  # the name callers used before `ds_engine.scheduler.is_scheduler`


class Engine:
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
        self.config: EngineConfig = self._backend.effective
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
        self._in_backward = False  # inside engine.backward (direct loss.backward() is refused)
        self._in_accumulate = False
        # when a micro-step ends a window, what a misuse of it is, when a step counts as skipped
        self._boundary = BoundaryPolicy(self.step, self._backend.user_accumulation_problem)
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
    def _loaders_in_progress(self) -> list[PreparedDataLoader]:
        """Prepared loaders being iterated, innermost last (the boundary policy's)."""
        return self._boundary.loaders_in_progress

    @_loaders_in_progress.setter
    def _loaders_in_progress(self, loaders: list[PreparedDataLoader]) -> None:
        self._boundary.loaders_in_progress = loaders

    @property
    def _trained_batch(self) -> dict[int, int]:
        """Loader id -> last batch of its pass a micro-step ran on (the boundary policy's)."""
        return self._boundary.trained_batch

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
        for cls in type(self).__mro__:
            if cls.__module__.startswith("ds_engine."):
                return cls.__name__.lower()
        return "engine"  # pragma: no cover - Engine itself is in ds_engine

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
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    # ================================================================= metrics
    def log_to(
        self,
        directory: str | os.PathLike[str],
        *,
        tensorboard: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """Log this run's metrics into `directory` (main process only; appends).

        `engine.log(...)` then writes one line per call to ``directory/metrics.jsonl`` (what
        `ds-engine plot` draws), and with `tensorboard` to ``directory/tensorboard`` too.

        Args:
            directory: Folder for the metrics (created if missing).
            tensorboard: Also log to TensorBoard (needs the `tensorboard` package).
            config: The run's hyperparameters, written to ``directory/run_config.json``.
        """
        if self._run_log is not None:
            self._run_log.close()
            self._run_log = None
        if self.is_main_process:
            from ds_engine.tracking import RunLog

            self._run_log = RunLog(directory, tensorboard=tensorboard)
            if config is not None:
                self._run_log.store_config(config)

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Log `values` (numbers, strings, one-element tensors) at `step` (main process only).

        At an accumulation boundary the Engine's own facts are added unless `values` has them:
        `lr` (the prepared scheduler's first group), `grad_norm` (pre-clip), `skipped_steps`
        and `loss_scale`. `step` defaults to the number of optimizer steps taken.

        Raises:
            RuntimeError: Before `log_to(directory)`.
        """
        if not self.is_main_process:
            return
        if self._run_log is None:
            raise RuntimeError(
                "`engine.log(...)` before `engine.log_to(directory)`: there is nowhere to write the "
                "metrics. HINT: call `engine.log_to('out/run')` once before the loop."
            )
        record = dict(values)
        if self.sync_gradients and self.num_optimizer_steps + self.num_skipped_steps > 0:
            facts: dict[str, Any] = {
                "grad_norm": self.grad_norm,
                "skipped_steps": self.num_skipped_steps,
                "loss_scale": self.loss_scale,
            }
            if self._scheduler is not None:
                facts["lr"] = self._scheduler.get_last_lr()[0]
            elif self._optimizer is not None:
                facts["lr"] = self._optimizer.param_groups[0]["lr"]
            record = {**facts, **record}
        self._run_log.log(record, step=self.num_optimizer_steps if step is None else int(step))

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. dataset caching)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
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
        if self._run_log is not None:
            self._run_log.close()
            self._run_log = None
        if self._autosaver is not None:
            self._autosaver.close()  # the previous signal handlers come back
        # `is_main_process` still answers afterwards: from the group, or the launcher's variables
        if dist.is_available() and dist.is_initialized():
            self._place_at_end = (dist.get_rank(), dist.get_world_size())
        else:
            with contextlib.suppress(ValueError):
                self._place_at_end = (
                    int(os.environ.get("RANK", "0")),
                    int(os.environ.get("WORLD_SIZE", "1")),
                )
        self.step.ended = True
        process_group.end_use(self, self._backend.destroy_process_group)

    # ================================================================= model creation
    def init_context(self) -> contextlib.AbstractContextManager[None]:
        """Create models inside this: under ZeRO-3 parameters are partitioned at creation.

        A no-op on other stages and on the fallback. transformers is told about the ZeRO-3
        config only while the context lasts, so a later plain `from_pretrained` stays plain.
        """
        self._refuse_if_ended("init_context()")
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
        blocks: dict[str, Any] = {}
        for key, value in values.items():
            block, _, rest = key.partition(".")
            if block not in ("optimizer", "scheduler") or not rest:
                raise ValueError(
                    f"Engine.fill_auto: {key!r} = {value!r} is not in the `optimizer` or `scheduler` "
                    'block; the Engine fills every other "auto" from the model, the dataloader and the '
                    "world size. HINT: pass keys like 'optimizer.params.lr'."
                )
            current = blocks.get(block, getattr(self.config, block))
            if current is None:
                continue  # no such block in the config: nothing is "auto" there
            blocks[block] = _fill_dotted(current, rest.split("."), value)
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
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        loaders = [o for o in objects if isinstance(o, DataLoader)]
        schedulers = [o for o in objects if is_scheduler(o) and not isinstance(o, torch.optim.Optimizer)]
        known = {id(o) for o in (*models, *optimizers, *loaders, *schedulers)}
        for obj in objects:
            if id(obj) not in known:
                raise TypeError(
                    f"`prepare` got a {type(obj).__name__}, which is not a model, optimizer, "
                    "DataLoader or LR scheduler. HINT: pass only those."
                )
        for kind, found in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers)):
            if len(found) > 1:
                raise ValueError(
                    f"`prepare` got {len(found)} {kind}s; ds_engine trains one model with one "
                    f"optimizer and one scheduler per Engine. HINT: use one Engine per model."
                )
        if models and self._model is not None:
            raise ValueError(
                f"`prepare` got a model ({type(models[0]).__name__}), but this Engine already prepared "
                f"one ({type(self.unwrap_model(self._model)).__name__}); an Engine holds one model, and a "
                "second would replace the first. HINT: create one Engine per model, each with its own "
                "choices (they share the process group), e.g. teacher_engine = Engine(zero_stage=3); "
                "teacher = teacher_engine.prepare(teacher)."
            )
        if schedulers and not models and not optimizers and not loaders and self._model is not None:
            return self._prepare_scheduler_alone(schedulers[0])
        if (optimizers or schedulers) and not models and self._model is None:
            raise ValueError(
                "`prepare` got an optimizer/scheduler but no model. HINT: pass the model in the "
                "same call: engine.prepare(model, optimizer, ...)."
            )
        if optimizers and not models:
            raise ValueError(
                "`prepare` got an optimizer without its model; this Engine's model was prepared in an "
                "earlier call without one (inference only). HINT: pass them in one call: "
                "engine.prepare(model, optimizer, ...)."
            )
        if models and optimizers:
            self._check_optimizer_parameters(models[0], optimizers[0])
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
                "dataloader": loaders[0] if loaders else None,
                "model": model,
                "model_parameters": self.config_optimizer_parameters,
            }
            wrapped, backend_optimizer, backend_scheduler = self._backend.prepare_model(
                model, optimizer, scheduler, facts=facts
            )
            self._model = wrapped
            self._guard_direct_backward(self.unwrap_model(wrapped))
            _guard_save_pretrained(self.unwrap_model(wrapped))
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
        if self._optimizer is None:
            raise ValueError(
                f"`{self._caller}.prepare(scheduler)`: the model was prepared without an optimizer "
                "(inference only), so there is nothing for an LR scheduler to drive. HINT: prepare "
                "the model with its optimizer first: prepare(model, optimizer), then prepare(scheduler)."
            )
        if self._scheduler is not None:
            raise ValueError(
                f"`{self._caller}.prepare(scheduler)`: a scheduler is prepared already; ds_engine trains "
                "one scheduler per Engine. HINT: prepare one scheduler only."
            )
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

    def _check_optimizer_parameters(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that holds tensors which are not the model's parameters.

        The Engine reduces, clips, partitions and saves the prepared model's parameters only:
        an optimizer built over another model (or over this one before it was re-created)
        would step parameters that never get a gradient, and DeepSpeed's ZeRO-2/3 fail on them
        deep inside. Holding only some of the model's parameters (a frozen part) is fine.
        Checked before any process group work, on every rank alike.
        """
        owned = {id(p) for p in model.parameters()}
        foreign: list[tuple[int, int, torch.Tensor]] = []
        total = 0
        for g, group in enumerate(optimizer.param_groups):
            params = group.get("params", [])
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for i, param in enumerate(params):
                total += 1
                if id(param) not in owned:
                    foreign.append((g, i, param))
        if not foreign:
            return
        g, i, first = foreign[0]
        shape = tuple(getattr(first, "ds_shape", None) or first.shape)
        which = (
            f"none of its {total} parameters is a parameter of the model"
            if len(foreign) == total
            else f"{len(foreign)} of its {total} parameters are not parameters of the model"
        )
        raise ValueError(
            f"`{self._caller}.prepare(model, optimizer)`: the optimizer ({type(optimizer).__name__}) "
            f"steps tensors the model ({type(model).__name__}) does not own: {which} (the first: "
            f"param_groups[{g}]['params'][{i}], shape {shape}). They would never get a gradient from "
            "this model (a run that counts steps and trains nothing). HINT: create the optimizer from "
            "the model you prepare, after creating it (after `init_context()` / `get_peft_model`): "
            "`torch.optim.AdamW(model.parameters(), ...)`; a tensor of your own that must train "
            "(e.g. a temperature) goes on the model: `model.temperature = torch.nn.Parameter(...)`."
        )

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
        sized_from = self.schedule_sized_from
        if sized_from not in ("auto", "prepared", "unprepared"):
            raise ValueError(
                f"`{self._caller}.schedule_sized_from = {sized_from!r}`; allowed: 'auto', 'prepared', "
                "'unprepared'. HINT: 'unprepared' when num_training_steps came from "
                "len(dataloader) before `prepare` (accelerate's scripts), else 'prepared'."
            )
        world = self.num_processes
        if world == 1:
            return 1  # both readings agree
        if sized_from != "auto":
            return world if sized_from == "unprepared" else 1
        total = schedule_length(scheduler)
        ga = self.config.gradient_accumulation_steps
        chosen, guess = self.default_schedule_reading, True
        only_chosen_fits = False  # is the length whole epochs of the reading applied, and not the other?
        if total is None:
            why = "its length is unknown"
        elif loader is None:
            why = "no dataloader was prepared"
        else:
            unprepared_len, prepared_len = len(loader.base_dataloader), len(loader)

            def fits(batches: int) -> bool:  # whole epochs of `batches / GA` optimizer steps
                per_epoch = {math.ceil(batches / ga), batches // ga} - {0}
                return any(total >= n and total % n == 0 for n in per_epoch)

            by = {"prepared": fits(prepared_len), "unprepared": fits(unprepared_len)}
            sizes = f"{unprepared_len} batches un-prepared, {prepared_len} per process, GA {ga}"
            if ga == 1:
                # a loop accumulating by hand (`loss / gas`, step every gas batches) sizes its
                # schedule as len / gas, which may look like either reading: never decide from it
                why = (
                    f"at gradient_accumulation_steps=1 its length ({total} steps; {sizes}) does not "
                    "tell (the loop may accumulate by hand, `loss / gas`, with any gas)"
                )
            else:
                if by["prepared"] != by["unprepared"]:
                    chosen, guess = ("unprepared" if by["unprepared"] else "prepared"), False
                reading = (
                    f"is whole epochs of the {chosen} dataloader only"
                    if not guess
                    else ("fits both readings" if by["prepared"] else "fits neither reading")
                )
                why = f"its length ({total} steps) {reading} ({sizes})"
            only_chosen_fits = by[chosen] and not by["unprepared" if chosen == "prepared" else "prepared"]
        if guess:
            why += f"; the default reading of {type(self).__name__}"
        per_step = world if chosen == "unprepared" else 1
        if self.is_main_process:
            # a warning where the reading applied is a guess the length does not single out
            _log.log(
                logging.WARNING if guess and not only_chosen_fits else logging.INFO,
                "ds_engine: the LR schedule is read as sized from the %s dataloader, so it advances %d "
                "time(s) per applied optimizer step on %d processes: %s. HINT: set "
                "`%s.schedule_sized_from = %r` before `prepare` for the other reading.",
                chosen,
                per_step,
                world,
                why,
                self._caller,
                "prepared" if chosen == "unprepared" else "unprepared",
            )
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
        )
        self._check_same_length_on_every_rank(prepared, index=len(self._dataloaders))
        self._dataloaders.append(prepared)
        return prepared

    def _check_same_length_on_every_rank(self, loader: PreparedDataLoader, *, index: int) -> None:
        """Refuse loaders whose length differs across ranks: one all_gather of (batches, samples).

        Every rank must take the same number of micro-steps (each one ends in collectives), and
        the sharding cuts one global sample order: a rank with more batches would wait alone in
        its next collective until the timeout. Raised on every rank alike.
        """
        world = self.num_processes
        if world == 1:
            return
        try:
            mine = [len(loader), loader.num_samples]
        except TypeError:  # no length: nothing to compare
            mine = [-1, -1]
        local = torch.tensor(mine, dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        lengths = [(int(p[0]), int(p[1])) for p in parts]
        if len(set(lengths)) == 1:
            return
        per_rank = ", ".join(
            f"rank {r}: {n} batches ({s} samples)" if n >= 0 else f"rank {r}: no length"
            for r, (n, s) in enumerate(lengths)
        )
        raise ValueError(
            f"`{self._caller}.prepare`: dataloader #{index} differs across ranks ({per_rank}); every "
            "rank must take the same number of steps, or the longer ones wait in a collective until "
            "the timeout. HINT: give every rank the same whole dataset and a plain sampler (shuffle or "
            "not): ds_engine shards it across ranks itself; do not split the data per rank or pass a "
            "rank-dependent sampler (DistributedSampler) yourself."
        )

    def _after_batch(self, loader: PreparedDataLoader, index: int) -> None:
        if self._autosaver is not None:  # `autosave`: save at this boundary if one is due
            self._autosaver.after_batch(loader, index)

    # ================================================================= the training step
    def _guard_direct_backward(self, module: torch.nn.Module) -> None:
        """Make `loss.backward()` on the prepared model's outputs stop with an error.

        A direct backward bypasses the Engine: no window scaling, no boundary, and DeepSpeed
        would divide by the configured GA (or refuse, on ZeRO-0) on its own. The forward hook
        sits on the user's module, inside DeepSpeed's / DDP's wrapper, so its gradient hooks
        run before the wrapper's own and nothing is reduced or scaled before the error.
        """

        # The hook holds the Engine weakly: DeepSpeed's engine keeps the module alive through
        # reference cycles the collector cannot see (tensor hooks), and a dropped Engine must
        # not stay alive through it (it would count as a user of the process group).
        engine_ref = weakref.ref(self)

        def check(grad: torch.Tensor) -> None:
            self = engine_ref()
            if self is None or self._in_backward:
                return
            other = any(engine._in_backward for engine in process_group.users() if engine is not self)
            trainable = any(p.requires_grad for p in module.parameters())
            if other and not trainable:
                # another Engine's backward passes through this frozen model to the one it trains
                # (a GAN's generator loss through its discriminator): no gradient lands here
                return
            if self._optimizer is None and trainable:
                raise RuntimeError(
                    "a backward pass reached the output of a model prepared without an optimizer "
                    "(inference only, e.g. a frozen teacher) whose parameters require gradients; it "
                    "has no optimizer to apply them. HINT: run it under `torch.no_grad()`, `.detach()` "
                    "its outputs, or freeze it (`model.requires_grad_(False)`), and call `backward` on "
                    "the Engine of the model you train."
                )
            if other:
                raise RuntimeError(
                    "another Engine's `backward` reached the output of this Engine's model, whose "
                    "parameters require gradients: they would get gradients outside this Engine's "
                    "accumulation. HINT: freeze it for the other model's step (`requires_grad_(False)` "
                    "before that forward, `requires_grad_(True)` after, the GAN idiom) or `.detach()` "
                    "its output."
                )
            if not self._in_backward:
                raise RuntimeError(
                    "`loss.backward()` was called on the output of a model prepared by ds_engine; it "
                    "would bypass gradient accumulation (window scaling, the boundary, the reduction "
                    "across ranks). HINT: call `engine.backward(loss)` instead."
                )

        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                for tensor in iter_tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(check)

        module.register_forward_hook(hook)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Context for one micro-step (forward + backward + optimizer/scheduler calls).

        Gradients are reduced across ranks only at an accumulation boundary; `optimizer.step()`,
        `scheduler.step()` and `optimizer.zero_grad()` inside it take effect only there.
        """
        self._refuse_if_ended("accumulate(model)")
        self._begin_micro_step()
        model = models[0] if models else self._model
        self._in_accumulate = True
        try:
            context = (
                self._backend.micro_step_context(
                    model, boundary=self.step.boundary, window_start=self.step.window_start
                )
                if model is not None
                else contextlib.nullcontext()
            )
            with context:
                yield
        finally:
            self._in_accumulate = False

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of `loss / window_length`; reduces gradients only at a boundary.

        Outside `accumulate`, each call is one micro-step of its own.

        Raises:
            TypeError: `loss` is not a tensor.
            ValueError: `loss` holds more than one value (reduce it first: `loss.mean()`), or
                does not require gradients.
            RuntimeError: No optimizer was prepared, after `end_training()`, or misuse of the
                accumulation window (the message says which).
        """
        self._refuse_if_ended("backward(loss)")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"`{self._caller}.backward(loss)` got a {type(loss).__name__} ({loss!r:.60}); it needs the "
                "loss tensor the forward computed (with its graph). HINT: pass the tensor itself, e.g. "
                "`outputs.loss`, not `loss.item()` or a float."
            )
        if loss.numel() != 1:
            raise ValueError(
                f"`{self._caller}.backward(loss)` got a loss of shape {tuple(loss.shape)} ({loss.numel()} "
                "values); backward needs a single number (a 0-dim tensor). HINT: reduce it first, e.g. "
                f"`{self._caller}.backward(loss.mean())` (per-sample or per-token losses), or pass "
                "`reduction='mean'` to the loss function."
            )
        if self._optimizer is None:
            if self._model is not None:
                raise RuntimeError(
                    "`engine.backward` on an Engine whose model was prepared without an optimizer: it is "
                    "inference only (no gradients, no optimizer state), e.g. a frozen teacher. HINT: call "
                    "`backward` on the Engine of the model you train; to train this one, prepare it with "
                    "its optimizer: engine.prepare(model, optimizer, ...)."
                )
            raise RuntimeError(
                "`engine.backward` before an optimizer was prepared. HINT: "
                "engine.prepare(model, optimizer, ...) first."
            )
        if kwargs:
            raise TypeError(
                f"`engine.backward` got unexpected arguments {sorted(kwargs)}. HINT: call "
                "`engine.backward(loss)`; the Engine scales the loss for accumulation itself."
            )
        self._refuse_training_while_gathered("engine.backward(loss)")
        if not loss.requires_grad:
            raise ValueError(
                f"`{self._caller}.backward(loss)` got a loss ({float(loss.detach()):.6g}) that does not "
                "require gradients: nothing connects it to a trained parameter (computed under "
                "`torch.no_grad()`, from `.detach()`ed outputs, or with every parameter frozen). HINT: "
                "compute the loss from the prepared model's forward with gradients enabled."
            )
        context: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if not self._in_accumulate:
            self._begin_micro_step()  # a micro-step of its own, with its own no_sync decision
            if self._model is not None:
                context = self._backend.micro_step_context(
                    self._model, boundary=self.step.boundary, window_start=self.step.window_start
                )
        else:
            self._boundary.check_second_backward()
        self.step.micro_backwards += 1
        self._in_backward = True
        try:
            with context:
                self._backend.backward(loss, scale=1.0 / self.step.window_len, boundary=self.step.boundary)
        finally:
            self._in_backward = False
        self.step.grads_pending = True

    def _refuse_training_while_gathered(self, call: str) -> None:
        """Raise inside `gathered(model)`: DeepSpeed's hooks are off and the parameters in use are
        whole copies, which ZeRO-3's backward and optimizer step would not keep consistent."""
        # per micro-step: nothing to look up unless some block is open (unwrap_model is not free
        # on the accelerate backend, which asks accelerate about DeepSpeed on every call)
        if _any_gathered() and self._model is not None and _is_gathered(self.unwrap_model(self._model)):
            raise RuntimeError(
                f"`{call}` inside `engine.gathered(model)`: the block holds the ZeRO-3 parameters "
                "whole for inference, with DeepSpeed's fetch/release hooks off; training there would "
                "leave the partitions and the gathered copies out of step. HINT: leave the block "
                "before training (it re-partitions on exit); inside it, evaluate under torch.no_grad()."
            )

    def _begin_micro_step(self) -> None:
        """Decide whether this micro-step ends an accumulation window (`BoundaryPolicy`)."""
        self._boundary.begin_micro_step(self.config.gradient_accumulation_steps)

    def _optimizer_step(self) -> None:
        self.step.refuse_if_ended("optimizer.step()")
        self._refuse_training_while_gathered("optimizer.step()")
        if not self._boundary.step_is_due(self._in_accumulate):
            return
        outcome = self._backend.optimizer_step()
        self._boundary.record_step(
            outcome.applied, outcome.grad_norm, outcome.loss_scale, self.config.max_consecutive_skipped_steps
        )

    def _zero_grad(self) -> None:
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
        configured = self.config.gradient_clipping
        if float(max_norm) != float(configured):
            raise ConfigError(
                f"`clip_grad_norm_(max_norm={max_norm})` differs from `gradient_clipping={configured}`; "
                "DeepSpeed clips with the config's value inside its step. HINT: "
                f"Engine(gradient_clipping={max_norm}, ...) and keep the two equal."
            )
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"`clip_grad_norm_(norm_type={norm_type})`: only the 2-norm is supported "
                "(DeepSpeed clips by the global 2-norm). HINT: drop `norm_type`."
            )
        self._check_clipped_parameters(parameters)
        if not self.step.boundary:
            return None
        return self._backend.clip_grad_norm_(float(max_norm))

    def _check_clipped_parameters(self, parameters: Any) -> None:
        """Refuse a parameter set other than the model's: clipping is global to every backend."""
        if self._model is None:
            raise RuntimeError(
                "`clip_grad_norm_` before `prepare`. HINT: engine.prepare(model, optimizer, ...) first."
            )
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        module = self.unwrap_model(self._model)
        every = {id(p) for p in module.parameters()}
        trained = {id(p) for p in module.parameters() if p.requires_grad}
        ids = {id(p) for p in given}
        if not trained <= ids or not ids <= every:
            raise ConfigError(
                f"`clip_grad_norm_` got {len(ids & trained)} of the model's {len(trained)} trained "
                f"parameters{' and tensors that are not its parameters' if not ids <= every else ''}; "
                "DeepSpeed clips the global norm of every trained parameter inside its step, so a "
                "subset cannot be clipped on its own. HINT: pass `model.parameters()`."
            )

    # ================================================================= utilities
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside a DeepSpeed engine / DDP / compiled wrapper."""
        model = self._backend.unwrap_model(model)
        return getattr(model, "_orig_mod", model)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast for the configured precision where the backend needs one (DeepSpeed casts itself)."""
        return self._backend.autocast()

    def gather(self, data: Any) -> Any:
        """Concatenate tensors (nested structures too) from every rank along dim 0."""
        if not self._dist("gather(...)") or dist.get_world_size() == 1:
            return data
        return map_tensors(data, all_gather_cat)

    def gather_for_metrics(self, data: Any) -> Any:
        """`gather`, minus the duplicates padded into the last batch of an epoch."""
        self._refuse_if_ended("gather_for_metrics(...)")
        gathered = self.gather(data)
        loader = self._boundary.current_loader
        if loader is None or loader.batch_index != len(loader) - 1:
            return gathered
        seen = loader.batch_index * loader.batch_size * self.num_processes
        remaining = loader.num_samples - seen
        return map_tensors(gathered, lambda t: t[:remaining] if t.dim() > 0 else t)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """All-reduce a tensor across ranks ("sum" or "mean"); returns a new tensor."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"`reduction={reduction!r}`; allowed: 'sum', 'mean'. HINT: reduction='mean'.")
        result = tensor.detach().clone()
        if self._dist("reduce(...)") and dist.get_world_size() > 1:
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                result = result / dist.get_world_size()
        return result

    # ================================================================= resumable state
    def state_dict(self) -> dict[str, Any]:
        """The Engine's own training state: step counters, scheduler, each prepared loader's position.

        What a training checkpoint stores beside the model and optimizer (torchtitan's
        `Stateful` shape); call it at a boundary, after `optimizer.step()`.
        """
        return {
            **self.step.state_dict(),
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "dataloaders": [loader.checkpoint_state() for loader in self._dataloaders],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`: prepare the same kinds of objects, in the same order, first.

        Raises:
            ValueError: the prepared scheduler / dataloaders do not match the saved ones.
        """
        scheduler, saved_scheduler = self._scheduler, state["scheduler"]
        if (scheduler is None) != (saved_scheduler is None):
            raise ValueError(
                "the checkpoint "
                + (
                    "has a scheduler state but no scheduler was prepared"
                    if scheduler is None
                    else "has no scheduler"
                )
                + ". HINT: pass the same objects to `engine.prepare` as in the run that saved it."
            )
        loaders, saved_loaders = self._dataloaders, state["dataloaders"]
        if len(loaders) != len(saved_loaders):
            raise ValueError(
                f"{len(loaders)} dataloaders are prepared but the checkpoint holds {len(saved_loaders)} "
                "positions. HINT: prepare the same dataloaders, in the same order, as the run that saved it."
            )
        self.step.load_state_dict(state)
        if scheduler is not None:
            scheduler.load_state_dict(saved_scheduler)
            scheduler.sync_optimizer_lr()
        for index, (loader, saved) in enumerate(zip(loaders, saved_loaders)):
            loader.load_checkpoint_state(saved, index=index)

    # ================================================================= saving
    def get_state_dict(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        exclude_frozen: bool = False,
        merged: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """The full state dict on rank 0, None on other ranks. Collective: call it on every rank.

        Under ZeRO-3 parameters are gathered layer by layer (rank 0 holds about one copy);
        `dtype=torch.float32` gives the fp32 master weights; `exclude_frozen` drops
        parameters with `requires_grad=False` (adapters).

        A peft `PeftModel` gives only its adapter's entries (LoRA matrices, `modules_to_save`
        copies), under `model.state_dict()`'s keys, and only those are gathered: the dict
        `PeftModel.save_pretrained(dir, state_dict=...)` takes. `merged=True` gives the base
        model's state dict with the LoRA adapters merged in instead.
        """
        self._refuse_if_ended("get_state_dict(model)")
        return self._backend.get_state_dict(model, dtype=dtype, exclude_frozen=exclude_frozen, merged=merged)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """accelerate's `save`: write `obj` to `f` on the main process only (a no-op elsewhere).

        Atomic: written to a hidden temporary sibling, fsynced and renamed into place, so `f`
        never holds a partly written file. `torch.save`, or safetensors' `save_file` when
        `safe_serialization` (then `obj` must be a dict of tensors). Not collective: any rank
        may call it; only rank 0 writes. Usable as transformers' `save_function`.
        """
        self._refuse_if_ended("save(obj, f)")
        if not self.is_main_process:
            return
        from ds_engine._io import write_file_atomic

        def write(tmp: Path) -> None:
            if safe_serialization:
                from ds_engine._safetensors import save_file

                save_file(obj, tmp, metadata={"format": "pt"})
            else:
                torch.save(obj, tmp)

        write_file_atomic(Path(os.fspath(f)), write)

    def save_pretrained(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        max_shard_size: int | str = "5GB",
        safe_serialization: bool = True,
        dtype: torch.dtype | None = None,
        exclude_frozen: bool = False,
        merged: bool = False,
    ) -> None:
        """Write a complete model folder that plain `from_pretrained` reloads. Collective.

        Rank 0 writes safetensors (sharded with an index past `max_shard_size`), the model
        config and the tokenizer into a temporary sibling and renames it into place, so a
        crash never leaves a folder that looks complete. Weights are streamed: each tensor is
        written into its shard as soon as it is gathered, while the next layer gathers, so
        rank 0 holds about two gather buckets (ZeRO-3 layers larger than a bucket arrive one
        rank's partition at a time), never a shard, let alone the model.

        A peft `PeftModel` writes only its adapter (peft's `adapter_config.json` and
        `adapter_model.safetensors`, reloaded by `PeftModel.from_pretrained(base, dir)`),
        gathering only the adapter's parameters. `merged=True` writes the base model with the
        LoRA adapters merged in, reloaded by the base class's plain `from_pretrained`.
        """
        self._refuse_if_ended("save_pretrained(model, directory)")
        self._backend.save_pretrained(
            self.unwrap_model(model),
            save_directory,
            tokenizer=tokenizer,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            dtype=dtype,
            exclude_frozen=exclude_frozen,
            merged=merged,
        )

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> None:
        """Save everything needed to resume training exactly. Collective: call it on every rank.

        Writes `directory/<tag>/`: the model and optimizer (DeepSpeed's own partitioned files, or
        full states on the fallback), the scheduler, the Engine's counters, each prepared
        dataloader's position (resuming continues at the next batch, also after a `break` out of
        the training loop; a pass nothing was trained on restarts), per-rank python / numpy /
        torch RNG states, `client_state`, the HF `config.json` and `ds_engine_meta.json`. The tag
        is written under a temporary name and renamed into place; `directory/latest` is written
        last. Call it at a boundary (right after `optimizer.step()`). The ranks must share the
        filesystem that holds `directory`.

        Args:
            directory: Checkpoint folder (created if missing); holds tags and `latest`.
            tag: Sub-folder name; default ``step_<optimizer steps taken, skipped included>``.
            client_state: Your own small state (step, epoch, ...): tensors, numbers, strings,
                None, and lists/tuples/dicts of them; returned by `load_checkpoint`.
            keep_last: Keep only the newest `keep_last` tags in `directory` (None keeps all).

        Raises:
            RuntimeError: Before `prepare`, or in the middle of an accumulation window.
            ValueError: For a bad `tag` or `keep_last`, or `directory` being a file.
            TypeError: When `client_state` holds objects that cannot be loaded without code.
        """
        from ds_engine.checkpoint import save_training_checkpoint

        self._refuse_if_ended("save_checkpoint(directory)")
        self._claim_checkpoint_directory(directory)
        save_training_checkpoint(
            directory,
            backend=self._backend,
            model=None if self._model is None else self.unwrap_model(self._model),
            state=self,
            tag=tag,
            client_state=client_state,
            keep_last=keep_last,
        )

    def _claim_checkpoint_directory(self, directory: str | os.PathLike[str]) -> None:
        """One checkpoint folder per Engine (per model); refuse an inference-only Engine.

        Tags (``step_<N>``) and `latest` live in the folder, so two Engines saving into one would
        overwrite each other's. Checked on every rank alike, before any collective.
        """
        if self._model is not None and self._optimizer is None:
            raise RuntimeError(
                "`save_checkpoint` on an Engine whose model was prepared without an optimizer "
                "(inference only): it has no training state to resume. HINT: save its weights with "
                "`engine.save_pretrained(model, directory)` (collective), or reload it as it was loaded."
            )
        key = os.path.abspath(os.fspath(directory))
        owner = _CHECKPOINT_DIRS.get(key)
        if owner is not None and owner is not self:
            del owner
            gc.collect()  # an Engine the script dropped may still sit in a reference cycle
            owner = _CHECKPOINT_DIRS.get(key)
        if owner is not None and owner is not self and not owner.step.ended:
            raise ValueError(
                f"`directory`={key!r} holds the checkpoints of another Engine of this process; two "
                "Engines in one folder would overwrite each other's tags and `latest`. HINT: give each "
                "Engine (each model) its own folder, e.g. 'ckpt/student' and 'ckpt/discriminator'."
            )
        _CHECKPOINT_DIRS[key] = self

    def load_checkpoint(self, directory: str | os.PathLike[str], *, tag: str | None = None) -> dict[str, Any]:
        """Resume from `save_checkpoint`'s folder. Collective; call it after `prepare`.

        `prepare` the same kinds of objects as the saving run (model, optimizer, dataloaders in
        the same order, scheduler). Restores everything `save_checkpoint` wrote. The number of
        ranks may differ: the fallback's states are full, and DeepSpeed's partitioned ZeRO states
        are re-partitioned through a universal checkpoint; ranks without a saved RNG state keep
        theirs (with a warning).

        Args:
            directory: The folder given to `save_checkpoint`.
            tag: The tag to load; default: the one named in `directory/latest`.

        Returns:
            The `client_state` given to `save_checkpoint` (an empty dict when none was).

        Raises:
            FileNotFoundError: A missing folder or tag (the message lists the tags found).
            ValueError: A folder that is not a checkpoint, a truncated file, or a checkpoint
                from another backend, ZeRO stage or precision (the message says what to do).
            UnsafeCheckpointError: A file asks the unpickler for something outside the
                allowlist (it could run code); the message names the file. A `ValueError`.
        """
        from ds_engine.checkpoint import load_training_checkpoint

        self._refuse_if_ended("load_checkpoint(directory)")
        return load_training_checkpoint(
            directory, backend=self._backend, model=self._model, state=self, tag=tag
        )

    def autosave(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        keep_last: int | None = None,
        signals: Iterable[str | int] | str | None = ("SIGTERM",),
        requeue: bool = False,
        client_state: Callable[[], Mapping[str, Any]] | None = None,
        agree_every: int | None = None,
    ) -> dict[str, Any] | None:
        """Resume from `directory` if it holds a checkpoint, then save there periodically and on preemption.

        Call it once on every rank, right after `prepare` and before the training loop; loop over
        epochs as ``for epoch in range(train_dl.epoch, epochs)`` so a resumed run continues its
        epoch. It loads the newest *complete* checkpoint of `directory` (exactly what
        `load_checkpoint` restores: model, optimizer, scheduler, RNG, counters, data position); a
        newer tag whose files do not match what its save recorded (truncated, missing, changed)
        is skipped with a warning naming it. Then, at optimizer boundaries of the prepared
        training dataloader (after the loop body of a batch returned, never at an epoch's last
        batch), it saves ``directory/step_<N>``: every `every_steps` optimizer steps, every
        `every_minutes` minutes (rank 0's clock), and once when one of `signals` reaches any
        rank; after that save every rank exits with status 143
        (`ds_engine.preemption.PREEMPTED_EXIT_CODE`). The ranks agree at each boundary with one
        small all_reduce; the signal handler only records the signal, so a second one during
        the save changes nothing. `end_training` puts the previous handlers back.

        Args:
            directory: The checkpoint folder (created at the first save); one per Engine.
            every_steps: Save every this many optimizer steps (skipped steps count); None: not
                by steps.
            every_minutes: Save when this many minutes passed since the last save; None: not by
                time.
            keep_last: Keep only the newest this many checkpoints (the oldest is removed only
                after the new one is complete); None keeps all.
            signals: The signals that mean "preempted" (names or numbers), e.g.
                ``("SIGTERM", "SIGUSR1")`` for Slurm's ``--signal=USR1@120``; () catches none.
            requeue: After a preemption save under Slurm, run ``scontrol requeue $SLURM_JOB_ID``.
            client_state: A function returning your own small state (same types as
                `save_checkpoint`'s), called at every save.
            agree_every: Agree across ranks every this many boundaries (1: at every one, so a
                signal is acted on at the next boundary); None: spaced by rank 0 so that the
                agreement takes at most 0.25 % of the step time, and at most 1 s apart.

        Returns:
            The resumed checkpoint's `client_state` (an empty dict when none was saved), or None
            when the run starts fresh.

        Raises:
            RuntimeError: Before `prepare`, after training began, called twice, or (with
                signals) outside the main thread.
            ValueError: A bad `every_steps`, `every_minutes`, `keep_last` or signal name.
            TypeError: `directory`, `requeue` or `client_state` of the wrong type.
        """
        from ds_engine.autosave import start_autosave

        self._refuse_if_ended("autosave(directory)")
        return start_autosave(
            self,
            directory,
            every_steps=every_steps,
            every_minutes=every_minutes,
            keep_last=keep_last,
            signals=signals,
            requeue=requeue,
            client_state=client_state,
            agree_every=agree_every,
        )

    # ================================================================= generation
    def generate(
        self, model: torch.nn.Module, *args: Any, gather: bool | None = None, **generate_kwargs: Any
    ) -> Any:
        """`model.generate(...)` on a prepared model: never hangs under ZeRO-3, fast when it fits.

        Collective for a ZeRO-3 (or FSDP) model: every rank calls it, each with its own prompts;
        ranks may stop at different lengths. `args` / `generate_kwargs` are those of Hugging
        Face `generate` and the result is its result. Runs under `torch.no_grad()` in eval mode;
        each submodule's train/eval mode is restored afterwards.

        - ZeRO 0-2 and the DDP fallback: plain `generate`.
        - ZeRO-3, gathered (fast): the whole model is gathered once, generated with no
          collective per token (each rank stops on its own), then re-partitioned.
        - ZeRO-3 (and FSDP), synced: parameters stay sharded and `synced_gpus=True` is set
          when there are several ranks, so a finished rank keeps stepping until all are done.
        - Inside `engine.gathered(model)` (ZeRO-3): no gather of its own; the gathered path on
          the parameters the block holds.

        Args:
            model: The model `prepare` returned (or the module inside it).
            gather: True / False force the gathered / synced path; None (default) gathers when
                the full parameters take at most half the memory available on every rank
                (`ds_engine.generation.GATHER_MEMORY_FRACTION`).

        Raises:
            TypeError: A bad `gather`, or a model without `generate`.
            ValueError: `gather=True` where the model cannot be gathered (FSDP), `gather=False`
                inside `gathered`, or `synced_gpus=False` on the synced path with several ranks.
        """
        self._dist("generate(...)")
        wrapper, module = self._generation_target(model)
        return _generate(wrapper, module, *args, gather=gather, **generate_kwargs)

    def gathered(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context: hold a ZeRO-3 model's parameters whole for a block, e.g. a whole evaluation loop.

        ``with engine.gathered(model):`` gathers every parameter once on entry (collective:
        every rank enters) and re-partitions on exit (also on an exception; no collective).
        Inside, `generate` skips its own gather and runs with no collective at all (ranks may
        call it different numbers of times and stop at different lengths), and plain forwards
        (``model(**batch)``) gather nothing per layer: one all-gather per block instead of one
        per `generate` call. The block needs the whole model's memory on every rank, as
        `generate(gather=True)` does. It does not change train/eval or grad mode: evaluate under
        `torch.no_grad()` (`generate` does so itself).

        Training in the block is refused: `engine.backward` and the prepared optimizer's `step`
        raise (DeepSpeed's fetch/release hooks are off and the parameters in use are gathered
        copies); train again after the block. Other gathers of the same parameters in the
        block (`get_state_dict`, `save_pretrained`) are refused by DeepSpeed; call them outside.
        A block inside a block for the same model is a no-op. ZeRO 0-2 and the DDP fallback
        (nothing partitioned): a no-op. FSDP2 shards: a no-op; `generate` inside stays synced.

        Args:
            model: The model `prepare` returned (or the module inside it).

        Raises:
            ValueError: A ZeRO-3 module whose DeepSpeed engine this Engine does not hold (a
                bare module prepared by another Engine: pass it to that Engine).
        """
        self._dist("gathered(model)")
        wrapper, module = self._generation_target(model)
        return _gathered(wrapper, module)

    def _generation_target(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the wrapper that owns DeepSpeed's hooks, the user's module) for `model`."""
        wrapper = model
        if self._model is not None and model is not self._model and self.unwrap_model(self._model) is model:
            wrapper = self._model  # the bare module: find its DeepSpeed engine
        return wrapper, self.unwrap_model(model)


def _fill_dotted(block: Mapping[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """A copy of `block` with the value at `path` set to `value` if it is "auto" there."""
    out = copy.deepcopy(dict(block))
    node: Any = out
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(path[-1]) == "auto":
        node[path[-1]] = value
    return out


def _is_partitioned(module: torch.nn.Module) -> bool:
    """Some parameter holds only this rank's shard (ZeRO-3, FSDP2): its `state_dict()` is not whole."""
    for param in module.parameters():
        if hasattr(param, "full_tensor"):  # FSDP2 DTensor
            return True
        if hasattr(param, "ds_id") and getattr(param, "ds_numel", param.numel()) != param.numel():
            return True  # ZeRO-3: the local tensor is empty outside a gather
    return False


def _save_pretrained_on_main(module: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
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
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if state_dict is None and _is_partitioned(module):
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


def _guard_save_pretrained(module: torch.nn.Module) -> None:
    """Route the prepared model's `save_pretrained` through `_save_pretrained_on_main` (per instance)."""
    import types

    if callable(getattr(type(module), "save_pretrained", None)):
        module.__dict__["save_pretrained"] = types.MethodType(_save_pretrained_on_main, module)


__all__: Sequence[str] = ("CONFIG_ENV", "Engine")
