"""The DeepSpeed backend's half of saving: reading ZeRO weights, and its checkpoint state files.

* `DeepSpeedGather` -- the `WeightGather` for a DeepSpeedEngine: ZeRO-3 partitions gathered
  per layer, the optimizer's fp32 master weights (ZeRO 1-3 through `_hp_mapping`, and the
  non-ZeRO 16-bit optimizers' own groups), offloaded partitions brought back around a gather.
* `save_deepspeed_states` / `load_deepspeed_checkpoint` -- DeepSpeed's own model + optimizer
  files inside a ds_engine tag folder; a tag of another world size is re-partitioned through a
  DeepSpeed universal checkpoint (`convert_to_universal`, cached as ``<tag>.universal``).

A separate module from `deepspeed.py` (the training half) so that each stays one concern;
DeepSpeed is imported lazily, inside functions, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ds_engine import weights
from ds_engine._io import (
    broadcast_from_rank0,
    current_rank,
    publish,
    raise_problem,
    tmp_sibling,
    world_size,
    write_failure,
    write_json,
)
from ds_engine.consolidate import consolidate_hint
from ds_engine.safety import (
    UnsafeCheckpointError,
    deepspeed_safe_globals,
    read_json_bounded,
    restricted_load,
    restricted_torch_load,
)

__all__ = [
    "UNIVERSAL_SUFFIX",
    "DeepSpeedGather",
    "checkpoint_problem",
    "convert_to_universal",
    "load_deepspeed_checkpoint",
    "load_deepspeed_states",
    "save_deepspeed_states",
]

#: A tag's universal checkpoint sits beside it as ``<tag>.universal`` (a cache, removed with it).
UNIVERSAL_SUFFIX = ".universal"
#: Inside it: the fingerprint of the tag it was converted from (`tag_fingerprint`).
UNIVERSAL_SOURCE_NAME = "ds_engine_source.json"


# =========================================================================== weights
def _is_zero3(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def _replicated_masters(ds_engine: Any) -> dict[int, torch.Tensor]:
    """id(param) -> fp32 master for DeepSpeed's non-ZeRO 16-bit optimizers (FP16_Optimizer and
    its unfused variant, used for fp16 and bf16 at ZeRO-0), whose params have no `_hp_mapping`."""
    optimizer = getattr(ds_engine, "optimizer", None)
    lp_groups = getattr(optimizer, "fp16_groups", None)
    if not lp_groups:
        return {}
    masters: dict[int, torch.Tensor] = {}
    flat_groups = getattr(optimizer, "fp32_groups_flat", None)
    if flat_groups and len(flat_groups) == len(lp_groups) and all(torch.is_tensor(t) for t in flat_groups):
        from torch._utils import _unflatten_dense_tensors

        for lp_group, flat in zip(lp_groups, flat_groups):
            for lp, hp in zip(lp_group, _unflatten_dense_tensors(flat, lp_group)):
                masters[id(lp)] = hp
        return masters
    for lp_group, hp_group in zip(lp_groups, getattr(optimizer, "fp32_groups", None) or []):
        for lp, hp in zip(lp_group, hp_group):
            masters[id(lp)] = hp
    return masters


def _master_fp32(
    tensor: torch.Tensor, ds_engine: Any, replicated: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    """The fp32 master copy the optimizer holds for `tensor` (collective), or None."""
    if ds_engine is None or getattr(ds_engine, "optimizer", None) is None or not tensor.requires_grad:
        return None
    if not _is_zero3(tensor) and not hasattr(tensor, "_hp_mapping"):
        return replicated.get(id(tensor))
    if _is_zero3(tensor) and getattr(tensor, "_z3_optimizer", None) is None:
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(tensor)


class DeepSpeedGather(weights.WeightGather):
    """Reads the weights of a model trained by `ds_engine` (a DeepSpeedEngine, or None).

    ZeRO-3 partitions are recognised on the parameters themselves, so the 16-bit weights are
    gathered without the engine; the fp32 masters need it (its optimizer holds them).
    """

    def __init__(self, ds_engine: Any = None) -> None:
        self.ds_engine = ds_engine

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        return tensor.ds_shape if _is_zero3(tensor) else tensor.shape  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def gathered(self, tensors: list[torch.Tensor]) -> Iterator[None]:
        partitioned = [t for t in tensors if _is_zero3(t)]
        if not partitioned:
            yield
            return
        import deepspeed

        # modifier_rank=None: read-only, so leaving the context re-partitions without a broadcast.
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            yield

    def pieces(self, tensor: torch.Tensor) -> Iterator[torch.Tensor | None] | None:
        """A ZeRO-3 parameter's partitions sent to rank 0 one at a time (point to point), in rank
        order: rank 0 holds one partition, never the whole tensor. None (use `gathered`) for
        anything but a plain partitioned parameter whose partition group is the whole world:
        gathered/persistent parameters, NVMe-offloaded or quantized partitions, sub-groups."""
        if not _is_zero3(tensor):
            return None
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        part = getattr(tensor, "ds_tensor", None)
        group = getattr(tensor, "ds_process_group", None)
        if (
            part is None
            or tensor.ds_status != ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
            or getattr(part, "final_location", None) is not None  # on NVMe
            or hasattr(part, "ds_quant_scale")
            or part.dtype != tensor.dtype
            or not torch.distributed.is_initialized()
            or group is None
            or torch.distributed.get_world_size(group) != torch.distributed.get_world_size()
        ):
            return None
        # group rank r holds elements [r*n, (r+1)*n) of the flattened parameter (n = the
        # partition size; the last partition is padded)
        numel, size = int(tensor.ds_numel), int(part.numel())  # type: ignore[attr-defined]
        counts = [max(0, min(size, numel - r * size)) for r in range(torch.distributed.get_world_size(group))]
        return weights.parts_to_rank0(part.detach().reshape(-1), counts, group)

    def fp32_masters(self) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        ds_engine = self.ds_engine
        if ds_engine is None:
            return None
        replicated = _replicated_masters(ds_engine)
        return lambda tensor: _master_fp32(tensor, ds_engine, replicated)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        optimizer = getattr(self.ds_engine, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "checkpoint_event_prologue"):
            optimizer.checkpoint_event_prologue()  # brings offloaded (NVMe) partitions back
        try:
            yield
        finally:
            if optimizer is not None and hasattr(optimizer, "checkpoint_event_epilogue"):
                optimizer.checkpoint_event_epilogue()


# =========================================================================== state files
def save_deepspeed_states(
    ds_engine: Any, staging_root: Path, tag: str, client_state: Mapping[str, Any]
) -> None:
    """DeepSpeed's own checkpoint of model + optimizer (+ its scheduler) into `staging_root/tag`.

    DeepSpeed's `save_checkpoint` is collective (barriers and an all_reduce around its file
    writes): a write that raised on one rank would leave the others in its barrier. So its file
    writes are recorded instead of raised (`_recorded_writes`): every rank goes through all of
    DeepSpeed's collectives, then a rank whose write failed raises an OSError naming the file
    and the cause, which the checkpointer agrees on across ranks before anyone waits again.
    """
    with _recorded_writes(ds_engine) as failures:
        ds_engine.save_checkpoint(
            str(staging_root), tag=tag, client_state=dict(client_state), save_latest=False
        )
    if failures:
        raise failures[0]


class _RecordingCheckpointEngine:
    """A DeepSpeed checkpoint engine whose `save` and `makedirs` record a failure instead of
    raising it (the partial file is removed); everything else is the wrapped engine's."""

    def __init__(self, inner: Any, failures: list[BaseException]) -> None:
        self._inner = inner
        self._failures = failures

    def save(self, state_dict: Any, path: str) -> None:
        try:
            self._inner.save(state_dict, path)
        except Exception as exc:
            _record(self._failures, exc, Path(path), "a DeepSpeed checkpoint file")
            with contextlib.suppress(OSError):
                Path(path).unlink(missing_ok=True)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self._inner.makedirs(path, exist_ok=exist_ok)
        except Exception as exc:
            _record(self._failures, exc, Path(path), "a DeepSpeed checkpoint folder")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _record(failures: list[BaseException], exc: BaseException, path: Path, what: str) -> None:
    failures.append(write_failure(exc, path, what) or exc)


