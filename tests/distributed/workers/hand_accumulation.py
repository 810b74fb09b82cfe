"""Hand-written accumulation at Engine(gradient_accumulation_steps=1): the gradient applied at each step.

accelerate's examples accumulate by hand: ``loss / gas``, ``engine.backward(loss)`` every
micro-step, ``optimizer.step(); optimizer.zero_grad()`` every gas micro-steps. Two shapes:

- ``last``: run_glue_no_trainer's ``(step + 1) % gas == 0 or step == len(loader) - 1``: full
  windows of gas micro-steps, then a short last window of ``r`` (every r in 1..gas);
- ``first``: nlp_example's ``step % gas == 0`` over two epochs: a first window of one
  micro-step, then gas-long windows, and the micro-steps after an epoch's last step carried
  into the next epoch's first step (as plain torch does, since nothing clears them).

The optimizer is SGD without momentum, clipping off, so the gradient the optimizer received
is ``(w_before - w_after) / lr`` from the gathered weights around each step. The reference is
a one-process plain-torch run of the same loop that takes each micro-step's samples of every
rank as one batch: at each step it holds the sum of ``grad(loss_i / gas)`` since the last
step, which for a full window is exactly the window mean (what Engine(GA=gas) applies).

Scenarios (JSON list) in --scenarios; keys: backend, zero_stage, coalesce, gas (list).
"""

from __future__ import annotations

import json
import os

import torch
from _common import parse_args, pretend_fsdp_platform, write_result
from torch.utils.data import DataLoader, TensorDataset
from window_grads import LR, MICRO_BATCH, VOCAB, compare, full_params, make_model

SEQ = 8


def make_data(gas: int, length: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 * gas + length)
    return TensorDataset(torch.randint(0, VOCAB, (world * MICRO_BATCH * length, SEQ), generator=g))


def cases(gas: int) -> list[tuple[str, int, int]]:
    """(shape, micro-steps per epoch, epochs)."""
    last = [("last", 2 * gas + r, 1) for r in range(1, gas + 1)]  # a short (or full) last window
    return [*last, ("first", 2 * gas + 1, 2), ("first", 2 * gas + gas - 1, 2)]


def steps_here(shape: str, step: int, length: int, gas: int) -> bool:
    if shape == "last":
        return (step + 1) % gas == 0 or step == length - 1
    return step % gas == 0


def reference(gas: int, world: int) -> list[dict[str, torch.Tensor]]:
    grads = []
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for shape, length, epochs in cases(gas):
        ids = make_data(gas, length, world).tensors[0]
        n = world * MICRO_BATCH
        pending = False
        for _ in range(epochs):
            for step in range(length):
                batch = ids[step * n : (step + 1) * n]
                (model(input_ids=batch, labels=batch).loss / gas).backward()
                pending = True
                if steps_here(shape, step, length, gas):
                    grads.append({k: p.grad.detach().double().clone() for k, p in model.named_parameters()})
                    opt.step()
                    opt.zero_grad()
                    pending = False
        if pending:  # `first` leaves its last micro-steps pending: one more step ends the case
            grads.append({k: p.grad.detach().double().clone() for k, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
    return grads


def run(scenario: dict, gas: int, world: int) -> dict:
    from ds_engine import Engine

    engine = Engine(
        backend=scenario["backend"],
        zero_stage=scenario["zero_stage"],
        gradient_accumulation_steps=1,
        precision="fp32",
        gradient_clipping=0.0,
        coalesce_grad_reduction=scenario.get("coalesce", False),
        micro_batch_size=MICRO_BATCH,
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = engine.prepare(model, optimizer)
    applied, error = [], None
    before = full_params(engine, model)
    try:
        for shape, length, epochs in cases(gas):
            loader = engine.prepare(DataLoader(make_data(gas, length, world), batch_size=MICRO_BATCH))
            for _ in range(epochs):
                for step, (batch,) in enumerate(loader):
                    loss = model(input_ids=batch, labels=batch).loss / gas
                    engine.backward(loss)
                    if steps_here(shape, step, length, gas):
                        optimizer.step()
                        optimizer.zero_grad()
                        after = full_params(engine, model)
                        applied.append({k: (before[k] - after[k]) / LR for k in after})
                        before = after
            if engine.has_unapplied_gradients:  # as the reference: one more step ends the case
                optimizer.step()
                optimizer.zero_grad()
                after = full_params(engine, model)
                applied.append({k: (before[k] - after[k]) / LR for k in after})
                before = after
    except RuntimeError as exc:
        error = str(exc)
    native = engine.ds_config or {}
    return {
        "applied": applied,
        "error": error,
        "optimizer_steps": engine.num_optimizer_steps,
        "managed": native.get("managed_gradient_accumulation", True),
    }


def main() -> None:
    args = parse_args([("--scenarios", {"required": True}), ("--pretend-fsdp", {"action": "store_true"})])
    if args.pretend_fsdp:
        pretend_fsdp_platform()
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for scenario in json.loads(args.scenarios):
        for gas in scenario["gas"]:
            out = run(scenario, gas, world)
            ref = reference(gas, world)
            errors = [compare(got, r) for got, r in zip(out["applied"], ref)]
            results.append(
                {
                    **scenario,
                    "gas": gas,
                    "error": out["error"],
                    "managed": out["managed"],
                    "num_steps": len(out["applied"]),
                    "num_reference_steps": len(ref),
                    "errors": [e for e, _, _ in errors],
                    "tensor_errors": [e for _, e, _ in errors],
                    "worst_tensor": [w for _, _, w in errors],
                }
            )
            print(
                f"[hand_accumulation] {scenario} gas={gas}: max error "
                f"{max(results[-1]['errors'], default=float('nan')):.2e}",
                flush=True,
            )
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
