"""Consolidated weights: gather a (partitioned) model's full state dict, and `save_pretrained`.

* `consolidated_state_dict` -- collective; rank 0 gets the full CPU state dict, other ranks
  None. Partitioned parameters are gathered one layer at a time (per submodule), so rank 0
  holds about one copy of the weights.
* `save_pretrained` -- collective; streams: each safetensors shard is laid out up front and
  every tensor is written at its offset as soon as it is gathered, on a background thread
  while the next layer gathers (`ds_engine._safetensors`), so rank 0 holds about two gather
  buckets, never a shard; a layer larger than a bucket is written as it arrives, one
  partition at a time where the backend can (`WeightGather.pieces`). Output is a
  transformers-compatible folder (safetensors byte for byte as `safetensors` writes them,
  index, `config.json`, tokenizer) written atomically.

What "gather" means is the backend's business: a `WeightGather` says how to read the full
value of its parameters (the DeepSpeed backend's reads ZeRO-3 partitions and the optimizer's
fp32 masters; the default reads tensors as they are, and FSDP2 DTensor shards through
`full_tensor()`). `Backend.get_state_dict` / `Backend.save_pretrained` pass their own.
Offline consolidation of a checkpoint folder is `ds_engine.consolidate`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine import _safetensors
from ds_engine._folders import MODEL_WEIGHTS, Staging
from ds_engine._io import (
    broadcast_from_rank0,
    current_rank,
    fsync_file,
    raise_rank0_failure,
    write_json,
)
from ds_engine._values import parse_size

__all__ = [
    "GATHER_BUCKET_BYTES",
    "Entry",
    "WeightGather",
    "consolidated_state_dict",
    "plan",
    "save_pretrained",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
#: The header metadata transformers writes (and `from_pretrained` checks for).
SAFETENSORS_METADATA = {"format": "pt"}


# --------------------------------------------------------------------------- the backend's part
class WeightGather:
    """How to read the full value of a backend's parameters; this base reads them as they are.

    A backend whose parameters are partitioned returns its own from `Backend.weight_gather()`
    (DeepSpeed's: `ds_engine/backends/deepspeed_states.py`). FSDP2 DTensor shards need none:
    every value read goes through its `full_tensor()` where it has one.
    """

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        """The whole tensor's shape (a partitioned parameter's local shape is not it)."""
        return tensor.shape

    def gathered(self, tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        """A scope in which `tensors` hold their full values (collective: every rank enters it)."""
        return contextlib.nullcontext()

    def fp32_masters(self) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """parameter -> the optimizer's fp32 master copy or None (collective per call); None when
        the backend keeps no masters (fp32 weights are then cast up from the parameters)."""
        return None

    def session(self) -> contextlib.AbstractContextManager[None]:
        """A scope around one whole gather (e.g. to bring offloaded optimizer partitions back)."""
        return contextlib.nullcontext()

    def pieces(self, tensor: torch.Tensor) -> Iterator[torch.Tensor | None] | None:
        """The full value of `tensor`, flattened, as consecutive pieces that rank 0 receives (None
        on other ranks) without the whole tensor ever existing anywhere; None when this backend
        cannot (then `gathered` is used). Collective: every rank iterates it to the end, and the
        answer (None or not) must be the same on every rank.

        This base sends FSDP2 shards (a DTensor sharded on dim 0 over a 1-D mesh: each rank's
        local rows are a consecutive run of the flattened tensor); other tensors get None.
        """
        mesh = getattr(tensor, "device_mesh", None)
        placements = getattr(tensor, "placements", None)
        if mesh is None or placements is None or mesh.ndim != 1 or len(placements) != 1:
            return None
        if not placements[0].is_shard(0) or not torch.distributed.is_initialized():
            return None
        local = tensor.to_local().detach()  # type: ignore[attr-defined]
        group = mesh.get_group()
        mine = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        counts = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(counts, mine, group=group)
        sizes = [int(c) for c in counts]
        if sum(sizes) != tensor.numel():  # padded or otherwise laid out: every rank sees it
            return None
        return parts_to_rank0(local.reshape(-1), sizes, group)


def parts_to_rank0(local: torch.Tensor, counts: list[int], group: Any) -> Iterator[torch.Tensor | None]:
    """Group rank r's first `counts[r]` elements of its flat `local` go to group rank 0 in rank
    order, point to point (rank 0 yields its own as a view, then each received buffer; the
    other ranks yield None). Collective over `group`: every rank iterates to the end."""
    dist = torch.distributed
    me = dist.get_rank(group)
    root = dist.get_global_rank(group, 0)
    for r, count in enumerate(counts):
        if count == 0:
            continue
        if r == 0:
            yield local[:count] if me == 0 else None
        elif me == 0:
            buffer = torch.empty(count, dtype=local.dtype, device=local.device)
            dist.recv(buffer, src=dist.get_global_rank(group, r))
            yield buffer
            del buffer
        else:
            if me == r:
                dist.send(local[:count].contiguous(), dst=root)
            yield None


# --------------------------------------------------------------------------- planning
@dataclass
class Entry:
    """One state-dict key: the live parameter/buffer it reads and who owns it."""

    key: str
    tensor: torch.Tensor  # the live Parameter / buffer object (partitioned under ZeRO-3)
    owner: int  # id() of the owning submodule: entries of one owner are gathered together
    is_param: bool
    shape: torch.Size  # the full (unpartitioned) shape
    out_dtype: torch.dtype
    #: The value to write, computed inside the gather from `tensor` and `extra` (e.g. a LoRA
    #: layer's merged weight); None writes the gathered `tensor` itself.
    compute: Callable[[], torch.Tensor] | None = None
    #: Further live tensors `compute` reads; gathered together with `tensor`.
    extra: tuple[torch.Tensor, ...] = ()

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


def plan(
    module: nn.Module, gather: WeightGather, *, dtype: torch.dtype | None, exclude_frozen: bool
) -> list[Entry]:
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
            Entry(key, tensor, owners.get(id(tensor), -1), is_param, gather.full_shape(tensor), out_dtype)
        )
    return entries


#: Consecutive small layers are gathered together up to this many bytes (fewer collectives); a
#: layer larger than this is gathered alone. It bounds the transient extra memory per gather.
GATHER_BUCKET_BYTES = 16 * 2**20
#: ... and to at most this share of everything gathered in one call (at least 1 MiB), so the
#: transient gather buffers stay a small fraction of the copy rank 0 builds.
GATHER_BUCKET_SHARE = 0.02


def bucket_bytes(entries: list[Entry], cap: int | None = None) -> int:
    """The gather bucket for one call over `entries`: 2 % of their bytes, within 1-16 MiB (and `cap`)."""
    share = int(sum(e.nbytes for e in entries) * GATHER_BUCKET_SHARE)
    size = min(GATHER_BUCKET_BYTES, max(2**20, share))
    return size if cap is None else max(1, min(size, cap))


def _groups(entries: list[Entry], limit: int = GATHER_BUCKET_BYTES) -> Iterator[list[Entry]]:
    """The unit of one ZeRO-3 gather: whole submodules' entries, merged up to `limit` bytes."""
    layers: list[list[Entry]] = []
    for entry in entries:
        if layers and entry.owner == layers[-1][-1].owner:
            layers[-1].append(entry)
        else:
            layers.append([entry])
    bucket: list[Entry] = []
    size = 0
    for layer in layers:
        nbytes = sum(e.nbytes for e in layer)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer)
        size += nbytes
    if bucket:
        yield bucket


