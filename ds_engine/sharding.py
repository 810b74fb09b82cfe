"""How a prepared dataloader's batches are cut across ranks: one global order, the same number
of batches on every rank, padding only at the end of an epoch.

One rule per shape of data (`ds_engine.dataloader.PreparedDataLoader` picks it):

- A sampler of indices and a ``batch_size`` (`ShardedBatchSampler`): the sampler's order is cut
  into global batches of ``batch_size * num_replicas`` samples; rank ``r`` takes the ``r``-th
  slice of each. The last global batch is completed by cycling from the start of the epoch.
- A batch sampler of whole batches (`BatchSamplerShard`, for length-grouped or bucketing
  samplers): whole batches go to the ranks round robin, as accelerate's ``BatchSamplerShard``
  does; the last round is completed by repeating the epoch's first batches (``drop_last`` on the
  batch sampler drops the incomplete round instead).
- A stream (`shard_stream`, for an ``IterableDataset``): every rank reads the whole stream and
  keeps its slice of each global batch, as accelerate's ``IterableDatasetShard`` does; the last
  global batch is completed from the stream's first samples. `StreamWindows` reads it one
  accumulation window (and one batch) ahead and has the ranks agree on how many batches are
  left, so every rank ends the epoch at the same batch and knows its last window's length.

In every case the padding sits at the end of the gathered, rank-ordered last batch, so
`gather_for_metrics` drops it by keeping that batch's real samples (`real_samples`).
Nothing here talks to other processes; `StreamWindows` is given the agreement as a function.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import Sampler

__all__ = [
    "UNKNOWN_LENGTH",
    "BatchSamplerShard",
    "ShardPosition",
    "ShardedBatchSampler",
    "StreamWindows",
    "epoch_permutation",
    "shard_stream",
]

UNKNOWN_LENGTH = sys.maxsize
"""The length of an epoch whose end has not been seen yet (a stream)."""

T = TypeVar("T")


def epoch_permutation(
    generator: torch.Generator, n: int, epoch: int, loader_draws_from_it: bool
) -> list[int]:
    """The order torch's `RandomSampler` gives in `epoch` (from 0), its `generator` in the state
    it had when the loader was prepared, iterated as a DataLoader iterates it under accelerate.

    Each epoch draws, in this order: the DataLoader's base seed when it shares the sampler's
    generator, the epoch's permutation, and the second permutation `RandomSampler` draws and
    slices empty when it is exhausted. Replaying the earlier epochs makes any epoch's order a
    function of the prepared state and the epoch number alone (resumable), at the cost of two
    permutations per earlier epoch.
    """
    order = torch.empty(0, dtype=torch.int64)
    for done in range(epoch + 1):
        if loader_draws_from_it:
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = torch.randperm(n, generator=generator)
        if done < epoch:
            torch.randperm(n, generator=generator)
    return order.tolist()


class ShardPosition:
    """Where this rank stands in a sharded order: which rank of how many, the epoch and the seed
    its order is drawn from, the batches to skip at the epoch's start (a resume), and whether an
    incomplete last round is dropped. The prepared loader moves it (`set_epoch`, resume)."""

    def __init__(self, *, num_replicas: int, rank: int, drop_last: bool, seed: int = 0) -> None:
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.skip_batches = 0


class ShardedBatchSampler(Sampler[list[int]], ShardPosition):
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
        shuffle_state: torch.Tensor | None = None,
        loader_draws_from_it: bool = False,
    ) -> None:
        ShardPosition.__init__(self, num_replicas=num_replicas, rank=rank, drop_last=drop_last, seed=seed)
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.shuffle_state = shuffle_state
        """The sampler's generator state at `prepare`, whose draws give each epoch's order (None:
        a generator seeded `seed + epoch`)."""
        self.loader_draws_from_it = loader_draws_from_it
        """The DataLoader shares the sampler's generator: it draws its base seed from it first."""
        self.index_sampler = index_sampler  # a custom user sampler, used as is

    def _order(self) -> list[int]:
        if self.index_sampler is not None:
            return list(self.index_sampler)
        if self.shuffle and self.shuffle_state is not None:
            generator = torch.Generator()
            generator.set_state(self.shuffle_state)
            return epoch_permutation(generator, self.num_samples, self.epoch, self.loader_draws_from_it)
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

    def real_samples(self, batch: int) -> int:
        """Samples of global batch `batch` (all ranks) that are not padding."""
        global_batch = self.batch_size * self.num_replicas
        return max(0, min(global_batch, self.num_samples - batch * global_batch))


