"""Consolidated weights and `save_pretrained` for ZeRO-partitioned (and plain) models.

Entry points, all free of module-level DeepSpeed imports:

* `consolidated_state_dict` -- collective; rank 0 gets the full CPU state dict, other ranks
  None. Under ZeRO-3 it gathers one layer at a time (per submodule), so rank 0 holds about one
  copy of the weights, and it needs no DeepSpeed flag set before `initialize`.
* `save_pretrained` -- collective; gathers and writes shard by shard, so rank 0 never holds
  more than one shard plus one layer. Output is a transformers-compatible folder (safetensors,
  index, `config.json`, tokenizer) written atomically.
* `consolidate_checkpoint` -- offline (no process group): a DeepSpeed ZeRO checkpoint folder
  to a `from_pretrained` folder, loading lazily so memory stays about one copy.

* `save_training_checkpoint` / `load_training_checkpoint` -- `Engine.save_checkpoint` and
  `Engine.load_checkpoint`: resumable training state (layout and guarantees in the section
  "training checkpoints" below), including resuming on another number of ranks.

How the model config travels with a checkpoint: `consolidate_checkpoint` looks for an HF
`config.json` in the tag folder, then in the checkpoint folder, then in its parent (the
Engine writes `config.json` next to its checkpoints); `config_from=` overrides the search.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine.safety import (
    UnsafeCheckpointError,
    deepspeed_safe_globals,
    restricted_load,
    restricted_torch_load,
)

__all__ = [
    "capture_rng_state",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "convert_to_universal",
    "load_training_checkpoint",
    "parse_size",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_pretrained",
    "save_training_checkpoint",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --------------------------------------------------------------------------- sizes
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Parse a byte size such as ``"5GB"``, ``"500MB"``, ``"1GiB"`` or an int.

    Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB)
    powers of 1024, as in transformers' `max_shard_size`.

    Args:
        size: A positive int (bytes) or a string of digits followed by an optional unit.

    Returns:
        The size in bytes.

    Raises:
        ValueError: When `size` is not a positive size in a known unit.
    """
    allowed = "a positive int or digits with a unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"`max_shard_size`={size!r} is not a size; allowed: {allowed}. HINT: use '5GB'.")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE_RE.match(size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"`max_shard_size`={size!r} is not a size; allowed: {allowed}. HINT: use '500MB'."
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"`max_shard_size`={size!r} must be positive; allowed: {allowed}. HINT: use '5GB'.")
    return value


# --------------------------------------------------------------------------- process group
def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist_ready() else 0


def _broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without a process group)."""
    if not _dist_ready() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------- planning
def _is_zero3(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def _full_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.ds_shape if _is_zero3(tensor) else tensor.shape  # type: ignore[attr-defined]


@dataclass
class _Entry:
    """One state-dict key: the live parameter/buffer it reads and who owns it."""

    key: str
    tensor: torch.Tensor  # the live Parameter / buffer object (partitioned under ZeRO-3)
    owner: int  # id() of the owning submodule: entries of one owner are gathered together
    is_param: bool
    shape: torch.Size  # the full (unpartitioned) shape
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= int(dim)
        return numel * torch.empty((), dtype=self.out_dtype).element_size()


def _owners(module: nn.Module) -> dict[int, int]:
    """id(tensor) -> id(owning submodule), the first owner in `named_modules` order."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for tensor in [*sub._parameters.values(), *sub._buffers.values()]:
            if tensor is not None:
                owners.setdefault(id(tensor), id(sub))
    return owners


def _model_float_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _plan(module: nn.Module, *, dtype: torch.dtype | None, exclude_frozen: bool) -> list[_Entry]:
    """The keys `module.state_dict()` would produce, bound to their live tensors, in order.

    `state_dict(keep_vars=True)` returns the parameter and buffer objects themselves (no copy,
    and under ZeRO-3 no gather), so key names, persistent-buffer filtering, shared submodules
    and state-dict hooks all match `module.state_dict()` exactly.
    """
    live = module.state_dict(keep_vars=True)
    param_ids = {id(p) for p in module.parameters()}
    owners = _owners(module)
    entries = []
    for key, tensor in live.items():
        if not isinstance(tensor, torch.Tensor):
            continue  # e.g. `_extra_state` objects: not weights
        is_param = id(tensor) in param_ids
        if exclude_frozen and is_param and not tensor.requires_grad:
            continue
        out_dtype = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        entries.append(
            _Entry(key, tensor, owners.get(id(tensor), -1), is_param, _full_shape(tensor), out_dtype)
        )
    return entries


#: Consecutive small layers are gathered together up to this many bytes (fewer collectives); a
#: layer larger than this is gathered alone. It bounds the transient extra memory per gather.
GATHER_BUCKET_BYTES = 16 * 2**20


def _groups(entries: list[_Entry]) -> Iterator[list[_Entry]]:
    """The unit of one ZeRO-3 gather: whole submodules' entries, merged up to the bucket size."""
    layers: list[list[_Entry]] = []
    for entry in entries:
        if layers and entry.owner == layers[-1][-1].owner:
            layers[-1].append(entry)
        else:
            layers.append([entry])
    bucket: list[_Entry] = []
    size = 0
    for layer in layers:
        nbytes = sum(e.nbytes for e in layer)
        if bucket and size + nbytes > GATHER_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer)
        size += nbytes
    if bucket:
        yield bucket


# --------------------------------------------------------------------------- gathering
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


@contextlib.contextmanager
def _gathered(tensors: list[torch.Tensor]) -> Iterator[None]:
    partitioned = [t for t in tensors if _is_zero3(t)]
    if not partitioned:
        yield
        return
    import deepspeed

    # modifier_rank=None: read-only, so leaving the context re-partitions without a broadcast.
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP2 DTensor shard (collective); other tensors as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def _check_not_empty(entry: _Entry, value: torch.Tensor) -> None:
    expected = 1
    for dim in entry.shape:
        expected *= int(dim)
    if value.numel() != expected:
        raise RuntimeError(
            f"consolidating `{entry.key}` gave a tensor of {value.numel()} elements (shape "
            f"{tuple(value.shape)}) but the parameter has {expected} (shape {tuple(entry.shape)}); "
            "refusing to save an empty or partial tensor. HINT: call this on every rank (it is "
            "collective) with the unwrapped module of the live DeepSpeed engine (`engine.module`)."
        )


