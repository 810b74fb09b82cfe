"""Sharding streams and batch samplers across ranks: every rank's batches, their counts, and no
sample twice beyond the documented padding, for many lengths and world sizes."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from ds_engine.dataloader import PreparedDataLoader, check_dataloader
from ds_engine.sharding import BatchSamplerShard, StreamWindows, shard_stream


def stream_shards(n: int, batch: int, world: int, drop_last: bool, skip: int = 0) -> list[list[tuple]]:
    return [
        list(
            shard_stream(
                range(n), batch_size=batch, num_replicas=world, rank=r, drop_last=drop_last, skip_batches=skip
            )
        )
        for r in range(world)
    ]


# ------------------------------------------------------------------------------- streams
@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 60),
    batch=st.integers(1, 5),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_stream_shards_are_the_global_batches_cut_in_rank_order(n, batch, world, drop_last):
    per_rank = stream_shards(n, batch, world, drop_last)
    global_batch = batch * world
    expected_batches = n // global_batch if drop_last else math.ceil(n / global_batch)
    assert all(len(rank) == expected_batches for rank in per_rank)  # the same count on every rank
    for b in range(expected_batches):
        assert all(len(rank[b][0]) == batch for rank in per_rank)  # every rank a full batch
        gathered = [i for rank in per_rank for i in rank[b][0]]  # rank order, as gather does
        real = per_rank[0][b][1]
        assert all(rank[b][1] == real for rank in per_rank)
        assert gathered[:real] == list(range(b * global_batch, b * global_batch + real))
        # the padding repeats the stream's first samples, only in the last global batch
        assert gathered[real:] == [i % max(1, min(n, global_batch)) for i in range(global_batch - real)]
        assert real == global_batch or b == expected_batches - 1
    kept = [i for rank in per_rank for batch_, real in rank for i in batch_]
    unique = sorted({i for i in kept})
    assert unique == list(range(expected_batches * global_batch if drop_last else n))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 40), batch=st.integers(1, 4), world=st.integers(1, 3), skip=st.integers(0, 12))
def test_a_skipped_stream_continues_exactly_where_the_whole_one_is(n, batch, world, skip):
    whole = stream_shards(n, batch, world, drop_last=False)
    resumed = stream_shards(n, batch, world, drop_last=False, skip=skip)
    assert resumed == [rank[skip:] for rank in whole]


def test_items_that_are_whole_batches_count_their_samples():
    items = [torch.zeros(3), torch.zeros(2), torch.zeros(4)]
    out = [
        list(shard_stream(items, batch_size=1, num_replicas=2, rank=r, drop_last=False, size=len))
        for r in range(2)
    ]
    assert [real for _, real in out[0]] == [5, 4]  # the padded 4th item (items[0]) is not real
    assert out[1][1][0][0] is items[0]


def _lockstep(counts: list[int], window: int, start: int) -> tuple[list[list[int]], list, list[int]]:
    """Each rank in a thread with a stream of `counts[r]` batches; `agree` is a real MIN over the
    ranks (a barrier collects every rank's count), as the all-reduce is."""
    ranks = len(counts)
    barrier = threading.Barrier(ranks)
    slots: list[int] = [0] * ranks
    outputs: list[list[int]] = [[] for _ in range(ranks)]
    lengths: list = [None] * ranks
    calls = [0] * ranks

    def run(r: int) -> None:
        def agree(mine: int) -> int:
            calls[r] += 1
            slots[r] = mine
            barrier.wait()
            agreed = min(slots)
            barrier.wait()
            return agreed

        batches = iter(range(start, max(start, counts[r])))
        stream = StreamWindows(batches, start=start, window=window, agree=agree)
        outputs[r] = list(stream)
        lengths[r] = stream.known_length

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outputs, lengths, calls


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    window=st.integers(1, 8),
    start=st.integers(0, 5),
)
def test_stream_windows_end_every_rank_together_at_the_shortest_stream(counts, window, start):
    outputs, lengths, calls = _lockstep(counts, window, start)
    shortest = max(start, min(counts))
    assert all(out == list(range(start, shortest)) for out in outputs)
    assert lengths == [shortest] * len(counts)
    # one agreement per window started (and one more when the stream ends at a window's end)
    assert len(set(calls)) == 1 and calls[0] <= (shortest - start) // window + 2


