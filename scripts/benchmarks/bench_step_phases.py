"""Where ds_engine's per-step time goes, phase by phase, next to raw DeepSpeed ZeRO-0, on 2 CPU ranks.

    .venv/bin/python scripts/benchmarks/bench_step_phases.py             # about 2 minutes
    .venv/bin/python scripts/benchmarks/bench_step_phases.py --windows 3000

`bench_overhead.py` says how much slower a ds_engine optimizer step is than raw DeepSpeed's;
this script says where. It launches itself on 2 ranks (torchrun, gloo, `OMP_NUM_THREADS=1`),
builds the same pair of trainers as `bench_overhead.py`'s `zero0` setting (its default small
model, GA=4, fp32, gradient clipping 1.0, one rendered DeepSpeed JSON for both), and times each
phase of every micro-step with `time.perf_counter`, windows alternating ABBA:

* data: drawing the batch (ds_engine's prepared loader / a `DistributedSampler` loader);
* enter / exit: `engine.accumulate(model)` (raw DeepSpeed has none);
* forward, backward: the model call and `engine.backward(loss)` (DeepSpeed's own `backward`);
* step: `optimizer.step()` + `optimizer.zero_grad()` (DeepSpeed's `engine.step()`).

Printed: rank 0's median per optimizer step (GA micro-steps) of each phase, both loops, and
the difference. The phases are timed on one rank, so waits for the other rank inside a
collective land in backward or step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("data", "enter", "forward", "backward", "step", "exit")


def worker(args: argparse.Namespace) -> None:
    import warnings

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import _bench_overhead_worker as w

    warnings.simplefilter("ignore")
    model_args = argparse.Namespace(
        layers=2, heads=4, hidden=64, vocab=1024, seq=32, micro_batch=2, ga=4, clip=1.0, precision="fp32"
    )
    windows = args.windows + 10
    ours = w.DsEngine(model_args, backend="deepspeed", zero_stage=0, coalesce=False, windows=windows)
    ds_config = ours.engine.ds_config
    assert ds_config is not None
    base = w.RawDeepSpeed(model_args, ds_config, coalesce=False, windows=windows)
    clock = time.perf_counter

    def ours_window(into: dict[str, float]) -> None:
        engine, model, optimizer, loader = ours.engine, ours.model, ours.optimizer, ours.loader
        for _ in range(model_args.ga):
            t0 = clock()
            ids, labels = next(loader)
            t1 = clock()
            context = engine.accumulate(model)
            context.__enter__()
            t2 = clock()
            loss = model(input_ids=ids, labels=labels).loss
            t3 = clock()
            engine.backward(loss)
            t4 = clock()
            optimizer.step()
            optimizer.zero_grad()
            t5 = clock()
            context.__exit__(None, None, None)
            t6 = clock()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                into[phase] += seconds

    def base_window(into: dict[str, float]) -> None:
        engine, loader = base.engine, base.loader
        for _ in range(model_args.ga):
            t0 = clock()
            ids, labels = (t.to(engine.device) for t in next(loader))
            t1 = clock()
            loss = engine(input_ids=ids, labels=labels).loss
            t2 = clock()
            engine.backward(loss)
            t3 = clock()
            engine.step()
            t4 = clock()
            for phase, seconds in zip(
                ("data", "forward", "backward", "step"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            ):
                into[phase] += seconds

    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in ("ours", "base")}
    for i in range(args.windows + 10):
        pair = (("base", base_window), ("ours", ours_window))
        for name, run in pair if i % 2 else pair[::-1]:
            into = dict.fromkeys(PHASES, 0.0)
            dist.barrier()
            run(into)
            if i >= 10:  # warm-up windows
                for phase in PHASES:
                    times[name][phase].append(into[phase])
    if dist.get_rank() == 0:
        print(
            f"per optimizer step (GA={model_args.ga} micro-steps), rank 0, median of {args.windows} windows:"
        )
        print(f"{'phase':9s} | {'raw DeepSpeed ms':>16s} | {'ds_engine ms':>12s} | {'difference ms':>13s}")
        total_base = total_ours = 0.0
        for phase in PHASES:
            b = statistics.median(times["base"][phase]) * 1e3
            o = statistics.median(times["ours"][phase]) * 1e3
            total_base, total_ours = total_base + b, total_ours + o
            print(f"{phase:9s} | {b:16.3f} | {o:12.3f} | {o - b:+13.3f}")
        print(f"{'sum':9s} | {total_base:16.3f} | {total_ours:12.3f} | {total_ours - total_base:+13.3f}")
    ours.close()
    base.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=1500, help="timed optimizer steps per loop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        __file__, "--worker", "--windows", str(args.windows),
    ]  # fmt: skip
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
