"""A rank dies mid-training: rank 1 raises, or SIGKILLs itself, at optimizer step 3.

Usage: dead_rank.py OUT BACKEND MODE   (MODE: raise | kill)

Both ranks train a small MLP through the Engine (`dist_timeout_s=30`); rank 1 writes the
time it fails to `OUT/failed_at` and then fails. Rank 0 would train for ~10 minutes more (it
writes `OUT/rank0_done` if it ever finishes): the job can only end quickly if the launcher
tears the group down, or rank 0's collective errors out.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine

FAIL_AT = 3


def main() -> None:
    out, backend, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    engine = Engine(backend=backend, zero_stage=2 if backend == "deepspeed" else 0, dist_timeout_s=30)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    rank = engine.process_index
    deadline = time.monotonic() + 600
    step = 0
    while time.monotonic() < deadline:
        for x, y in loader:
            if rank == 1 and step == FAIL_AT:
                (out / "failed_at").write_text(str(time.time()))
                print(f"dead_rank: rank 1 fails by {mode} at step {step}", flush=True)
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("dead_rank: rank 1 raises on purpose")
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            step += 1
            time.sleep(0.05)
    (out / f"rank{rank}_done").write_text("finished")


if __name__ == "__main__":
    main()
