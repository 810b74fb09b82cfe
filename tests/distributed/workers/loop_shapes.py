"""Loop shapes users of accelerate write: each trains exactly like the canonical loop or stops at once.

For every ZeRO stage in --stages on one backend, each shape gets a fresh Engine, model and
data and runs until it finishes or raises. A shape that finishes must end with the weights
of the canonical ``accumulate()`` loop (proven window-exact by test_window_exact.py); a shape
that raises must do so before any optimizer step was applied (the weights are the initial
ones) and at the expected micro-step.
"""

from __future__ import annotations

import json
import os

import torch
from _common import parse_args, pretend_fsdp_platform, write_result
from torch.utils.data import DataLoader, TensorDataset

MICRO_BATCH = 2
LR = 0.05
SEQ = 8
VOCAB = 32
NUM_BATCHES = 8  # per rank


def make_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0
    )
    cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def make_data(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCAB, (world * MICRO_BATCH * NUM_BATCHES, SEQ), generator=g))


def full_params(engine, model) -> dict[str, torch.Tensor]:
    module = engine.unwrap_model(model)
    out = {}
    for name, param in module.named_parameters():
        if hasattr(param, "full_tensor"):
            out[name] = param.full_tensor().detach().clone()
        elif hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                out[name] = param.detach().clone()
        else:
            out[name] = param.detach().clone()
    return out


# Each shape: (engine GA, loop). A loop gets (engine, model, optimizer, loader, gas) and runs.
def canonical(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        with engine.accumulate(model):
            engine.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()


def no_accumulate_step_every_micro_step(engine, model, optimizer, loader, gas):
    """accumulate() left out; step/zero_grad called every micro-step (the Engine decides)."""
    for (batch,) in loader:
        engine.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()


def zero_grad_first(engine, model, optimizer, loader, gas):
    """torch's usual order: zero_grad at the start of each micro-step, inside accumulate()."""
    for (batch,) in loader:
        with engine.accumulate(model):
            optimizer.zero_grad()
            engine.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()


def hand_written_accumulation(engine, model, optimizer, loader, gas):
    """accelerate's nlp_example / run_glue_no_trainer: divide by gas, step every gas micro-steps."""
    for step, (batch,) in enumerate(loader):
        loss = model(input_ids=batch, labels=batch).loss / gas
        engine.backward(loss)
        if step % gas == gas - 1:
            optimizer.step()
            optimizer.zero_grad()


def hand_written_accumulation_first_step(engine, model, optimizer, loader, gas):
    """accelerate's checkpointing example: `if step % gas == 0` (steps at micro-step 0, gas, ...)."""
    for step, (batch,) in enumerate(loader):
        loss = model(input_ids=batch, labels=batch).loss / gas
        engine.backward(loss)
        if step % gas == 0:
            optimizer.step()
            optimizer.zero_grad()


def backward_without_step(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        engine.backward(model(input_ids=batch, labels=batch).loss)


def zero_grad_before_step(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        with engine.accumulate(model):
            engine.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.zero_grad()
            optimizer.step()


def step_before_backward(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        with engine.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.step()
            engine.backward(loss)
            optimizer.zero_grad()


def two_backwards_in_one_micro_step(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        with engine.accumulate(model):
            engine.backward(model(input_ids=batch, labels=batch).loss)
            engine.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()


def direct_loss_backward(engine, model, optimizer, loader, gas):
    for (batch,) in loader:
        with engine.accumulate(model):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()


# name -> (Engine GA, loop, gas the loop uses, expected): expected is "trains" (the canonical
# loop's weights), "runs" (no error, 4 optimizer steps: its own windows, whose applied gradients
# test_hand_accumulation.py checks), or the (micro-steps taken, optimizer steps applied) when
# the error is raised.
SHAPES = {
    "canonical_ga2": (2, canonical, 2, "trains"),
    "no_accumulate_ga2": (2, no_accumulate_step_every_micro_step, 2, "trains"),
    "zero_grad_first_ga2": (2, zero_grad_first, 2, "trains"),
    # GA=1: the user accumulates by hand; gradients add up until their step(), as in torch
    "hand_written_ga1": (1, hand_written_accumulation, 2, "trains"),
    "hand_written_first_step_ga1": (1, hand_written_accumulation_first_step, 2, "runs"),
    # GA=2: the user's steps fall off the Engine's boundaries (two accumulators disagree)
    "hand_written_ga2": (2, hand_written_accumulation_first_step, 2, (2, 0)),
    "backward_without_step_ga2": (2, backward_without_step, 2, (2, 0)),
    # GA=1: accumulation that is never applied: refused when the epoch ends without a step
    "backward_without_step_ga1": (1, backward_without_step, 1, (8, 0)),
    "zero_grad_before_step_ga1": (1, zero_grad_before_step, 1, (1, 0)),
    "step_before_backward_ga2": (2, step_before_backward, 2, (2, 0)),
    "two_backwards_ga2": (2, two_backwards_in_one_micro_step, 2, (1, 0)),
    "direct_loss_backward_ga2": (2, direct_loss_backward, 2, (1, 0)),
}


def run_shape(name: str, backend: str, stage: int, world: int) -> dict:
    from ds_engine import Engine

    ga, loop, gas, expected = SHAPES[name]
    engine = Engine(
        backend=backend,
        zero_stage=stage,
        gradient_accumulation_steps=ga,
        precision="fp32",
        gradient_clipping=0.0,
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(make_data(world), batch_size=MICRO_BATCH)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    initial = full_params(engine, model)
    error = None
    try:
        loop(engine, model, optimizer, loader, gas)
    except RuntimeError as exc:
        error = str(exc)
    final = full_params(engine, model)
    unchanged = all(torch.equal(initial[k], final[k]) for k in initial)
    return {
        "shape": name,
        "expected": expected,
        "error": error,
        "micro_steps": engine.num_micro_steps,
        "optimizer_steps": engine.num_optimizer_steps,
        "weights_unchanged": unchanged,
        "final": {k: v.tolist() for k, v in final.items()} if expected == "trains" else None,
        "has_unapplied_gradients": engine.has_unapplied_gradients,
    }


def main() -> None:
    args = parse_args(
        [
            ("--backend", {"required": True}),
            ("--stages", {"required": True}),
            ("--pretend-fsdp", {"action": "store_true"}),
        ]
    )
    if args.pretend_fsdp:
        pretend_fsdp_platform()
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for stage in json.loads(args.stages):
        reference = run_shape("canonical_ga2", args.backend, stage, world)
        canonical_final = reference["final"]
        for name in SHAPES:
            r = reference if name == "canonical_ga2" else run_shape(name, args.backend, stage, world)
            if r["final"] is not None:  # a shape that trains: compare with the canonical loop
                r["max_diff_vs_canonical"] = max(
                    float((torch.tensor(r["final"][k]) - torch.tensor(canonical_final[k])).abs().max())
                    for k in r["final"]
                )
                r["final"] = None
            results.append({"stage": stage, "backend": args.backend, **r})
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
