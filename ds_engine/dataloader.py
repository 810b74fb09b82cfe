"""Dataloader sharding shared by both backends.

The Engine owns the accumulation boundary, so it must know where each training dataloader
stands (batch index, length). Both backends therefore use this one wrapper rather than
DeepSpeed's or accelerate's own, which keeps the semantics identical on both.

Every shape of data a DataLoader takes is accepted (`ds_engine.sharding` holds the rules):
a sampler with a ``batch_size`` (cut into global batches, rank ``r`` takes the ``r``-th slice),
a custom ``batch_sampler`` (whole batches to the ranks round robin), ``batch_size=None`` over
a map-style dataset (each item a whole batch, round robin), and an ``IterableDataset`` (every
rank reads the stream and keeps its slice of each global batch; the ranks agree once per
accumulation window on how many batches are left). Every rank takes the same number of
batches; the last global batch is completed by cycling from the start of the epoch, and
`gather_for_metrics` drops exactly those duplicates (`last_batch_real_samples`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from ds_engine._io import broadcast_from_rank0
from ds_engine.sharding import (
    UNKNOWN_LENGTH,
    BatchSamplerShard,
    ShardedBatchSampler,
    ShardPosition,
    StreamWindows,
    shard_stream,
)

__all__ = [
    "PreparedDataLoader",
    "ShardedBatchSampler",
    "check_dataloader",
    "check_same_length_on_every_rank",
    "move_to_device",
]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if type(batch) in (tuple, list):  # the default collation's: no namedtuple, no mapping
        return type(batch)(
            item.to(device, non_blocking=True)
            if isinstance(item, torch.Tensor)
            else move_to_device(item, device)
            for item in batch
        )
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]  # BatchEncoding, OrderedDict, ...
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def check_dataloader(dataloader: DataLoader, *, caller: str | None = None) -> None:
    """Refuse a DataLoader whose data is split per rank already (ds_engine shards it itself).

    `prepare` calls it for every loader before any process group work (and again when the loader
    is wrapped); the same on every rank. `caller`: what the script calls the Engine, for the message.

    Raises:
        ValueError: A `DistributedSampler` (as `sampler`, or inside the `batch_sampler`), or a
            `datasets.IterableDataset` already split by `split_dataset_by_node`.
    """
    where = (
        f"`{caller + '.' if caller else ''}prepare`: the DataLoader over {type(dataloader.dataset).__name__}"
    )
    samplers = [getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)]
    samplers.append(getattr(samplers[1], "sampler", None))
    for sampler in samplers:
        if isinstance(sampler, DistributedSampler):
            raise ValueError(
                f"{where} samples with a DistributedSampler (num_replicas={sampler.num_replicas}, "
                f"rank={sampler.rank}): ds_engine shards every loader across ranks itself, so each rank "
                "would see 1/world of its share. HINT: build the DataLoader with a plain sampler "
                "(`shuffle=True` or `sampler=RandomSampler(dataset)`) and the whole dataset."
            )
    split = getattr(dataloader.dataset, "_distributed", None)
    if isinstance(dataloader.dataset, IterableDataset) and split is not None:
        raise ValueError(
            f"{where} streams a datasets.IterableDataset already split per rank by "
            f"`split_dataset_by_node` ({split}): ds_engine shards the stream across ranks itself "
            "(every rank reads it and keeps its slice of each global batch). HINT: pass the whole "
            "stream, without `split_dataset_by_node`."
        )


def _prepared_shuffle(sampler: RandomSampler) -> tuple[int, torch.Tensor]:
    """(seed, generator state) a shuffled loader's order is drawn from, as accelerate prepares it:
    the sampler's own generator as it is now, or else a new one seeded from one draw of the global
    torch RNG (made on every rank, as accelerate does); rank 0's state on every rank."""
    generator = sampler.generator
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    state = broadcast_from_rank0(generator.get_state())
    return int(generator.initial_seed()), state


def _keep(item: Any) -> Any:
    """The source loader of a stream passes items on as they are (collated later, per rank)."""
    return item


def _batch_len(batch: Any) -> int:
    """Samples in an item that is a whole batch: the first dimension of its first tensor or list."""
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values()))) if batch else 1
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, tuple) and batch and hasattr(batch[0], "shape"):  # (inputs, labels)
        return _batch_len(batch[0])
    try:
        return len(batch)
    except TypeError:
        return 1


