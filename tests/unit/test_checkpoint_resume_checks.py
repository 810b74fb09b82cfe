"""What a resume checks before it loads anything: the optimizer class, and the engine state.

A tag records the class of the optimizer that trained it; a resume with another class (whose
state does not fit: SGD's `momentum` is not in Adam's groups) is refused at `load_checkpoint`,
naming both, instead of failing at the first `step()` with a bare `KeyError`. An
`engine_state.pt` of the wrong shape, or whose position lies past its epoch (which resumed
into an empty epoch without a word), is refused naming the file and the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_engine.checkpoint import CHECKPOINT_META_NAME, ENGINE_STATE_NAME
from tests.helpers import micro_step, prepared_linear, quiet_fallback


def _prepared(make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> tuple[Any, ...]:
    return prepared_linear(quiet_fallback(), optimizer=make_optimizer)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    engine, model, optimizer, loader = _prepared(_adamw)
    micro_step(engine, model, optimizer, next(iter(loader)))
    engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
    return tmp_path / "ckpt"


# --------------------------------------------------------------------------- optimizer class
def test_the_tag_records_the_optimizer_class(saved: Path) -> None:
    meta = json.loads((saved / "t1" / CHECKPOINT_META_NAME).read_text())
    assert meta["optimizer"] == "torch.optim.adamw.AdamW"


def test_a_resume_with_another_optimizer_class_is_refused_naming_both(saved: Path) -> None:
    engine, model, optimizer, loader = _prepared(_sgd)
    with pytest.raises(
        ValueError,
        match=r"t1' was written by a run whose optimizer is torch\.optim\.adamw\.AdamW but this run's is "
        r"torch\.optim\.sgd\.SGD; .*HINT: prepare the saved run's optimizer class \(`AdamW`\), or turn it "
        r"into weights with `ds-engine consolidate .* OUT --tag t1`",
    ):
        engine.load_checkpoint(saved)
    micro_step(engine, model, optimizer, next(iter(loader)))  # nothing was loaded: SGD trains on as it was


def test_the_same_class_resumes_and_an_unrecorded_class_is_not_compared(saved: Path) -> None:
    engine, model, optimizer, loader = _prepared(_adamw)
    engine.load_checkpoint(saved)
    micro_step(engine, model, optimizer, next(iter(loader)))
    path = saved / "t1" / CHECKPOINT_META_NAME
    meta = json.loads(path.read_text())
    del meta["optimizer"]  # a tag written before the class was recorded
    path.write_text(json.dumps(meta))
    engine, *_ = _prepared(_adamw)
    engine.load_checkpoint(saved)


def test_a_recorded_class_that_is_not_a_name_is_refused(saved: Path) -> None:
    path = saved / "t1" / CHECKPOINT_META_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "optimizer": ["AdamW"]}))
    engine, *_ = _prepared(_adamw)
    with pytest.raises(
        ValueError, match=r"ds_engine_meta\.json': `optimizer` is \['AdamW'\]; allowed: .*HINT"
    ):
        engine.load_checkpoint(saved)


# --------------------------------------------------------------------------- engine state
def _edit(saved: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    path = saved / "t1" / ENGINE_STATE_NAME
    state = torch.load(path, weights_only=True)
    result = change(state)
    torch.save(state if result is None else result, path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s["dataloaders"][0].update(next_batch=10**12),
            r"`dataloaders\[0\]\.next_batch` is 1000000000000; allowed: a batch of its epoch \(4 batches of "
            r"2 x 1 ranks for 8 samples\)",
        ),
        (
            lambda s: s["dataloaders"][0].update(epoch=-1),
            r"`dataloaders\[0\]\.epoch` is -1; allowed: an int >= 0",
        ),
        (
            lambda s: s["dataloaders"][0].pop("batch_size") and None,
            r"`dataloaders\[0\]\.batch_size` is missing",
        ),
        (lambda s: s["dataloaders"].append("x"), r"`dataloaders\[1\]` is 'x'; allowed: a dict"),
        (lambda s: s["counters"].update(num_optimizer_steps="5"), r"`counters\.num_optimizer_steps` is '5'"),
        (lambda s: s["counters"].update(num_micro_steps=-3), r"`counters\.num_micro_steps` is -3"),
        (lambda s: s.pop("dataloaders") and None, r"`dataloaders` is missing; allowed: a list"),
        (lambda s: s.update(client_state=[1]), r"`client_state` is \[1\]; allowed: a dict"),
        (lambda s: [s], r"`\(the whole file\)` is of type list; allowed: a dict"),
    ],
    ids=[
        "position_past_the_epoch",
        "negative_epoch",
        "missing_batch_size",
        "position_not_a_dict",
        "counter_as_text",
        "negative_counter",
        "no_dataloaders",
        "client_state_not_a_dict",
        "a_list",
    ],
)
def test_an_engine_state_of_the_wrong_shape_names_the_file_and_key(
    saved: Path, change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    _edit(saved, change)
    engine, model, *_ = _prepared(_adamw)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError) as raised:
        engine.load_checkpoint(saved)
    text = str(raised.value)
    assert re.match(rf"checkpoint file '.*/t1/engine_state\.pt': {message}", text), text
    assert re.search(r"HINT: the file was changed after ds_engine wrote it", text), text
    assert torch.equal(model.weight, before)  # refused before anything was loaded


def test_a_position_past_the_prepared_epoch_names_the_file_and_key(saved: Path) -> None:
    """Consistent with its own geometry (1 batch of 1000 samples) but 500 batches into this loader."""
    _edit(saved, lambda s: s["dataloaders"][0].update(next_batch=1, batch_size=1000))
    engine, *_ = _prepared(_adamw)
    with pytest.raises(
        ValueError,
        match=r"checkpoint file '.*/t1/engine_state\.pt': `dataloaders\[0\]\.next_batch` \(1 batches of 1000 "
        r"samples\) resumes at batch 500 but prepared dataloader #0 has 4 batches per epoch\. HINT: ",
    ):
        engine.load_checkpoint(saved)
