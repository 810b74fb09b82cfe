"""Training-call misuse on 2 ranks, one backend per launch (`--backend`), in one process per rank:

- loaders whose length differs across ranks are refused at `prepare` on every rank;
- an optimizer over another model's parameters is refused at `prepare` (every ZeRO stage);
  the real thing (the optimizer from `model.parameters()`, ZeRO-3 created in `init_context`)
  still trains;
- a `break` out of the training loop, a save, and a resume in new Engines see the batches of
  the uninterrupted run;
- last: after `end_training()` every call raises the same error on both ranks, writes nothing.
"""

from __future__ import annotations

import gc
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import error_of, parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine


def data(n: int) -> TensorDataset:
    """Sample i has features all equal to i: a batch names the samples it holds."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 4), torch.randn(n, 1, generator=g)
    )


def model_() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class RankSampler(torch.utils.data.Sampler[int]):
    """A sampler whose length depends on the rank (as a hand-made per-rank split would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def lengths_differ(backend: str) -> dict[str, Any]:
    result = {}
    engine = Engine(backend=backend)
    per_rank = 32 if rank() == 0 else 48
    model = model_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result["dataset"] = error_of(lambda: engine.prepare(model, opt, DataLoader(data(per_rank), batch_size=4)))
    result["prepared_model_after_error"] = engine._model is not None
    engine2 = Engine(backend=backend)
    loader = DataLoader(data(64), batch_size=4, sampler=RankSampler(40 if rank() == 0 else 64))
    result["sampler"] = error_of(lambda: engine2.prepare(loader))
    # equal lengths pass (and a second loader of another length is fine: lengths are per loader)
    engine3 = Engine(backend=backend)
    a, b = engine3.prepare(DataLoader(data(32), batch_size=4), DataLoader(data(48), batch_size=2))
    result["equal"] = [len(a), len(b)]
    return result


def foreign_optimizer(backend: str, stage: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    engine = Engine(backend=backend, zero_stage=stage)
    with engine.init_context():
        model, other = model_(), model_()
    opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    result["error"] = error_of(lambda: engine.prepare(model, opt, DataLoader(data(16), batch_size=2)))
    # the real thing: the optimizer from the model's own parameters (ZeRO-3: created in init_context)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt, loader = engine.prepare(model, opt, DataLoader(data(16), batch_size=2))
    probe = torch.ones(1, 4, device=engine.device)
    with torch.no_grad():
        before = float(model(probe).sum())
    for x, y in loader:
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        after = float(model(probe).sum())
    result["steps"] = engine.num_optimizer_steps
    result["trained"] = after != before
    return result


def batches_seen(
    backend: str, ckpt: Path, *, stop_after: int | None, resume: bool, total: int = 12
) -> list[Any]:
    """Shuffled data, 4 batches per rank an epoch, GA 2: the samples of each batch, in order."""
    engine = Engine(backend=backend, zero_stage=2, gradient_accumulation_steps=2)
    model = model_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data(16), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
    model, opt, loader = engine.prepare(model, opt, loader)
    done = engine.load_checkpoint(ckpt)["done"] if resume else 0
    seen: list[Any] = []
    while done + len(seen) < total:
        for x, y in loader:
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            seen.append(x[:, 0].tolist())
            if len(seen) == stop_after or done + len(seen) == total:
                break
        if len(seen) == stop_after:
            engine.save_checkpoint(ckpt, client_state={"done": len(seen)})
            break
    return seen


def after_end(backend: str, out: Path) -> dict[str, Any]:
    gc.collect()  # the scenarios' Engines are gone: this one's end destroys the group
    engine = Engine(backend=backend, zero_stage=2)
    model = model_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, loader, sched = engine.prepare(model, opt, DataLoader(data(8), batch_size=2), sched)
    for x, y in loader:
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    engine.end_training()
    folder = out / "after_end"
    x = torch.ones(2, 4)
    calls = {
        "backward": lambda: engine.backward(model(x).sum()),
        "step": opt.step,
        "scheduler": sched.step,
        "save_checkpoint": lambda: engine.save_checkpoint(folder / "ckpt"),
        "load_checkpoint": lambda: engine.load_checkpoint(folder / "ckpt"),
        "save_pretrained": lambda: engine.save_pretrained(model, folder / "model"),
        "get_state_dict": lambda: engine.get_state_dict(model),
        "gather": lambda: engine.gather(torch.ones(1)),
        "prepare": lambda: engine.prepare(DataLoader(data(8), batch_size=2)),
    }
    return {
        "place": [engine.process_index, engine.num_processes, engine.is_main_process],
        "group_alive": dist.is_initialized(),
        "errors": {name: error_of(fn) for name, fn in calls.items()},
        "written": folder.exists(),
    }


def main() -> None:
    args = parse_args([("--backend", {"required": True})])
    out = Path(args.out)
    backend = args.backend
    result: dict[str, Any] = {"rank": rank()}
    try:
        result["lengths"] = lengths_differ(backend)
        stages = (0, 2, 3) if backend == "deepspeed" else (0,)
        result["foreign"] = {str(stage): foreign_optimizer(backend, stage) for stage in stages}
        result["whole"] = batches_seen(backend, out / "unused", stop_after=None, resume=False)
        first = batches_seen(backend, out / "ckpt", stop_after=2, resume=False)
        result["resumed"] = first + batches_seen(backend, out / "ckpt", stop_after=None, resume=True)
        result["after_end"] = after_end(backend, out)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["tb"] = traceback.format_exc()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