def test_stream_windows_know_the_end_before_the_last_window_starts():
    seen_lengths = []
    stream = StreamWindows(iter(range(7)), start=0, window=3, agree=lambda m: m)
    for batch in stream:
        seen_lengths.append((batch, stream.known_length))
    # 7 batches, windows [0,1,2] [3,4,5] [6]: the end is known from batch 6's window on
    assert seen_lengths == [(0, None), (1, None), (2, None), (3, None), (4, None), (5, None), (6, 7)]
    stream = StreamWindows(iter(range(6)), start=0, window=3, agree=lambda m: m)
    lengths = [stream.known_length for _ in stream]
    # ends exactly at a window's end: known one batch ahead, from the last window's start
    assert lengths == [None, None, None, 6, 6, 6]


def test_stream_windows_agree_once_per_window_and_stop_at_the_agreed_count():
    calls = []

    def agree(mine: int) -> int:
        calls.append(mine)
        return min(mine, 2) if len(calls) == 3 else mine  # another rank has 2 batches left then

    out = list(StreamWindows(iter(range(100)), start=0, window=4, agree=agree))
    assert calls == [5, 5, 5] and out == list(range(10))  # windows 0-3, 4-7, then 8, 9 only


# ------------------------------------------------------------------------------- batch samplers
def batch_shards(batches: list[list[int]], world: int, drop_last: bool) -> list[list[list[int]]]:
    return [
        list(BatchSamplerShard(batches, num_replicas=world, rank=r, drop_last=drop_last))
        for r in range(world)
    ]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=0, max_size=25),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_batch_sampler_shards_deal_whole_batches_round_robin(sizes, world, drop_last):
    batches, start = [], 0
    for size in sizes:
        batches.append(list(range(start, start + size)))
        start += size
    per_rank = batch_shards(batches, world, drop_last)
    n = len(batches)
    expected = n // world if drop_last else math.ceil(n / world)
    assert all(len(rank) == expected for rank in per_rank)
    shard = BatchSamplerShard(batches, num_replicas=world, rank=0, drop_last=drop_last)
    assert len(shard) == expected
    dealt = [per_rank[r][b] for b in range(expected) for r in range(world)]
    real = dealt[:n]
    assert real == batches[: len(real)]  # the user's order, rank by rank, round by round
    assert dealt[n:] == [batches[i % n] for i in range(len(dealt) - n)] if n else dealt == []
    for b in range(expected):
        gathered = [i for r in range(world) for i in per_rank[r][b]]
        keep = shard.real_samples(b)
        expected_keep = sum(len(x) for x in batches[b * world : min(n, (b + 1) * world)])
        assert keep == expected_keep
        assert len(set(gathered[:keep])) == keep  # no sample twice in what gather_for_metrics keeps


def test_batch_sampler_shard_calls_set_epoch_and_redraws_per_pass():
    class Seeded:
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            g = torch.Generator().manual_seed(self.epoch)
            order = torch.randperm(8, generator=g).tolist()
            return iter([order[i : i + 2] for i in range(0, 8, 2)])

        def __len__(self) -> int:
            return 4

    shard = BatchSamplerShard(Seeded(), num_replicas=2, rank=0, drop_last=False)
    first = list(shard)
    assert list(shard) == first
    shard.epoch = 1
    assert list(shard) != first


# ------------------------------------------------------------------------------- the prepared loader
class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).float().unsqueeze(1).unbind(0))


def _prepared(dl: DataLoader, *, world: int = 1, rank: int = 0, window: int = 1) -> PreparedDataLoader:
    return PreparedDataLoader(
        dl,
        num_replicas=world,
        rank=rank,
        device=torch.device("cpu"),
        on_batch=lambda *a: None,
        on_end=lambda *a: None,
        window=lambda: window,
    )


def test_a_stream_loader_yields_this_rank_slice_and_knows_its_end():
    loaders = [_prepared(DataLoader(Stream(11), batch_size=2), world=2, rank=r, window=2) for r in range(2)]
    got = [[b.squeeze(1).tolist() for b in loader] for loader in loaders]
    assert got[0] == [[0, 1], [4, 5], [8, 9]] and got[1] == [[2, 3], [6, 7], [10, 0]]
    assert loaders[0].known_len() == 3 and loaders[0].kind == "stream"
    with pytest.raises(TypeError, match="HINT"):
        len(loaders[0])


