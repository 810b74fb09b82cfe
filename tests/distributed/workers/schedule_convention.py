"""LR schedules sized each way end at 0 on 2 ranks (Engine.schedule_sized_from / default_schedule_reading).

Each case builds a linear schedule (transformers' `get_linear_schedule_with_warmup`) whose
`num_training_steps` comes from the un-prepared dataloader (accelerate's scripts) or from the
optimizer steps this run takes (the prepared loader), trains one epoch with the canonical
loop (or hand-written accumulation at GA=1), and records the LR after every applied step.
"""

from __future__ import annotations

import json
import logging

import torch
from _common import parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset

LR = 0.1
MICRO_BATCH = 2


def run(case: dict, records: list[str]) -> dict:
    from transformers import get_linear_schedule_with_warmup

    from ds_engine import Engine

    class AccelerateStyle(Engine):  # what an accelerate-compatible subclass sets
        default_schedule_reading = "unprepared"

    cls = AccelerateStyle if case.get("accelerate_style") else Engine
    ga, gas = case["ga"], case.get("gas", 1)
    engine = cls(backend=case["backend"], gradient_accumulation_steps=ga, gradient_clipping=0.0)
    if case.get("sized_from"):
        engine.schedule_sized_from = case["sized_from"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    n = case["batches"] * MICRO_BATCH
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2
    )
    world = engine.num_processes
    unprepared = len(loader)
    prepared_len = -(-unprepared // world)
    total = {
        "unprepared": unprepared // (ga * gas),  # accelerate's scripts: len(dataloader) / gas, before prepare
        "prepared": -(-prepared_len // ga) // gas,  # the optimizer steps this run takes
    }[case["schedule_from"]]
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, total)
    records.clear()
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    lrs = []
    for step, (x, y) in enumerate(loader):
        if gas > 1:  # hand-written accumulation at GA=1
            engine.backward(torch.nn.functional.mse_loss(model(x), y) / gas)
            if (step + 1) % gas == 0:
                optimizer.step()
                optimizer.zero_grad()
                if not optimizer.is_overflow:
                    scheduler.step()
                lrs.append(scheduler.get_last_lr()[0])
        else:
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if engine.sync_gradients:
                lrs.append(scheduler.get_last_lr()[0])
    return {
        **case,
        "num_training_steps": total,
        "lrs": lrs,
        "optimizer_steps": engine.num_optimizer_steps,
        "got_per_step": scheduler.steps_per_optimizer_step,
        "log": list(records),
    }


class Recorder(logging.Handler):
    def __init__(self, records: list[str]) -> None:
        super().__init__(logging.INFO)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname}: {record.getMessage()}")


def main() -> None:
    args = parse_args([("--cases", {"required": True})])
    records: list[str] = []
    log = logging.getLogger("ds_engine")
    log.setLevel(logging.INFO)
    log.addHandler(Recorder(records))
    write_result(args.out, {"results": [run(c, records) for c in json.loads(args.cases)]})


if __name__ == "__main__":
    main()