class BatchSamplerShard(Sampler[list[int]], ShardPosition):
    """Whole batches of a user's batch sampler to the ranks round robin.

    Global batch ``b`` is the user's batches ``b * num_replicas ... b * num_replicas + W - 1``;
    rank ``r`` takes the ``r``-th of them. Every rank gets ``ceil(batches / W)`` batches: the
    last round is completed by the epoch's first batches (``floor(batches / W)`` with
    ``drop_last``: the incomplete round is dropped). Each pass iterates the user's sampler
    once (after its ``set_epoch(epoch)`` when it has one), so its batches must be the same on
    every rank: a deterministic order, or one drawn from a seed and the epoch.

    Args:
        batch_sampler: The user's batch sampler (an iterable of lists of indices).
        num_replicas: The number of ranks.
        rank: This rank.
        drop_last: Drop the last incomplete round instead of padding it.
    """

    def __init__(
        self, batch_sampler: Iterable[Any], *, num_replicas: int, rank: int, drop_last: bool
    ) -> None:
        ShardPosition.__init__(self, num_replicas=num_replicas, rank=rank, drop_last=drop_last)
        self.batch_sampler = batch_sampler
        self._batches: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, *, fresh: bool = False) -> list[list[int]]:
        """The user's batches of this epoch (drawn once per pass: `fresh` at a pass's start)."""
        if fresh or self._batches is None or self._batches[0] != self.epoch:
            set_epoch = getattr(self.batch_sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            self._batches = (self.epoch, [list(batch) for batch in self.batch_sampler])
        return self._batches[1]

    def num_batches(self) -> int:
        """The user's batches per epoch (its `len` when it has one)."""
        try:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        except TypeError:
            return len(self.epoch_batches())

    @property
    def num_samples(self) -> int:
        """Indices in one epoch's batches (without padding)."""
        return sum(len(batch) for batch in self.epoch_batches())

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_batches() // self.num_replicas
        return math.ceil(self.num_batches() / self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(fresh=True)
        for b in range(self.skip_batches, len(self)):
            i = b * self.num_replicas + self.rank
            yield batches[i % len(batches)]

    def real_samples(self, batch: int) -> int:
        """Indices of round `batch` (all ranks) that are not padding."""
        batches = self.epoch_batches()
        first = batch * self.num_replicas
        return sum(len(b) for b in batches[first : min(len(batches), first + self.num_replicas)])


def shard_stream(
    items: Iterable[Any],
    *,
    batch_size: int,
    num_replicas: int,
    rank: int,
    drop_last: bool,
    skip_batches: int = 0,
    size: Callable[[Any], int] | None = None,
) -> Iterator[tuple[list[Any], int]]:
    """This rank's slice of each global batch of a stream, as accelerate's ``IterableDatasetShard``.

    Every rank reads every item: the stream's order is cut into global batches of
    ``batch_size * num_replicas`` items, rank ``r`` keeps items ``r * batch_size ...`` of each.
    An incomplete last global batch is dropped with `drop_last`, else completed by cycling
    through the stream's first global batch (the padding lands at its end).

    Args:
        items: The stream.
        batch_size: Items per rank per batch.
        num_replicas: The number of ranks.
        rank: This rank.
        drop_last: Drop an incomplete last global batch.
        skip_batches: Global batches to read past first (resume): their items are read, not kept.
        size: Samples in an item (an item that is a whole batch); default 1.

    Yields:
        (this rank's items, samples of the global batch that are not padding).
    """
    global_batch = batch_size * num_replicas
    mine = range(rank * batch_size, (rank + 1) * batch_size)
    first: list[Any] = []
    kept: list[Any] = []
    count = real = 0
    skip = skip_batches * global_batch
    for item in items:
        if len(first) < global_batch:
            first.append(item)
        if skip:
            skip -= 1
            continue
        if count in mine:
            kept.append(item)
        real += 1 if size is None else size(item)
        count += 1
        if count == global_batch:
            yield kept, real
            kept, count, real = [], 0, 0
    if count and not drop_last and not skip:
        for pad in range(global_batch - count):
            if count + pad in mine:
                kept.append(first[pad % len(first)])
        yield kept, real


class StreamWindows(Generic[T]):
    """A stream's batches, read one accumulation window and one batch ahead, ended together.

    Before the first batch of each window (and at a pass's start) every rank reads up to the
    window's end plus one batch, and the ranks agree on the smallest count read (`agree`: one
    all-reduce MIN). Fewer than asked means the epoch ends in this window: `known_length`
    is set before its first batch is yielded, so the window's length, and whether a batch is the
    epoch's last, are known when it is trained on; every rank stops at the same batch.

    Args:
        batches: This rank's batches (from `shard_stream`).
        start: The index of the first batch (a resumed position).
        window: The accumulation window (gradient_accumulation_steps).
        agree: Called with this rank's count; returns the smallest over all ranks.
    """

    def __init__(self, batches: Iterator[T], *, start: int, window: int, agree: Callable[[int], int]) -> None:
        self.batches = batches
        self.start = start
        self.window = max(1, int(window))
        self.agree = agree
        self.known_length: int | None = None
        """The batches of this epoch, once its end is in sight; None before."""

    def __iter__(self) -> Iterator[T]:
        index = self.start
        buffer: deque[T] = deque()
        exhausted = False
        while True:
            want = (index // self.window + 1) * self.window - index + 1  # the window's rest, one more
            while len(buffer) < want and not exhausted:
                try:
                    buffer.append(next(self.batches))
                except StopIteration:
                    exhausted = True
            agreed = self.agree(len(buffer))
            last = agreed < want
            if last:
                self.known_length = index + agreed
            for _ in range(agreed if last else want - 1):
                yield buffer.popleft()
                index += 1
            if last:
                return
