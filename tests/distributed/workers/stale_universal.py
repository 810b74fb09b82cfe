"""Universal-cache worker: save tag `state` on some ranks, or resume it on another number.

``--phase save``: train `--steps` steps on data drawn from `--seed`, save tag `state` into
`--ckpt` (again and again under the same name, as `Accelerator.save_state(dir)` does).
``--phase resume``: load tag `state` (on another world size: through the universal checkpoint
cached beside it). Either way rank 0 reports the full weights and the step counter.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    args = parse_args(
        [
            ("--phase", {"required": True}),
            ("--ckpt", {"required": True}),
            ("--seed", {"type": int, "default": 0}),
            ("--steps", {"type": int, "default": 2}),
        ]
    )
    from ds_engine import Engine

    warnings.simplefilter("ignore")
    engine = Engine(
        backend="deepspeed",
        zero_stage=2,
        precision="fp32",
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    g = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g) * 10)
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    result: dict[str, Any] = {}
    if args.phase == "save":
        for step, (x, y) in enumerate(loader):
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if step + 1 == args.steps:
                break
        engine.save_checkpoint(Path(args.ckpt), tag="state")
        meta = json.loads((Path(args.ckpt) / "state" / "ds_engine_meta.json").read_text())
        result["optimizer"] = meta["optimizer"]
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(Path(args.ckpt), tag="state")
        result["warnings"] = [str(w.message) for w in caught if "ds_engine" in str(w.message)]
    state = engine.get_state_dict(model)
    if rank() == 0:
        assert state is not None
        result["weights"] = {k: v.float().flatten().tolist() for k, v in state.items()}
    result["num_optimizer_steps"] = engine.num_optimizer_steps
    write_result(args.out, result)
    engine.end_training()


if __name__ == "__main__":
    main()
