"""Overhead of ds_engine over raw DeepSpeed and plain accelerate, on 2 CPU ranks.

    .venv/bin/python scripts/bench_overhead.py                  # ~4 min CPU per rank; ~12 min at load 8
    .venv/bin/python scripts/bench_overhead.py --steps 20           # more timed steps, less noise
    .venv/bin/python scripts/bench_overhead.py --settings zero3,accelerate
    .venv/bin/python scripts/bench_overhead.py --settings zero0-null,zero0   # noise floor first
    .venv/bin/python scripts/bench_overhead.py --settings zero0,zero3,accelerate --profile

One invocation launches `scripts/_bench_overhead_worker.py` with torchrun on 2 ranks (gloo,
`GLOO_SOCKET_IFNAME=lo`, `OMP_NUM_THREADS=1`). For every setting it trains a GPT-2 built
from a config (4 layers, hidden 256, vocab 8192: ~5.3M parameters; seq 64, micro batch 4,
GA=4, fp32, AdamW, gradient clipping 1.0) twice on the same seed and data:

- raw DeepSpeed (`deepspeed.initialize` + `engine.backward(loss); engine.step()` on every
  micro-step) vs ds_engine, for ZeRO 0, 2 and 3 — both get the identical JSON: the raw run
  is initialised with the `engine.ds_config` that ds_engine built. "-coalesce" rows run the
  window inside DeepSpeed's `coalesce_grad_reduction()` (raw) vs
  `Engine(coalesce_grad_reduction=True)`;
- plain accelerate (`Accelerator(cpu=True, gradient_accumulation_steps=4)` +
  `accelerator.accumulate(model)`) vs `Engine(backend="accelerate")`.

The two trainers alternate one optimizer step at a time (ABBA), so load from other processes
hits both alike; warm-up steps are excluded, and the table gives the median of the timed
steps (a step's time is the slowest rank's). "passes/step" is the number of micro-steps per
optimizer step that issued a gradient reduction (counted by wrapping torch.distributed; DDP
through a comm hook). "loss diff" is the largest relative difference between the two runs'
per-step mean losses: it shows that both trained the same thing. Target: ratio <= 1.02.
On shared cores the noise floor is several percent: `zero0-null` (raw DeepSpeed against
itself) measured 0.95 and 1.06 in two runs at load 6-9, so compare any ratio with it.

--profile: after its timed steps, the ds_engine trainer of each setting runs as many optimizer
steps again under cProfile (on every rank; the table's timings are not profiled), and a second
table gives the share of that time spent in ds_engine's own Python code (the self time of the
functions in the `ds_engine` package; the rank with the largest share), and that share with
the builtins those functions call directly. cProfile slows Python code more than torch's C++,
so these shares overstate rather than understate ds_engine's cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.distributed.launcher import free_port, run_command, worker_env  # noqa: E402

WORKER = ROOT / "scripts" / "_bench_overhead_worker.py"
SETTINGS = ("zero0", "zero2", "zero2-coalesce", "zero3", "zero3-coalesce", "accelerate")
NULL_SETTING = "zero0-null"  # raw DeepSpeed against itself: the noise floor (opt-in)
TARGET = 1.02


def run_benchmark(
    *,
    settings: list[str],
    steps: int,
    warmup: int,
    model: dict[str, int],
    profile: bool = False,
    timeout: float = 1200,
) -> dict[str, Any]:
    """Launch the 2-rank worker and return its result (``{"info": ..., "results": [...]}``)."""
    out = Path(tempfile.mkdtemp(prefix="ds_engine_bench_"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        str(WORKER),
        "--out",
        str(out),
        "--settings",
        ",".join(settings),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    for key, value in model.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if profile:
        cmd.append("--profile")
    proc = run_command(cmd, timeout=timeout, env=worker_env())
    result_file = out / "result.json"
    if proc.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"benchmark workers failed (exit {proc.returncode}):\n{proc.stdout[-8000:]}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def format_table(result: dict[str, Any]) -> str:
    """The figures as a plain-text table, one row per setting."""
    info, args = result["info"], result["info"]["args"]
    lines = [
        f"GPT-2 {info['num_params'] / 1e6:.1f}M params, seq {args['seq']}, micro batch "
        f"{args['micro_batch']}, GA={args['ga']}, {args['precision']}, {info['world_size']} CPU ranks; "
        f"medians of {args['steps']} optimizer steps after {args['warmup']} warm-up, ABBA-interleaved",
        "baseline: raw DeepSpeed for zero*, plain accelerate for `accelerate`; ratio = ds_engine / baseline "
        f"({NULL_SETTING}: raw DeepSpeed in both columns)",
        "",
        f"{'setting':<15} | {'baseline s/step':>15} | {'ds_engine s/step':>16} | {'ratio':>5} | "
        f"{'paired':>6} | {'CPU ratio':>9} | {'passes/step (base, ours)':>24} | {'loss diff':>9}",
        "-" * 123,
    ]
    for r in result["results"]:
        base, ours = r["baseline"], r["ds_engine"]
        passes = f"{base['reduction_passes_per_step']:g}, {ours['reduction_passes_per_step']:g}"
        lines.append(
            f"{r['setting']:<15} | {base['median']:>15.3f} | {ours['median']:>16.3f} | "
            f"{r['ratio']:>5.3f} | {r['paired_ratio']:>6.3f} | {r['cpu_ratio']:>9.3f} | "
            f"{passes:>24} | {r['max_loss_rel_diff']:>9.1e}"
        )
    lines += [
        "",
        "paired: median over steps of (ds_engine step / the baseline step run next to it).",
        "CPU ratio: the same for CPU seconds per step summed over ranks (blind to other processes' load).",
    ]
    return "\n".join(lines)


def format_profile(result: dict[str, Any]) -> str:
    """ds_engine's share of its profiled steps, one row per setting that ran ds_engine."""
    rows = [r for r in result["results"] if "profile" in r]
    if not rows:
        return "profile: no setting ran ds_engine"
    header = (
        f"{'setting':<15} | {'profiled s/step':>15} | {'ds_engine own code':>18} | "
        f"{'+ builtins it calls':>19} | largest ds_engine self times per step"
    )
    lines = [
        f"profile: cProfile over {rows[0]['profile']['steps']} more ds_engine optimizer steps per setting "
        "(after the timed ones; the rank with the largest share)",
        "",
        header,
        "-" * len(header),
    ]
    for r in rows:
        p = r["profile"]
        top = ", ".join(f"{name} {seconds / p['steps'] * 1e3:.2f} ms" for name, seconds in p["top"])
        lines.append(
            f"{r['setting']:<15} | {p['total_s'] / p['steps']:>15.3f} | {p['own_share']:>18.3%} | "
            f"{p['direct_share']:>19.3%} | {top}"
        )
    lines += [
        "",
        "own code: self time of the functions in the ds_engine package / all self time under the profiler.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per trainer")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma list of {', '.join(SETTINGS)}, or {NULL_SETTING} (raw DeepSpeed vs itself: noise floor)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print ds_engine's own share of its step time (cProfile over --steps more steps)",
    )
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in (*SETTINGS, NULL_SETTING)]
    if unknown or not settings:
        allowed = ", ".join((*SETTINGS, NULL_SETTING))
        parser.error(f"--settings {args.settings!r}: unknown {unknown}; allowed: {allowed}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1 and warmup >= 0")
    start = time.perf_counter()
    model = {
        "layers": args.layers,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
    }
    result = run_benchmark(
        settings=settings, steps=args.steps, warmup=args.warmup, model=model, profile=args.profile
    )
    print(format_table(result))
    slower = [r["setting"] for r in result["results"] if r["ratio"] > TARGET]
    print(f"\ntarget: ratio <= {TARGET}; above it: {', '.join(slower) if slower else 'none'}")
    if args.profile:
        print("\n" + format_profile(result))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
