"""Gathering a (partitioned) model's full state dict: the backend's `WeightGather`, the plan, the groups.

* `WeightGather` -- how a backend's parameters are read whole (the base reads them as they
  are; FSDP2 DTensor shards go through `full_tensor()` or stream partition by partition).
* `plan` -- the keys `module.state_dict()` would produce, bound to their live tensors.
* `consolidated_state_dict` -- collective; rank 0 gets the full CPU state dict, other ranks
  None. Partitioned parameters are gathered one layer at a time (per submodule), so rank 0
  holds about one copy of the weights.

`ds_engine.weights` writes what is gathered here (and re-exports these names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ds_engine._io import current_rank

__all__ = [
    "GATHER_BUCKET_BYTES",
    "Batch",
    "Entry",
    "WeightGather",
    "bucket_bytes",
    "check_not_empty",
    "consolidated_state_dict",
    "parts_to_rank0",
    "plan",
]


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
