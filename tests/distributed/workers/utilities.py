"""Every accelerate-named utility on a real 2-rank group, for the backend given in --backend."""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path

import torch
from _common import parse_args, probe_exit, write_result
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    args = parse_args([("--backend", {"required": True})])
    probe_exit(args.out)
    from ds_engine import Engine

    engine = Engine(backend=args.backend, zero_stage=0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.arange(20).float()), batch_size=2, shuffle=True)
    evaluation = DataLoader(TensorDataset(torch.arange(7).float()), batch_size=2)
    p_model, _, p_train, p_eval = engine.prepare(model, optimizer, train, evaluation)
    out: dict = {
        "backend": engine.backend_name,
        "rank": engine.process_index,
        "world": engine.num_processes,
        "is_main": engine.is_main_process,
        "is_local_main": engine.is_local_main_process,
        "local_rank": engine.local_process_index,
        "device": str(engine.device),
        "unwrapped_is_original": engine.unwrap_model(p_model) is model,
        "ds_config_is_none": engine.ds_config is None,
    }
    # training shards: distinct per rank, reshuffled per epoch
    epoch0 = [int(x) for (batch,) in p_train for x in batch]
    p_train.set_epoch(1)
    epoch1 = [int(x) for (batch,) in p_train for x in batch]
    out["epoch0"], out["epoch1"] = epoch0, epoch1
    # gather: uneven dim-0 sizes allowed
    local = torch.arange(engine.process_index + 1).float() + 10 * engine.process_index
    out["gather"] = engine.gather(local).tolist()
    out["gather_dict"] = engine.gather({"x": torch.tensor([engine.process_index])})["x"].tolist()
    # gather_for_metrics: exactly the 7 evaluation samples, no padded duplicates
    seen = []
    for (batch,) in p_eval:
        seen.extend(engine.gather_for_metrics(batch).tolist())
    out["metrics_samples"] = seen
    out["reduce_sum"] = float(engine.reduce(torch.tensor(float(engine.process_index + 1))))
    out["reduce_mean"] = float(engine.reduce(torch.tensor(float(engine.process_index + 1)), "mean"))
    # print: only the local main process prints
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        engine.print("hello from", engine.process_index)
    out["printed"] = buffer.getvalue()
    # main_process_first: rank 0 finishes its block before rank 1 starts its own
    marker = Path(args.out) / "order.txt"
    with engine.main_process_first():
        with marker.open("a") as f:
            f.write(f"{engine.process_index}:{time.time()}\n")
        if engine.is_main_process:
            time.sleep(0.5)
    engine.wait_for_everyone()
    out["order"] = [line.split(":")[0] for line in marker.read_text().splitlines()]
    with engine.autocast():
        out["autocast_ok"] = bool(torch.isfinite(p_model(torch.ones(1, 3, device=engine.device))).all())
    out["pid"] = os.getpid()
    engine.end_training()
    import torch.distributed as dist

    out["group_alive_after_end_training"] = dist.is_initialized()
    try:
        engine.wait_for_everyone()
        out["after_end"] = "no error"
    except RuntimeError as exc:
        out["after_end"] = str(exc)
    write_result(args.out, out)


if __name__ == "__main__":
    main()
