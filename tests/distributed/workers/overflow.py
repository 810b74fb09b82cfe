"""Overflow-aware stepping worker.

Trains a small MLP with an LR schedule and injects non-finite gradients (loss * inf on rank 0
only, so ranks must agree to skip) at chosen optimizer steps. Records, per boundary: whether
the step was skipped, the LR after the scheduler call, the loss scale, the grad norm.
"""

from __future__ import annotations

import json
import math
import os

import torch
from _common import parse_args, patch_cpu_fp16, probe_exit, write_result
from torch.utils.data import DataLoader, TensorDataset


def run(s: dict) -> dict:
    from ds_engine import Engine

    ga = s.get("ga", 1)
    steps = s.get("steps", 8)
    choices = {
        "zero_stage": s.get("zero_stage", 0),
        "precision": s["precision"],
        "gradient_accumulation_steps": ga,
    }
    if s["precision"] == "fp16":
        choices.update(
            initial_scale_power=s.get("initial_scale_power", 8),
            hysteresis=s.get("hysteresis", 2),
            loss_scale_window=s.get("loss_scale_window", 1000),
        )
    if s.get("clip"):
        choices["gradient_clipping"] = s["clip"]
    if s.get("ds_scheduler"):
        choices["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 1e-3,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        }
    engine = Engine(backend=s["backend"], **choices)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if s.get("hf_schedule"):
        from transformers import get_scheduler

        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=steps)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(5)
    n = world * 2 * ga * steps
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    loader = DataLoader(data, batch_size=2)
    if s.get("ds_scheduler"):  # DeepSpeed's own scheduler from the config, reached the same way
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        scheduler = engine.lr_scheduler
    else:
        model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    inject = set(s.get("inject", []))
    # DeepSpeed runs the module in fp16/bf16; float inputs must match (HF token ids need nothing)
    dtype = next(engine.unwrap_model(model).parameters()).dtype
    records = []
    for batch_index, (x, y) in enumerate(loader):
        window = batch_index // ga
        with engine.accumulate(model):
            out = model(x.to(dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
            if window in inject and engine.process_index == 0 and batch_index % ga == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            if s.get("clip"):
                engine.clip_grad_norm_(model.parameters(), s["clip"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            records.append(
                {
                    "skipped": engine.step_was_skipped,
                    "lr": scheduler.get_last_lr()[0],
                    "loss_scale": engine.loss_scale,
                    "grad_norm": engine.grad_norm
                    if engine.grad_norm is None or math.isfinite(engine.grad_norm)
                    else str(engine.grad_norm),
                }
            )
    params_finite = all(
        bool(torch.isfinite(p).all()) for p in engine.unwrap_model(model).parameters() if p.numel() > 0
    )
    ds = getattr(engine._backend, "ds_engine", None)
    return {
        **s,
        # fp32 ZeRO-0 with clipping: skipped inside DeepSpeed's step(), counted there as for fp16
        "clip_norm_kept": ds is not None and "_ds_engine_clip_norm" in vars(ds),
        "deepspeed_skipped_steps": getattr(ds, "skipped_steps", None),
        "records": records,
        "num_optimizer_steps": engine.num_optimizer_steps,
        "num_skipped_steps": engine.num_skipped_steps,
        "scheduler_steps": scheduler.num_steps,
        "last_epoch": getattr(
            scheduler.scheduler, "last_epoch", getattr(scheduler.scheduler, "last_batch_iteration", None)
        ),
        "params_finite": params_finite,
        "backend_name": engine.backend_name,
    }


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    probe_exit(args.out)
    scenarios = json.loads(args.scenarios)
    if any(s["backend"] == "deepspeed" and s["precision"] == "fp16" for s in scenarios):
        patch_cpu_fp16()
    results = []
    for s in scenarios:
        try:
            results.append(run(s))
        except Exception as exc:  # report per scenario; the test shows which one
            import traceback

            results.append(
                {**s, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
            )
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
