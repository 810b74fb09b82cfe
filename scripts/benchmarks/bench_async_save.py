"""Training stall and extra memory of a blocking checkpoint save against a background one.

Run (from the repository root; one process per measurement, no process group):

    .venv/bin/python scripts/benchmarks/bench_async_save.py [--widths 1024,2048] [--repeats 3]

For each size, an MLP of `depth` square layers of `width` (fp32, AdamW: the checkpoint holds
the weights and two moments, about 12 bytes a parameter plus the RNG and engine state) is
trained by the DeepSpeed-free fallback Engine. After a few warm-up steps one checkpoint is
saved, in a fresh process per mode:

* blocking: `engine.save_checkpoint(folder, blocking=True)` -- the stall is the whole save;
* background: `blocking=False` -- the stall is the copy to host memory (and the folder set-up);
  training then takes 5 more steps while the thread writes, and `wait_for_checkpoint()` ends it.

Printed side by side per size: the checkpoint's bytes, each stall (median over `repeats`
processes), stall(background) / stall(blocking) (target <= 25 %), the background save's whole
time, and the extra peak memory of each mode over the peak before the save (ru_maxrss), with
the background one as a share of the checkpoint's bytes (target <= one copy, 100 %).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(width: int, depth: int, blocking: bool, folder: Path) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ds_engine import Engine
    from ds_engine.checkpoint import wait_for_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(backend="accelerate")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(64, width), torch.randn(64, width))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=4))
    batches = iter(loader)

    def step() -> float:
        x, y = next(batches)
        start = time.perf_counter()
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    before = _peak()
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag="t", blocking=blocking)
    stall = time.perf_counter() - start
    steps = [step() for _ in range(5)]
    wait_for_checkpoint()
    whole = time.perf_counter() - start
    nbytes = sum(p.stat().st_size for p in (folder / "t").iterdir())
    return {"stall": stall, "whole": whole, "extra": _peak() - before, "bytes": nbytes, "step": min(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1024,2048")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # width,blocking,folder: a measuring process
    args = parser.parse_args()
    if args.one:
        width, blocking, folder = args.one.split(",", 2)
        print(json.dumps(measure(int(width), args.depth, blocking == "1", Path(folder))))
        return
    print(
        f"{'model':<22} {'ckpt MB':>8} {'stall blocking s':>17} {'stall background s':>19} {'share':>6} "
        f"{'background whole s':>19} {'extra MB blocking':>18} {'extra MB background':>20} {'of ckpt':>8}"
    )
    for width in (int(w) for w in args.widths.split(",")):
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for i in range(args.repeats):
            for blocking in (True, False) if i % 2 == 0 else (False, True):
                folder = Path(tempfile.mkdtemp(prefix="bench_async_save_"))
                try:
                    done = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--depth",
                            str(args.depth),
                            "--one",
                            f"{width},{int(blocking)},{folder}/ckpt",
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                runs[blocking].append(json.loads(done.stdout.strip().splitlines()[-1]))

        def med(blocking: bool, key: str, runs: dict[bool, list[dict[str, Any]]] = runs) -> float:
            return statistics.median(r[key] for r in runs[blocking])

        nbytes = med(True, "bytes")
        params = args.depth * (width * width + width)
        share = med(False, "stall") / med(True, "stall")
        extra_bg = med(False, "extra")
        print(
            f"{f'{params / 1e6:.0f}M params (w {width})':<22} {nbytes / 1e6:8.0f} {med(True, 'stall'):17.3f} "
            f"{med(False, 'stall'):19.3f} {share:6.0%} {med(False, 'whole'):19.3f} "
            f"{med(True, 'extra') / 1e6:18.0f} {extra_bg / 1e6:20.0f} {extra_bg / nbytes:8.0%}",
            flush=True,
        )
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
