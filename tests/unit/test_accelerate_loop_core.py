"""The accelerate drop-in's core pieces in one process: hand-written accumulation at GA=1, `is_overflow`,
`engine.save`, the prepared model's `save_pretrained`, and what a schedule's length is read from."""

from __future__ import annotations

import pytest
import torch

from ds_engine import Engine
from ds_engine.scheduler import OverflowAwareScheduler, PreparedOptimizer, schedule_length
from ds_engine.step_state import StepState
from tests.helpers import regression_loader


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)


def test_schedule_length_reads_transformers_and_torch_schedules():
    from transformers import get_scheduler

    opt = _optimizer()
    assert schedule_length(get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)) == 10
    assert schedule_length(get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=12)) == 12
    wsd = get_scheduler(
        "warmup_stable_decay",
        opt,
        num_warmup_steps=2,
        scheduler_specific_kwargs={"num_decay_steps": 3, "num_stable_steps": 5},
    )
    assert schedule_length(wsd) == 10
    assert schedule_length(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=7)) == 7
    assert schedule_length(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=9)) == 9
    assert schedule_length(torch.optim.lr_scheduler.LinearLR(opt, total_iters=4)) == 4
    assert schedule_length(torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)) is None
    assert schedule_length(get_scheduler("constant_with_warmup", opt, num_warmup_steps=2)) is None


def test_scheduler_steps_per_optimizer_step_once_per_applied_step():
    state = StepState()
    opt = _optimizer()
    wrapped = OverflowAwareScheduler(
        torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0), state, steps_per_optimizer_step=2
    )
    state.num_optimizer_steps = 1
    wrapped.step()
    wrapped.step()  # a second call for the same optimizer step: a no-op
    assert (wrapped.num_steps, wrapped.scheduler.last_epoch) == (1, 2)
    state.step_was_skipped = True
    state.num_skipped_steps = 1
    wrapped.step()  # a skipped step: held
    assert wrapped.scheduler.last_epoch == 2
    assert wrapped.state_dict()["steps_per_optimizer_step"] == 2


def test_is_overflow_is_the_last_steps_skip():
    state = StepState()
    opt = PreparedOptimizer(_optimizer(), step=lambda: None, zero_grad=lambda: None, step_state=state)
    assert opt.is_overflow is False and opt.step_was_skipped is False
    state.step_was_skipped = True
    assert opt.is_overflow is True and opt.step_was_skipped is True


def test_hand_written_accumulation_at_ga1_applies_the_sum_until_step():
    engine = Engine(backend="accelerate", gradient_clipping=0.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer, loader = engine.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), regression_loader(8)
    )
    data = list(regression_loader(8))
    for step, (x, y) in enumerate(loader):
        engine.backward(torch.nn.functional.mse_loss(model(x), y) / 2)
        (torch.nn.functional.mse_loss(reference(data[step][0]), data[step][1]) / 2).backward()
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    assert engine.num_optimizer_steps == 2 and not engine.has_unapplied_gradients
    for got, want in zip(engine.unwrap_model(model).parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert engine.optimizer_step_was_skipped is False and optimizer.is_overflow is False


def test_an_epoch_of_backward_without_any_step_is_refused_at_its_end():
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    model, _opt, loader = engine.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), regression_loader(8)
    )
    with pytest.raises(RuntimeError, match=r"called `engine\.backward` but never `optimizer\.step\(\)`"):
        for x, y in loader:
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
    assert engine.num_micro_steps == 4


def test_engine_save_writes_atomically_torch_and_safetensors(tmp_path):
    from safetensors.torch import load_file

    engine = Engine(backend="accelerate")
    obj = {"w": torch.arange(4.0)}
    engine.save(obj, tmp_path / "obj.pt")
    engine.save(obj, tmp_path / "obj.safetensors", safe_serialization=True)
    assert torch.equal(torch.load(tmp_path / "obj.pt", weights_only=True)["w"], obj["w"])
    assert torch.equal(load_file(str(tmp_path / "obj.safetensors"))["w"], obj["w"])
    with pytest.raises(Exception):  # noqa: B017 - safetensors refuses a non-tensor dict
        engine.save({"w": "text"}, tmp_path / "bad.safetensors", safe_serialization=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["obj.pt", "obj.safetensors"]  # no temp left


def test_prepared_models_save_pretrained_idiom_writes_a_reloadable_folder(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    engine = Engine(backend="accelerate")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8))
    model, _opt = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    unwrapped = engine.unwrap_model(model)
    assert "save_pretrained" in vars(unwrapped)  # routed per instance
    unwrapped.save_pretrained(
        tmp_path / "m", state_dict=engine.get_state_dict(model), save_function=engine.save
    )
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "m").state_dict()
    expected = engine.get_state_dict(model)
    assert expected is not None
    for key, value in expected.items():
        assert torch.equal(reloaded[key], value), key
