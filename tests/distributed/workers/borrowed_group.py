"""Worker: an Engine on a process group the script formed itself (borrowed), or on its own.

--group host: the script calls `torch.distributed.init_process_group("gloo")` before the Engine
  (with --env keep through torchrun's variables; with --env strip the launcher's variables are
  removed first and the group is formed from an explicit tcp:// address, rank and world size).
  The Engine trains (ZeRO-3 on DeepSpeed) to `end_training`; the group must still work after it:
  an `all_reduce` on it, then a second Engine on the same group, then the script destroys it.
--group engine: the Engine forms the group and `end_training` must destroy it (and an exit
  probe records that no group is left at interpreter exit).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import parse_args, probe_exit
from torch.utils.data import DataLoader, TensorDataset

#: torchrun's variables, removed for a host that forms its group without a launcher (torchrun's
#: TORCHELASTIC_USE_AGENT_STORE would make a tcp:// rendezvous wait for the agent's store).
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def train(backend: str) -> dict[str, Any]:
    from ds_engine import Engine

    choices: dict[str, Any] = {"gradient_accumulation_steps": 2}
    if backend == "deepspeed":
        choices["zero_stage"] = 3
    engine = Engine(backend=backend, **choices)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=4))
    losses = []
    for x, y in loader:
        with engine.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(engine.reduce(loss.detach(), "mean")))
    facts = {
        "owns": engine.owns_process_group,
        "place": [engine.process_index, engine.num_processes, engine.local_process_index],
        "steps": engine.num_optimizer_steps,
        "losses": losses,
    }
    engine.end_training()
    facts["alive_after_end"] = dist.is_available() and dist.is_initialized()
    return facts


def main() -> None:
    args = parse_args(
        [
            ("--backend", {"required": True}),
            ("--group", {"choices": ["host", "engine"], "required": True}),
            ("--env", {"choices": ["keep", "strip"], "default": "keep"}),
            ("--port", {"type": int, "default": 0}),
        ]
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {"rank": rank}
    try:
        if args.group == "engine":
            probe_exit(args.out)
            result["first"] = train(args.backend)
        else:
            if args.env == "strip":
                addr = os.environ["MASTER_ADDR"]
                for name in LAUNCHER_VARS:
                    os.environ.pop(name, None)
                dist.init_process_group(
                    "gloo", init_method=f"tcp://{addr}:{args.port}", rank=rank, world_size=world
                )
            else:
                dist.init_process_group("gloo")
            result["first"] = train(args.backend)
            # the host's group still works: an all_reduce on it
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            result["all_reduce"] = float(total)
            # and a second Engine borrows it again
            result["second"] = train(args.backend)
            dist.barrier()
            result["env_after"] = {
                name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
            }
    except Exception as exc:  # reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["tb"] = traceback.format_exc()
    path = Path(args.out) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)
    if args.group == "host" and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # the host ends its own group
    else:
        import time

        deadline = time.monotonic() + 300
        while not all((Path(args.out) / f"rank{r}.json").exists() for r in range(world)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)


if __name__ == "__main__":
    main()