@contextlib.contextmanager
def _recorded_writes(ds_engine: Any) -> Iterator[list[BaseException]]:
    """Within: `ds_engine`'s checkpoint file writes (its checkpoint engine, and the recovery
    scripts rank 0 copies beside the ZeRO files) record their failures in the yielded list."""
    failures: list[BaseException] = []
    inner = getattr(ds_engine, "checkpoint_engine", None)
    if inner is not None:
        ds_engine.checkpoint_engine = _RecordingCheckpointEngine(inner, failures)
    copy = getattr(ds_engine, "_copy_recovery_script", None)
    if callable(copy):

        def recorded_copy(save_path: str) -> None:
            try:
                copy(save_path)
            except Exception as exc:
                _record(failures, exc, Path(save_path) / "zero_to_fp32.py", "DeepSpeed's recovery script")

        ds_engine._copy_recovery_script = recorded_copy  # this instance only
    try:
        yield failures
    finally:
        if inner is not None:
            ds_engine.checkpoint_engine = inner
        if callable(copy):
            del ds_engine._copy_recovery_script  # the class's method again


def load_deepspeed_states(ds_engine: Any, root: Path, tag: str) -> dict[str, Any]:
    """Load `root/tag` with DeepSpeed (model, optimizer and partitions, its scheduler)."""
    with restricted_torch_load(deepspeed_safe_globals()):  # DeepSpeed asks for weights_only=False
        load_path, client_state = ds_engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if load_path is None:
        raise RuntimeError(
            f"DeepSpeed could not load {str(root / tag)!r} (see its log above). HINT: check that the "
            "model is the one that was saved."
        )
    return dict(client_state or {})


