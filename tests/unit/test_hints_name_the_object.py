"""Hints name the object the user's script holds: `engine` for an Engine, `accelerator` for
`ds_engine.Accelerator` (a ported accelerate script has no `engine`). The schedule-reading log
line (2 ranks only) is checked in `tests/distributed/test_examples.py`."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Accelerator


def test_a_bad_schedule_reading_names_the_accelerator() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(cpu=True)
    accelerator.schedule_sized_from = "sideways"
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4)
    loader = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=2)
    with pytest.raises(ValueError, match=r"`accelerator\.schedule_sized_from = 'sideways'`"):
        accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.end_training()
