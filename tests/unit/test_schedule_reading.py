"""The LR-schedule length reading on its own (`ds_engine.scheduler.schedule_reading`), and the
other pure pieces the Engine delegates to: dotted "auto" filling, the config variable's name."""

from __future__ import annotations

import logging

import pytest
import torch

from ds_engine.auto_values import filled_auto_blocks
from ds_engine.scheduler import schedule_reading


def _linear(total: int) -> torch.optim.lr_scheduler.LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=total)


def _read(
    total: int | None, *, ga: int = 2, lengths=(40, 20), sized_from="auto", world=2, default="prepared"
):
    scheduler = _linear(total) if total is not None else object()
    return schedule_reading(
        scheduler,
        sized_from=sized_from,
        world=world,
        ga=ga,
        loader_lengths=lengths,
        default=default,
        caller="engine",
        owner="Engine",
    )


def test_one_process_and_an_explicit_reading_say_nothing():
    assert _read(30, world=1) == (1, logging.INFO, "")
    assert _read(30, sized_from="unprepared")[:2] == (2, logging.INFO)
    assert _read(30, sized_from="prepared") == (1, logging.INFO, "")


def test_a_bad_reading_names_the_choices():
    with pytest.raises(ValueError, match=r"`engine.schedule_sized_from = 'both'`; allowed: 'auto'"):
        _read(30, sized_from="both")


def test_a_length_of_whole_epochs_of_one_reading_decides():
    # 30 batches un-prepared, 15 per process, GA 2: 15, or 7 / 8 optimizer steps per epoch
    per_step, level, message = _read(45, lengths=(30, 15))  # 3 epochs of 15: the un-prepared only
    assert (per_step, level) == (2, logging.INFO)
    assert "is whole epochs of the unprepared dataloader only" in message
    per_step, level, message = _read(16, lengths=(30, 15))  # 2 epochs of 8: the prepared only
    assert (per_step, level) == (1, logging.INFO)
    assert "HINT: set `engine.schedule_sized_from = 'unprepared'` before `prepare`" in message


@pytest.mark.parametrize(
    ("total", "ga", "lengths", "why"),
    [
        (40, 2, (40, 20), "fits both readings"),
        (7, 2, (40, 20), "fits neither reading"),
        (None, 2, (40, 20), "its length is unknown"),
        (30, 2, None, "no dataloader was prepared"),
        (30, 1, (40, 20), "at gradient_accumulation_steps=1 its length"),
    ],
)
def test_otherwise_the_default_reading_applies_with_a_warning(total, ga, lengths, why):
    for default, per_step in (("prepared", 1), ("unprepared", 2)):
        got, level, message = _read(total, ga=ga, lengths=lengths, default=default)
        assert got == per_step and why in message and "the default reading of Engine" in message
        if why != "fits both readings":
            assert level == logging.WARNING


def test_fill_auto_fills_only_auto_values_in_the_two_blocks():
    class Config:
        optimizer = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}}
        scheduler = None

    blocks = filled_auto_blocks(
        Config, {"optimizer.params.lr": 3e-5, "optimizer.params.weight_decay": 0.0, "scheduler.params.x": 1}
    )
    assert blocks == {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.1}}}
    assert Config.optimizer["params"]["lr"] == "auto"  # a copy: the config is not changed
    with pytest.raises(ValueError, match=r"'zero_optimization.stage' = 3 is not in the `optimizer`"):
        filled_auto_blocks(Config, {"zero_optimization.stage": 3})


def test_the_config_variable_is_named_in_a_module_of_its_own():
    from ds_engine import engine, engine_env

    assert engine.CONFIG_ENV == engine_env.CONFIG_ENV == "DS_ENGINE_CONFIG"
