"""`loss.backward()` on a prepared model's outputs stops before any parameter gets a gradient.

The guard hooks the outputs of every forward; an output whose graph reaches another output
without passing a parameter (a Hugging Face loss computed from the logits) shares that
output's hook. Every output a backward can start from must still be caught, and caught early.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ds_engine import Engine
from ds_engine.collectives import iter_tensors
from ds_engine.guards import _uncovered

DIRECT = r"`loss.backward\(\)` was called on the output of a model prepared by ds_engine"


class TwoHeads(torch.nn.Module):
    """A trunk, two heads, a loss from the first head, and the trunk's features returned too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 8)
        self.head_a = torch.nn.Linear(8, 2)
        self.head_b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.tanh(self.trunk(x))
        a, b = self.head_a(features), self.head_b(features)
        return {"loss": a.pow(2).mean(), "a": a, "b": b, "features": features}


def _prepared(model: torch.nn.Module) -> tuple[Engine, torch.nn.Module]:
    engine = Engine(backend="accelerate")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = engine.prepare(model, optimizer)
    return engine, model


@pytest.mark.parametrize(
    "start",
    [
        lambda out: out["loss"],
        lambda out: out["a"].sum(),
        lambda out: out["b"].sum(),
        lambda out: out["features"].sum(),
        lambda out: out["loss"] + out["b"].mean(),
    ],
    ids=["loss", "head_a", "head_b", "features", "loss_and_head_b"],
)
def test_every_output_is_caught_before_any_parameter_gets_a_gradient(start) -> None:
    engine, model = _prepared(TwoHeads())
    out = model(torch.ones(2, 4))
    with pytest.raises(RuntimeError, match=DIRECT):
        start(out).backward()
    assert all(p.grad is None for p in engine.unwrap_model(model).parameters())


def test_a_hugging_face_loss_shares_its_logits_hook_and_is_still_caught() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=8))
    ids = torch.randint(0, 64, (2, 8))
    out = gpt2(input_ids=ids, labels=ids)
    tensors = [t for t in iter_tensors(out) if t.requires_grad]
    assert [tensors[i] is out.logits for i in _uncovered(tensors)] == [True]  # one hook, on the logits

    engine, model = _prepared(gpt2)  # the second forward reuses the first one's decision
    for start in (lambda o: o.loss, lambda o: torch.nn.functional.log_softmax(o.logits, -1).mean()):
        with pytest.raises(RuntimeError, match=DIRECT):
            start(model(input_ids=ids, labels=ids)).backward()
        assert all(p.grad is None for p in engine.unwrap_model(model).parameters())


def test_outputs_separated_by_a_parameter_keep_their_own_hooks() -> None:
    out = TwoHeads()(torch.ones(2, 4))
    tensors = [t for t in iter_tensors(out) if t.requires_grad]
    kept = _uncovered(tensors)
    # the loss is computed from head a without a parameter between: covered by a's hook
    assert [id(tensors[i]) for i in kept] == [id(out["a"]), id(out["b"]), id(out["features"])]


def test_engine_backward_still_trains_through_the_shared_hook() -> None:
    engine, model = _prepared(TwoHeads())
    before = [p.detach().clone() for p in engine.unwrap_model(model).parameters()]
    with engine.accumulate(model):
        engine.backward(model(torch.ones(2, 4))["loss"])
        engine.optimizer.step()
    after = list(engine.unwrap_model(model).parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after))


class Switching(torch.nn.Module):
    """The same outputs, of the same autograd node types, wired two ways: `b` computed from `a`
    (no parameter between: covered by `a`'s hook) or from a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head_a = torch.nn.Linear(4, 2)
        self.head_b = torch.nn.Linear(4, 2)
        self.b_from_a = True

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.head_a(x)
        return {"a": a, "b": (a if self.b_from_a else self.head_b(x)) * 2}


def test_an_output_covered_in_one_forward_is_caught_when_the_next_wires_it_otherwise() -> None:
    engine, model = _prepared(Switching())
    inner = engine.unwrap_model(model)
    first = model(torch.ones(2, 4))  # `b` covered by `a`: the signature's decision is remembered
    tensors = [t for t in iter_tensors(first) if t.requires_grad]
    assert _uncovered(tensors) == (0,)
    inner.b_from_a = False  # same output signature, but `b` now reaches a parameter first
    second = model(torch.ones(2, 4))
    with pytest.raises(RuntimeError, match=DIRECT):
        second["b"].sum().backward()
    assert all(p.grad is None for p in inner.parameters())


STARTS = {
    "loss": lambda out: out["loss"],
    "head_a": lambda out: out["a"].sum(),
    "head_b": lambda out: out["b"].sum(),
    "features": lambda out: out["features"].sum(),
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [0, 2])
def test_under_deepspeed_the_check_runs_in_deepspeeds_own_output_hooks(stage: int) -> None:
    """DeepSpeed's engine hooks every output of its forward itself: the guard checks there (no
    hook of its own per forward) and still stops every direct backward before any gradient,
    in its own words (before DeepSpeed's refusal on ZeRO-0); a forward that bypasses the
    wrapper (the unwrapped module) is caught by the module's hook."""
    engine = Engine(backend="deepspeed", zero_stage=stage, micro_batch_size=2)
    try:
        heads = TwoHeads()
        model, _ = engine.prepare(heads, torch.optim.SGD(heads.parameters(), lr=0.1))
        inner = engine.unwrap_model(model)
        for name, start in STARTS.items():
            out = model(torch.ones(2, 4))
            # DeepSpeed's one hook per output, none of the guard's
            assert [len(t._backward_hooks or {}) for t in out.values()] == [1] * 4, name
            with pytest.raises(RuntimeError, match=DIRECT):
                start(out).backward()
            assert all(p.grad is None for p in inner.parameters()), name
        with pytest.raises(RuntimeError, match=DIRECT):
            inner(torch.ones(2, 4))["b"].sum().backward()
        assert all(p.grad is None for p in inner.parameters())

        before = [p.detach().clone() for p in inner.parameters()]
        with engine.accumulate(model):
            engine.backward(model(torch.ones(2, 4))["loss"])
            engine.optimizer.step()
        assert any(not torch.equal(b, a) for b, a in zip(before, inner.parameters()))
    finally:
        engine.end_training()


@pytest.mark.deepspeed
def test_under_deepspeed_a_model_prepared_without_an_optimizer_says_so() -> None:
    engine = Engine(backend="deepspeed", zero_stage=0, micro_batch_size=2)
    try:
        teacher = engine.prepare(TwoHeads())
        with pytest.raises(RuntimeError, match="prepared without an optimizer"):
            teacher(torch.ones(2, 4))["loss"].backward()
    finally:
        engine.end_training()