def checkpoint_problem(meta: Mapping[str, Any], tag_dir: Path, *, zero_stage: int, precision: str) -> str:
    """'' when a DeepSpeed tag (`meta`) loads into a run of `zero_stage` / `precision`, else why not."""
    where = str(tag_dir)
    hint = consolidate_hint(tag_dir)
    if meta["zero_stage"] != zero_stage:
        return (
            f"{where!r} was written with zero_stage={meta['zero_stage']} but this Engine runs "
            f"zero_stage={zero_stage}; ZeRO stages partition the optimizer differently. {hint}"
            f"or resume with zero_stage={meta['zero_stage']}."
        )
    if meta["precision"] != precision:
        return (
            f"{where!r} was written with precision={meta['precision']!r} but this Engine runs "
            f"precision={precision!r}. {hint}or resume with precision={meta['precision']!r}."
        )
    return ""


def _zero_partition_files(tag_dir: Path) -> list[Path]:
    return sorted(tag_dir.glob("*zero_pp_rank_*optim_states.pt"))


def needs_universal(meta: Mapping[str, Any], tag_dir: Path) -> bool:
    """True when the tag's partitioned optimizer states were cut for another world size."""
    return int(meta["world_size"]) != world_size() and bool(_zero_partition_files(tag_dir))


def load_deepspeed_checkpoint(ds_engine: Any, root: Path, tag: str, meta: Mapping[str, Any]) -> None:
    """Load the tag `root/tag` into `ds_engine` (collective), through a universal checkpoint when
    its ZeRO partitions were written by another number of ranks (rank 0 decides for all)."""
    universal = broadcast_from_rank0(needs_universal(meta, root / tag) if current_rank() == 0 else None)
    if universal:
        _load_universal(ds_engine, root, tag, meta)
    else:
        load_deepspeed_states(ds_engine, root, tag)


