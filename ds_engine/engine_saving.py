"""The Engine's saving and resuming surface: its resumable state, weights, checkpoints, autosave.

`EngineSaving` is a part of `ds_engine.engine.Engine` (a base class of it): the methods the user
calls to save and resume, each a thin front for `ds_engine.checkpoint` / the backend's weight
saving. `claim_checkpoint_folder` keeps one checkpoint folder per Engine of a process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from ds_engine.backends.base import Backend
    from ds_engine.dataloader import PreparedDataLoader
    from ds_engine.engine import Engine
    from ds_engine.scheduler import OverflowAwareScheduler, PreparedOptimizer
    from ds_engine.step_state import StepState

__all__ = ["EngineSaving", "claim_checkpoint_folder"]

#: Checkpoint folder (absolute) -> the Engine that saves into it (one folder per Engine).
_CHECKPOINT_DIRS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def claim_checkpoint_folder(engine: Any, directory: str | os.PathLike[str]) -> None:
    """`engine` saves its checkpoints into `directory`: one folder per Engine (per model); an
    inference-only Engine is refused.

    Tags (``step_<N>``) and `latest` live in the folder, so two Engines saving into one would
    overwrite each other's. Checked on every rank alike, before any collective.
    """
    if engine.model is not None and engine.optimizer is None:
        raise RuntimeError(
            "`save_checkpoint` on an Engine whose model was prepared without an optimizer "
            "(inference only): it has no training state to resume. HINT: save its weights with "
            "`engine.save_pretrained(model, directory)` (collective), or reload it as it was loaded."
        )
    key = os.path.abspath(os.fspath(directory))
    owner = _CHECKPOINT_DIRS.get(key)
    if owner is not None and owner is not engine:
        del owner
        gc.collect()  # an Engine the script dropped may still sit in a reference cycle
        owner = _CHECKPOINT_DIRS.get(key)
    if owner is not None and owner is not engine and not owner.step.ended:
        raise ValueError(
            f"`directory`={key!r} holds the checkpoints of another Engine of this process; two "
            "Engines in one folder would overwrite each other's tags and `latest`. HINT: give each "
            "Engine (each model) its own folder, e.g. 'ckpt/student' and 'ckpt/discriminator'."
        )
    _CHECKPOINT_DIRS[key] = engine


class EngineSaving:
    """The Engine's save / resume methods (see `ds_engine.engine.Engine`)."""

    if TYPE_CHECKING:  # provided by the Engine
        _backend: Backend
        _model: torch.nn.Module | None
        _optimizer: PreparedOptimizer | None
        _scheduler: OverflowAwareScheduler | None
        _dataloaders: list[PreparedDataLoader]
        _run_log: Any  # ds_engine.tracking.RunLog
        _autosaver: Any  # ds_engine.autosave.AutoSaver
        step: StepState

        @property
        def is_main_process(self) -> bool: ...

        @property
        def _caller(self) -> str: ...

        def _watch(self, call: str) -> contextlib.AbstractContextManager[None]: ...

        def _refuse_if_ended(self, call: str) -> None: ...

        def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

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
        blocking: bool = True,
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
            blocking: False returns once the state is copied to host memory; a thread writes
                the files and publishes the tag while training goes on. The next
                `save_checkpoint`, `load_checkpoint` and `end_training` wait for it and raise its
                error on every rank (docs/preemption.md, "Background saves").

        Raises:
            RuntimeError: Before `prepare`, or in the middle of an accumulation window.
            ValueError: For a bad `tag` or `keep_last`, or `directory` being a file.
            TypeError: When `client_state` holds objects that cannot be loaded without code.
        """
        from ds_engine.checkpoint import save_training_checkpoint

        self._refuse_if_ended("save_checkpoint(directory)")
        claim_checkpoint_folder(self, directory)
        save_training_checkpoint(
            directory,
            backend=self._backend,
            model=None if self._model is None else self.unwrap_model(self._model),
            state=cast("Engine", self),
            tag=tag,
            client_state=client_state,
            keep_last=keep_last,
            blocking=blocking,
        )

    def _end_saving(self) -> None:
        """At `end_training`: close the metrics log and `autosave`'s handlers, then wait for a
        background checkpoint save in flight (collective in effect) and raise its error."""
        from ds_engine.checkpoint import wait_for_checkpoint

        if self._run_log is not None:
            self._run_log.close()
            self._run_log = None
        if self._autosaver is not None:
            self._autosaver.close()  # the previous signal handlers come back
        with self._watch("end_training"):
            wait_for_checkpoint()

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
            directory, backend=self._backend, model=self._model, state=cast("Engine", self), tag=tag
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
        self._autosaver, client = start_autosave(
            cast("Engine", self),
            directory,
            caller=self._caller,
            current=self._autosaver,
            every_steps=every_steps,
            every_minutes=every_minutes,
            keep_last=keep_last,
            signals=signals,
            requeue=requeue,
            client_state=client_state,
            agree_every=agree_every,
        )
        return client