# --------------------------------------------------------------------------- gathering
def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP2 DTensor shard (collective); other tensors as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def check_not_empty(entry: Entry, value: torch.Tensor) -> None:
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


#: A value `_gathered_groups` yields per entry: its CPU tensor (rank 0), None (other ranks), or
#: the key of an earlier entry it is tied to (same live tensor).
_Value = torch.Tensor | str | None


@dataclass
class Batch:
    """One group's values. `in_place`: they are the gathered tensors themselves (no copy), valid
    only until the producer is resumed, so the consumer must be done with them by then."""

    values: list[tuple[Entry, _Value]]
    in_place: bool = False
    #: Set when the one value is a piece of its entry: the byte offset of the piece in it.
    part_offset: int | None = None


def _gathered_groups(
    entries: list[Entry],
    *,
    gather: WeightGather,
    want_master: bool,
    keep: bool,
    limit: int,
    before_copy: Callable[[], None] | None = None,
    in_place_above: int | None = None,
    pieces_above: int | None = None,
) -> Iterator[Batch]:
    """Gather `entries` group by group (collective) and yield each group's values.

    With `keep` (rank 0) each value is a CPU copy in the entry's dtype, made inside the gather;
    the gathered parameters are re-partitioned before the group is yielded, so the caller holds
    only copies. In a group of more than `pieces_above` bytes, tensors the backend can send a
    partition at a time (`WeightGather.pieces`, not with fp32 masters) are yielded piece by
    piece (`Batch.part_offset`). A group (or what is left of it) of more than
    `in_place_above` bytes is yielded inside its gather without copies (`Batch.in_place`),
    so a layer too large to exist twice never does.
    `before_copy()` runs after a group's gather and before its values are made (a background
    writer waits there, so its last batch is freed before the next one exists).
    Every rank must call this with the same entries.
    """
    done: dict[int, str] = {}  # id(live tensor) -> first key, so tied keys share one copy
    master_of = gather.fp32_masters() if want_master else None
    for group in _groups(entries, limit):
        masters: dict[int, torch.Tensor] = {}
        if master_of is not None:
            for entry in group:
                if entry.compute is not None:
                    continue  # computed from the live (gathered) tensors, not from masters
                if entry.is_param and id(entry.tensor) not in masters and id(entry.tensor) not in done:
                    master = master_of(entry.tensor)
                    if master is not None:
                        masters[id(entry.tensor)] = master
        to_gather: dict[int, torch.Tensor] = {}
        for entry in group:
            if entry.compute is not None or (
                id(entry.tensor) not in masters and id(entry.tensor) not in done
            ):
                to_gather.setdefault(id(entry.tensor), entry.tensor)
            for tensor in entry.extra:
                to_gather.setdefault(id(tensor), tensor)
        group_bytes = sum(e.nbytes for e in group)
        if pieces_above is not None and group_bytes > pieces_above and master_of is None:
            # a layer larger than a bucket: its partitioned tensors are streamed one partition at
            # a time where the backend can, so they never exist whole (not even during the gather)
            rest = []
            for entry in group:
                parts = None
                if (
                    entry.compute is None
                    and not entry.extra
                    and id(entry.tensor) not in done
                    and entry.out_dtype == entry.tensor.dtype
                ):
                    parts = gather.pieces(entry.tensor)
                if parts is None:
                    rest.append(entry)
                    continue
                yield from _streamed(entry, parts, keep=keep, before_copy=before_copy)
                done[id(entry.tensor)] = entry.key
                to_gather.pop(id(entry.tensor), None)
            group = rest
            if not group:
                continue
        in_place = in_place_above is not None and sum(e.nbytes for e in group) > in_place_above
        batch = Batch([], in_place=in_place)
        with gather.gathered(list(to_gather.values())):
            if keep and before_copy is not None:
                before_copy()
            for entry in group:
                ident = id(entry.tensor) if entry.compute is None else id(entry)
                if ident in done:
                    batch.values.append((entry, done[ident]))
                    continue
                if entry.compute is not None:
                    with torch.no_grad():
                        value = _full(entry.compute().detach())
                else:
                    value = _full(masters.get(ident, entry.tensor).detach())
                check_not_empty(entry, value)
                out = None
                if keep:
                    shaped = value.reshape(entry.shape)
                    out = shaped.to(device="cpu", dtype=entry.out_dtype, copy=not in_place)
                    del shaped
                del value
                batch.values.append((entry, out))
                done[ident] = entry.key
            if in_place:
                yield batch  # consumed before the gather ends
                batch.values.clear()
        masters.clear()
        if not in_place:
            yield batch
        del batch


