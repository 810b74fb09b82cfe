"""Cluster worker: a deterministic regression run whose global batch is the same on any world size.

Each rank takes `--global-batch / WORLD_SIZE` samples per micro-step (GA 1, no dropout, fp32), so
1 process, 2 "nodes" of one process, or a group that shrinks or grows between restarts all train
the same steps on the same samples. With `--ckpt` the loop runs under
`engine.autosave(--ckpt, every_steps=1)` and resumes from it. Every optimizer step appends
`{"step", "world", "restart", "loss"}` to `<out>/steps_rank<R>.jsonl` (`--step-sleep` seconds
after each, so that a test can act mid-run); at the end rank 0 writes the final fp32 weights to
`<out>/weights.pt` and every rank its `rank<R>.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 64
EPOCHS = 3


def main() -> None:
    args = parse_args(
        [
            ("--ckpt", {"default": ""}),
            ("--global-batch", {"type": int, "default": 8}),
            ("--step-sleep", {"type": float, "default": 0.0}),
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ds_engine import Engine

    engine = Engine(gradient_accumulation_steps=1, precision="fp32", gradient_clipping=1.0)
    world = engine.num_processes
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=args.global_batch // world,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    if args.ckpt:
        engine.autosave(args.ckpt, every_steps=1, keep_last=3)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(out / f"steps_rank{rank()}.jsonl", "a", buffering=1) as log:
        for _epoch in range(loader.epoch, EPOCHS):
            for xb, yb in loader:
                with engine.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    engine.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                record = {"step": engine.num_optimizer_steps, "world": world, "restart": restart}
                log.write(json.dumps({**record, "loss": loss.item()}) + "\n")
                time.sleep(args.step_sleep)
    weights = engine.get_state_dict(model, dtype=torch.float32)  # collective: rank 0 gets them
    if weights is not None:
        torch.save(weights, out / "weights.pt")
    write_result(args.out, {"steps": engine.num_optimizer_steps, "world": world})
    engine.end_training()


if __name__ == "__main__":
    main()
