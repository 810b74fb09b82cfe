"""DeepSpeed-specific Engine features on 2 ranks: CPU-Adam swap under optimizer offload keeps
every hyper-parameter, the config's native optimizer when none is passed, and the reported
grad norm equals the global pre-clip norm of a single-process reference."""

from __future__ import annotations

import os

import torch
from _common import parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))


def model_() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def offload_keeps_hyperparameters() -> dict:
    from ds_engine import Engine

    engine = Engine(zero_stage=2, offload_optimizer="cpu", gradient_accumulation_steps=1)
    model = model_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5**k)
    model, optimizer, loader, scheduler = engine.prepare(
        model, optimizer, DataLoader(data(8), batch_size=2), scheduler
    )
    inner = engine._backend.ds_engine.optimizer.optimizer  # the ZeRO optimizer wraps the real one
    lrs = []
    for x, y in loader:
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(inner.param_groups[0]["lr"])
    group = inner.param_groups[0]
    return {
        "type": type(inner).__name__,
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "adamw_mode": bool(getattr(inner, "adam_w_mode", False)),
        "lrs": lrs,
        "steps": engine.num_optimizer_steps,
    }


def native_optimizer() -> dict:
    from ds_engine import Engine

    engine = Engine(zero_stage=1, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.85, 0.99]}})
    model, loader = engine.prepare(model_(), DataLoader(data(8), batch_size=2))
    before = [p.detach().clone() for p in engine.unwrap_model(model).parameters()]
    for x, y in loader:
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            engine.optimizer.step()  # DeepSpeed's own optimizer, reached through the Engine
    after = list(engine.unwrap_model(model).parameters())
    return {
        "changed": any(not torch.equal(a, b) for a, b in zip(after, before)),
        "optimizer": type(engine._backend.ds_engine.optimizer).__name__,
        "ds_optimizer_block": engine.ds_config["optimizer"],
    }


def grad_norms(stage: int, clip: float) -> dict:
    from ds_engine import Engine

    world = int(os.environ["WORLD_SIZE"])
    engine = Engine(zero_stage=stage, gradient_accumulation_steps=2, gradient_clipping=clip)
    model = model_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = data(world * 2 * 2 * 2)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(dataset, batch_size=2))
    got = []
    for x, y in loader:
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip:
                engine.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            got.append(engine.grad_norm)
    # reference: one process, each window as one batch, SGD with the same clipping
    ref_model = model_()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    expected = []
    for start in range(0, len(dataset), world * 4):
        x, y = dataset.tensors[0][start : start + world * 4], dataset.tensors[1][start : start + world * 4]
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip if clip else float("inf"))
        expected.append(float(norm))
        ref_opt.step()
    return {"stage": stage, "clip": clip, "got": got, "expected": expected}


def main() -> None:
    args = parse_args()
    out = {
        "offload": offload_keeps_hyperparameters(),
        "native": native_optimizer(),
        "norms": [grad_norms(stage, clip) for stage in (0, 1, 2, 3) for clip in (0.0, 0.05)],
    }
    write_result(args.out, out)


if __name__ == "__main__":
    main()