def _collect(
    entries: list[_Entry], *, ds_engine: Any, want_master: bool, keep: bool
) -> dict[str, torch.Tensor] | None:
    """Gather `entries` group by group; return CPU copies when `keep` (rank 0), else None.

    Every rank must call this with the same entries: the gathers are collective.
    """
    out: dict[str, torch.Tensor] | None = {} if keep else None
    done: dict[int, str] = {}  # id(live tensor) -> first key, so tied keys share one copy
    replicated = _replicated_masters(ds_engine) if want_master else {}
    for group in _groups(entries):
        masters: dict[int, torch.Tensor] = {}
        if want_master:
            for entry in group:
                if entry.is_param and id(entry.tensor) not in masters and id(entry.tensor) not in done:
                    master = _master_fp32(entry.tensor, ds_engine, replicated)
                    if master is not None:
                        masters[id(entry.tensor)] = master
        to_gather = [e.tensor for e in group if id(e.tensor) not in masters and id(e.tensor) not in done]
        with _gathered(to_gather):
            for entry in group:
                ident = id(entry.tensor)
                if ident in done:
                    if out is not None:
                        out[entry.key] = out[done[ident]]
                    continue
                value = _full(masters.get(ident, entry.tensor).detach())
                _check_not_empty(entry, value)
                if out is not None:
                    out[entry.key] = value.reshape(entry.shape).to(
                        device="cpu", dtype=entry.out_dtype, copy=True
                    )
                done[ident] = entry.key
        masters.clear()
    return out


def _prologue(ds_engine: Any) -> None:
    optimizer = getattr(ds_engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()  # brings offloaded (NVMe) partitions back


def _epilogue(ds_engine: Any) -> None:
    optimizer = getattr(ds_engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "checkpoint_event_epilogue"):
        optimizer.checkpoint_event_epilogue()


def consolidated_state_dict(
    module: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    exclude_frozen: bool = False,
    ds_engine: Any = None,
) -> dict[str, torch.Tensor] | None:
    """Collect the full state dict of `module` on rank 0 (collective: every rank calls it).

    Under ZeRO-3 the partitions are gathered one submodule at a time and copied to CPU on
    rank 0 only, so rank 0 holds about one copy of the weights plus one gather bucket (whole
    layers, up to `GATHER_BUCKET_BYTES`, or one larger layer); no DeepSpeed
    flag (`stage3_gather_16bit_weights_on_model_save`) is needed.

    Args:
        module: The unwrapped model (`ds_engine.module` for a DeepSpeedEngine).
        dtype: Dtype of floating-point tensors in the result. None keeps the training dtype
            (16-bit under fp16/bf16 training). `torch.float32` with `ds_engine` given returns
            the optimizer's fp32 master weights (parameters without a master copy, such as
            frozen ones, are cast up).
        exclude_frozen: Leave out parameters with `requires_grad=False` (buffers are kept).
        ds_engine: The DeepSpeedEngine that trains `module`; needed for fp32 master weights.

    Returns:
        On rank 0 (or without a process group) a dict with exactly the keys of
        `module.state_dict()` mapping to CPU tensors (tied keys share one tensor); None on
        other ranks.

    Raises:
        RuntimeError: When a gathered tensor does not have its parameter's full size.
    """
    entries = _plan(module, dtype=dtype, exclude_frozen=exclude_frozen)
    want_master = dtype == torch.float32 and ds_engine is not None
    _prologue(ds_engine)
    try:
        return _collect(entries, ds_engine=ds_engine, want_master=want_master, keep=_rank() == 0)
    finally:
        _epilogue(ds_engine)


# --------------------------------------------------------------------------- tied weights
def _any(module: nn.Module) -> Any:
    """`module` typed as Any, for transformers helpers annotated with `PreTrainedModel`."""
    return module


def _is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "save_pretrained") and hasattr(config, "to_dict")


def _drop_tied(module: nn.Module, entries: list[_Entry]) -> list[_Entry]:
    """Drop tied duplicates the way transformers' own `save_pretrained` does.

    For HF models transformers' `remove_tied_weights_from_state_dict` decides which alias to
    keep (it needs the `_tied_weights_keys` patterns); it is fed one small proxy tensor per
    live tensor, so aliases share storage exactly as the real weights do. Plain modules keep
    the first key of each alias group (safetensors cannot store aliases).
    """
    if not _is_hf_model(module):
        seen: set[int] = set()
        kept = []
        for entry in entries:
            if id(entry.tensor) not in seen:
                seen.add(id(entry.tensor))
                kept.append(entry)
        return kept
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    proxies: dict[int, torch.Tensor] = {}
    proxy_sd = {e.key: proxies.setdefault(id(e.tensor), torch.empty(1)) for e in entries}
    for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
        proxy_sd.pop(key, None)
    kept_keys = set(remove_tied_weights_from_state_dict(proxy_sd, _any(module)))
    return [e for e in entries if e.key in kept_keys]


