"""Checkpoints written in the background (`blocking=False`): the state is the one of the save's
step, whatever training does next; errors come back at the next call that waits; nothing is
published before the files are complete."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine._async_save import host_copy
from ds_engine.checkpoint import LATEST_NAME, wait_for_checkpoint
from ds_engine.safety import restricted_load


def _prepared() -> tuple[Any, ...]:
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        engine = Engine(backend="accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    return engine, *engine.prepare(model, optimizer, DataLoader(data, batch_size=2))


def _step(engine: Any, model: Any, optimizer: Any, batch: Any) -> None:
    x, y = batch
    with engine.accumulate(model):
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _save(engine: Any, model: Any, directory: Path, tag: str, blocking: bool, **kwargs: Any) -> None:
    engine.save_checkpoint(directory, tag=tag, blocking=blocking, **kwargs)


def _files(tag_dir: Path) -> dict[str, Any]:
    return {p.name: restricted_load(p) for p in sorted(tag_dir.glob("*.pt"))}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_host_copy_is_a_snapshot_that_keeps_views_and_parameters() -> None:
    base = torch.arange(6.0)
    param = torch.nn.Parameter(torch.ones(2))
    state = {"a": base, "view": base[2:4], "nested": [(param, 3)], "size": torch.Size([2])}
    copied = host_copy(state)
    base.add_(1)
    param.data.zero_()
    assert torch.equal(copied["a"], torch.arange(6.0))
    assert copied["view"].untyped_storage().data_ptr() == copied["a"].untyped_storage().data_ptr()
    assert torch.equal(copied["view"], torch.tensor([2.0, 3.0]))
    assert isinstance(copied["nested"][0][0], torch.nn.Parameter)
    assert torch.equal(copied["nested"][0][0], torch.ones(2))
    assert isinstance(copied["size"], torch.Size)


def test_a_background_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared()
    batches = iter(loader)
    _step(engine, model, optimizer, next(batches))
    _save(engine, model, tmp_path / "blocking", "t", True)
    _save(engine, model, tmp_path / "background", "t", False)
    for _ in range(3):  # training goes on while the thread writes
        _step(engine, model, optimizer, next(batches))
    wait_for_checkpoint()
    assert (tmp_path / "background" / LATEST_NAME).read_text() == "t"
    ours, theirs = _files(tmp_path / "background" / "t"), _files(tmp_path / "blocking" / "t")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert _same(ours[name], theirs[name]), name
    assert sorted(p.name for p in (tmp_path / "background").iterdir()) == ["latest", "t"]  # no staging left


def test_the_next_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared()
    batches = iter(loader)
    for tag in ("a", "b", "c"):
        _step(engine, model, optimizer, next(batches))
        _save(engine, model, tmp_path / "ckpt", tag, False, keep_last=2)
    wait_for_checkpoint()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["b", "c", "latest"]
    assert not [t for t in threading.enumerate() if t.name == "ds-engine-checkpoint"]


def test_an_error_in_the_background_is_raised_at_the_next_wait_and_nothing_is_published(
    tmp_path: Path,
) -> None:
    engine, model, optimizer, loader = _prepared()
    batches = iter(loader)
    _step(engine, model, optimizer, next(batches))
    _save(engine, model, tmp_path / "ckpt", "good", False)
    _step(engine, model, optimizer, next(batches))
    _save(engine, model, tmp_path / "ckpt", "bad", False, client_state={"when": threading.Lock})
    with pytest.raises(TypeError, match=r"`client_state` holds an object that cannot be loaded without"):
        wait_for_checkpoint()
    wait_for_checkpoint()  # raised once: the next wait has nothing in flight
    assert (tmp_path / "ckpt" / LATEST_NAME).read_text() == "good"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["good", "latest"]


def test_blocking_must_be_a_bool(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared()
    _step(engine, model, optimizer, next(iter(loader)))
    with pytest.raises(ValueError, match=r"`blocking`='no' must be True or False"):
        _save(engine, model, tmp_path / "ckpt", "t", "no")  # type: ignore[arg-type]
