"""Hostile-folder worker: a real 2-rank DeepSpeed checkpoint planted with each folder case.

Trains a small model on ZeRO-2, saves tag `t1` into `good/` and `outside/`, then for every case
of `tests/hostile_corpus.py`'s `FOLDER_CASES` rank 0 copies `good/` and plants the case (a
`latest` naming `..` or an absolute path, links, FIFOs ...), and every rank calls
`Engine.load_checkpoint` on the copy. Each rank reports the error it got (None: loaded).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset


def attempt(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    from ds_engine import Engine
    from tests.hostile_corpus import FOLDER_CASES

    warnings.simplefilter("ignore")
    engine = Engine(
        backend="deepspeed", zero_stage=2, precision="fp32", micro_batch_size=2, gradient_accumulation_steps=1
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    x, y = next(iter(loader))
    with engine.accumulate(model):
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    engine.save_checkpoint(out / "good", tag="t1")
    engine.save_checkpoint(out / "outside", tag="t1")
    victim = "mp_rank_00_model_states.pt"  # every rank reads it
    errors: dict[str, str | None] = {}
    for case in FOLDER_CASES:
        root = out / "cases" / case.name
        tag: list[str | None] = [None]
        if rank() == 0:
            shutil.copytree(out / "good", root, symlinks=True)
            tag[0] = case.plant(root, "t1", victim, out / "outside")
        torch.distributed.broadcast_object_list(tag, src=0)
        errors[case.name] = attempt(lambda root=root, tag=tag[0]: engine.load_checkpoint(root, tag=tag))
    result: dict[str, Any] = {"errors": errors, "victim": victim}
    write_result(args.out, result)
    engine.end_training()


if __name__ == "__main__":
    main()
