"""Dataloader sharding shared by both backends.

The Engine owns the accumulation boundary, so it must know where each training dataloader
stands (batch index, length). Both backends therefore use this one wrapper rather than
DeepSpeed's or accelerate's own, which keeps the semantics identical on both.

Sharding is by whole batches, as accelerate does: the user's sampler order is cut into
global batches of ``batch_size * num_processes`` samples; rank ``r`` takes the ``r``-th
slice of each. The last global batch is completed by cycling from the start of the epoch
(every rank gets a full batch, so collectives line up), and `gather_for_metrics` drops
exactly those duplicates because they sit at the end of the gathered, rank-ordered batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
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


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches: slice `rank` of every global batch, padded at the end."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        index_sampler: Sampler | None = None,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.index_sampler = index_sampler  # a custom user sampler, used as is
        self.epoch = 0
        self.skip_batches = 0

    def _order(self) -> list[int]:
        if self.index_sampler is not None:
            return list(self.index_sampler)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.num_samples, generator=generator).tolist()
        return list(range(self.num_samples))

    def __len__(self) -> int:
        global_batch = self.batch_size * self.num_replicas
        if self.drop_last:
            return self.num_samples // global_batch
        return math.ceil(self.num_samples / global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        global_batch = self.batch_size * self.num_replicas
        total = len(self) * global_batch
        if total > len(order) and order:
            order = order + [order[i % len(order)] for i in range(total - len(order))]
        for b in range(self.skip_batches, len(self)):
            start = b * global_batch + self.rank * self.batch_size
            yield order[start : start + self.batch_size]


class PreparedDataLoader:
    """A rank's shard of a user's DataLoader, on the right device, that reports its position.

    Iterating it tells the Engine which batch is current, so the Engine can put the
    accumulation boundary at every GA-th batch and at the last one.
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
    ) -> None:
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError(
                "`prepare` got a DataLoader over an IterableDataset, which ds_engine cannot shard "
                "evenly across ranks. HINT: use a map-style dataset (datasets.Dataset works), or shard "
                "the stream yourself and do not pass the loader to `prepare`."
            )
        if dataloader.batch_size is None:
            raise ValueError(
                "`prepare` got a DataLoader with `batch_size=None` (a custom batch_sampler). "
                "HINT: pass `batch_size=` and a plain `sampler` instead of a `batch_sampler`."
            )
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
        sampler: Any = dataloader.sampler
        shuffle = isinstance(sampler, RandomSampler)
        custom = None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
        if shuffle and getattr(sampler, "generator", None) is not None:
            seed = int(sampler.generator.initial_seed())
        self.batch_sampler = ShardedBatchSampler(
            len(custom) if custom is not None else len(dataloader.dataset),  # type: ignore[arg-type]
            dataloader.batch_size,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=dataloader.drop_last,
            index_sampler=custom,
        )
        self._loader = DataLoader(
            dataloader.dataset,
            batch_sampler=self.batch_sampler,
            collate_fn=dataloader.collate_fn,
            num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory,
            timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
            persistent_workers=dataloader.persistent_workers if dataloader.num_workers > 0 else False,
            generator=self._generator,
        )
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
    def batch_size(self) -> int:
        """Per-rank micro-batch size."""
        return int(self.base_dataloader.batch_size)  # type: ignore[arg-type]

    @property
    def num_samples(self) -> int:
        """Samples in one epoch over all ranks, without padding (what gather_for_metrics keeps)."""
        return self.batch_sampler.num_samples

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (the same permutation on every rank).

        A position inside another epoch (a pass left early, a restored position) no longer
        applies: the next pass starts at batch 0 of `epoch`.
        """
        if int(epoch) != int(self.batch_sampler.epoch):
            self._left_at = None
        if self._restored_epoch is not None and int(epoch) != self._restored_epoch:
            self.batch_sampler.skip_batches = 0
            self._restored_epoch = None
        self.batch_sampler.epoch = epoch
        self._epoch_set_explicitly = True

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next iteration start at batch `num_batches` (resume mid-epoch)."""
        self.batch_sampler.skip_batches = num_batches
        self._left_at = None
        self._restored_epoch = None

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
        if next_batch >= len(self):
            epoch, next_batch = epoch + 1, 0
        return epoch, next_batch

    def state_dict(self) -> dict[str, int]:
        """Where to resume: the batch after the one being processed (0 between epochs)."""
        epoch, next_batch = self._resume_point()
        return {"epoch": epoch, "batch_index": next_batch}

    def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict()` plus what resuming on another number of ranks or data needs."""
        epoch, next_batch = self._resume_point()
        return {
            "epoch": epoch,
            "next_batch": next_batch,
            "batch_size": int(self.batch_size),
            "num_replicas": int(self.batch_sampler.num_replicas),
            "num_samples": int(self.num_samples),
            "epoch_set_explicitly": bool(self._epoch_set_explicitly),
        }

    def load_checkpoint_state(self, saved: Mapping[str, Any], *, index: int = 0) -> None:
        """Resume at `checkpoint_state()`'s position, converted by sample count to this global batch.

        Raises:
            ValueError: the data set has another number of samples than the saved one, or the
                position lies past this loader's epoch.
        """
        next_batch = int(saved["next_batch"])
        old_global = int(saved["batch_size"]) * int(saved["num_replicas"])
        new_global = int(self.batch_size) * int(self.batch_sampler.num_replicas)
        if int(saved["num_samples"]) != int(self.num_samples):
            raise ValueError(
                f"prepared dataloader #{index} has {self.num_samples} samples but the checkpoint's had "
                f"{saved['num_samples']}; the saved position would point elsewhere. HINT: resume with the "
                "same data set."
            )
        if old_global != new_global:
            samples = next_batch * old_global
            next_batch, rest = divmod(samples, new_global)
            if rest:
                warnings.warn(
                    f"ds_engine: dataloader #{index} resumed at sample {samples}, which is not a multiple "
                    f"of the new global batch ({new_global}); it restarts at sample "
                    f"{next_batch * new_global} ({rest} samples are seen again).",
                    stacklevel=4,
                )
        if next_batch > len(self):  # past the epoch: the resumed epoch would be empty, silently
            raise ValueError(
                f"`dataloaders[{index}].next_batch` ({saved['next_batch']} batches of {old_global} samples) "
                f"resumes at batch {next_batch} but prepared dataloader #{index} has {len(self)} batches "
                "per epoch. HINT: the saved position does not fit this data; restore the checkpoint's "
                "file, or load an older tag with `tag=...`."
            )
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
        self._generator.manual_seed(self.batch_sampler.seed + self.batch_sampler.epoch)
        self.in_progress = True
        self._left_at, self._restored_epoch = None, None
        finished = False
        try:
            for offset, batch in enumerate(self._loader):
                self.batch_index = start + offset
                self._on_batch(self, self.batch_index)
                yield move_to_device(batch, self.device)
                if self._after_batch is not None:  # the body of this batch returned (autosave)
                    self._after_batch(self, self.batch_index)
                self.batch_index = start + offset + 1
            finished = True
        finally:
            self.in_progress = False
            self.batch_sampler.skip_batches = 0
            if not finished and start:
                self._left_at = start  # unless `keep_position` says more was consumed
            self._on_end(self)
        if not self._epoch_set_explicitly:
            self.batch_sampler.epoch += 1  # reshuffle next epoch, as accelerate does
        self._epoch_set_explicitly = False


def check_same_length_on_every_rank(
    loader: PreparedDataLoader, *, index: int, world: int, caller: str
) -> None:
    """Refuse loaders whose length differs across ranks: one all_gather of (batches, samples).

    Every rank must take the same number of micro-steps (each one ends in collectives), and
    the sharding cuts one global sample order: a rank with more batches would wait alone in
    its next collective until the timeout. Raised on every rank alike.

    Args:
        loader: The prepared loader (#`index` of its Engine).
        index: Its position among the Engine's prepared loaders, for the message.
        world: The number of processes.
        caller: What the script calls the Engine ("engine", "accelerator").
    """
    if world == 1:
        return
    try:
        mine = [len(loader), loader.num_samples]
    except TypeError:  # no length: nothing to compare
        mine = [-1, -1]
    local = torch.tensor(mine, dtype=torch.int64, device=loader.device)
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
        f"`{caller}.prepare`: dataloader #{index} differs across ranks ({per_rank}); every "
        "rank must take the same number of steps, or the longer ones wait in a collective until "
        "the timeout. HINT: give every rank the same whole dataset and a plain sampler (shuffle or "
        "not): ds_engine shards it across ranks itself; do not split the data per rank or pass a "
        "rank-dependent sampler (DistributedSampler) yourself."
    )