def _needs_weight_conversion(module: nn.Module) -> bool:
    """True when transformers would rename/convert weights on save (e.g. fused MoE experts)."""
    if not _is_hf_model(module):
        return False
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return False
        conversions = get_model_conversion_mapping(_any(module), add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    return bool(conversions)


# --------------------------------------------------------------------------- sharding
@dataclass
class _Shard:
    filename: str
    entries: list[_Entry]


def _split(entries: list[_Entry], max_bytes: int, weights_name: str) -> list[_Shard]:
    """Split like huggingface_hub: in order, a new shard when the next tensor would overflow."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry.nbytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        return [_Shard(weights_name, shards[0])]
    stem, ext = weights_name.rsplit(".", 1)
    total = len(shards)
    return [_Shard(f"{stem}-{i + 1:05d}-of-{total:05d}.{ext}", s) for i, s in enumerate(shards)]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
        _fsync_file(path)


def _write_weights(tensors: dict[str, torch.Tensor], path: Path, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)
    _fsync_file(path)


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _fsync_file(path)


# --------------------------------------------------------------------------- atomic folder
def _tmp_sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}"


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished `tmp` folder to `target`, replacing an existing one safely."""
    for path in tmp.rglob("*"):
        if path.is_file():
            _fsync_file(path)
    _fsync_dir(tmp)
    if target.exists():
        if _exchange(tmp, target):  # one atomic swap: the final name always holds a whole folder
            shutil.rmtree(tmp, ignore_errors=True)  # `tmp` now holds the old folder
        else:  # no renameat2: two renames, and the old folder is put back if the second fails
            old = _tmp_sibling(target, "old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    _fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return bool(result == 0)


def _preflight(save_directory: Path, module: nn.Module | None, tokenizer: Any) -> str:
    """'' when saving can start, else the error message (checked before any collective)."""
    if save_directory.exists() and not save_directory.is_dir():
        return (
            f"`save_directory`={str(save_directory)!r} is a file, not a directory. "
            "HINT: pass a directory path (it is created, or replaced atomically if it exists)."
        )
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        return (
            f"`tokenizer` of type {type(tokenizer).__name__} has no `save_pretrained`; allowed: a "
            "transformers tokenizer or processor. HINT: pass the tokenizer from AutoTokenizer."
        )
    if tokenizer is not None and module is not None and not _is_hf_model(module):
        return (
            f"`tokenizer` was given but the model ({type(module).__name__}) is not a transformers "
            "model (no `config`), so the folder could not be loaded with from_pretrained anyway. "
            "HINT: save the tokenizer separately with `tokenizer.save_pretrained(dir)`."
        )
    return ""


def _save_hf_config(module: nn.Module, directory: Path, weights_dtype: torch.dtype | None) -> None:
    config: Any = copy.deepcopy(module.config)  # do not touch the live model's config
    config.architectures = [type(module).__name__]
    if weights_dtype is not None:
        config.dtype = str(weights_dtype).split(".")[-1]
    config.save_pretrained(str(directory))
    can_generate = getattr(module, "can_generate", None)
    generation_config = getattr(module, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(str(directory))


def _check_given_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    shapes = {name: _full_shape(p) for name, p in module.named_parameters(remove_duplicate=False)}
    for key, value in state_dict.items():
        if key in shapes and shapes[key].numel() > 0 and value.numel() == 0:
            raise RuntimeError(
                f"`state_dict[{key!r}]` has 0 elements but the model parameter has shape "
                f"{tuple(shapes[key])}; refusing to write an empty tensor (under ZeRO-3 "
                "`module.state_dict()` returns empty partitions). HINT: leave `state_dict=None` "
                "so save_pretrained gathers the weights itself."
            )


def save_pretrained(
    module: nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    ds_engine: Any = None,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    dtype: torch.dtype | None = None,
    exclude_frozen: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write `module` as a `from_pretrained` folder (collective: every rank calls it).

    Weights are gathered and written shard by shard: under ZeRO-3 rank 0 never holds more
    than one shard plus one layer. Rank 0 writes safetensors (`model.safetensors`, or
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` past
    `max_shard_size`), `config.json` (and `generation_config.json`) for transformers models,
    and the tokenizer. Tied duplicates are dropped as transformers' `save_pretrained` drops
    them. Everything goes into a hidden sibling folder `.<name>.tmp-<pid>` first, is fsynced,
    then renamed over `save_directory` (an existing folder is moved aside, replaced, then
    deleted), so a crash never leaves a folder that looks complete.

    Args:
        module: The unwrapped model (`ds_engine.module` for a DeepSpeedEngine); a transformers
            `PreTrainedModel` or any `nn.Module` (then only weights are written).
        save_directory: Target folder; created, or replaced atomically.
        ds_engine: The DeepSpeedEngine training `module`; needed for fp32 master weights.
        tokenizer: Optional tokenizer saved with `tokenizer.save_pretrained` (HF models only).
        max_shard_size: Largest shard, e.g. "5GB", "500MB", "1GiB" or bytes.
        safe_serialization: safetensors (True) or `pytorch_model.bin` via torch.save (False).
        dtype: As in `consolidated_state_dict` (None: the training dtype).
        exclude_frozen: Leave out parameters with `requires_grad=False`.
        state_dict: Write this (rank 0's) dict instead of gathering the weights.

    Raises:
        ValueError: For a bad `max_shard_size`, a `save_directory` that is a file, or a
            tokenizer that cannot be saved with this model.
        RuntimeError: When a tensor would be written empty, or rank 0 failed to write.
    """
    max_bytes = parse_size(max_shard_size)
    target = Path(save_directory).absolute()
    rank = _rank()
    problem = _broadcast_from_rank0(_preflight(target, module, tokenizer) if rank == 0 else None)
    if problem:
        raise ValueError(problem)

    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
    is_hf = _is_hf_model(module)
    tmp = _tmp_sibling(target, "tmp")
    error: BaseException | None = None

    def on_rank0(step: Any, *args: Any) -> None:
        # rank 0 keeps taking part in the collectives after a write error, so no rank hangs;
        # the error is re-raised on every rank at the end.
        nonlocal error
        if rank == 0 and error is None:
            try:
                step(*args)
            except BaseException as exc:  # re-raised below on every rank
                error = exc

    def start() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    on_rank0(start)
    shards: list[_Shard] = []
    saved_dtype = dtype

    def write_given(given: Mapping[str, torch.Tensor] | None, cast: torch.dtype | None) -> None:
        if given is not None:
            shards.extend(
                _write_given_state_dict(module, given, tmp, weights_name, max_bytes, safe_serialization, cast)
            )

    try:
        if state_dict is not None:
            on_rank0(write_given, state_dict, dtype)
        else:
            entries = _plan(module, dtype=dtype, exclude_frozen=exclude_frozen)
            want_master = dtype == torch.float32 and ds_engine is not None
            saved_dtype = dtype or _model_float_dtype(module)
            _prologue(ds_engine)
            try:
                if _needs_weight_conversion(module):
                    # transformers renames/fuses some weights on save (many-to-one across layers),
                    # so the whole dict is needed at once: gather it, then let transformers revert
                    # the mapping. This path holds one full copy on rank 0 (like transformers).
                    from transformers.core_model_loading import revert_weight_conversion

                    full = _collect(entries, ds_engine=ds_engine, want_master=want_master, keep=rank == 0)
                    if full is not None:
                        on_rank0(write_given, revert_weight_conversion(_any(module), full), None)
                    del full
                else:
                    shards = _split(_drop_tied(module, entries), max_bytes, weights_name)
                    for shard in shards:
                        keep = rank == 0 and error is None
                        tensors = _collect(
                            shard.entries, ds_engine=ds_engine, want_master=want_master, keep=keep
                        )
                        if tensors is not None:
                            on_rank0(_write_weights, tensors, tmp / shard.filename, safe_serialization)
                        del tensors
            finally:
                _epilogue(ds_engine)
    except BaseException:
        # raised on every rank alike (e.g. an empty gathered tensor): no half-written folder
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finish() -> None:
        if len(shards) > 1:
            weight_map = {e.key: s.filename for s in shards for e in s.entries}
            metadata: dict[str, Any] = {"total_size": sum(e.nbytes for s in shards for e in s.entries)}
            if is_hf:
                metadata["total_parameters"] = sum(_full_shape(p).numel() for p in module.parameters())
            _write_json(tmp / index_name, {"metadata": metadata, "weight_map": weight_map})
        if is_hf:
            _save_hf_config(module, tmp, saved_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _publish(tmp, target)

    on_rank0(finish)
    if rank == 0 and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    failure = _broadcast_from_rank0(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"rank 0 failed to write {str(target)!r}: {failure}")


def _write_given_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    tmp: Path,
    weights_name: str,
    max_bytes: int,
    safe_serialization: bool,
    dtype: torch.dtype | None,
) -> list[_Shard]:
    """Shard and write an already-consolidated dict (rank 0 only); returns the shard plan."""
    _check_given_state_dict(module, state_dict)
    if _is_hf_model(module):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        given = dict(state_dict)
        for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
            given.pop(key, None)
        state_dict = remove_tied_weights_from_state_dict(given, _any(module))
    entries = []
    for key, value in state_dict.items():
        out_dtype = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
        entries.append(_Entry(key, value, 0, False, value.shape, out_dtype))
    if not _is_hf_model(module):
        entries = _drop_aliases(entries)
    shards = _split(entries, max_bytes, weights_name)
    for shard in shards:
        tensors = {
            e.key: e.tensor.detach().to(device="cpu", dtype=e.out_dtype).contiguous() for e in shard.entries
        }
        _write_weights(tensors, tmp / shard.filename, safe_serialization)
    return shards


def _drop_aliases(entries: list[_Entry]) -> list[_Entry]:
    """Keep the first key of each group of tensors sharing storage (safetensors refuses aliases)."""
    seen: set[tuple[Any, ...]] = set()
    kept = []
    for entry in entries:
        t = entry.tensor
        ident = (
            (t.device, t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (None, id(t), 0)
        )
        if ident not in seen:
            seen.add(ident)
            kept.append(entry)
    return kept


# --------------------------------------------------------------------------- offline
def _listing(path: Path, limit: int = 12) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def _resolve_tag(checkpoint_dir: Path, tag: str | None) -> tuple[str, Path]:
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(checkpoint_dir)!r} does not exist (or is not a folder). "
            "HINT: pass the folder given to `save_checkpoint` (the one holding `latest`)."
        )
    if tag is None:
        latest = checkpoint_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(
                f"{str(checkpoint_dir)!r} has no `latest` file, so no tag to consolidate; found: "
                f"{_listing(checkpoint_dir)}. HINT: pass `--tag TAG` (a sub-folder name) or the "
                "folder given to `save_checkpoint`."
            )
        tag = latest.read_text().strip()
    tag_dir = checkpoint_dir / tag
    if not tag_dir.is_dir():
        tags = [p.name for p in checkpoint_dir.iterdir() if p.is_dir()]
        raise FileNotFoundError(
            f"tag {tag!r} not found in {str(checkpoint_dir)!r}; tags found: {sorted(tags) or 'none'}. "
            "HINT: pass one of them with `--tag`."
        )
    if not list(tag_dir.glob("*model_states.pt")):
        raise ValueError(
            f"{str(tag_dir)!r} is not a DeepSpeed checkpoint (no `*model_states.pt`); found: "
            f"{_listing(tag_dir)}. HINT: point at a folder written by `engine.save_checkpoint`."
        )
    return tag, tag_dir


def _find_config(
    checkpoint_dir: Path, tag_dir: Path, config_from: str | os.PathLike[str] | None
) -> Path | None:
    if config_from is not None:
        path = Path(config_from)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"`config_from`={str(config_from)!r} holds no `config.json`. "
                "HINT: pass the folder of the original model (the one given to from_pretrained)."
            )
        return path
    for folder in (tag_dir, checkpoint_dir, checkpoint_dir.parent):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def _load_zero0_module(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full module state dict a ZeRO-0 checkpoint stores in its model-states file."""
    path = sorted(tag_dir.glob("*model_states.pt"))[0]
    state = restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
    module = state.get("module") if isinstance(state, dict) else None
    if not isinstance(module, dict):
        raise ValueError(f"{str(path)!r} holds no `module` state dict. HINT: is this a DeepSpeed checkpoint?")
    return module


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "5GB",
    config_from: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True,
) -> Path:
    """Turn a DeepSpeed ZeRO checkpoint into a `from_pretrained` folder, offline.

    No process group is needed. The fp32 master weights are read with DeepSpeed's own
    `zero_to_fp32` reader in lazy mode and materialised one shard at a time, so memory stays
    about one copy of the weights. ZeRO-0 checkpoints (no partitions) are read from their
    model-states file. The HF `config.json` (and `generation_config.json`) is taken from
    `config_from`, else from the tag folder, the checkpoint folder, or its parent, in that
    order; without one only the weights are written.

    Args:
        checkpoint_dir: The folder given to `save_checkpoint` (holds `latest` and tag folders).
        output_dir: Target folder; created, or replaced atomically.
        tag: Tag folder to read; default: the one named in `latest`.
        dtype: Output dtype of floating-point tensors: a torch dtype or "fp32", "bf16", "fp16".
        max_shard_size: Largest shard, e.g. "5GB".
        config_from: A folder (or file) holding the model's `config.json`.
        safe_serialization: safetensors (True) or `pytorch_model.bin` (False).

    Returns:
        The output folder.

    Raises:
        FileNotFoundError: Missing checkpoint folder, `latest` file, tag or config.
        UnsafeCheckpointError: A checkpoint file asks the unpickler for something outside the
            allowlist (`ds_engine.safety`); names the file. Nothing of the file's choosing ran.
        ValueError: A folder that is not a DeepSpeed checkpoint, a truncated or corrupt file
            (named), or a bad dtype / shard size.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(
                f"`dtype`={dtype!r} is not allowed; allowed: {sorted(_DTYPES)}. HINT: use 'fp32'."
            )
        dtype = _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"`dtype`={dtype} is not allowed; allowed: torch.float32, bfloat16, float16.")
    max_bytes = parse_size(max_shard_size)
    checkpoint = Path(checkpoint_dir).absolute()
    target = Path(output_dir).absolute()
    tag, tag_dir = _resolve_tag(checkpoint, tag)
    config_path = _find_config(checkpoint, tag_dir, config_from)
    problem = _preflight(target, None, None)
    if problem:
        raise ValueError(problem)

    if list(tag_dir.glob("*optim_states.pt")) and _zero_stage(tag_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with restricted_torch_load(deepspeed_safe_globals()):  # it asks for weights_only=False
            lazy: dict[str, Any] = get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint), tag=tag, lazy_mode=True
            )
    else:
        lazy = _load_zero0_module(tag_dir)

    entries = []
    seen: set[int] = set()
    for key, value in lazy.items():
        if id(value) in seen:  # tied weights: DeepSpeed lists the alias after its source
            continue
        seen.add(id(value))
        out_dtype = dtype if value.dtype.is_floating_point else value.dtype
        entries.append(_Entry(key, value, 0, True, torch.Size(value.shape), out_dtype))
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    shards = _split(entries, max_bytes, weights_name)

    tmp = _tmp_sibling(target, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for shard in shards:
            tensors = {}
            for entry in shard.entries:
                tensors[entry.key] = entry.tensor.contiguous().to(dtype=entry.out_dtype)
                _check_not_empty(entry, tensors[entry.key])
            _write_weights(tensors, tmp / shard.filename, safe_serialization)
            del tensors
        if len(shards) > 1:
            index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
            weight_map = {e.key: s.filename for s in shards for e in s.entries}
            total = sum(e.nbytes for s in shards for e in s.entries)
            _write_json(tmp / index_name, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if config_path is not None:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["dtype"] = str(dtype).split(".")[-1]
            config.pop("torch_dtype", None)
            _write_json(tmp / "config.json", config)
            generation = config_path.parent / "generation_config.json"
            if generation.is_file():
                shutil.copyfile(generation, tmp / generation.name)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _zero_stage(tag_dir: Path) -> int:
    """The ZeRO stage the first optimizer-states file records (0 when it records none).

    Raises:
        UnsafeCheckpointError: The file asks for something outside the allowlist.
        ValueError: The file is truncated, corrupt, or holds no optimizer state: never taken
            for ZeRO-0, whose model-states file would then be read as the whole model.
    """
    path = sorted(tag_dir.glob("*optim_states.pt"))[0]
    state = restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
    optim = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(optim, dict):
        raise ValueError(
            f"checkpoint file {str(path)!r} holds no `optimizer_state_dict` (found "
            f"{sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__}), so its ZeRO "
            "stage is unknown. HINT: point at a folder written by DeepSpeed's `save_checkpoint`, or "
            "remove the stray file."
        )
    return int(optim.get("zero_stage", 0))


# =========================================================================== training checkpoints
# A training checkpoint is a folder `directory/` holding one sub-folder per tag and a `latest`
# file naming the newest tag:
#
#   directory/latest                      the newest tag (written last, atomically)
#   directory/<tag>/ds_engine_meta.json   backend, ZeRO stage, world size, precision, versions
#   directory/<tag>/engine_state.pt       counters, scheduler, dataloader positions, client_state
#   directory/<tag>/rng_state_rank<R>.pt  python / numpy / torch RNG of rank R
#   directory/<tag>/config.json           the model's HF config (so `ds-engine consolidate` finds it)
#   directory/<tag>/...                   DeepSpeed's own files (`mp_rank_00_model_states.pt`,
#                                         `*zero_pp_rank_*_optim_states.pt`), or on the fallback
#                                         `model_states.pt` + `optimizer_states.pt` (full states)
#
# A tag is written into `directory/.<tag>.tmp/<tag>` by every rank, then rank 0 renames it into
# place after a barrier, so a crash never leaves a tag folder that looks complete. This assumes
# the ranks share a filesystem (as DeepSpeed's own `latest` file does). Every file is read by
# torch's weights-only unpickler with an explicit allowlist (`ds_engine.safety`): ds_engine's
# own files directly, DeepSpeed's by DeepSpeed's loader inside `restricted_torch_load`.

CHECKPOINT_META_NAME = "ds_engine_meta.json"
ENGINE_STATE_NAME = "engine_state.pt"
FALLBACK_MODEL_NAME = "model_states.pt"
FALLBACK_OPTIMIZER_NAME = "optimizer_states.pt"
LATEST_NAME = "latest"
CHECKPOINT_FORMAT = 1
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


def rng_state_name(rank: int) -> str:
    """File name of rank `rank`'s RNG state inside a tag folder."""
    return f"rng_state_rank{rank}.pt"


def _world() -> int:
    return torch.distributed.get_world_size() if _dist_ready() else 1


def _barrier() -> None:
    if _dist_ready() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _raise_problem(problem: tuple[str, str] | None) -> None:
    """Raise `problem` = (exception kind, message), the same on every rank that got it."""
    if problem:
        kind, message = problem
        kinds = {
            "FileNotFoundError": FileNotFoundError,
            "RuntimeError": RuntimeError,
            "UnsafeCheckpointError": UnsafeCheckpointError,
        }
        raise kinds.get(kind, ValueError)(message)


# --------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (and CUDA) RNG states, as weights-only-safe types."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np = None  # type: ignore[assignment]
    if np is not None:
        numpy_state = np.random.get_state(legacy=False)
        assert isinstance(numpy_state, dict)
        # numpy arrays need an allowlist under weights_only; a tensor of the same words does not
        state["numpy"] = {
            "bit_generator": str(numpy_state["bit_generator"]),
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    import random

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": saved["bit_generator"],
                "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
                "has_gauss": saved["has_gauss"],
                "gauss": saved["gauss"],
            }
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- small safe files
def _save_safe(obj: Any, path: Path, what: str) -> None:
    """`torch.save`, then prove the file loads with `weights_only=True` (no code on load)."""
    try:
        torch.save(obj, path)
        torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError, RuntimeError) as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        detail = next((line.split("error: ")[-1] for line in lines if "Unsupported global" in line), lines[0])
        raise TypeError(
            f"{what} holds an object that cannot be loaded without running code ({detail}); allowed: "
            "tensors, numbers, strings, None, and lists/tuples/dicts of them. HINT: convert it (e.g. "
            "numpy arrays to tensors, objects to dicts) before `save_checkpoint`."
        ) from None
    _fsync_file(path)


def _load_safe(path: Path) -> Any:
    """One of ds_engine's own files: tensors and plain containers only (`_save_safe` proved it)."""
    return restricted_load(path, hint="load an older tag with `tag=...`")


# --------------------------------------------------------------------------- engine state
def _engine_state(engine: Any, client_state: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"format": CHECKPOINT_FORMAT, **engine.state_dict(), "client_state": dict(client_state or {})}


# --------------------------------------------------------------------------- metadata
def _checkpoint_meta(engine: Any, tag: str) -> dict[str, Any]:
    import time

    from ds_engine import __version__
    from ds_engine._imports import deepspeed_version

    backend = engine.backend_name
    deepspeed = deepspeed_version() if backend == "deepspeed" else None
    return {
        "format": CHECKPOINT_FORMAT,
        "tag": tag,
        "backend": backend,
        "zero_stage": int(engine.config.zero_stage) if backend == "deepspeed" else None,
        "world_size": _world(),
        "precision": engine.config.precision,
        "gradient_accumulation_steps": int(engine.config.gradient_accumulation_steps),
        "num_optimizer_steps": int(engine.num_optimizer_steps),
        "ds_engine_version": __version__,
        "torch_version": torch.__version__,
        "deepspeed_version": None if deepspeed is None else str(deepspeed),
        "saved_at": time.time(),
    }


def _check_tag_name(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST_NAME or tag.endswith(".tmp"):
        raise ValueError(
            f"`tag`={tag!r} is not a usable tag; allowed: letters, digits and _ . + = - (not starting "
            f"with '.' or '-', not {LATEST_NAME!r}, no '/'). HINT: use tag='step_100'."
        )


def _tags(directory: Path) -> list[str]:
    """Sub-folders of `directory` that are ds_engine checkpoint tags, oldest first."""
    found = []
    for sub in directory.iterdir() if directory.is_dir() else ():
        meta = sub / CHECKPOINT_META_NAME
        if sub.is_dir() and not sub.name.startswith(".") and meta.is_file():
            try:
                saved_at = float(json.loads(meta.read_text(encoding="utf-8")).get("saved_at", 0.0))
            except (OSError, ValueError):
                saved_at = 0.0
            found.append((saved_at, sub.name))
    return [name for _, name in sorted(found)]


# --------------------------------------------------------------------------- save
def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_training_checkpoint(
    engine: Any,
    directory: str | os.PathLike[str],
    *,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write a resumable checkpoint of `engine` (collective: every rank calls it).

    See `Engine.save_checkpoint` for the contract; this is its implementation.

    Returns:
        The published tag folder, ``directory/<tag>``.
    """
    if engine._model is None:
        raise RuntimeError(
            "`save_checkpoint` before `prepare`: there is no model to save. HINT: call "
            "`engine.prepare(model, optimizer, ...)` first."
        )
    if not engine.sync_gradients or engine.has_unapplied_gradients:
        raise RuntimeError(
            f"`save_checkpoint` in the middle of an accumulation window (micro-step "
            f"{engine.num_micro_steps}, GA={engine.gradient_accumulation_steps}): the gradients "
            "accumulated so far are not saved. HINT: save right after `optimizer.step()` at a boundary, "
            "i.e. when `engine.sync_gradients` is True."
        )
    if tag is None:
        tag = f"step_{engine.num_optimizer_steps + engine.num_skipped_steps}"
    _check_tag_name(tag)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"`keep_last`={keep_last!r} must be a positive int or None (keep all). HINT: keep_last=3."
        )
    target_root = Path(directory).absolute()
    rank = _rank()
    problem = None
    if rank == 0 and target_root.exists() and not target_root.is_dir():
        problem = (
            "ValueError",
            f"`directory`={str(target_root)!r} is a file, not a folder. HINT: pass a folder path "
            "(created if missing).",
        )
    _raise_problem(_broadcast_from_rank0(problem))

    staging_root = target_root / f".{tag}.tmp"
    staging = staging_root / tag
    if rank == 0:
        shutil.rmtree(staging_root, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    error: BaseException | None = None
    try:
        engine._backend.save_checkpoint(staging_root, tag, {})
        _save_safe(capture_rng_state(), staging / rng_state_name(rank), "the RNG state")
        if rank == 0:
            _save_safe(_engine_state(engine, client_state), staging / ENGINE_STATE_NAME, "`client_state`")
            module = engine.unwrap_model(engine._model)
            if _is_hf_model(module):
                _save_hf_config(module, staging, None)
            _write_json(staging / CHECKPOINT_META_NAME, _checkpoint_meta(engine, tag))
    except BaseException as exc:  # every rank must still reach the barrier below
        error = exc
    failed = _any_rank_failed(error is not None)
    if not failed:
        _barrier()
        if rank == 0:
            try:
                _publish(staging, target_root / tag)
                shutil.rmtree(staging_root, ignore_errors=True)
                _write_text_atomic(target_root / LATEST_NAME, tag)
                if keep_last is not None:
                    for old in _tags(target_root)[:-keep_last]:
                        if old != tag:
                            shutil.rmtree(target_root / old, ignore_errors=True)
                            shutil.rmtree(target_root / (old + UNIVERSAL_SUFFIX), ignore_errors=True)
            except BaseException as exc:
                error = exc
        failed = _any_rank_failed(error is not None)
    if failed:
        if rank == 0:
            shutil.rmtree(staging_root, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(
            f"another rank failed while writing checkpoint {str(target_root / tag)!r}; nothing was "
            "published. HINT: see that rank's error above."
        )
    return target_root / tag


def _any_rank_failed(failed: bool) -> bool:
    if not _dist_ready() or torch.distributed.get_world_size() == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":  # pragma: no cover - GPU runs
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


# --------------------------------------------------------------------------- load
def _read_meta(tag_dir: Path) -> dict[str, Any]:
    path = tag_dir / CHECKPOINT_META_NAME
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(
            f"checkpoint file {str(path)!r} is not valid JSON ({exc}). HINT: the file is truncated or "
            "corrupt; load an older tag with `tag=...`."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{str(path)!r} has format {meta.get('format') if isinstance(meta, dict) else meta!r}; this "
            f"ds_engine reads format {CHECKPOINT_FORMAT}. HINT: load it with the ds_engine version that "
            "wrote it."
        )
    return meta


def resolve_checkpoint(
    directory: str | os.PathLike[str], tag: str | None = None
) -> tuple[str, Path, dict[str, Any]]:
    """Find and check a tag of a ds_engine training checkpoint (no process group needed).

    Args:
        directory: The folder given to `save_checkpoint`.
        tag: A tag in it; default: the one named in its `latest` file.

    Returns:
        (tag, tag folder, the tag's metadata).

    Raises:
        FileNotFoundError: The folder, its `latest` file, or the tag does not exist.
        ValueError: The folder is not a ds_engine checkpoint, or a file in it is truncated.
    """
    root = Path(directory).absolute()
    if not root.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(root)!r} does not exist (or is not a folder). HINT: pass the "
            "folder given to `engine.save_checkpoint`."
        )
    tags = _tags(root)
    if tag is None:
        latest = root / LATEST_NAME
        if not latest.is_file():
            if (root / CHECKPOINT_META_NAME).is_file():
                raise ValueError(
                    f"{str(root)!r} is a tag folder, not a checkpoint folder. HINT: pass its parent "
                    f"{str(root.parent)!r} with tag={root.name!r}."
                )
            raise ValueError(
                f"{str(root)!r} is not a ds_engine checkpoint: no `{LATEST_NAME}` file; found: "
                f"{_listing(root)}. HINT: pass the folder given to `engine.save_checkpoint`"
                + (f", or one of its tags with `tag=` ({', '.join(tags)})." if tags else ".")
            )
        tag = latest.read_text(encoding="utf-8").strip()
    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(
            f"tag {tag!r} not found in {str(root)!r}; tags found: {', '.join(tags) or 'none'}. "
            "HINT: pass one of them with `tag=`."
        )
    if not (tag_dir / CHECKPOINT_META_NAME).is_file():
        raise ValueError(
            f"{str(tag_dir)!r} is not a ds_engine checkpoint tag (no `{CHECKPOINT_META_NAME}`); found: "
            f"{_listing(tag_dir)}. HINT: point at a folder written by `engine.save_checkpoint` (a raw "
            "DeepSpeed checkpoint can be turned into weights with `ds-engine consolidate`)."
        )
    meta = _read_meta(tag_dir)
    if not (tag_dir / ENGINE_STATE_NAME).is_file():
        raise ValueError(
            f"{str(tag_dir)!r} lacks `{ENGINE_STATE_NAME}`; the checkpoint is incomplete. HINT: load "
            "an older tag with `tag=`."
        )
    # Every file's pickle goes through the restricted unpickler now (tensor data stays mapped,
    # unread): a truncated file, or one asking for anything off the allowlist, is refused here
    # on rank 0 and the error reaches every rank, instead of one rank failing inside DeepSpeed's
    # collective load while the others wait. DeepSpeed's own loads are restricted again later.
    safe_globals = deepspeed_safe_globals() if meta.get("backend") == "deepspeed" else ()
    older = ", ".join(t for t in tags if t != tag) or "none other saved"
    for path in sorted(tag_dir.glob("*.pt")):
        restricted_load(
            path, safe_globals=safe_globals, mmap=True, hint=f"load an older tag with `tag=` ({older})."
        )
    return tag, tag_dir, meta


def _zero_partition_files(tag_dir: Path) -> list[Path]:
    return sorted(tag_dir.glob("*zero_pp_rank_*optim_states.pt"))


def _compatibility(engine: Any, meta: Mapping[str, Any], tag_dir: Path) -> tuple[str, bool]:
    """('' or the error message, whether DeepSpeed must load through a universal checkpoint)."""
    backend, world = engine.backend_name, _world()
    where = str(tag_dir)
    consolidate_hint = (
        f"HINT: turn it into weights with `ds-engine consolidate {tag_dir.parent} OUT --tag {tag_dir.name}`, "
        "load them with `from_pretrained(OUT)` before `prepare` (the optimizer starts fresh), "
    )
    if meta["backend"] != backend:
        return (
            f"{where!r} was written by the {meta['backend']!r} backend but this Engine runs {backend!r}; "
            f"their optimizer files differ. {consolidate_hint}or resume with "
            f"Engine(backend={meta['backend']!r}).",
            False,
        )
    if backend != "deepspeed":
        return "", False
    stage = int(engine.config.zero_stage)
    if meta["zero_stage"] != stage:
        return (
            f"{where!r} was written with zero_stage={meta['zero_stage']} but this Engine runs "
            f"zero_stage={stage}; ZeRO stages partition the optimizer differently. {consolidate_hint}"
            f"or resume with zero_stage={meta['zero_stage']}.",
            False,
        )
    if meta["precision"] != engine.config.precision:
        return (
            f"{where!r} was written with precision={meta['precision']!r} but this Engine runs "
            f"precision={engine.config.precision!r}. {consolidate_hint}or resume with "
            f"precision={meta['precision']!r}.",
            False,
        )
    if int(meta["world_size"]) != world and _zero_partition_files(tag_dir):
        return "", True  # partitioned optimizer states: re-partitioned through a universal checkpoint
    return "", False


def load_training_checkpoint(
    engine: Any, directory: str | os.PathLike[str], *, tag: str | None = None
) -> dict[str, Any]:
    """Restore `engine` from a checkpoint (collective). See `Engine.load_checkpoint`."""
    if engine._model is None:
        raise RuntimeError(
            "`load_checkpoint` before `prepare`: there is nothing to load into. HINT: call "
            "`engine.prepare(model, optimizer, dataloader, scheduler)` with the same objects as the "
            "run that saved it, then `load_checkpoint`."
        )
    rank, world = _rank(), _world()
    outcome: Any = None
    if rank == 0:
        try:
            found_tag, tag_dir, meta = resolve_checkpoint(directory, tag)
            problem, universal = _compatibility(engine, meta, tag_dir)
            outcome = (("ValueError", problem) if problem else None, found_tag, universal, meta)
        except (FileNotFoundError, ValueError) as exc:
            outcome = ((type(exc).__name__, str(exc)), None, False, None)
    problem, found_tag, universal, meta = _broadcast_from_rank0(outcome)
    _raise_problem(problem)
    root = Path(directory).absolute()
    tag_dir = root / found_tag
    if universal:
        _load_deepspeed_universal(engine, root, found_tag, meta)
    else:
        engine._backend.load_checkpoint(root, found_tag)
    state = _load_safe(tag_dir / ENGINE_STATE_NAME)
    engine.load_state_dict(state)
    rng_path = tag_dir / rng_state_name(rank)
    if rng_path.is_file():
        restore_rng_state(_load_safe(rng_path))
    else:
        import warnings

        warnings.warn(
            f"ds_engine: the checkpoint was written by {meta['world_size']} ranks, so rank {rank} of "
            f"{world} has no saved RNG state; its RNG is left as it is.",
            stacklevel=3,
        )
    return dict(state["client_state"])


# --------------------------------------------------------------------------- backend parts
def save_deepspeed_states(
    ds_engine: Any, staging_root: Path, tag: str, client_state: Mapping[str, Any]
) -> None:
    """DeepSpeed's own checkpoint of model + optimizer (+ its scheduler) into `staging_root/tag`."""
    ds_engine.save_checkpoint(str(staging_root), tag=tag, client_state=dict(client_state), save_latest=False)


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


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _fqn_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """A `optimizer.state_dict()` (parameters numbered) keyed by parameter name instead.

    The numbering is the order of `optimizer.param_groups`, which `load_state_dict` relies
    on too; torch's distributed-checkpoint loader needs names to place FSDP shards.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {order[int(index)]: value for index, value in saved.get("state", {}).items()}
    groups = []
    start = 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": order[start : start + count]})
        start += count
    return {"state": state, "param_groups": groups}


def save_full_states(tag_dir: Path, *, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """The fallback's world-size-independent files: full model and optimizer states.

    Collective: every rank calls it; rank 0 writes. Under FSDP the shards are gathered with
    torch's distributed-checkpoint `get_state_dict` (full, on rank 0's CPU) and the optimizer
    state is keyed by parameter name (`optimizer_format: "fqn"`); otherwise the plain
    `state_dict()`s are written (`"index"`, torch's own format).
    """
    inner = _inner_optimizer(optimizer)
    if _is_fsdp(model) and inner.state:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        module_state, optimizer_state = get_state_dict(model, inner, options=options)
        optimizer_format = "fqn"
    elif _is_fsdp(model):  # no step taken yet: nothing sharded in the optimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module_state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        optimizer_state, optimizer_format = inner.state_dict(), "index"
    else:
        module_state, optimizer_state, optimizer_format = model.state_dict(), inner.state_dict(), "index"
    if _rank() != 0:
        return
    _save_safe({"module": module_state}, tag_dir / FALLBACK_MODEL_NAME, "the model state")
    _save_safe(
        {
            "optimizer": optimizer_state,
            "optimizer_format": optimizer_format,
            "scaler": scaler.state_dict() if scaler is not None else None,
        },
        tag_dir / FALLBACK_OPTIMIZER_NAME,
        "the optimizer state",
    )


def load_full_states(tag_dir: Path, *, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """Inverse of `save_full_states`, on every rank (FSDP or not, any world size)."""
    for name in (FALLBACK_MODEL_NAME, FALLBACK_OPTIMIZER_NAME):
        if not (tag_dir / name).is_file():
            raise ValueError(
                f"{str(tag_dir)!r} has no `{name}`; it is not a checkpoint of the accelerate fallback. "
                "HINT: load it with the backend that wrote it (see its ds_engine_meta.json)."
            )
    module_state = _load_safe(tag_dir / FALLBACK_MODEL_NAME)["module"]
    states = _load_safe(tag_dir / FALLBACK_OPTIMIZER_NAME)
    inner = _inner_optimizer(optimizer)
    optimizer_state = states["optimizer"]
    fqn = states.get("optimizer_format", "index") == "fqn"
    if fqn or _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)  # every rank read the full file
        set_model_state_dict(model, module_state, options=options)
        if not fqn and not optimizer_state.get("state"):
            # Saved before the first step: nothing to place. (torch's loader would take a
            # zero-lr step to create the state, which starts Adam's step count at 1.)
            inner.load_state_dict(optimizer_state)
        else:
            if not fqn:
                optimizer_state = _fqn_optimizer_state(model, inner, optimizer_state)
            set_optimizer_state_dict(model, inner, optimizer_state, options=options)
    else:
        model.load_state_dict(module_state)
        inner.load_state_dict(optimizer_state)
    if scaler is not None and states.get("scaler") is not None:
        scaler.load_state_dict(states["scaler"])


UNIVERSAL_SUFFIX = ".universal"


def convert_to_universal(tag_dir: Path) -> Path:
    """Convert a DeepSpeed ZeRO tag folder to a universal checkpoint next to it (offline, rank 0).

    The result, ``<tag>.universal`` beside the tag folder, is cached: a second resume on
    another world size reuses it. Written under a temporary name and renamed into place.
    """
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)
    if target.is_dir():  # its files are read through the restricted loader when loaded
        return target
    tmp = _tmp_sibling(target, "tmp")
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
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _load_deepspeed_universal(engine: Any, root: Path, tag: str, meta: Mapping[str, Any]) -> None:
    """Re-partition a ZeRO checkpoint for another world size via DeepSpeed's universal checkpoint."""
    import warnings

    problem: tuple[str, str] | None = None
    if _rank() == 0:
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
                f"{_world()}; converting it to a DeepSpeed universal checkpoint failed "
                f"({type(exc).__name__}: {exc}). HINT: resume on {meta['world_size']} ranks, or "
                f"`ds-engine consolidate {root} OUT --tag {tag}` and start from those weights.",
            )
    _raise_problem(_broadcast_from_rank0(problem))  # every rank raises rank 0's error
    ds_engine = engine._backend.ds_engine
    config = ds_engine._config
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True  # read by DeepSpeed at load time only
    try:
        engine._backend.load_checkpoint(root, tag + UNIVERSAL_SUFFIX)
    finally:
        config.load_universal_checkpoint = previous
    warnings.warn(
        f"ds_engine: resumed a checkpoint of {meta['world_size']} ranks on {_world()} through DeepSpeed's "
        "universal checkpoint (model, optimizer and schedule carried over; the data order continues "
        "by sample count; ranks without a saved RNG state keep their own).",
        stacklevel=4,
    )
