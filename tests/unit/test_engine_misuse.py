"""Training-call misuse in one process: a non-scalar loss, an optimizer over other tensors,
calls after `end_training`, and the position a checkpoint records after a `break`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine
from tests.helpers import train

BACKENDS = ["accelerate", pytest.param("deepspeed", marks=pytest.mark.deepspeed)]


def _data(n: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 4), torch.randn(n, 1, generator=g)
    )


def _prepared(backend: str, **choices):
    engine = Engine(backend=backend, **choices)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(_data(), batch_size=2)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    return engine, model, optimizer, loader, scheduler


# ------------------------------------------------------------------ the loss
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loss_with_several_values_is_refused_before_anything_runs(backend):
    engine, model, optimizer, _, _ = _prepared(backend)

    def per_sample() -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(torch.ones(3, 4)), torch.zeros(3, 1), reduction="none")

    with pytest.raises(
        ValueError, match=r"loss of shape \(3, 1\) \(3 values\).*HINT: .*engine\.backward\(loss\.mean\(\)\)"
    ):
        engine.backward(per_sample())
    with pytest.raises(TypeError, match=r"got a float.*HINT: pass the tensor itself"):
        engine.backward(1.5)  # type: ignore[arg-type]
    with torch.no_grad():
        detached = per_sample().mean()
    with pytest.raises(ValueError, match=r"does not require gradients.*torch\.no_grad\(\).*HINT: compute"):
        engine.backward(detached)
    assert engine.num_micro_steps == 0 and not engine.has_unapplied_gradients
    engine.backward(per_sample().mean())  # the fix works, also with a one-element (1,) loss
    optimizer.step()
    engine.backward(per_sample().sum().reshape(1))
    optimizer.step()
    assert engine.num_optimizer_steps == 2
    engine.end_training()


# ------------------------------------------------------------------ the optimizer's parameters
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_over_another_models_parameters_is_refused_at_prepare(backend):
    engine = Engine(backend=backend)
    model, other = torch.nn.Linear(4, 1), torch.nn.Linear(4, 3)
    with pytest.raises(
        ValueError,
        match=r"optimizer \(AdamW\) steps tensors the model \(Linear\) does not own: none of its 2 "
        r"parameters is a parameter of the model \(the first: param_groups\[0\]\['params'\]\[0\], "
        r"shape \(3, 4\)\).*HINT: .*torch\.optim\.AdamW\(model\.parameters\(\), \.\.\.\)",
    ):
        engine.prepare(model, torch.optim.AdamW(other.parameters()))
    assert engine.optimizer is None and getattr(engine._backend, "ds_engine", None) is None
    extra = torch.nn.Parameter(torch.ones(2))
    groups = [{"params": list(model.parameters())}, {"params": [extra], "lr": 1.0}]
    with pytest.raises(
        ValueError, match=r"1 of its 3 parameters are not.*param_groups\[1\]\['params'\]\[0\], shape \(2,\)"
    ):
        engine.prepare(model, torch.optim.SGD(groups, lr=0.1))
    engine.end_training()  # no Engine of this test outlives it (they share the group)


def test_an_optimizer_over_part_of_the_model_is_fine():
    engine = Engine(backend="accelerate")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)  # a frozen part the optimizer does not hold
    frozen = model[0].weight.detach().clone()
    model, optimizer = engine.prepare(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    before = engine.unwrap_model(model)[1].weight.detach().clone()
    engine.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    inner = engine.unwrap_model(model)
    assert not torch.equal(inner[1].weight, before) and torch.equal(inner[0].weight, frozen)
    engine.end_training()  # no Engine of this test outlives it (they share the group)


# ------------------------------------------------------------------ after end_training
def _after_end_calls(engine, model, optimizer, loader, scheduler, tmp_path: Path):
    x = torch.ones(2, 4)
    return {
        "engine.backward(loss)": lambda: engine.backward(model(x).sum()),
        "engine.accumulate(model)": lambda: engine.accumulate(model).__enter__(),
        "optimizer.step()": optimizer.step,
        "optimizer.zero_grad()": optimizer.zero_grad,
        "scheduler.step()": scheduler.step,
        "engine.clip_grad_norm_(...)": lambda: engine.clip_grad_norm_(model.parameters(), 1.0),
        "engine.save_checkpoint(directory)": lambda: engine.save_checkpoint(tmp_path / "ckpt"),
        "engine.load_checkpoint(directory)": lambda: engine.load_checkpoint(tmp_path / "ckpt"),
        "engine.get_state_dict(model)": lambda: engine.get_state_dict(model),
        "engine.save_pretrained(model, directory)": lambda: engine.save_pretrained(model, tmp_path / "out"),
        "engine.save(obj, f)": lambda: engine.save({"a": 1}, tmp_path / "obj.pt"),
        "engine.gather(...)": lambda: engine.gather(torch.ones(1)),
        "engine.reduce(...)": lambda: engine.reduce(torch.ones(1)),
        "engine.wait_for_everyone()": engine.wait_for_everyone,
        "engine.prepare(...)": lambda: engine.prepare(DataLoader(_data(), batch_size=2)),
        "engine.init_context()": engine.init_context,
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_call_after_end_training_raises_the_same_error(backend, tmp_path):
    engine, model, optimizer, loader, scheduler = _prepared(backend)
    train(engine, model, optimizer, loader, scheduler)
    steps, lr = engine.num_optimizer_steps, scheduler.get_last_lr()
    engine.end_training()
    engine.end_training()  # a second call does nothing
    for call, fn in _after_end_calls(engine, model, optimizer, loader, scheduler, tmp_path).items():
        with pytest.raises(RuntimeError) as caught:
            fn()
        message = str(caught.value)
        assert message.startswith(f"`{call}` after `end_training()`: end_training() destroyed"), (
            call,
            message,
        )
        assert re.search(r"HINT: call `end_training\(\)` once, as the script's last call", message), message
    assert engine.num_optimizer_steps == steps and scheduler.get_last_lr() == lr
    assert not list(tmp_path.iterdir())  # nothing was written
    # what needs neither the group nor the prepared objects still answers
    assert engine.is_main_process and engine.num_processes == 1 and engine.process_index == 0
    engine.print("done")
    assert engine.unwrap_model(model) is not None


def test_the_accelerate_surface_names_its_own_object_after_end_training(tmp_path):
    from ds_engine import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    model, optimizer, _ = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), batch_size=2)
    )
    accelerator.end_training()
    with pytest.raises(RuntimeError, match=r"^`accelerator\.backward\(loss\)` after `end_training\(\)`"):
        accelerator.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(
        RuntimeError, match=r"^`accelerator\.save_(state|checkpoint)\(.*\)` after `end_training\(\)`"
    ):
        accelerator.save_state(tmp_path / "state")
    assert not (tmp_path / "state").exists()
    with pytest.raises(RuntimeError, match=r"^`optimizer\.step\(\)` after `end_training\(\)`"):
        optimizer.step()
    for name in ("reduce", "pad_across_processes", "gather_for_metrics"):
        with pytest.raises(RuntimeError, match=rf"^`accelerator\.{name}\(\.\.\.\)` after `end_training\(\)`"):
            getattr(accelerator, name)(torch.ones(2))


# ------------------------------------------------------------------ leaving the loop
def _run(tmp_path: Path, *, stop_after: int | None, resume: bool, total: int = 16) -> list[list[float]]:
    """Train over a shuffled loader (8 batches an epoch, GA 2) until `total` batches were seen, or
    `stop_after` (then break and save); the batches (first feature of each sample) seen, in order."""
    torch.manual_seed(0)
    engine = Engine(backend="accelerate", gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(_data(16), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    done = engine.load_checkpoint(tmp_path / "ckpt")["done"] if resume else 0
    seen: list[list[float]] = []
    while done + len(seen) < total:
        for x, y in loader:
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            seen.append(x[:, 0].tolist())
            if len(seen) == stop_after or done + len(seen) == total:
                break  # the usual `if step >= max_steps: break`
        if len(seen) == stop_after:
            engine.save_checkpoint(tmp_path / "ckpt", client_state={"done": len(seen)})
            break
    engine.end_training()
    return seen


@pytest.mark.parametrize("stop_after", [4, 8])  # mid-epoch, and on the epoch's last batch
def test_a_break_out_of_the_loop_then_a_save_resumes_at_the_next_batch(tmp_path, stop_after):
    whole = _run(tmp_path, stop_after=None, resume=False)
    first = _run(tmp_path, stop_after=stop_after, resume=False)
    rest = _run(tmp_path, stop_after=None, resume=True)
    assert first + rest == whole
    assert len(whole) == 16


def test_a_break_before_training_the_batch_resumes_at_that_batch(tmp_path):
    """`if step >= max_steps: break` at the top of the body: the fetched batch was not trained on."""
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(_data(16), batch_size=2))
    for step, (x, _) in enumerate(loader):
        if step >= 3:
            break
        engine.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert engine.state_dict()["dataloaders"][0]["next_batch"] == 3
    engine.end_training()  # no Engine of this test outlives it (they share the group)


def test_a_break_out_of_a_loop_over_two_zipped_loaders_keeps_both_positions():
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, first, second = engine.prepare(
        model, optimizer, DataLoader(_data(16), batch_size=2), DataLoader(_data(12), batch_size=2)
    )
    for step, ((x, _), (z, _)) in enumerate(zip(first, second)):
        engine.backward(model(x).sum() + model(z).sum())
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            break
    assert [d["next_batch"] for d in engine.state_dict()["dataloaders"]] == [3, 3]
    engine.end_training()  # no Engine of this test outlives it (they share the group)


def test_a_break_out_of_an_evaluation_loop_starts_its_next_pass_afresh(tmp_path):
    """A pass nothing trained on (evaluation) restarts at its first batch, live and after a resume."""
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, train, evaluation = engine.prepare(
        model, optimizer, DataLoader(_data(16), batch_size=2), DataLoader(_data(16), batch_size=2)
    )
    for step, (x, _) in enumerate(train):
        engine.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            with torch.no_grad():
                for i, _batch in enumerate(evaluation):
                    if i == 2:
                        break
        if step == 2:
            break
    positions = [(d["epoch"], d["next_batch"]) for d in engine.state_dict()["dataloaders"]]
    assert positions == [(0, 3), (0, 0)]
    assert next(iter(evaluation))[0][0, 0].item() == 0.0  # the live next pass starts afresh too
    engine.end_training()  # no Engine of this test outlives it (they share the group)


def test_set_epoch_to_another_epoch_drops_a_position_of_the_old_one(tmp_path):
    """A loop that caps the steps per epoch (`break`) and sets the next epoch: resume starts it at 0."""
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(_data(16), batch_size=2))
    for step, (x, _) in enumerate(loader):
        engine.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            break
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.end_training()
    resumed = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = resumed.prepare(model, optimizer, DataLoader(_data(16), batch_size=2))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.state_dict()["dataloaders"][0]["next_batch"] == 3  # saved at once: kept
    loader.set_epoch(0)  # the same epoch: the position holds
    assert next(iter(loader))[0][0, 0].item() == 6.0
    resumed.load_checkpoint(tmp_path / "ckpt")
    loader.set_epoch(1)  # the script moved on to the next epoch
    state = resumed.state_dict()["dataloaders"][0]
    assert (state["epoch"], state["next_batch"]) == (1, 0)
    resumed.end_training()


# ------------------------------------------------------------------ train() / eval()
@pytest.mark.parametrize("backend", BACKENDS)
def test_train_and_eval_of_a_prepared_model_return_it(backend):
    engine = Engine(backend=backend)
    teacher = engine.prepare(torch.nn.Linear(4, 1)).eval()
    assert teacher is not None and isinstance(teacher, torch.nn.Module)
    assert not teacher.training and not engine.unwrap_model(teacher).training
    assert teacher.train() is teacher and teacher.training and engine.unwrap_model(teacher).training
    assert teacher.train(False) is teacher and not engine.unwrap_model(teacher).training
    engine.end_training()
