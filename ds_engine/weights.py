"""Consolidated weights: gather a (partitioned) model's full state dict, and `save_pretrained`.

* `consolidated_state_dict` -- collective; rank 0 gets the full CPU state dict, other ranks
  None (`ds_engine._gather`, re-exported here).
* `save_pretrained` -- collective; streams: each safetensors shard is laid out up front and
  every tensor is written at its offset as soon as it is gathered, on a background thread
  while the next layer gathers (`ds_engine._safetensors`), so rank 0 holds about two gather
  buckets, never a shard; a layer larger than a bucket is written as it arrives, one
  partition at a time where the backend can (`WeightGather.pieces`). A given state dict is
  written file by file in the file's own order, at the speed of a plain write. Output is a
  transformers-compatible folder (safetensors byte for byte as `safetensors` writes them,
  index, `config.json`, tokenizer) written atomically.

What "gather" means is the backend's business: a `WeightGather` says how to read the full
value of its parameters (the DeepSpeed backend's reads ZeRO-3 partitions and the optimizer's
fp32 masters; the default reads tensors as they are, and FSDP2 DTensor shards through
`full_tensor()`). `Backend.get_state_dict` / `Backend.save_pretrained` pass their own. What a
save names (files, tied keys, transformers' renames) is `ds_engine._weight_names`. Offline
consolidation of a checkpoint folder is `ds_engine.consolidate`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine import _safetensors
from ds_engine._folders import MODEL_WEIGHTS, Staging
from ds_engine._gather import (
    GATHER_BUCKET_BYTES,
    Batch,
    Entry,
    WeightGather,
    _collect,
    _gathered_groups,
    _model_float_dtype,
    bucket_bytes,
    check_not_empty,
    consolidated_state_dict,
    parts_to_rank0,
    plan,
)
from ds_engine._io import broadcast_from_rank0, current_rank, fsync_file, raise_rank0_failure, write_json
from ds_engine._values import parse_size
from ds_engine._weight_names import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    Shard,
    any_model,
    drop_aliases,
    drop_tied,
    is_hf_model,
    saved_names,
    split_given,
    split_shards,
)

__all__ = [  # the gathering and naming parts are re-exported: backends and adapters import them here
    "GATHER_BUCKET_BYTES",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "Batch",
    "Entry",
    "Shard",
    "WeightGather",
    "check_not_empty",
    "consolidated_state_dict",
    "is_hf_model",
    "one_at_a_time",
    "parts_to_rank0",
    "plan",
    "preflight",
    "save_hf_config",
    "save_pretrained",
    "split_shards",
    "stream_shards",
    "write_weights",
]

#: The header metadata transformers writes (and `from_pretrained` checks for).
SAFETENSORS_METADATA = {"format": "pt"}


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
    shard at a time. A given `state_dict` is written file by file, each in its byte order, with
    no thread and no copy of a tensor already in its output dtype. Rank 0 writes safetensors
    (`model.safetensors`, or
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
    save = _Save(module, gather, Staging(target), rank, max_bytes, safe_serialization)
    save.on_rank0(save.staging.start)
    saved_dtype = dtype
    try:
        if state_dict is not None:
            save.on_rank0(save.write_given, state_dict, dtype)
        else:
            if entries is None:
                entries = plan(module, gather, dtype=dtype, exclude_frozen=exclude_frozen)
            saved_dtype = dtype or _model_float_dtype(module)
            with gather.session():
                save.write_gathered(entries, want_master=dtype == torch.float32)
    except BaseException:
        # raised on every rank alike (e.g. an empty gathered tensor): no half-written folder
        if rank == 0:
            save.staging.discard()
        raise
    save.on_rank0(save.finish, tokenizer, saved_dtype)
    if rank == 0 and save.error is not None:
        save.staging.discard()
    raise_rank0_failure(save.error, target)


@dataclass
class _Save:
    """One `save_pretrained` call's state: where it stages, the shards written, rank 0's error."""

    module: nn.Module
    gather: WeightGather
    staging: Staging
    rank: int
    max_bytes: int
    safe: bool
    shards: list[Shard] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def weights_name(self) -> str:
        return SAFE_WEIGHTS_NAME if self.safe else WEIGHTS_NAME

    def on_rank0(self, step: Callable[..., Any], *args: Any) -> None:
        """Run `step` on rank 0 unless it failed already. Rank 0 keeps taking part in the
        collectives after a write error, so no rank hangs; `save_pretrained` re-raises the
        error on every rank at the end."""
        if self.rank == 0 and self.error is None:
            try:
                step(*args)
            except BaseException as exc:  # re-raised by `raise_rank0_failure` on every rank
                self.error = exc

    def write_given(
        self, given: Mapping[str, torch.Tensor] | None, cast: torch.dtype | None, drop_tied: bool = True
    ) -> None:
        if given is not None:
            self.shards.extend(
                _write_given_state_dict(
                    self.module,
                    given,
                    self.gather,
                    self.staging.folder,
                    self.weights_name,
                    self.max_bytes,
                    self.safe,
                    cast,
                    drop_tied,
                )
            )

    def write_gathered(self, entries: list[Entry], *, want_master: bool) -> None:
        """Gather `entries` (collective) and write them, streamed where transformers' names allow."""
        kept = drop_tied(self.module, entries)  # before any renaming, as transformers does
        saved = saved_names(self.module, kept)
        if saved is None:
            # transformers fuses/splits some weights on save (many-to-one across layers), so the
            # whole dict is needed at once: gather it, then let transformers revert the mapping.
            # This path holds one full copy on rank 0 (like transformers).
            from transformers.core_model_loading import revert_weight_conversion

            full = _collect(kept, gather=self.gather, want_master=want_master, keep=self.rank == 0)
            if full is not None:
                self.on_rank0(
                    self.write_given, revert_weight_conversion(any_model(self.module), full), None, False
                )
            del full
            return
        self.shards = split_shards(saved, self.max_bytes, self.weights_name)
        if not self.safe:
            for shard in self.shards:
                keep = self.rank == 0 and self.error is None
                tensors = _collect(shard.entries, gather=self.gather, want_master=want_master, keep=keep)
                if tensors is not None:
                    self.on_rank0(write_weights, tensors, self.staging.folder / shard.filename, False)
                del tensors
            return
        limit = bucket_bytes(entries, cap=self.max_bytes // 2)

        def groups(shard: Shard, before_copy: Callable[[], None] | None) -> Iterator[Batch]:
            # a group that could not exist twice within half a shard is written from the
            # gathered tensors, before the next gather
            return _gathered_groups(
                shard.entries,
                gather=self.gather,
                want_master=want_master,
                keep=before_copy is not None,
                limit=limit,
                before_copy=before_copy,
                in_place_above=self.max_bytes // 2,
                pieces_above=limit,
            )

        write = self.rank == 0 and self.error is None
        failed = stream_shards(self.shards, self.staging.folder, groups, write=write)
        if failed is not None and self.error is None:
            self.error = failed

    def finish(self, tokenizer: Any, saved_dtype: torch.dtype | None) -> None:
        """The index, config files and tokenizer, then the folder published (rank 0)."""
        tmp = self.staging.folder
        is_hf = is_hf_model(self.module)
        if len(self.shards) > 1:
            weight_map = {e.key: s.filename for s in self.shards for e in s.entries}
            metadata: dict[str, Any] = {"total_size": sum(e.nbytes for s in self.shards for e in s.entries)}
            if is_hf:
                metadata["total_parameters"] = sum(
                    self.gather.full_shape(p).numel() for p in self.module.parameters()
                )
            index = SAFE_WEIGHTS_INDEX_NAME if self.safe else WEIGHTS_INDEX_NAME
            write_json(tmp / index, {"metadata": metadata, "weight_map": weight_map})
        if is_hf:
            save_hf_config(self.module, tmp, saved_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        self.staging.publish(MODEL_WEIGHTS)


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
        state_dict = remove_tied_weights_from_state_dict(given, any_model(module))
    entries = []
    for key, value in state_dict.items():
        out_dtype = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
        entries.append(Entry(key, value, 0, False, value.shape, out_dtype))
    if not is_hf_model(module):
        entries = drop_aliases(entries)
    shards = split_given(entries, max_bytes, weights_name)
    if safe_serialization:  # a tensor at a time, in the file's order: no second copy of a shard
        for shard in shards:
            _write_given_shard(shard, tmp / shard.filename)
        return shards
    for shard in shards:
        tensors = {
            e.key: e.tensor.detach().to(device="cpu", dtype=e.out_dtype).contiguous() for e in shard.entries
        }
        write_weights(tensors, tmp / shard.filename, safe_serialization)
    return shards


def _write_given_shard(shard: Shard, path: Path) -> None:
    """One safetensors file of existing tensors, written in its byte order on this thread (a
    sequential write, as fast as a plain one); a tensor is cast or copied only when its dtype,
    device or layout asks for it, and freed before the next one. Not fsynced here: `Staging`
    fsyncs the staged folder once before publishing it."""
    layout = [(e.key, e.out_dtype, tuple(int(d) for d in e.shape)) for e in shard.entries]
    out = _safetensors.SafetensorsFile(path, layout, SAFETENSORS_METADATA)
    by_key = {e.key: e for e in shard.entries}
    try:
        for key in out.order:
            entry = by_key[key]
            with torch.no_grad():
                value = entry.tensor.detach().to(device="cpu", dtype=entry.out_dtype).contiguous()
            check_not_empty(entry, value)
            out.write(key, value.reshape(entry.shape))
            del value
        out.close(sync=False)  # the staged folder is fsynced whole before it is published
    finally:
        out.abort()