def tag_fingerprint(tag_dir: Path) -> dict[str, Any]:
    """What identifies the exact contents of a tag folder: the folder's and each entry's inode,
    size and modification time (ns). A tag saved again under the same name (a new folder
    published in its place, new files) differs in all of them; an untouched one in none."""

    def facts(path: Path) -> list[int]:
        info = path.lstat()
        return [info.st_ino, info.st_size, info.st_mtime_ns]

    return {
        "folder": facts(tag_dir),
        "files": {path.name: facts(path) for path in sorted(tag_dir.iterdir())},
    }


def _cached_universal(target: Path, tag_dir: Path) -> bool:
    """True when `target` is a universal checkpoint converted from the tag as it is now."""
    if target.is_symlink() or not target.is_dir():
        return False
    try:
        recorded = read_json_bounded(target / UNIVERSAL_SOURCE_NAME, "it is converted again")
    except (OSError, ValueError):
        return False  # none recorded (or junk): converted from who knows what
    if recorded != json.loads(json.dumps(tag_fingerprint(tag_dir))):
        return False
    for folder, subfolders, files in os.walk(target):  # links are never followed: convert again
        for name in subfolders + files:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return False
    return True


def convert_to_universal(tag_dir: Path) -> Path:
    """Convert a DeepSpeed ZeRO tag folder to a universal checkpoint next to it (offline, rank 0).

    The result, ``<tag>.universal`` beside the tag folder, is cached, keyed to the exact tag it
    came from (`tag_fingerprint`, recorded in it as `ds_engine_source.json`): a second resume
    on another world size reuses it, and a tag saved again under the same name (as
    `Accelerator.save_state(dir)` does with tag `state`) is converted again. Written under a
    temporary name and renamed into place.
    """
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)
    source = tag_fingerprint(tag_dir)
    if _cached_universal(target, tag_dir):  # its files are read through the restricted loader
        return target
    if target.is_symlink():
        target.unlink()  # never follow it, nor swap it into a temporary name
    tmp = tmp_sibling(target, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(tmp),
        num_extract_workers=1,  # in this process, inside the restricted scope: no worker pool
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        with (
            open(os.devnull, "w") as sink,
            contextlib.redirect_stdout(sink),  # it prints progress
            restricted_torch_load(deepspeed_safe_globals()),  # it asks for weights_only=False
        ):
            ds_to_universal(args)
        write_json(tmp / UNIVERSAL_SOURCE_NAME, source)
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _load_universal(ds_engine: Any, root: Path, tag: str, meta: Mapping[str, Any]) -> None:
    """Re-partition a ZeRO checkpoint for another world size via DeepSpeed's universal checkpoint."""
    problem: tuple[str, str] | None = None
    if current_rank() == 0:
        try:
            universal = convert_to_universal(root / tag)
            for path in sorted(universal.rglob("*.pt")):  # as `resolve_checkpoint` does for the tag
                restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
        except UnsafeCheckpointError as exc:
            problem = ("UnsafeCheckpointError", str(exc))
        except Exception as exc:  # the other ranks wait at the broadcast below
            problem = (
                "ValueError",
                f"{str(root / tag)!r} was written by {meta['world_size']} ranks and this run has "
                f"{world_size()}; converting it to a DeepSpeed universal checkpoint failed "
                f"({type(exc).__name__}: {exc}). HINT: resume on {meta['world_size']} ranks, or "
                f"`ds-engine consolidate {root} OUT --tag {tag}` and start from those weights.",
            )
    raise_problem(broadcast_from_rank0(problem))  # every rank raises rank 0's error
    config = ds_engine._config
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True  # read by DeepSpeed at load time only
    try:
        load_deepspeed_states(ds_engine, root, tag + UNIVERSAL_SUFFIX)
    finally:
        config.load_universal_checkpoint = previous
    warnings.warn(
        f"ds_engine: resumed a checkpoint of {meta['world_size']} ranks on {world_size()} through "
        "DeepSpeed's universal checkpoint (model, optimizer and schedule carried over; the data order "
        "continues by sample count; ranks without a saved RNG state keep their own).",
        stacklevel=6,  # the user's engine.load_checkpoint(...) call
    )
