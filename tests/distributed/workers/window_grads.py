"""Window-exact accumulation, every case: the gradient applied at each boundary is the window mean.

For one backend setting (DeepSpeed ZeRO 0-3, coalesced 2/3, or the fallback's DDP / FSDP2)
and every GA in the scenario, one Engine trains a tiny GPT-2 (it returns its own loss, the
shape that exposed DeepSpeed's GA hook) over one prepared dataloader per last-window length:
windows ``[GA, r]`` for every ``r`` in ``1..GA`` (``r == GA`` is a full last window).

The optimizer is SGD without momentum or weight decay, and clipping is off, so the step is
``w -= lr * g``: the gradient the optimizer really received is ``(w_before - w_after) / lr``,
read from the full (gathered) weights around each boundary. Neither Adam (which divides by the
gradient's own scale) nor clipping (which renormalises it) can hide a wrong divisor here.
A single-process plain-torch reference takes each window as one big batch on the same data
and records its exact gradient before stepping.

Scenarios (JSON list) in --scenarios; keys: backend, zero_stage, coalesce, gas (list of GA).
"""

from __future__ import annotations

import json
import os
import time

import torch
from _common import parse_args, pretend_fsdp_platform, write_result
from torch.utils.data import DataLoader, TensorDataset

MICRO_BATCH = 2
LR = 0.05
SEQ = 8
VOCAB = 32


def make_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def make_data(ga: int, last: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 * ga + last)
    ids = torch.randint(0, VOCAB, (world * MICRO_BATCH * (ga + last), SEQ), generator=g)
    return TensorDataset(ids)


def full_params(engine, model) -> dict[str, torch.Tensor]:
    module = engine.unwrap_model(model)
    out = {}
    for name, param in module.named_parameters():
        if hasattr(param, "full_tensor"):  # FSDP2 shard
            out[name] = param.full_tensor().detach().double().clone()
        elif hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                out[name] = param.detach().double().clone()
        else:
            out[name] = param.detach().double().clone()
    return out


def reference(gas: list[int], world: int) -> list[dict[str, torch.Tensor]]:
    """Exact window-mean gradients of a one-process run that takes each window as one batch."""
    grads = []
    for ga in gas:
        model = make_model()  # each GA starts from the seeded weights, as each Engine does
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for last in range(1, ga + 1):
            ids = make_data(ga, last, world).tensors[0]
            start = 0
            for window in (ga, last):
                n = window * world * MICRO_BATCH
                batch = ids[start : start + n]
                start += n
                opt.zero_grad()
                model(input_ids=batch, labels=batch).loss.backward()
                grads.append({k: p.grad.detach().double().clone() for k, p in model.named_parameters()})
                opt.step()
    return grads


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """Relative error of the whole gradient, and the largest per-tensor one (with its name)."""
    diff = torch.sqrt(sum(((got[k] - r).norm() ** 2 for k, r in ref.items()), torch.tensor(0.0)))
    total = torch.sqrt(sum((r.norm() ** 2 for r in ref.values()), torch.tensor(0.0, dtype=torch.float64)))
    worst, where = 0.0, ""
    for name, r in ref.items():
        floor = 1e-3 * float(total)  # e.g. GPT-2's attention key bias: zero up to rounding
        err = float((got[name] - r).norm()) / max(float(r.norm()), floor)
        if err > worst:
            worst, where = err, name
    return float(diff / total), worst, where


def run(scenario: dict, world: int) -> dict:
    from ds_engine import Engine

    gas = scenario["gas"]
    windows, applied = [], []
    for ga in gas:
        t0 = time.time()
        engine = Engine(
            backend=scenario["backend"],
            zero_stage=scenario["zero_stage"],
            gradient_accumulation_steps=ga,
            precision="fp32",
            gradient_clipping=0.0,
            coalesce_grad_reduction=scenario.get("coalesce", False),
            micro_batch_size=MICRO_BATCH,
        )
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = engine.prepare(model, optimizer)
        before = full_params(engine, model)
        for last in range(1, ga + 1):
            loader = engine.prepare(DataLoader(make_data(ga, last, world), batch_size=MICRO_BATCH))
            boundaries = []
            for (batch,) in loader:
                with engine.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    engine.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                boundaries.append(engine.sync_gradients)
                if engine.sync_gradients:
                    after = full_params(engine, model)
                    applied.append({k: (before[k] - after[k]) / LR for k in after})
                    before = after
            windows.append({"ga": ga, "last": last, "boundaries": boundaries})
        print(f"[window_grads] {scenario} GA={ga}: {time.time() - t0:.1f}s", flush=True)
    return {"windows": windows, "applied": applied, "steps": len(applied)}


def main() -> None:
    args = parse_args([("--scenarios", {"required": True}), ("--pretend-fsdp", {"action": "store_true"})])
    if args.pretend_fsdp:
        pretend_fsdp_platform()
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for scenario in json.loads(args.scenarios):
        out = run(scenario, world)
        ref = reference(scenario["gas"], world)
        errors = [compare(got, r) for got, r in zip(out["applied"], ref)]
        results.append(
            {
                **scenario,
                "windows": out["windows"],
                "num_boundaries": out["steps"],
                "num_reference_windows": len(ref),
                "errors": [e for e, _, _ in errors],
                "tensor_errors": [e for _, e, _ in errors],
                "worst_tensor": [w for _, _, w in errors],
            }
        )
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
