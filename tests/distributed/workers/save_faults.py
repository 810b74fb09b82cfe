"""A training checkpoint save that fails on one rank, or on all, on 2 ranks (one backend per launch).

For each case of --cases (JSON): train a step, save `step_1` (keep_last=1), train a step, bring in
the fault, save `step_2` and time the error on this rank; then check what is on disk and load the
folder in a fresh Engine. The process group's timeout is short (`dist_timeout_s`), so a rank left
waiting in a collective fails the case in a minute instead of half an hour.

Faults (`how`):
* ``inject``: on rank `rank` only, `torch.save` of a file whose name holds `file` raises the
  OSError a full disk gives (ENOSPC) -- the one way to fill the disk for one rank of two that
  share it. DeepSpeed's own writes go through `torch.save` too.
* ``full``: the checkpoint folder lies on a small tmpfs (mounted by the test) that rank 0 fills
  to the last byte: every rank's writes hit a real full disk.
* ``read_only``: that tmpfs is remounted read-only: rank 0 cannot even make the staging folder.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine
from ds_engine.checkpoint import resolve_checkpoint

TIMEOUT_S = 90  # the process group's collective timeout: a hang ends the case in 90 s, not 1800


def _engine(backend: str, stage: int) -> Engine:
    choices: dict[str, Any] = {"backend": backend, "dist_timeout_s": TIMEOUT_S}
    if backend == "deepspeed":
        choices["zero_stage"] = stage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(**choices)


def _prepared(backend: str, stage: int) -> tuple[Any, ...]:
    engine = _engine(backend, stage)
    torch.manual_seed(0)
    with engine.init_context():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return (engine, *engine.prepare(model, optimizer, DataLoader(data, batch_size=2)))


def _step(engine: Engine, model: Any, optimizer: Any, batch: Any) -> None:
    x, y = batch
    with engine.accumulate(model):
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as stream:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    stream.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def _remount(folder: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(folder)], check=True, capture_output=True)


def run_case(case: dict[str, Any], backend: str, root: Path) -> dict[str, Any]:
    disk = root / case["name"]
    ckpt = disk / "ckpt"
    engine, model, optimizer, loader = _prepared(backend, case.get("stage", 0))
    batches = iter(loader)
    _step(engine, model, optimizer, next(batches))
    engine.save_checkpoint(ckpt, keep_last=1, client_state={"saved_at_step": 1})
    _step(engine, model, optimizer, next(batches))
    dist.barrier()
    if rank() == 0 and case["how"] == "full":
        _fill(disk)
    if rank() == 0 and case["how"] == "read_only":
        _remount(disk, "ro")
    dist.barrier()
    real_save = torch.save
    if case["how"] == "inject" and rank() == case["rank"]:

        def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if case["file"] in str(f):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_save(obj, f, *args, **kwargs)

        torch.save = failing_save  # type: ignore[assignment]
    result: dict[str, Any] = {"error": "", "errno": None}
    started = time.monotonic()
    try:
        engine.save_checkpoint(ckpt, keep_last=1, client_state={"saved_at_step": 2})
    except Exception as exc:
        result.update(error=f"{type(exc).__name__}: {exc}", errno=getattr(exc, "errno", None))
    result["seconds_to_error"] = time.monotonic() - started
    torch.save = real_save  # type: ignore[assignment]
    dist.barrier()  # rank 0 removes the staging folder before it raises: wait for it
    result["listing"] = sorted(os.listdir(ckpt))
    result["newest"] = resolve_checkpoint(ckpt)[0]
    dist.barrier()
    if rank() == 0 and case["how"] == "full":
        (disk / "filler").unlink()
    if rank() == 0 and case["how"] == "read_only":
        _remount(disk, "rw")
    dist.barrier()
    fresh, _, _, _ = _prepared(backend, case.get("stage", 0))
    client = fresh.load_checkpoint(ckpt)
    result["loaded"] = {"client_state": client, "steps": fresh.num_optimizer_steps}
    # the same engine saves again once the fault is gone (nothing left half-done)
    engine.save_checkpoint(ckpt, keep_last=1, client_state={"saved_at_step": 2})
    result["after_retry"] = sorted(os.listdir(ckpt))
    return result


def main() -> None:
    args = parse_args(
        [("--backend", {"required": True}), ("--cases", {"required": True}), ("--root", {"required": True})]
    )
    results: dict[str, Any] = {}
    for case in json.loads(args.cases):
        try:
            results[case["name"]] = run_case(case, args.backend, Path(args.root))
        except Exception:
            results[case["name"]] = {"crash": traceback.format_exc()}
            break  # the process group may be out of step now
    write_result(args.out, results)


if __name__ == "__main__":
    main()
