"""Sharding by whole batches: distinct samples per rank, padding only at the end, reshuffle per epoch."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ds_engine.dataloader import PreparedDataLoader, ShardedBatchSampler, move_to_device


def shards(num_samples: int, batch: int, world: int, **kw) -> list[list[list[int]]]:
    return [
        list(
            ShardedBatchSampler(
                num_samples,
                batch,
                num_replicas=world,
                rank=r,
                shuffle=kw.get("shuffle", False),
                seed=kw.get("seed", 0),
                drop_last=kw.get("drop_last", False),
            )
        )
        for r in range(world)
    ]


def test_ranks_get_distinct_consecutive_slices_of_each_global_batch():
    per_rank = shards(16, 2, 2)
    assert per_rank[0] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert per_rank[1] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    seen = sorted(i for rank in per_rank for batch in rank for i in batch)
    assert seen == list(range(16))


def test_uneven_tail_is_padded_from_the_start_so_every_rank_gets_full_batches():
    per_rank = shards(7, 2, 2)
    assert [len(b) for b in per_rank[0]] == [2, 2]
    assert [len(b) for b in per_rank[1]] == [2, 2]
    # gathered in rank order, the last global batch is [4, 5, 6, 0]: the duplicate is at the end
    assert per_rank[0][-1] + per_rank[1][-1] == [4, 5, 6, 0]


def test_drop_last_drops_the_incomplete_global_batch():
    per_rank = shards(7, 2, 2, drop_last=True)
    assert per_rank == [[[0, 1]], [[2, 3]]]


def test_shuffle_is_the_same_permutation_on_every_rank_and_changes_per_epoch():
    a = ShardedBatchSampler(20, 2, num_replicas=2, rank=0, shuffle=True, seed=3, drop_last=False)
    b = ShardedBatchSampler(20, 2, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=False)
    epoch0 = [i for batch in list(a) + list(b) for i in batch]
    assert sorted(epoch0) == list(range(20))
    a.epoch = b.epoch = 1
    epoch1 = [i for batch in list(a) + list(b) for i in batch]
    assert sorted(epoch1) == list(range(20)) and epoch1 != epoch0


def _loader(n=10, batch=2, shuffle=False, world=2, rank=0, events=None):
    events = [] if events is None else events
    ds = TensorDataset(torch.arange(n).float().unsqueeze(1))
    return PreparedDataLoader(
        DataLoader(ds, batch_size=batch, shuffle=shuffle),
        num_replicas=world,
        rank=rank,
        device=torch.device("cpu"),
        on_batch=lambda dl, i: events.append(i),
        on_end=lambda dl: events.append("end"),
    )


def test_prepared_loader_reports_each_batch_and_the_end():
    events: list = []
    loader = _loader(events=events)
    batches = [b[0].squeeze(1).tolist() for b in loader]
    assert batches == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]
    assert events == [0, 1, 2, "end"]
    assert len(loader) == 3 and loader.num_samples == 10


def test_resume_skips_batches_without_loading_them():
    loader = _loader()
    loader.load_state_dict({"epoch": 0, "batch_index": 2})
    assert [b[0].squeeze(1).tolist() for b in loader] == [[8.0, 9.0]]
    assert next(b[0].squeeze(1).tolist() for b in loader) == [0.0, 1.0]  # next epoch starts at 0


def test_epoch_advances_automatically_and_set_epoch_pins_it():
    loader = _loader(shuffle=True)
    first = [b[0].squeeze(1).tolist() for b in loader]
    second = [b[0].squeeze(1).tolist() for b in loader]
    assert first != second
    loader.set_epoch(0)
    assert [b[0].squeeze(1).tolist() for b in loader] == first


def test_iterable_dataset_is_sharded_not_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    loader = PreparedDataLoader(
        DataLoader(Stream(), batch_size=1),
        num_replicas=1,
        rank=0,
        device=torch.device("cpu"),
        on_batch=lambda *a: None,
        on_end=lambda *a: None,
    )
    assert loader.kind == "stream" and [b.tolist() for b in loader] == [[0], [1], [2]]


def test_move_to_device_keeps_structure():
    batch = {"a": torch.ones(1), "b": [torch.zeros(1), 3], "c": (torch.ones(2),)}
    moved = move_to_device(batch, torch.device("cpu"))
    assert set(moved) == {"a", "b", "c"} and moved["b"][1] == 3 and isinstance(moved["c"], tuple)


def test_each_pass_draws_the_base_seed_a_torch_dataloader_draws_from_the_global_rng():
    # a torch DataLoader (and accelerate's) draws one int64 from the global RNG per pass: the
    # model's random stream after it (dropout) is the same as theirs
    loader = _loader(shuffle=True)
    torch.manual_seed(11)
    torch.empty((), dtype=torch.int64).random_()
    expected = torch.rand(3)
    torch.manual_seed(11)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(3), expected)


def test_a_shuffled_order_is_accelerates_and_is_drawn_once_at_prepare():
    from torch.utils.data import DataLoader as TorchLoader

    torch.manual_seed(3)
    plain = TorchLoader(range(10), batch_size=2, shuffle=True)
    seed = int(torch.empty((), dtype=torch.int64).random_().item())  # what accelerate's prepare draws
    plain.sampler.generator = torch.Generator().manual_seed(seed)
    torch_epochs = [[int(i) for batch in plain for i in batch] for _ in range(3)]
    torch.manual_seed(3)
    loader = _loader(shuffle=True, world=1)
    ours = [[int(i) for batch in loader for i in batch[0].squeeze(1).tolist()] for _ in range(3)]
    assert ours == torch_epochs  # every epoch, as torch's sampler continues its generator


def test_a_resumed_shuffle_keeps_the_saved_order_whatever_the_new_run_draws():
    torch.manual_seed(5)
    loader = _loader(shuffle=True)
    it = iter(loader)
    next(it)
    saved = loader.checkpoint_state()
    rest = [b[0].squeeze(1).tolist() for b in it]
    torch.manual_seed(6)  # the resumed run seeds otherwise: its own draw would give another order
    resumed = _loader(shuffle=True)
    resumed.load_checkpoint_state(saved)
    assert [b[0].squeeze(1).tolist() for b in resumed] == rest


def test_state_dict_mid_epoch_points_at_the_next_batch_and_resume_keeps_advancing_epochs():
    torch.manual_seed(0)  # both runs seed alike, so prepare draws the same order
    loader = _loader(shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state == {"epoch": 0, "batch_index": 1}
    rest_of_epoch0 = [b[0].squeeze(1).tolist() for b in it]
    epoch1 = [b[0].squeeze(1).tolist() for b in loader]
    torch.manual_seed(0)
    resumed = _loader(shuffle=True)
    resumed.load_state_dict(state)
    assert [b[0].squeeze(1).tolist() for b in resumed] == rest_of_epoch0
    assert [b[0].squeeze(1).tolist() for b in resumed] == epoch1