def test_a_stream_loader_resumes_mid_stream_exactly():
    whole = [b.squeeze(1).tolist() for b in _prepared(DataLoader(Stream(13), batch_size=2), window=3)]
    loader = _prepared(DataLoader(Stream(13), batch_size=2), window=3)
    it = iter(loader)
    next(it), next(it)
    saved = loader.checkpoint_state()
    assert saved["data"] == "stream" and saved["next_batch"] == 2
    resumed = _prepared(DataLoader(Stream(13), batch_size=2), window=3)
    resumed.load_checkpoint_state(saved)
    assert [b.squeeze(1).tolist() for b in resumed] == whole[2:]


def test_a_batch_sampler_loader_resumes_mid_epoch_and_drops_the_padding_in_gathers():
    ds = TensorDataset(torch.arange(10).float())
    batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [0]]  # a bucketing sampler's whole batches
    loaders = [_prepared(DataLoader(ds, batch_sampler=batches), world=2, rank=r) for r in range(2)]
    got = [[b[0].tolist() for b in loader] for loader in loaders]
    assert got[0] == [[0, 1, 2], [4, 5], [0]] and got[1] == [[3], [6, 7, 8, 9], [0, 1, 2]]
    assert loaders[0].kind == "batches" and len(loaders[0]) == 3
    it = iter(loaders[0])
    for _ in range(3):
        next(it)
    assert loaders[0].last_batch_real_samples() == 1  # [0] is real, rank 1's [0, 1, 2] is padding
    saved = loaders[1].checkpoint_state()
    loaders[1].load_checkpoint_state({**saved, "next_batch": 1, "epoch": 0})
    assert [b[0].tolist() for b in loaders[1]] == [[6, 7, 8, 9], [0, 1, 2]]


def test_torch_batch_sampler_over_a_plain_sampler_is_sharded_like_batch_size():
    ds = TensorDataset(torch.arange(10).float())
    dl = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 2, drop_last=False))
    loader = _prepared(dl, world=2, rank=1)
    assert loader.kind == "indices" and [b[0].tolist() for b in loader] == [
        [2.0, 3.0],
        [6.0, 7.0],
        [0.0, 1.0],
    ]


def test_batch_size_none_over_a_map_dataset_deals_whole_items():
    ds = [torch.full((2,), float(i)) for i in range(5)]
    loaders = [_prepared(DataLoader(ds, batch_size=None), world=2, rank=r) for r in range(2)]
    got = [[b[0].item() for b in loader] for loader in loaders]
    assert got == [[0.0, 2.0, 4.0], [1.0, 3.0, 0.0]] and loaders[0].kind == "items"


def test_a_distributed_sampler_is_refused_naming_it_with_a_hint():
    from torch.utils.data import DistributedSampler

    ds = TensorDataset(torch.arange(8).float())
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=1))
    with pytest.raises(ValueError, match=r"DistributedSampler \(num_replicas=2, rank=1\).*HINT"):
        check_dataloader(dl, caller="accelerator")


def test_a_stream_already_split_by_node_is_refused_with_a_hint():
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2)
    split = split_dataset_by_node(stream, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"split_dataset_by_node.*rank=0, world_size=2.*HINT"):
        check_dataloader(DataLoader(split, batch_size=2))
    check_dataloader(DataLoader(stream, batch_size=2))  # the whole stream is fine