def _streamed(
    entry: Entry, parts: Iterator[torch.Tensor | None], *, keep: bool, before_copy: Callable[[], None] | None
) -> Iterator[Batch]:
    """`entry`'s value as part batches (rank 0; each a received buffer or a view of rank 0's own
    partition, unchanged while the save runs); checks the parts add up to its size."""
    offset = 0
    for part in parts:
        if keep and before_copy is not None:
            before_copy()
        if keep and part is not None:
            yield Batch([(entry, part)], part_offset=offset)
        offset += part.nbytes if part is not None else 0
        del part
    if keep and offset != entry.nbytes:
        raise RuntimeError(
            f"consolidating `{entry.key}` streamed {offset} bytes but the parameter has {entry.nbytes} "
            f"(shape {tuple(entry.shape)}); refusing to save a partial tensor."
        )


def _collect(
    entries: list[Entry], *, gather: WeightGather, want_master: bool, keep: bool
) -> dict[str, torch.Tensor] | None:
    """Gather `entries` group by group; return CPU copies when `keep` (rank 0), else None.

    Every rank must call this with the same entries: the gathers are collective.
    """
    out: dict[str, torch.Tensor] = {}
    limit = bucket_bytes(entries)
    for batch in _gathered_groups(entries, gather=gather, want_master=want_master, keep=keep, limit=limit):
        if not keep:
            continue
        for entry, value in batch.values:
            if isinstance(value, str):  # a tied alias
                out[entry.key] = out[value]
            elif value is not None:
                out[entry.key] = value
    return out if keep else None


