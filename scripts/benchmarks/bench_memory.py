"""Measured vs estimated model-state memory per rank, real DeepSpeed on 2 CPU ranks.

    .venv/bin/python scripts/benchmarks/bench_memory.py      # bf16, ZeRO 0, 2, 3, ~52M-param GPT-2
    .venv/bin/python scripts/benchmarks/bench_memory.py --precision fp32 --stages 0,1,2,3

Launches `tests/distributed/workers/memory_real.py` (the worker
`tests/distributed/test_memory_real.py` runs too) with torchrun (2 ranks, gloo), which builds a
GPT-2 from a config, takes two optimizer steps under raw `deepspeed.initialize` and sums every
tensor storage reachable from the engine's module and optimizer (each storage once). The measured
figure is the peak over the second step (after backward, and inside the optimizer step), compared
with `ds_engine.memory.estimate_memory(...)` for 2 "GPUs" on one node: the estimate's model states
(params + grads + optimizer states). The ZeRO-3 working layer is left out of the comparison because
no layer is gathered at those moments.
Target: the ratio measured/estimated within 0.85..1.15.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import ROOT, run_ranks

from ds_engine.memory import estimate_memory

WORKER = ROOT / "tests" / "distributed" / "workers" / "memory_real.py"

GB = 1e9


def compare(rank_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per stage: the largest rank's measured peak against the estimate."""
    rows = []
    for per_rank in zip(*(r["results"] for r in rank_results)):
        first = per_rank[0]
        est = estimate_memory(
            first["num_params"],
            largest_layer_params=first["largest_layer_params"],
            num_gpus_per_node=first["world_size"],
            zero_stage=first["stage"],
            precision=first["precision"],
        )
        measured = max(r["peak"]["total"] for r in per_rank)
        estimated = est.accelerator.model_states
        rows.append(
            {
                "stage": first["stage"],
                "precision": first["precision"],
                "optimizer_class": first["optimizer_class"],
                "num_params": first["num_params"],
                "measured": measured,
                "estimated": estimated,
                "ratio": measured / estimated,
                "breakdown": first["peak"]["breakdown"],
                "estimate": est,
            }
        )
    return rows


def measure(stages: str, precision: str, timeout: float = 1500, **model: int) -> list[dict[str, Any]]:
    """Run the 2-rank measurement and return the comparison rows."""
    args = ["--stages", stages, "--precision", precision]
    for key, value in model.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as out:
        return compare(run_ranks(WORKER, Path(out), *args, nproc=2, timeout=timeout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,2,3")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    start = time.perf_counter()
    rows = measure(args.stages, args.precision)
    print(f"model: GPT-2, {rows[0]['num_params'] / 1e6:.1f}M params; 2 CPU ranks; {args.precision}; AdamW")
    print(
        f"{'stage':>5} | {'measured GB/rank':>16} | {'estimated GB/rank':>17} | {'ratio':>5} | "
        "DeepSpeed optimizer"
    )
    for row in rows:
        print(
            f"{row['stage']:>5} | {row['measured'] / GB:>16.3f} | {row['estimated'] / GB:>17.3f} | "
            f"{row['ratio']:>5.2f} | {row['optimizer_class']}"
        )
    print("\nmeasured breakdown (GB, rank 0) vs estimate:")
    for row in rows:
        parts = ", ".join(f"{k} {v / GB:.3f}" for k, v in sorted(row["breakdown"].items()))
        e = row["estimate"].accelerator
        print(
            f"  ZeRO-{row['stage']}: measured {parts}; estimated params {e.params / GB:.3f}, "
            f"grads {e.gradients / GB:.3f}, optimizer {e.optimizer_states / GB:.3f}"
        )
    print(f"\n({time.perf_counter() - start:.0f} s)")
    bad = [row["stage"] for row in rows if not 0.85 <= row["ratio"] <= 1.15]
    if bad:
        print(f"outside the 15 % target: ZeRO-{bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