class WorkerAwareStream(IterableDataset):
    """Each DataLoader worker yields every num_workers-th sample (as `datasets` streams split)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(torch.arange(worker, 10, workers).float().unsqueeze(1).unbind(0))


def test_a_stream_read_by_workers_is_sharded_once_across_ranks():
    loaders = [
        _prepared(DataLoader(WorkerAwareStream(), batch_size=2, num_workers=2), world=2, rank=r, window=2)
        for r in range(2)
    ]
    got = [[v for b in loader for v in b.squeeze(1).tolist()] for loader in loaders]
    assert sorted(got[0] + got[1]) == sorted([float(i) for i in range(10)] + [0.0, 1.0])  # 3 x 4, padded
    assert len(got[0]) == len(got[1]) == 6


def test_a_checkpoint_of_another_kind_of_loader_is_refused_naming_both():
    stream = _prepared(DataLoader(Stream(8), batch_size=2))
    plain = _prepared(DataLoader(TensorDataset(torch.arange(8).float()), batch_size=2))
    with pytest.raises(ValueError, match=r"kind 'indices' but the checkpoint's was 'stream'.*HINT"):
        plain.load_checkpoint_state(stream.checkpoint_state())


def test_deepspeed_sizes_a_batch_sampler_by_its_batch_size_or_largest_batch():
    from types import SimpleNamespace

    ds = TensorDataset(torch.arange(10).float())
    auto, chosen = SimpleNamespace(micro_batch_size="auto"), SimpleNamespace(micro_batch_size=4)
    loader = _prepared(DataLoader(ds, batch_sampler=[[0, 1, 2], [3], [4, 5]]))
    assert loader.for_sizing(auto).batch_size == 3
    assert loader.for_sizing(chosen) is loader.base_dataloader  # the choice stands alone
    declared = BatchSampler(list(range(10)), batch_size=5, drop_last=False)  # not a plain sampler
    assert _prepared(DataLoader(ds, batch_sampler=declared)).for_sizing(auto).batch_size == 5
    assert _prepared(DataLoader(ds, batch_size=2)).for_sizing(auto).batch_size == 2


@pytest.mark.parametrize("data", ["stream", "batches"])
def test_a_position_saved_on_two_ranks_resumes_on_one_at_the_same_place(data):
    def loader(world: int, rank: int) -> PreparedDataLoader:
        if data == "stream":
            return _prepared(DataLoader(Stream(14), batch_size=2), world=world, rank=rank, window=2)
        ds = TensorDataset(torch.arange(14).float())
        return _prepared(DataLoader(ds, batch_sampler=[[i, i + 1] for i in range(0, 14, 2)]), world=world)

    def values(batches) -> list[float]:
        return [v for b in batches for v in (b if data == "stream" else b[0]).flatten().tolist()]

    two = loader(2, 0)
    it = iter(two)
    next(it), next(it)  # global batches 0 and 1 of 2 ranks: samples 0-7
    saved = two.checkpoint_state()
    one = loader(1, 0)
    one.load_checkpoint_state(saved)
    assert values(one) == [float(i) for i in range(8, 14)]


class PairStream(IterableDataset):
    """7 (x, y) pairs, no length."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(7, 3, generator=g), torch.randn(7, 1, generator=g)
        return iter(list(zip(x.unbind(0), y.unbind(0))))


@pytest.mark.parametrize("ga", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("use_windows", [False, True])
def test_an_engine_trains_a_stream_with_the_short_last_window_weighted_right(ga, use_windows):
    """One process, the fallback: boundaries every GA batches and at the stream's end (found by
    reading ahead), each window's step the mean of its batches' gradients (SGD, lr 1);
    `engine.windows` hands out the same windows."""
    import warnings

    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        engine = Engine(
            backend="accelerate", gradient_accumulation_steps=ga, precision="fp32", gradient_clipping=0.0
        )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(PairStream(), batch_size=1))
    pairs = list(PairStream())
    windows = engine.windows(loader) if use_windows else ([batch] for batch in loader)
    boundaries, weight, seen = [], model.weight.detach().clone(), 0
    for window in windows:
        for x, y in window:
            with engine.accumulate(model):
                engine.backward(((model(x) - y) ** 2).mean())
                optimizer.step()
                optimizer.zero_grad()
            boundaries.append(engine.sync_gradients)
            seen += 1
            if engine.sync_gradients:  # the window's mean gradient, from the weights before it
                start = (seen - 1) // ga * ga
                xs = torch.stack([p[0] for p in pairs[start:seen]])
                ys = torch.stack([p[1] for p in pairs[start:seen]])
                w = weight.clone().requires_grad_(True)
                (((xs @ w.T) - ys) ** 2).mean().backward()
                assert torch.allclose(model.weight.detach(), weight - w.grad, atol=1e-6), (ga, seen)
                weight = model.weight.detach().clone()
    lengths = [ga] * (7 // ga) + ([7 % ga] if 7 % ga else [])
    assert boundaries == [i + 1 == n for n in lengths for i in range(n)]
    assert engine.num_optimizer_steps == len(lengths) and seen == 7


def test_prepare_refuses_a_split_loader_while_sorting_its_arguments():
    """Before any process group work: `sort_prepare_arguments` runs first in `prepare`."""
    from torch.utils.data import DistributedSampler

    from ds_engine.guards import sort_prepare_arguments

    ds = TensorDataset(torch.arange(8).float())
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    with pytest.raises(
        ValueError, match=r"`prepare`: the DataLoader over TensorDataset samples with a Distrib"
    ):
        sort_prepare_arguments((dl,), None)
