"""Several Engines in one process (one per model), in a single process: the errors and guards.

The 2-rank behaviour (a shared process group, distillation parity, per-model overflow) is in
`tests/distributed/test_multi_model.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_engine import Engine


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _trained(seed: int = 0) -> tuple[Engine, torch.nn.Module, torch.optim.Optimizer]:
    engine = Engine(backend="accelerate")
    model = _mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    return engine, model, optimizer


def test_a_second_model_on_one_engine_is_refused_with_the_one_engine_per_model_hint():
    engine, _, _ = _trained()
    with pytest.raises(ValueError, match=r"already prepared one .*one Engine per model"):
        engine.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_a_model_prepared_without_an_optimizer_is_inference_only():
    engine = Engine(backend="accelerate")
    teacher = _mlp(1)
    expected = teacher(torch.ones(3, 4))
    teacher = engine.prepare(teacher)
    assert engine.optimizer is None and engine.lr_scheduler is None
    with torch.no_grad():
        assert torch.equal(teacher(torch.ones(3, 4)), expected.detach())
    with pytest.raises(RuntimeError, match="prepared without an optimizer: it is inference only"):
        engine.backward(teacher(torch.ones(3, 4)).sum())
    with pytest.raises(RuntimeError, match=r"no training state to resume. HINT: .*save_pretrained"):
        engine.save_checkpoint("unused")
    optimizer = torch.optim.SGD(engine.unwrap_model(teacher).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer without its model.*engine.prepare\(model, optimizer"):
        engine.prepare(optimizer)
    assert engine.get_state_dict(teacher) is not None  # weights are still readable


def test_a_backward_into_a_trainable_inference_only_model_is_refused():
    student_engine, student, _ = _trained()
    teacher_engine = Engine(backend="accelerate")
    teacher = teacher_engine.prepare(_mlp(1))  # not frozen, not under no_grad
    x = torch.ones(2, 4)
    loss = (student(x) - teacher(x)).pow(2).mean()
    with pytest.raises(RuntimeError, match=r"prepared without an optimizer.*torch.no_grad"):
        student_engine.backward(loss)


def test_another_engines_backward_passes_through_a_frozen_model_only():
    gen_engine, gen, gen_optimizer = _trained(0)
    disc_engine, disc, _ = _trained(1)
    disc_module = disc_engine.unwrap_model(disc)
    x = torch.ones(2, 4)

    # trainable discriminator: its parameters would get gradients outside its own Engine
    with pytest.raises(RuntimeError, match=r"another Engine's `backward`.*requires_grad_\(False\)"):
        gen_engine.backward(disc_module(gen(x).repeat(1, 4)).mean())
    gen_optimizer.zero_grad()
    for p in disc_module.parameters():
        p.grad = None

    # frozen (the GAN idiom): the generator trains, the discriminator gets nothing
    disc_module.requires_grad_(False)
    before = [p.detach().clone() for p in gen_engine.unwrap_model(gen).parameters()]
    gen_engine.backward(disc_module(gen(x).repeat(1, 4)).mean())
    gen_optimizer.step()
    disc_module.requires_grad_(True)
    assert all(p.grad is None for p in disc_module.parameters())
    after = list(gen_engine.unwrap_model(gen).parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after))


def test_two_engines_cannot_share_a_checkpoint_folder(tmp_path):
    first, _, _ = _trained(0)
    second, _, _ = _trained(1)
    first.save_checkpoint(tmp_path / "first")
    with pytest.raises(ValueError, match=r"another Engine of this process.*its own folder"):
        second.save_checkpoint(tmp_path / "first")
    second.save_checkpoint(tmp_path / "second")
    assert (tmp_path / "first" / "latest").read_text() == (tmp_path / "second" / "latest").read_text()


@pytest.mark.deepspeed
def test_deepspeed_zero3_model_without_optimizer_is_partitioned_and_forward_matches(monkeypatch):
    # DeepSpeed's ZeRO-3 engine swaps torch.nn.functional.linear process-wide: put torch's back
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    model = _mlp(2)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    expected = model(x).detach()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    first = Engine(backend="deepspeed", zero_stage=3)
    second = Engine(backend="deepspeed", zero_stage=2)
    try:
        wrapped = first.prepare(model)
        assert first.optimizer is None
        assert type(wrapped.optimizer).__name__ == "DeepSpeedZeRoOffload"  # no optimizer state
        assert "optimizer" not in (first.ds_config or {})
        with torch.no_grad():
            assert torch.allclose(wrapped(x), expected, rtol=1e-6, atol=1e-7)
        # ZeRO-1/2 have nothing to shard without an optimizer: the model runs replicated
        other = second.prepare(_mlp(3))
        assert (second.ds_config or {})["zero_optimization"]["stage"] == 0
        assert other.optimizer is None
        state = first.get_state_dict(wrapped)
        assert state is not None and all(torch.equal(state[k], v) for k, v in weights.items())
        # the first Engine to end leaves the group to the other
        first.end_training()
        assert dist.is_initialized()
        second.end_training()
        assert not dist.is_initialized()
    finally:
        first.end_training()
        second.end_training()