def consolidated_state_dict(
    module: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    exclude_frozen: bool = False,
    gather: WeightGather | None = None,
    entries: list[Entry] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Collect the full state dict of `module` on rank 0 (collective: every rank calls it).

    Partitioned parameters (ZeRO-3) are gathered one submodule at a time and copied to CPU on
    rank 0 only, so rank 0 holds about one copy of the weights plus one gather bucket (whole
    layers, up to 2 % of the weights within 1-16 MiB, or one larger layer); no DeepSpeed
    flag (`stage3_gather_16bit_weights_on_model_save`) is needed.

    Args:
        module: The unwrapped model (`ds_engine.module` for a DeepSpeedEngine).
        dtype: Dtype of floating-point tensors in the result. None keeps the training dtype
            (16-bit under fp16/bf16 training). `torch.float32` with a `gather` that knows the
            optimizer returns its fp32 master weights (parameters without a master copy, such
            as frozen ones, are cast up).
        exclude_frozen: Leave out parameters with `requires_grad=False` (buffers are kept).
        gather: How the backend's parameters are read (`Backend.weight_gather()`); None reads
            them as they are.
        entries: Collect these (`plan(module, ...)` or a subset / transform of it, as
            `ds_engine.adapters` builds for LoRA models) instead of the whole state dict.

    Returns:
        On rank 0 (or without a process group) a dict with exactly the keys of
        `module.state_dict()` mapping to CPU tensors (tied keys share one tensor); None on
        other ranks.

    Raises:
        RuntimeError: When a gathered tensor does not have its parameter's full size.
    """
    gather = gather or WeightGather()
    if entries is None:
        entries = plan(module, gather, dtype=dtype, exclude_frozen=exclude_frozen)
    with gather.session():
        return _collect(entries, gather=gather, want_master=dtype == torch.float32, keep=current_rank() == 0)


# --------------------------------------------------------------------------- tied weights
def _any(module: nn.Module) -> Any:
    """`module` typed as Any, for transformers helpers annotated with `PreTrainedModel`."""
    return module


def is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "save_pretrained") and hasattr(config, "to_dict")


def _drop_tied(module: nn.Module, entries: list[Entry]) -> list[Entry]:
    """Drop tied duplicates the way transformers' own `save_pretrained` does.

    For HF models transformers' `remove_tied_weights_from_state_dict` decides which alias to
    keep (it needs the `_tied_weights_keys` patterns); it is fed one small proxy tensor per
    live tensor, so aliases share storage exactly as the real weights do. Plain modules keep
    the first key of each alias group (safetensors cannot store aliases).
    """
    if not is_hf_model(module):
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


def _save_conversions(module: nn.Module) -> list[Any]:
    """The weight conversions transformers reverts on save (renames, fused experts), or []."""
    if not is_hf_model(module):
        return []
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return []
        conversions = get_model_conversion_mapping(_any(module), add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    return list(conversions or ())


def _saved_names(module: nn.Module, entries: list[Entry]) -> list[Entry] | None:
    """`entries` under the names and in the order transformers' `save_pretrained` writes them.

    transformers reverts the conversions it applied on load (`revert_weight_conversion`): a
    legacy checkpoint's `LayerNorm.gamma` goes back to `gamma`, a removed prefix comes back.
    When every conversion is a renaming, a key's saved name does not depend on any tensor, so
    transformers' own function is run on a dict of empty stand-ins and each entry takes the
    name its stand-in comes back under: the weights can then stream shard by shard. Returns None
    when a conversion computes tensors from several (a `WeightConverter`, e.g. fused MoE
    experts) or the renaming is not one-to-one: those need the whole dict at once.
    """
    conversions = _save_conversions(module)
    if not conversions:
        return entries
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    if any(isinstance(c, WeightConverter) for c in conversions):
        return None
    stand_ins = [torch.empty(0) for _ in entries]
    owner = {id(t): e for t, e in zip(stand_ins, entries, strict=True)}
    reverted = revert_weight_conversion(
        _any(module), {e.key: t for e, t in zip(entries, stand_ins, strict=True)}
    )
    renamed = [(key, owner.get(id(value))) for key, value in reverted.items()]
    named = [(key, e) for key, e in renamed if e is not None]
    if not len(named) == len(renamed) == len(entries) == len({id(e) for _, e in named}):
        return None  # a stand-in came back changed, under two keys, or two keys became one
    return [replace(e, key=key) for key, e in named]


# --------------------------------------------------------------------------- sharding
@dataclass
class Shard:
    """One weights file of a save: its name and the entries it holds, in order."""

    filename: str
    entries: list[Entry]


def split_shards(entries: list[Entry], max_bytes: int, weights_name: str) -> list[Shard]:
    """Split as huggingface_hub's `split_torch_state_dict_into_shards`: in order, a new shard when
    the next tensor would overflow the open one; a tensor larger than `max_bytes` gets a shard of
    its own where it comes (the open shard stays open), so the files match transformers'."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        nbytes = entry.nbytes
        if nbytes > max_bytes:
            shards.append([entry])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current = []
            size = 0
        current.append(entry)
        size += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return [Shard(weights_name, shards[0])]
    stem, ext = weights_name.rsplit(".", 1)
    total = len(shards)
    return [Shard(f"{stem}-{i + 1:05d}-of-{total:05d}.{ext}", s) for i, s in enumerate(shards)]


def write_weights(tensors: dict[str, torch.Tensor], path: Path, safe_serialization: bool) -> None:
    """Write one weights file and fsync it (safetensors without a second copy of the tensors)."""
    if safe_serialization:
        _safetensors.save_file(tensors, path, metadata=SAFETENSORS_METADATA)
    else:
        torch.save(tensors, path)
        fsync_file(path)


def one_at_a_time(shard: Shard, before_copy: Callable[[], None] | None) -> Iterator[Batch]:
    """`stream_shards` batches for tensors that exist already or load lazily (a given state dict,
    an offline checkpoint's memory-mapped fragments): one CPU tensor in its output dtype at a
    time, read while the previous one is written."""
    for entry in shard.entries:
        if before_copy is not None:
            before_copy()
        with torch.no_grad():
            value = entry.tensor.contiguous().to(device="cpu", dtype=entry.out_dtype)
        check_not_empty(entry, value)
        yield Batch([(entry, value.reshape(entry.shape))])
        del value


def stream_shards(
    shards: list[Shard],
    directory: Path,
    batches: Callable[[Shard, Callable[[], None] | None], Iterator[Batch]],
    *,
    write: bool,
) -> BaseException | None:
    """Write safetensors shards a batch at a time, on a background thread (collective per `batches`).

    `batches(shard, before_copy)` yields the shard's values batch by batch (CPU tensors where
    `write`, else None); each batch is written at its offsets while the next one is produced,
    and `before_copy` waits for the write in flight, so at most two batches exist at once (one
    for an in-place batch, which is written before the producer resumes). Every shard file is
    laid out up front and fsynced when complete. Returns the first write error; later batches
    are still produced, so collective producers keep every rank in step.
    """
    writer = _safetensors.BackgroundWriter() if write else None
    opened: list[_safetensors.SafetensorsFile] = []

    def start(shard: Shard) -> None:
        layout = [(e.key, e.out_dtype, tuple(int(d) for d in e.shape)) for e in shard.entries]
        opened.append(_safetensors.SafetensorsFile(directory / shard.filename, layout, SAFETENSORS_METADATA))

    def put(batch: Batch) -> None:
        for entry, value in batch.values:
            if not isinstance(value, torch.Tensor):
                continue
            if batch.part_offset is None:
                opened[-1].write(entry.key, value)
            else:
                opened[-1].write_part(entry.key, value, batch.part_offset)

    try:
        for shard in shards:
            if writer is not None:
                writer.submit(start, shard)
            for batch in batches(shard, writer.idle if writer is not None else None):
                if writer is not None:
                    writer.submit(put, batch)
                    if batch.in_place:
                        writer.idle()
                del batch
            if writer is not None:
                writer.submit(lambda: opened[-1].close())
    finally:
        error = writer.close() if writer is not None else None
        for file in opened:
            file.abort()
    return error


def preflight(save_directory: Path, module: nn.Module | None, tokenizer: Any) -> str:
    """'' when saving can start, else the error message (checked before any collective)."""
    if save_directory.exists() and not save_directory.is_dir():
        return (
            f"`save_directory`={str(save_directory)!r} is a file, not a directory. "
            "HINT: pass a directory path (it is created; in an existing one only the files the "
            "save writes are replaced)."
        )
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        return (
            f"`tokenizer` of type {type(tokenizer).__name__} has no `save_pretrained`; allowed: a "
            "transformers tokenizer or processor. HINT: pass the tokenizer from AutoTokenizer."
        )
    if tokenizer is not None and module is not None and not is_hf_model(module):
        return (
            f"`tokenizer` was given but the model ({type(module).__name__}) is not a transformers "
            "model (no `config`), so the folder could not be loaded with from_pretrained anyway. "
            "HINT: save the tokenizer separately with `tokenizer.save_pretrained(dir)`."
        )
    return ""


def save_hf_config(module: nn.Module, directory: Path, weights_dtype: torch.dtype | None) -> None:
    config: Any = copy.deepcopy(module.config)  # do not touch the live model's config
    config.architectures = [type(module).__name__]
    if weights_dtype is not None:
        config.dtype = str(weights_dtype).split(".")[-1]
    config.save_pretrained(str(directory))
    can_generate = getattr(module, "can_generate", None)
    generation_config = getattr(module, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(str(directory))


def _check_given_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], gather: WeightGather
) -> None:
    shapes = {name: gather.full_shape(p) for name, p in module.named_parameters(remove_duplicate=False)}
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
    gather: WeightGather | None = None,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    dtype: torch.dtype | None = None,
    exclude_frozen: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    entries: list[Entry] | None = None,
) -> None:
    """Write `module` as a `from_pretrained` folder (collective: every rank calls it).

    Weights are streamed (safetensors): gathered a bucket of layers at a time and written at
    their offsets while the next bucket gathers; with partitioned parameters (ZeRO-3) rank 0
    holds about two buckets (2 % of the weights, 1-16 MiB, each), and a layer larger than a
    bucket arrives one partition at a time (two in flight). `pytorch_model.bin` output is written a
    shard at a time. Rank 0 writes safetensors (`model.safetensors`, or
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` past
    `max_shard_size`), `config.json` (and `generation_config.json`) for transformers models,
    and the tokenizer. Tied duplicates are dropped as transformers' `save_pretrained` drops
    them. Everything is written into a hidden staging folder first and fsynced, so a full disk
    or a crash while writing leaves the previous files byte-identical; then a new folder is
    renamed into place whole. An existing folder keeps everything this save does not write
    (e.g. `checkpoint-N/` folders, logs): only the files written and stale weight files of
    this naming (other shards, the single file or index of the other layout, the other
    serialization's weights) are replaced, by renames, the weights index or single file last
    (`ds_engine._folders`); a crash there leaves a folder `from_pretrained` refuses, never
    one with a mix of old and new weights.

    Args:
        module: The unwrapped model (`ds_engine.module` for a DeepSpeedEngine); a transformers
            `PreTrainedModel` or any `nn.Module` (then only weights are written).
        save_directory: Target folder; created, or updated (only what this save writes).
        gather: How the backend's parameters are read (`Backend.weight_gather()`); None reads
            them as they are.
        tokenizer: Optional tokenizer saved with `tokenizer.save_pretrained` (HF models only).
        max_shard_size: Largest shard, e.g. "5GB", "500MB", "1GiB" or bytes.
        safe_serialization: safetensors (True) or `pytorch_model.bin` via torch.save (False).
        dtype: As in `consolidated_state_dict` (None: the training dtype).
        exclude_frozen: Leave out parameters with `requires_grad=False`.
        state_dict: Write this (rank 0's) dict instead of gathering the weights.
        entries: Gather and write these instead of `plan(module, ...)` (e.g. a LoRA model's
            merged weights under the base model's keys: `ds_engine.adapters`).

    Raises:
        ValueError: For a bad `max_shard_size`, a `save_directory` that is a file, or a
            tokenizer that cannot be saved with this model.
        RuntimeError: When a tensor would be written empty, or rank 0 failed to write.
    """
    max_bytes = parse_size(max_shard_size, name="max_shard_size")
    gather = gather or WeightGather()
    target = Path(save_directory).absolute()
    rank = current_rank()
    problem = broadcast_from_rank0(preflight(target, module, tokenizer) if rank == 0 else None)
    if problem:
        raise ValueError(problem)

    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
    is_hf = is_hf_model(module)
    staging = Staging(target)
    tmp = staging.folder
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

    on_rank0(staging.start)
    shards: list[Shard] = []
    saved_dtype = dtype

    def write_given(
        given: Mapping[str, torch.Tensor] | None, cast: torch.dtype | None, drop_tied: bool = True
    ) -> None:
        if given is not None:
            shards.extend(
                _write_given_state_dict(
                    module, given, gather, tmp, weights_name, max_bytes, safe_serialization, cast, drop_tied
                )
            )

    try:
        if state_dict is not None:
            on_rank0(write_given, state_dict, dtype)
        else:
            if entries is None:
                entries = plan(module, gather, dtype=dtype, exclude_frozen=exclude_frozen)
            want_master = dtype == torch.float32
            saved_dtype = dtype or _model_float_dtype(module)
            with gather.session():
                kept = _drop_tied(module, entries)  # before any renaming, as transformers does
                saved = _saved_names(module, kept)
                if saved is None:
                    # transformers fuses/splits some weights on save (many-to-one across layers),
                    # so the whole dict is needed at once: gather it, then let transformers revert
                    # the mapping. This path holds one full copy on rank 0 (like transformers).
                    from transformers.core_model_loading import revert_weight_conversion

                    full = _collect(kept, gather=gather, want_master=want_master, keep=rank == 0)
                    if full is not None:
                        on_rank0(write_given, revert_weight_conversion(_any(module), full), None, False)
                    del full
                else:
                    shards = split_shards(saved, max_bytes, weights_name)
                    limit = bucket_bytes(entries, cap=max_bytes // 2)
                    if safe_serialization:

                        def groups(shard: Shard, before_copy: Callable[[], None] | None) -> Iterator[Batch]:
                            # a group that could not exist twice within half a shard is written
                            # from the gathered tensors, before the next gather
                            return _gathered_groups(
                                shard.entries,
                                gather=gather,
                                want_master=want_master,
                                keep=before_copy is not None,
                                limit=limit,
                                before_copy=before_copy,
                                in_place_above=max_bytes // 2,
                                pieces_above=limit,
                            )

                        failed = stream_shards(shards, tmp, groups, write=rank == 0 and error is None)
                        if failed is not None and error is None:
                            error = failed
                    else:
                        for shard in shards:
                            keep = rank == 0 and error is None
                            tensors = _collect(
                                shard.entries, gather=gather, want_master=want_master, keep=keep
                            )
                            if tensors is not None:
                                on_rank0(write_weights, tensors, tmp / shard.filename, safe_serialization)
                            del tensors
    except BaseException:
        # raised on every rank alike (e.g. an empty gathered tensor): no half-written folder
        if rank == 0:
            staging.discard()
        raise

    def finish() -> None:
        if len(shards) > 1:
            weight_map = {e.key: s.filename for s in shards for e in s.entries}
            metadata: dict[str, Any] = {"total_size": sum(e.nbytes for s in shards for e in s.entries)}
            if is_hf:
                metadata["total_parameters"] = sum(gather.full_shape(p).numel() for p in module.parameters())
            write_json(tmp / index_name, {"metadata": metadata, "weight_map": weight_map})
        if is_hf:
            save_hf_config(module, tmp, saved_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        staging.publish(MODEL_WEIGHTS)

    on_rank0(finish)
    if rank == 0 and error is not None:
        staging.discard()
    raise_rank0_failure(error, target)


def _write_given_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    gather: WeightGather,
    tmp: Path,
    weights_name: str,
    max_bytes: int,
    safe_serialization: bool,
    dtype: torch.dtype | None,
    drop_tied: bool = True,
) -> list[Shard]:
    """Shard and write an already-consolidated dict (rank 0 only); returns the shard plan.

    `drop_tied=False`: tied and ignored keys were dropped already (before transformers' renames).
    """
    if drop_tied:
        _check_given_state_dict(module, state_dict, gather)
    if is_hf_model(module) and drop_tied:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        given = dict(state_dict)
        for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
            given.pop(key, None)
        state_dict = remove_tied_weights_from_state_dict(given, _any(module))
    entries = []
    for key, value in state_dict.items():
        out_dtype = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
        entries.append(Entry(key, value, 0, False, value.shape, out_dtype))
    if not is_hf_model(module):
        entries = _drop_aliases(entries)
    shards = _split_given(entries, max_bytes, weights_name)
    if safe_serialization:  # a tensor at a time: no second copy of a shard
        failed = stream_shards(shards, tmp, one_at_a_time, write=True)
        if failed is not None:
            raise failed
        return shards
    for shard in shards:
        tensors = {
            e.key: e.tensor.detach().to(device="cpu", dtype=e.out_dtype).contiguous() for e in shard.entries
        }
        write_weights(tensors, tmp / shard.filename, safe_serialization)
    return shards


def _split_given(entries: list[Entry], max_bytes: int, weights_name: str) -> list[Shard]:
    """Shards of a dict of real tensors. Written as they are, huggingface_hub's own split decides
    (it sizes a tensor by its storage and keeps views of one storage in one shard, which is what
    transformers writes for e.g. experts split from a fused tensor); cast, `split_shards`."""
    if not entries or any(e.out_dtype != e.tensor.dtype for e in entries):
        return split_shards(entries, max_bytes, weights_name)
    from huggingface_hub import split_torch_state_dict_into_shards

    stem, ext = weights_name.rsplit(".", 1)
    tensors = {e.key: e.tensor for e in entries}
    pattern = f"{stem}{{suffix}}.{ext}"
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=pattern, max_shard_size=max_bytes)
    by_key = {e.key: e for e in entries}
    return [Shard(name, [by_key[k] for k in keys]) for name, keys in split.filename_to_tensors.items()]


def _drop_aliases(entries: list[Entry]) -> list[Entry]:
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
