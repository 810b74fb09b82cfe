"""Autosave worker: the README's loop with `engine.autosave`, interrupted (or not) on purpose.

Trains a tiny model for EPOCHS epochs (6 optimizer steps each on 2 ranks) with a seeded shuffled
loader, GA=2, dropout, python/numpy noise per rank, AdamW and a linear LR decay, through
`engine.autosave(--ckpt, every_steps=--every, keep_last=2)`. Every optimizer step appends a line
to ``<out>/steps_rank<R>.jsonl`` (step, loss, LR, the sample ids of the window); a resumed run
appends the steps it trains again, so the last line of each step is what the run ended with.
At the end it saves one more checkpoint into ``<out>/final`` and rank 0 writes, per file of it,
a digest of every tensor and number it holds (weights, optimizer state, scheduler, RNG,
counters), for the test to compare with an uninterrupted run's.

Interruptions, each fired once per output folder (a marker file keeps a restarted run from
firing again): ``--fire STEP:RANK:WHAT`` at the first micro-step of optimizer step STEP + 1
(before its backward), rank RANK does WHAT: ``TERM`` / ``USR1`` sends that signal to itself,
``LAUNCHER`` sends SIGTERM to its parent (`ds-engine launch`), ``KILL`` SIGKILLs itself,
``TERMBACKWARD`` sends SIGTERM to itself from inside that micro-step's backward (a gradient hook).
``--fire STEP:RANK:KILLSAVE:WHERE`` SIGKILLs rank RANK inside the save of optimizer step STEP, at
its first file write: ``before`` it, ``after`` it, or ``torn`` (the file written half, then killed).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import parse_args, rank
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 48
MICRO_BATCH = 2
EPOCHS = 3


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


def digest(obj, path: str = "", out: dict | None = None) -> dict:
    """path -> sha256 of every tensor / number in a nested structure (order-independent keys)."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        out[path] = (
            f"{t.dtype}{tuple(t.shape)}:"
            + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        )
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            # ZeRO-3's flat fp32 partition ends in padding that is never written (its bytes vary from
            # process to process); the fp32 weights are compared whole through `get_state_dict`
            if key in ("saved_at", "ds_config", "ds_version", "client_state", "fp32_flat_groups"):
                continue
            digest(obj[key], f"{path}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            digest(item, f"{path}[{i}]", out)
    elif isinstance(obj, (bool, int, float)) or obj is None:
        out[path] = repr(obj)
    return out


def checkpoint_digests(tag_dir: Path) -> dict:
    found = {}
    for file in sorted(tag_dir.glob("*.pt")):
        found[file.name] = digest(torch.load(file, map_location="cpu", weights_only=False))
    return found


def kill_inside_saves(engine, step: int, where: str, marker: Path) -> None:
    """SIGKILL this rank at the first file the save of optimizer `step` writes (`torch.save`)."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if engine.num_optimizer_steps != step or marker.exists():
            return real_save(obj, f, *args, **kwargs)
        marker.write_text(json.dumps({"what": f"KILLSAVE:{where}", "time": time.time(), "step": step}))
        if where != "before":
            real_save(obj, f, *args, **kwargs)
            if where == "torn" and isinstance(f, (str, os.PathLike)):
                size = os.path.getsize(f)
                with open(f, "r+b") as file:
                    file.truncate(size // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def main() -> None:
    args = parse_args(
        [
            ("--ckpt", {"required": True}),
            ("--backend", {"default": "accelerate"}),
            ("--zero-stage", {"type": int, "default": 0}),
            ("--every", {"type": int, "default": 4}),
            ("--fire", {"default": ""}),
            ("--signals", {"default": "SIGTERM,SIGUSR1"}),
            ("--agree-every", {"type": int, "default": 1}),
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ds_engine import Engine

    engine = Engine(
        backend=args.backend,
        zero_stage=args.zero_stage,
        gradient_accumulation_steps=2,
        precision="fp32",
        gradient_clipping=1.0,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 20)
    train_dl = DataLoader(
        make_data(), batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    model, optimizer, train_dl, scheduler = engine.prepare(model, optimizer, train_dl, scheduler)
    random.seed(100 + rank())
    np.random.seed(200 + rank())
    torch.manual_seed(300 + rank())

    client = engine.autosave(  # resumes from args.ckpt if it holds a checkpoint
        args.ckpt,
        every_steps=args.every,
        keep_last=2,
        signals=args.signals.split(","),
        agree_every=args.agree_every,
    )
    start = {"step": engine.num_optimizer_steps, "epoch": train_dl.epoch, "client": client}
    with open(out / f"starts_rank{rank()}.jsonl", "a") as f:
        f.write(json.dumps(start) + "\n")

    fire_step, fire_rank, what, where = (
        [*args.fire.split(":"), "", "", "", ""][:4] if args.fire else ("-1", "-1", "", "")
    )
    marker = out / "fired"
    if what == "KILLSAVE" and rank() == int(fire_rank) and not marker.exists():
        kill_inside_saves(engine, int(fire_step), where, marker)
    log = open(out / f"steps_rank{rank()}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed after the loop
    window: list[int] = []
    for _epoch in range(train_dl.epoch, EPOCHS):  # a resumed run continues its epoch
        for x, y, ids in train_dl:
            with engine.accumulate(model):
                if (
                    engine.num_optimizer_steps == int(fire_step)
                    and rank() == int(fire_rank)
                    and not window
                    and not marker.exists()
                ):
                    marker.write_text(json.dumps({"what": what, "time": time.time(), "step": int(fire_step)}))
                    if what == "TERMBACKWARD":
                        x = x.clone().requires_grad_(True)  # its gradient is computed last in backward
                        x.register_hook(lambda g: (os.kill(os.getpid(), signal.SIGTERM), g)[1])
                    elif what == "KILL":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif what == "LAUNCHER":
                        os.kill(os.getppid(), signal.SIGTERM)
                    else:
                        os.kill(os.getpid(), getattr(signal, f"SIG{what}"))
                x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape)).float()
                y = y * (1.0 + 0.05 * random.random())
                loss = torch.nn.functional.mse_loss(model(x), y)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window += ids.tolist()
            if engine.sync_gradients:
                record = {
                    "step": engine.num_optimizer_steps,
                    "loss": loss.item(),
                    "lr": scheduler.get_last_lr()[0],
                    "ids": window,
                }
                log.write(json.dumps(record) + "\n")
                window = []
    log.close()
    final = out / "final"
    engine.save_checkpoint(final, tag="end")
    weights = engine.get_state_dict(model, dtype=torch.float32)  # collective: rank 0 gets them
    result = {"steps": engine.num_optimizer_steps, "epoch": train_dl.epoch}
    if rank() == 0:
        result["digests"] = {**checkpoint_digests(final / "end"), "fp32 weights": digest(weights)}
    (out / f"rank{rank()}.json").write_text(json.dumps(result))
    engine.end_training()
    print(f"rank {rank()} done", file=sys.stderr)


if __name__ == "__main__":
    main()