class _FirstIndex(Sampler[int]):
    """A sampler of single indices from batches of one (items that are whole batches)."""

    def __init__(self, batches: ShardedBatchSampler) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[int]:
        return (batch[0] for batch in self.batches)


class StreamShard(ShardPosition):
    """A stream's sharding settings and position (what `batch_sampler` is for map-style data).

    Its length, per rank, exists only when the dataset has one (`len(dataset)` items).
    """

    def __init__(
        self, dataset: Any, batch_size: int, *, num_replicas: int, rank: int, drop_last: bool
    ) -> None:
        super().__init__(num_replicas=num_replicas, rank=rank, drop_last=drop_last)
        self.dataset = dataset
        self.batch_size = batch_size

    def __len__(self) -> int:
        try:
            items = len(self.dataset)
        except TypeError:
            raise TypeError(
                f"a prepared DataLoader over a stream ({type(self.dataset).__name__}) has no length: its "
                "end is known only once reached. HINT: size the run in optimizer steps (max_steps), or "
                "give the dataset a `__len__`."
            ) from None
        global_batch = self.batch_size * self.num_replicas
        return items // global_batch if self.drop_last else -(-items // global_batch)


class PreparedDataLoader:
    """A rank's shard of a user's DataLoader, on the right device, that reports its position.

    Iterating it tells the Engine which batch is current, so the Engine can put the
    accumulation boundary at every GA-th batch and at the last one. `kind` says which sharding
    rule applies: "indices" (a sampler and a `batch_size`), "batches" (a custom `batch_sampler`),
    "items" (`batch_size=None` over a map-style dataset: each item is a whole batch) or "stream"
    (an `IterableDataset`, with a `batch_size` or with items that are whole batches).

    Args:
        dataloader: The user's DataLoader.
        num_replicas: The number of ranks.
        rank: This rank.
        device: Where batches go.
        on_batch: Called with each batch's index before it is yielded.
        on_end: Called when a pass ends (exhausted, left, or raised).
        seed: The shuffle seed when the sampler has no generator of its own.
        after_batch: Called when the loop body of a batch returned.
        window: The accumulation window (gradient_accumulation_steps); a stream is read that
            far (and one batch) ahead so that its last window's length is known in time.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        num_replicas: int,
        rank: int,
        device: torch.device,
        on_batch: Callable[[PreparedDataLoader, int], None],
        on_end: Callable[[PreparedDataLoader], None],
        seed: int = 0,
        after_batch: Callable[[PreparedDataLoader, int], None] | None = None,
        window: Callable[[], int] | None = None,
    ) -> None:
        check_dataloader(dataloader)
        self.base_dataloader = dataloader
        # The inner loader draws its worker base seed from this generator, not from the
        # global torch RNG, so iterating never shifts the user's random stream (dropout):
        # a resumed run draws exactly what an uninterrupted one does.
        self._generator = torch.Generator()
        self.device = device
        self._on_batch = on_batch
        self._on_end = on_end
        self._after_batch = after_batch
        """Called when the loop body of a batch returned, before the next batch is fetched."""
        self._window = window or (lambda: 1)
        self._init_position()
        self._stream: StreamWindows | None = None
        """The pass over a stream in progress (or the last one): where its end is known."""
        self._pass_len: int | None = None
        """`len(self)` during a pass over map-style data (fixed for the pass)."""
        self._real_samples = 0
        """A stream: the samples of the current global batch that are not padding."""
        self.agreements = 0
        """A stream: how many times the ranks agreed on the batches left (one all-reduce each)."""
        self.agreement_seconds = 0.0
        """A stream: the time those agreements took, in seconds."""
        loader_options: dict[str, Any] = {
            "num_workers": dataloader.num_workers,
            "pin_memory": dataloader.pin_memory,
            "timeout": dataloader.timeout,
            "worker_init_fn": dataloader.worker_init_fn,
            "multiprocessing_context": dataloader.multiprocessing_context,
            "persistent_workers": dataloader.persistent_workers if dataloader.num_workers > 0 else False,
            "generator": self._generator,
        }
        sampler: Any = dataloader.sampler
        batch_size, drop_last = dataloader.batch_size, dataloader.drop_last
        user_batches = dataloader.batch_sampler if batch_size is None else None
        if type(user_batches) is BatchSampler and isinstance(
            user_batches.sampler, (RandomSampler, SequentialSampler)
        ):
            # torch's own batching of a plain sampler: the same as `batch_size=`, seeded per epoch
            sampler, batch_size, drop_last = (
                user_batches.sampler,
                user_batches.batch_size,
                user_batches.drop_last,
            )
            user_batches = None
        self.batch_sampler: Any
        if isinstance(dataloader.dataset, IterableDataset):
            self.kind = "stream"
            self.batch_sampler = StreamShard(
                dataloader.dataset, batch_size or 1, num_replicas=num_replicas, rank=rank, drop_last=drop_last
            )
            self._loader = DataLoader(dataloader.dataset, batch_size=None, collate_fn=_keep, **loader_options)
            return
        if user_batches is not None:
            self.kind = "batches"
            self.batch_sampler = BatchSamplerShard(
                user_batches,
                num_replicas=num_replicas,
                rank=rank,
                drop_last=bool(getattr(user_batches, "drop_last", False)),
            )
            self._loader = DataLoader(
                dataloader.dataset,
                batch_sampler=self.batch_sampler,
                collate_fn=dataloader.collate_fn,
                **loader_options,
            )
            return
        self.kind = "indices" if batch_size is not None else "items"
        shuffle = isinstance(sampler, RandomSampler)
        custom = None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
        shuffle_state = None
        if shuffle:
            seed, shuffle_state = _prepared_shuffle(sampler)
        self.batch_sampler = ShardedBatchSampler(
            len(custom) if custom is not None else len(dataloader.dataset),  # type: ignore[arg-type]
            batch_size or 1,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            index_sampler=custom,
            shuffle_state=shuffle_state,
            loader_draws_from_it=shuffle
            and dataloader.generator is not None
            and dataloader.generator is getattr(sampler, "generator", None),
        )
        if batch_size is None:  # each index is a whole batch: fetched and converted one at a time
            self._loader = DataLoader(
                dataloader.dataset,
                sampler=_FirstIndex(self.batch_sampler),
                batch_size=None,
                collate_fn=dataloader.collate_fn,
                **loader_options,
            )
            return
        self._loader = DataLoader(
            dataloader.dataset,
            batch_sampler=self.batch_sampler,
            collate_fn=dataloader.collate_fn,
            **loader_options,
        )

    def _init_position(self) -> None:
        self.batch_index = 0
        self.in_progress = False
        self._epoch_set_explicitly = False
        self._left_at: int | None = None
        """Where the last pass, left before its end (a `break`), resumes (`keep_position`); None:
        the next pass starts afresh. What `checkpoint_state()` records until the next pass starts."""
        self._restored_epoch: int | None = None
        """The epoch of a position restored by `load_state_dict` that no pass has started yet."""

    # ------------------------------------------------------------------ facts
    @property
    def dataset(self) -> Any:
        return self.base_dataloader.dataset

    @property
    def batch_size(self) -> int | None:
        """Per-rank micro-batch size (None where the user's loader has none: whole batches)."""
        return self.base_dataloader.batch_size

    @property
    def _unit(self) -> int:
        """Positions count global batches of `_unit * num_replicas` samples, batches or items."""
        return int(getattr(self.batch_sampler, "batch_size", 1))

    @property
    def num_samples(self) -> int:
        """Samples in one epoch over all ranks, without padding (a stream: only with a `len`).

        Raises:
            TypeError: A stream whose dataset has no length.
        """
        if self.kind == "stream":
            return len(self.dataset)
        return int(self.batch_sampler.num_samples)

    @property
    def epoch(self) -> int:
        return int(self.batch_sampler.epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def for_sizing(self, config: Any) -> Any:
        """What fills a DeepSpeed "auto" micro batch size (its `batch_size`): the user's loader, or
        where it has no `batch_size` (whole batches) and `config.micro_batch_size` is "auto", the
        batch sampler's `batch_size` attribute or else its epoch's largest batch (DeepSpeed reads
        that number only for its batch-size bookkeeping and throughput reports)."""
        if self.batch_size is not None or config.micro_batch_size != "auto" or self.kind != "batches":
            return self.base_dataloader
        declared = getattr(self.batch_sampler.batch_sampler, "batch_size", None)
        largest = max((len(batch) for batch in self.batch_sampler.epoch_batches()), default=1)
        return SimpleNamespace(batch_size=declared if isinstance(declared, int) else largest)

    def schedule_lengths(self) -> tuple[int, int] | None:
        """(the user's loader's length, this one's) for sizing a schedule; None where either has
        none (a stream, a batch sampler without `__len__`)."""
        if self.kind == "stream":
            return None
        try:
            return len(self.base_dataloader), len(self)
        except TypeError:
            return None

    def known_len(self) -> int:
        """Batches in this epoch as far as known (what the boundary policy reads): `len(self)`,
        or for a stream its length once its end is in sight (`UNKNOWN_LENGTH` before)."""
        if self._pass_len is not None:  # read once per pass: asked on every micro-step
            return self._pass_len
        if self.kind != "stream":
            length = len(self)
            if self.in_progress:  # fixed for the pass (its batches are drawn at its start)
                self._pass_len = length
            return length
        if self._stream is not None and self._stream.known_length is not None:
            return self._stream.known_length
        return UNKNOWN_LENGTH

    def last_batch_real_samples(self) -> int | None:
        """At the epoch's last batch: its samples over all ranks that are not padding (what
        `gather_for_metrics` keeps); None at any other batch, or where items are whole batches
        of a map-style dataset (their sizes are unknown: nothing is dropped)."""
        if self.batch_index != self.known_len() - 1 or self.kind == "items":
            return None
        if self.kind == "stream":
            return self._real_samples
        return int(self.batch_sampler.real_samples(self.batch_index))

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (the same permutation on every rank).

        A position inside another epoch (a pass left early, a restored position) no longer
        applies: the next pass starts at batch 0 of `epoch`.
        """
        if int(epoch) != int(self.batch_sampler.epoch):
            self._left_at = None
            self._stream = None
        if self._restored_epoch is not None and int(epoch) != self._restored_epoch:
            self.batch_sampler.skip_batches = 0
            self._restored_epoch = None
        self.batch_sampler.epoch = epoch
        self._epoch_set_explicitly = True

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next iteration start at batch `num_batches` (resume mid-epoch).

        A stream reads the skipped global batches' items (every rank all of them) without
        collating or keeping them: the cost of reading that part of the stream again.
        """
        self.batch_sampler.skip_batches = num_batches
        self._left_at = None
        self._restored_epoch = None
        self._stream = None

    def keep_position(self, next_batch: int) -> None:
        """After a pass left before its end (a `break` out of the loop): record `next_batch` (the
        batches consumed) as where this epoch resumes, so a checkpoint saved now continues there.

        The Engine calls it for a pass it trained on; the next pass in this process still starts
        afresh (as a new `for` over a DataLoader does), unless repositioned.
        """
        if not self.in_progress:
            self._left_at = int(next_batch)

    def _resume_point(self) -> tuple[int, int]:
        """(epoch, batch): the batch after the one being processed; the position a pass left early
        keeps (`keep_position`) or a restored one not yet reached; the next epoch after its last."""
        epoch = int(self.epoch)
        if self.in_progress:
            next_batch = int(self.batch_index) + 1
        elif self.batch_sampler.skip_batches:
            next_batch = int(self.batch_sampler.skip_batches)  # where the next pass starts
        elif self._left_at is not None:
            next_batch = self._left_at
        else:
            next_batch = 0
        if next_batch >= self.known_len():
            epoch, next_batch = epoch + 1, 0
        return epoch, next_batch

    def state_dict(self) -> dict[str, int]:
        """Where to resume: the batch after the one being processed (0 between epochs)."""
        epoch, next_batch = self._resume_point()
        return {"epoch": epoch, "batch_index": next_batch}

    def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict()` plus what resuming on another number of ranks or data needs.

        Positions count global batches of `batch_size` x `num_replicas` units: samples, or the
        user's whole batches ("batches", "items": `batch_size` 1). `num_samples` is the units of
        an epoch; a stream's end is not known, so its entry is the units before the position.
        """
        epoch, next_batch = self._resume_point()
        unit, world = self._unit, int(self.batch_sampler.num_replicas)
        if self.kind == "stream":
            units = next_batch * unit * world
        elif self.kind == "batches":
            units = int(self.batch_sampler.num_batches())
        else:
            units = int(self.num_samples)
        state: dict[str, Any] = {
            "epoch": epoch,
            "next_batch": next_batch,
            "batch_size": unit,
            "num_replicas": world,
            "num_samples": units,
            "epoch_set_explicitly": bool(self._epoch_set_explicitly),
        }
        if self.kind != "indices":
            state["data"] = self.kind
        shuffle_state = getattr(self.batch_sampler, "shuffle_state", None)
        if shuffle_state is not None:  # the order of every epoch, whatever seeds the resumed run
            state["shuffle_state"] = shuffle_state.clone()
        return state

    def load_checkpoint_state(self, saved: Mapping[str, Any], *, index: int = 0) -> None:
        """Resume at `checkpoint_state()`'s position, converted by sample count to this global batch.

        Raises:
            ValueError: the data set has another number of samples (batches) than the saved one,
                another shape (a stream, a batch sampler), or the position lies past this
                loader's epoch.
        """
        next_batch = int(saved["next_batch"])
        old_global = int(saved["batch_size"]) * int(saved["num_replicas"])
        new_global = self._unit * int(self.batch_sampler.num_replicas)
        saved_kind = str(saved.get("data", "indices"))
        units = "batches" if self.kind in ("batches", "items") else "samples"
        if saved_kind != self.kind:
            raise ValueError(
                f"prepared dataloader #{index} is of kind {self.kind!r} but the checkpoint's was "
                f"{saved_kind!r} ('indices': a sampler and batch_size; 'batches': a batch_sampler; "
                "'items': batch_size=None; 'stream': an IterableDataset): the saved position would "
                "point elsewhere. HINT: resume with the same DataLoader set-up as the saved run."
            )
        if self.kind != "stream":
            mine = self.batch_sampler.num_batches() if self.kind == "batches" else self.num_samples
            if int(saved["num_samples"]) != int(mine):
                raise ValueError(
                    f"prepared dataloader #{index} has {mine} {units} but the checkpoint's had "
                    f"{saved['num_samples']}; the saved position would point elsewhere. HINT: resume "
                    "with the same data set."
                )
        if old_global != new_global:
            samples = next_batch * old_global
            next_batch, rest = divmod(samples, new_global)
            if rest:
                warnings.warn(
                    f"ds_engine: dataloader #{index} resumed at {units[:-1]} {samples}, which is not a "
                    f"multiple of the new global batch ({new_global}); it restarts at {units[:-1]} "
                    f"{next_batch * new_global} ({rest} {units} are seen again).",
                    stacklevel=4,
                )
        if self.kind != "stream" and next_batch > len(self):  # the resumed epoch would be empty, silently
            raise ValueError(
                f"`dataloaders[{index}].next_batch` ({saved['next_batch']} batches of {old_global} {units}) "
                f"resumes at batch {next_batch} but prepared dataloader #{index} has {len(self)} batches "
                "per epoch. HINT: the saved position does not fit this data; restore the checkpoint's "
                "file, or load an older tag with `tag=...`."
            )
        shuffled = getattr(self.batch_sampler, "shuffle_state", None) is not None
        if shuffled and saved.get("shuffle_state") is not None:  # its shape was checked on load
            self.batch_sampler.shuffle_state = saved["shuffle_state"].clone()
        self.load_state_dict({"epoch": int(saved["epoch"]), "batch_index": next_batch})
        # load_state_dict pins the epoch; the saved run may have let it advance by itself
        self._epoch_set_explicitly = bool(saved["epoch_set_explicitly"])

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at `state`; the epoch then advances by itself as before."""
        self.batch_sampler.epoch = int(state["epoch"])
        self.skip_first_batches(int(state["batch_index"]))
        self._restored_epoch = int(state["epoch"])

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        start = self.batch_sampler.skip_batches
        if self.base_dataloader.generator is None and not (start and self._restored_epoch is not None):
            # each pass over a torch DataLoader (accelerate's too) draws its base seed from the
            # global RNG; so does this one, so the model's random stream (dropout) is theirs. Not
            # when resuming a checkpoint mid-epoch: that draw is in the RNG state it restored.
            torch.empty((), dtype=torch.int64).random_()
        self._generator.manual_seed(self.batch_sampler.seed + self.batch_sampler.epoch)
        self.in_progress = True
        self._left_at, self._restored_epoch = None, None
        finished = False
        on_batch, after_batch, device = self._on_batch, self._after_batch, self.device
        try:
            self._pass_len = None
            for index, batch in enumerate(self._batches(start), start):
                self.batch_index = index
                on_batch(self, index)
                yield move_to_device(batch, device)
                if after_batch is not None:  # the body of this batch returned (autosave)
                    after_batch(self, index)
                self.batch_index = index + 1
            finished = True
        finally:
            self.in_progress = False
            self.batch_sampler.skip_batches = 0
            if not finished and start:
                self._left_at = start  # unless `keep_position` says more was consumed
            try:
                self._on_end(self)
            finally:
                self._pass_len = None
        if not self._epoch_set_explicitly:
            self.batch_sampler.epoch += 1  # reshuffle next epoch, as accelerate does
        self._epoch_set_explicitly = False

    def _batches(self, start: int) -> Iterator[Any]:
        """This rank's collated batches of the pass that starts at batch `start`."""
        if self.kind != "stream":
            yield from self._loader
            return
        shard = self.batch_sampler
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):  # a `datasets` stream reshuffles its buffer per epoch
            set_epoch(shard.epoch)
        whole = self.batch_size is None  # each item is a whole batch
        items = shard_stream(
            self._loader,
            batch_size=shard.batch_size,
            num_replicas=shard.num_replicas,
            rank=shard.rank,
            drop_last=shard.drop_last,
            skip_batches=start,
            size=_batch_len if whole else None,
        )
        self._stream = StreamWindows(items, start=start, window=self._window(), agree=self._agree)
        collate = self.base_dataloader.collate_fn
        for kept, real in self._stream:
            self._real_samples = real
            yield collate(kept[0]) if whole else collate(kept)

    def _agree(self, count: int) -> int:
        """The smallest `count` over all ranks: one all-reduce (MIN) of one integer."""
        if self.batch_sampler.num_replicas == 1 or not (dist.is_available() and dist.is_initialized()):
            return count
        began = time.perf_counter()
        agreed = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        result = int(agreed.item())
        self.agreements += 1
        self.agreement_seconds += time.perf_counter() - began
        return result


def check_same_length_on_every_rank(
    loader: PreparedDataLoader, *, index: int, caller: str, world: int | None = None
) -> None:
    """Refuse loaders whose length differs across ranks: one all_gather of (batches, samples).

    Every rank must take the same number of micro-steps (each one ends in collectives), and
    the sharding cuts one global sample order: a rank with more batches would wait alone in
    its next collective until the timeout. Raised on every rank alike.

    Args:
        loader: The prepared loader (#`index` of its Engine).
        index: Its position among the Engine's prepared loaders, for the message.
        caller: What the script calls the Engine ("engine", "accelerator").
        world: The number of processes (default: the loader's `num_replicas`).
    """
    world = int(loader.batch_sampler.num_replicas) if world is None else world
    if world == 1:
        return
    try:
        mine = [len(loader), loader.num_samples]
    except TypeError:  # no length: nothing to compare
        mine = [-1, -1]
    batches = loader.batch_sampler.epoch_batches() if loader.kind == "batches" else []
    mine.append(hash(tuple(tuple(batch) for batch in batches)) & (2**62 - 1))
    local = torch.tensor(mine, dtype=torch.int64, device=loader.device)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    lengths = [(int(p[0]), int(p[1])) for p in parts]
    if len(set(lengths)) == 1:
        if len({int(p[2]) for p in parts}) == 1:
            return
        raise ValueError(
            f"`{caller}.prepare`: dataloader #{index}'s batch_sampler "
            f"({type(loader.batch_sampler.batch_sampler).__name__}) yields different batches on "
            "different ranks; ds_engine deals its batches to the ranks round robin, so every rank must "
            "draw the same ones. HINT: seed the batch sampler's random generator the same on every rank "
            "(from a fixed seed and, for a new order each epoch, a `set_epoch(epoch)` method)."
        )
    per_rank = ", ".join(
        f"rank {r}: {n} batches ({s} samples)" if n >= 0 else f"rank {r}: no length"
        for r, (n, s) in enumerate(lengths)
    )
    raise ValueError(
        f"`{caller}.prepare`: dataloader #{index} differs across ranks ({per_rank}); every "
        "rank must take the same number of steps, or the longer ones wait in a collective until "
        "the timeout. HINT: give every rank the same whole dataset and a plain sampler (shuffle or "
        "not): ds_engine shards it across ranks itself; do not split the data per rank or pass a "
        "rank-dependent sampler (DistributedSampler) yourself."
    )
