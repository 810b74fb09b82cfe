"""One checkpoint folder per live Engine: an Engine the script dropped (even one held in a
reference cycle) or ended no longer claims its folder; a live one still does."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine
from tests.helpers import train


def _trained(seed: int) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback says what it cannot honour
        engine = Engine(backend="accelerate")
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2)
    train(engine, *engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader))
    engine.cycle = engine  # type: ignore[attr-defined]  # a reference cycle, as real scripts make
    return engine


def test_a_dropped_or_ended_engine_releases_its_folder(tmp_path: Path) -> None:
    gc.disable()  # the cycle survives until the claim check collects it
    try:
        _trained(0).save_checkpoint(tmp_path / "ckpt")  # dropped without end_training
        _trained(1).save_checkpoint(tmp_path / "ckpt", tag="next")
    finally:
        gc.enable()
    ended = _trained(2)
    ended.save_checkpoint(tmp_path / "ckpt2")
    ended.end_training()
    _trained(3).save_checkpoint(tmp_path / "ckpt2", tag="next")
    live = _trained(4)
    live.save_checkpoint(tmp_path / "ckpt3")
    with pytest.raises(ValueError, match=r"holds the checkpoints of another Engine of this process.*HINT"):
        _trained(5).save_checkpoint(tmp_path / "ckpt3", tag="next")
    assert live.num_optimizer_steps == 2
