"""The classic mistakes that hang a distributed run, each ended by the watchdog or refused at once.

Usage: hang_misuse.py OUT BACKEND CASE   (hang_timeout_s = 15)

CASE:
  save_on_main_only     rank 0 calls `save_pretrained` under `if engine.is_main_process:`
                        while rank 1 trains on (ZeRO-3 on DeepSpeed: gathering the weights is a
                        collective; the fallback's save is one too: the ranks agree it is written)
  state_dict_on_main    the same with `get_state_dict`
  early_break           rank 1 leaves the loop after step 3 and calls `end_training`; rank 0
                        trains on
  main_first_zero3      `init_context()` (ZeRO-3 partitions the weights at creation, a
                        collective) inside `main_process_first()`: refused before it can hang

Each rank writes `OUT/started_rank{r}` (the time) before the misuse; nothing after it should run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine

HANG_TIMEOUT_S = 15


def main() -> None:
    out, backend, case = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    stage = 3 if backend == "deepspeed" else 0
    engine = Engine(backend=backend, zero_stage=stage, hang_timeout_s=HANG_TIMEOUT_S, dist_timeout_s=600)
    rank = engine.process_index
    torch.manual_seed(0)
    if case == "main_first_zero3":
        (out / f"started_rank{rank}").write_text(str(time.time()))
        with engine.main_process_first(), engine.init_context():
            torch.nn.Linear(8, 8)
        (out / f"survived_rank{rank}").write_text("the misuse was not refused")
        return
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    for step, (x, y) in enumerate(loader):
        if step == 3:
            (out / f"started_rank{rank}").write_text(str(time.time()))
            if case == "early_break" and rank == 1:
                engine.end_training()
                break
            if case == "save_on_main_only" and engine.is_main_process:
                engine.save_pretrained(model, out / "saved")
            if case == "state_dict_on_main" and engine.is_main_process:
                engine.get_state_dict(model)
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    (out / f"finished_rank{rank}").write_text("trained to the end")


if __name__ == "__main__":
    main()
