"""Overhead of ds_engine over raw DeepSpeed and plain accelerate, on 2 CPU ranks.

    .venv/bin/python scripts/benchmarks/bench_overhead.py          # two sizes, <= ~14 min (--budget 840)
    .venv/bin/python scripts/benchmarks/bench_overhead.py --budget 1800   # more pairs: a narrower interval
    .venv/bin/python scripts/benchmarks/bench_overhead.py --settings zero3,accelerate --ttfs-settings none
    .venv/bin/python scripts/benchmarks/bench_overhead.py --steps 20 --rounds 1  # fixed pairs, no early stop
    .venv/bin/python scripts/benchmarks/bench_overhead.py --profile       # + ds_engine's share of a step

Three tables, each run with torchrun on 2 ranks (gloo, `GLOO_SOCKET_IFNAME=lo`,
`OMP_NUM_THREADS=1`) by `_bench_overhead_worker.py`, all on one GPT-2 built from a
config, at two sizes by default (`--sizes`, the budget shared evenly): `small`, 2 layers, hidden
64, vocab 1024, seq 32, micro batch 2 (0.17M parameters), where a step is cheap and many pairs fit
in the budget; ds_engine's per-step work (accumulate / backward / step bookkeeping, the ZeRO-0
non-finite check, the loader wrapper) does not shrink with the model, so there its share of a
step is largest. `medium`, 4 layers, hidden 256, vocab 8192, seq 64, micro batch 4 (5.3M
parameters), where the model's own work dominates a step as it does at real sizes. Both with
GA=4, fp32, AdamW, gradient clipping 1.0. `--layers/--hidden/--vocab/--seq/--micro-batch` give
a model of your own instead (unset ones from `small`).

**Per-step overhead.** For every setting the same model is trained twice on the same seed and
data: raw DeepSpeed (`deepspeed.initialize` + `engine.backward(loss); engine.step()` on every
micro-step) vs ds_engine for ZeRO 0, 2 and 3, both on the identical JSON (the raw run gets the
`engine.ds_config` ds_engine built); "-coalesce" rows run the window inside DeepSpeed's
`coalesce_grad_reduction()` (raw) vs `Engine(coalesce_grad_reduction=True)`; `accelerate` is
plain accelerate (`Accelerator(cpu=True, gradient_accumulation_steps=4)` +
`accelerator.accumulate(model)`) vs `Engine(backend="accelerate")`. `zero0-null` is the noise
floor: raw DeepSpeed ZeRO-0 against a second raw DeepSpeed ZeRO-0, measured like the rest.
The two trainers alternate one optimizer step at a time (ABBA); a step's time is the slowest
rank's; each pair (ds_engine's step and the baseline's run next to it) gives a ratio, and the
table's ratio is the median of those. Its 95% interval is a bootstrap (2000 resamples of the
pairs, within each round and order); "rounds" is the range of the per-round medians. Rounds are
separate torchrun launches with freshly built trainers (at least `--rounds`, 3 by default), so
their spread shows what one run-to-run repeat moves. Adaptive: the time left is shared among
the settings whose interval is still wider than `--ci` (half-width, 0.5 % by default), each
given the pairs its interval needs by the last round's noise; the run stops when every
interval is that narrow or the time is up. "vs 1.02" judges the target ratio <= 1.02 by the
interval: "below", "above" or "unsure" (the interval straddles 1.02).

**Time to first step.** Construction + prepare + the first optimizer step (GA micro-steps) of
ds_engine (`Engine(...)`, `engine.prepare(model, optimizer, loader)`) vs raw DeepSpeed
(`deepspeed.initialize` on the same JSON, a `DistributedSampler` loader), same model, each
sample in a fresh process forked after `import torch, transformers, deepspeed` (the process
group is formed inside the timed part, by both); pairs ABBA-interleaved after one untimed
ds_engine sample (it renders the JSON the raw runs get); 16 pairs for ZeRO-0 and 6 for ZeRO-3
(a ZeRO-3 sample takes ~10x longer: DeepSpeed's `initialize` imports torch's compiler stack
there) by default. The ratio is the median of the pairs' ratios, its interval a distribution-free
one from their order statistics. Target: ratio <= 1.1.
`from ds_engine import Engine` (after those imports) is timed apart and shown ("+ import").

**Construction profile.** One more ds_engine child per stage runs `Engine(...)` + `prepare` +
the first step under cProfile, with DeepSpeed's entry points timed apart (`initialize`,
`init_distributed` and its engine's `forward` / `backward` / `step`: what raw DeepSpeed runs
too): the time outside them is what ds_engine adds (config resolution and validation, its lazy
imports, the loader and step bookkeeping), listed by ds_engine function: where the TTFS
ratio's difference goes.

Noise: on 2 shared cores a pair's ratio scatters by ~20 % (one standard deviation) at load
5-8, so an interval 1 % wide needs thousands of pairs per setting; the default budget gets
there only on a quiet machine, and otherwise says "no" in the "<2% wide" column. The final
line gives the load average around every launch.

--profile: in round 1, after its timed steps, the ds_engine trainer of each setting runs
`--profile-steps` more optimizer steps under cProfile, and a last table gives the share of that
time spent in ds_engine's own Python code (self time of the `ds_engine` package's functions;
the rank with the largest share) and that share with the builtins those functions call
directly. cProfile slows Python more than torch's C++: these shares overstate ds_engine's cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _launch import run_command, torchrun_command

WORKER = Path(__file__).resolve().with_name("_bench_overhead_worker.py")
NULL_SETTING = "zero0-null"  # raw DeepSpeed against itself: the noise floor
SETTINGS = (NULL_SETTING, "zero0", "zero2", "zero2-coalesce", "zero3", "zero3-coalesce", "accelerate")
#: The default model sizes: `small` (0.17M parameters) makes ds_engine's fixed per-step work the
#: largest share of a step; `medium` (5.3M) is the first size whose step is mostly the model's.
SIZES = {
    "small": {"layers": 2, "hidden": 64, "vocab": 1024, "seq": 32, "micro_batch": 2},
    "medium": {"layers": 4, "hidden": 256, "vocab": 8192, "seq": 64, "micro_batch": 4},
}
TTFS_STAGES = ("zero0", "zero2", "zero3")
TARGET = 1.02
TTFS_TARGET = 1.1
WIDE = 0.02  # the interval width the table states it is under (or not)
MIN_SLICE_S = 3.0  # the least stepping time a setting gets in a round
LOADS: list[float] = []  # the 1-minute load average before and after every launch
MIN_PAIRS = 20  # fewer pairs: the bootstrap interval is not trusted (the table says "n/a")
TTFS_MIN_COVERAGE = 0.9  # fewer pairs than give a 90 % interval for the TTFS median: no verdict


# ---------------------------------------------------------------------------- launches
def launch(mode: str, worker_args: list[str], out: Path, *, timeout: float) -> None:
    """One torchrun launch of the worker on 2 ranks, writing into `out`."""
    cmd = torchrun_command(WORKER, "--mode", mode, "--out", str(out), *worker_args, nproc=2)
    LOADS.append(os.getloadavg()[0])
    proc = run_command(cmd, timeout=timeout)
    LOADS.append(os.getloadavg()[0])
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark workers ({mode}) failed (exit {proc.returncode}):\n{proc.stdout[-8000:]}"
        )


def model_args(model: dict[str, int]) -> list[str]:
    args: list[str] = []
    for key, value in model.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def run_round(
    settings: list[str],
    *,
    model: dict[str, int],
    warmup: int,
    first: int,
    steps: int = 0,
    seconds: list[float] | None = None,
    min_steps: int = 10,
    max_steps: int = 3000,
    profile_steps: int = 0,
    timeout: float = 1800,
) -> dict[str, Any]:
    """One round: a launch that runs every setting once (`steps` pairs, or `seconds` each)."""
    worker_args = [
        "--settings",
        ",".join(settings),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--first",
        str(first),
        "--min-steps",
        str(min_steps),
        "--max-steps",
        str(max_steps),
        "--profile-steps",
        str(profile_steps),
        *model_args(model),
    ]
    if seconds is not None:
        worker_args += ["--seconds", ",".join(f"{s:.1f}" for s in seconds)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_engine_bench_steps_") as tmp:
        launch("steps", worker_args, Path(tmp), timeout=timeout)
        result: dict[str, Any] = json.loads((Path(tmp) / "result.json").read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def run_ttfs(
    stages: list[str], *, repeats: list[int], model: dict[str, int], timeout: float = 1800
) -> dict[str, Any]:
    """Time-to-first-step samples (fresh forked processes) and one construction profile per stage."""
    worker_args = ["--settings", ",".join(stages), "--repeats", ",".join(map(str, repeats))]
    worker_args += ["--profile", *model_args(model)]
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ds_engine_bench_ttfs_") as tmp:
        launch("ttfs", worker_args, Path(tmp), timeout=timeout)
        for path in sorted((Path(tmp) / "ttfs").glob("*.json"), key=lambda p: int(p.name[1:].split(".")[0])):
            sample = json.loads(path.read_text())
            samples.setdefault(sample["name"], []).append(sample)
    return {"repeats": repeats, "stages": stages, "samples": list(samples.values())}


# ---------------------------------------------------------------------------- statistics
def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval for the median: the k-th smallest and k-th largest value, k the
    largest with coverage >= `level` (k = 1 when none reaches it). Returns (lo, hi, coverage)."""
    xs = sorted(values)
    n = len(xs)

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n-k+1)) = 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def bootstrap_median_ci(
    strata: list[list[float]], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile interval of the median of the pooled values, resampling within each stratum."""
    strata = [s for s in strata if s]
    if sum(len(s) for s in strata) < 2:
        value = strata[0][0] if strata else math.nan
        return value, value
    rng = np.random.default_rng(seed)
    medians = []
    for chunk in range(0, resamples, 250):
        size = min(250, resamples - chunk)
        drawn = [np.asarray(s)[rng.integers(0, len(s), (size, len(s)))] for s in strata]
        medians.append(np.median(np.concatenate(drawn, axis=1), axis=1))
    lo, hi = np.percentile(np.concatenate(medians), [2.5, 97.5])
    return float(lo), float(hi)


def summarize(setting: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool one setting's rounds: paired ratios, their interval, the rounds' spread."""
    wall: list[list[float]] = []  # strata: (round, who went first)
    cpu: list[list[float]] = []
    round_medians = []
    base_times: list[float] = []
    ours_times: list[float] = []
    for r in rounds:
        b, o = r["baseline"]["step_times"], r["ds_engine"]["step_times"]
        cb, co = r["baseline"]["cpu_step_times"], r["ds_engine"]["cpu_step_times"]
        ratios = [x / y for x, y in zip(o, b)]
        cpu_ratios = [x / y for x, y in zip(co, cb)]
        round_medians.append(statistics.median(ratios))
        base_times += b
        ours_times += o
        for first in (False, True):
            wall.append([q for q, f in zip(ratios, r["ours_first"]) if f == first])
            cpu.append([q for q, f in zip(cpu_ratios, r["ours_first"]) if f == first])
    pooled = [q for s in wall for q in s]
    lo, hi = bootstrap_median_ci(wall)
    cpu_lo, cpu_hi = bootstrap_median_ci(cpu)
    ratio = statistics.median(pooled)
    return {
        "setting": setting,
        "rounds": len(rounds),
        "pairs": len(pooled),
        "baseline_median": statistics.median(base_times),
        "ds_engine_median": statistics.median(ours_times),
        "ratio": ratio,
        "ci": [lo, hi],
        "half_width": (hi - lo) / 2,
        "round_medians": round_medians,
        "cpu_ratio": statistics.median(q for s in cpu for q in s),
        "cpu_ci": [cpu_lo, cpu_hi],
        "pair_s": (sum(base_times) + sum(ours_times)) / len(pooled),
        "passes": [
            rounds[0]["baseline"]["reduction_passes_per_step"],
            rounds[0]["ds_engine"]["reduction_passes_per_step"],
        ],
        "max_loss_rel_diff": max(r["max_loss_rel_diff"] for r in rounds),
        "narrow": "n/a" if len(pooled) < MIN_PAIRS else "yes" if hi - lo < WIDE else "no",
        "verdict": "unsure"
        if len(pooled) < MIN_PAIRS
        else "below"
        if hi <= TARGET
        else "above"
        if lo > TARGET
        else "unsure",
        "profile": next((r["profile"] for r in rounds if "profile" in r), None),
        "warnings": sorted({w for r in rounds for w in r["warnings"]}),
    }


def summarize_ttfs(ttfs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage: the pairs' ratios of the slowest rank's total, phase medians, the profile."""
    rows = []
    samples = ttfs["samples"]
    for stage in ttfs["stages"]:
        slowest = {
            (s[0]["variant"], s[0]["kind"], s[0]["pair"]): max(s, key=lambda x: x["total_s"])
            for s in samples
            if s[0]["stage"] == stage
        }
        timed = {k: v for k, v in slowest.items() if k[1] == "timed"}
        pairs = sorted({k[2] for k in timed})
        ds = [timed[("ds_engine", "timed", p)] for p in pairs]
        raw = [timed[("raw", "timed", p)] for p in pairs]
        ratios = [d["total_s"] / r["total_s"] for d, r in zip(ds, raw)]
        # the first window's loss, averaged over the ranks (they may shard the data differently):
        # both variants trained the same thing
        losses = {
            (s[0]["variant"], s[0]["pair"]): statistics.mean(x["loss"] for x in s)
            for s in samples
            if s[0]["stage"] == stage and s[0]["kind"] == "timed"
        }
        loss_diff = max(
            abs(losses[("ds_engine", p)] - losses[("raw", p)]) / abs(losses[("raw", p)]) for p in pairs
        )
        with_import = [(d["total_s"] + d["import_s"]) / r["total_s"] for d, r in zip(ds, raw)]
        reference = next(s for s in samples if s[0]["stage"] == stage and s[0]["kind"] == "warmup")
        reference_config = next(x for x in reference if x["rank"] == 0)["ds_config"]
        same_json = all(
            x["ds_config"] == reference_config
            for s in samples
            if s[0]["stage"] == stage and s[0]["variant"] == "ds_engine"
            for x in s
        )
        profile = slowest.get(("ds_engine", "profile", -1))

        def med(rows: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in rows)

        lo, hi, coverage = median_interval(ratios)
        verdict = "unsure"
        if coverage >= TTFS_MIN_COVERAGE and hi <= TTFS_TARGET:
            verdict = "below"
        elif coverage >= TTFS_MIN_COVERAGE and lo > TTFS_TARGET:
            verdict = "above"
        rows.append(
            {
                "stage": stage,
                "pairs": len(pairs),
                "raw_s": med(raw, "total_s"),
                "ds_engine_s": med(ds, "total_s"),
                "ratio": statistics.median(ratios),
                "pair_ratios": ratios,
                "interval": [lo, hi],
                "coverage": coverage,
                "max_loss_rel_diff": loss_diff,
                "with_import": statistics.median(with_import),
                "import_s": med(ds, "import_s"),
                "raw_phases": [med(raw, "prepare_s"), med(raw, "step_s")],
                "ds_engine_phases": [med(ds, "construct_s"), med(ds, "prepare_s"), med(ds, "step_s")],
                "same_json": same_json,
                "verdict": verdict,
                "profile": None if profile is None else profile["profile"],
            }
        )
    return rows


# ---------------------------------------------------------------------------- the adaptive plan
def plan_slices(
    pending: list[str],
    summaries: dict[str, dict[str, Any]],
    *,
    available_s: float,
    rounds_left: int,
    ci_target: float,
) -> list[float]:
    """Seconds of timed pairs per pending setting for the next round.

    Each gets an equal share of the time left (spread over the rounds still planned), or less:
    the time its interval still needs, from its noise so far (the half-width shrinks as one
    over the square root of the pairs), spread over those rounds; never below `MIN_SLICE_S`.
    """
    share = max(available_s, 0.0) / (rounds_left * len(pending))
    slices = []
    for setting in pending:
        s = summaries.get(setting)
        if s is None or not math.isfinite(s["half_width"]) or s["half_width"] <= 0:
            slices.append(max(share, MIN_SLICE_S))
            continue
        pairs_needed = s["pairs"] * (s["half_width"] / ci_target) ** 2 - s["pairs"]
        need_s = max(pairs_needed, 0.0) * s["pair_s"] * 1.2 / rounds_left
        slices.append(max(min(share, need_s), MIN_SLICE_S))
    return slices


# ---------------------------------------------------------------------------- tables
def format_table(info: dict[str, Any], rows: list[dict[str, Any]], *, ci_target: float) -> str:
    """The per-step figures, one row per setting (the noise floor first)."""
    args = info["args"]
    pairs = ", ".join(f"{r['setting']} {r['pairs']}" for r in rows)
    header = (
        f"{'setting':<15} | {'baseline s/step':>15} | {'ds_engine s/step':>16} | {'ratio':>5} | "
        f"{'95% interval':>12} | {'<2% wide':>8} | {'rounds min-max':>14} | {'vs 1.02':>7} | "
        f"{'CPU ratio':>9} | {'CPU 95% int.':>12} | {'passes/step (base, ours)':>24} | {'loss diff':>9}"
    )
    lines = [
        f"per-step overhead: GPT-2 {info['num_params'] / 1e6:.2f}M params (layers {args['layers']}, hidden "
        f"{args['hidden']}, vocab {args['vocab']}), seq {args['seq']}, micro batch {args['micro_batch']}, "
        f"GA={args['ga']}, {args['precision']}, {info['world_size']} CPU ranks; "
        f"{info['rounds']} rounds (separate launches), {args['warmup']} warm-up pairs each",
        f"pairs timed: {pairs}",
        "baseline: raw DeepSpeed for zero*, plain accelerate for `accelerate`; "
        f"{NULL_SETTING}: raw DeepSpeed in both columns (the noise floor)",
        "",
        header,
        "-" * len(header),
    ]
    for r in rows:
        lo, hi = r["ci"]
        cpu_lo, cpu_hi = r["cpu_ci"]
        passes = f"{r['passes'][0]:g}, {r['passes'][1]:g}"
        spread = f"{min(r['round_medians']):.3f}-{max(r['round_medians']):.3f}"
        lines.append(
            f"{r['setting']:<15} | {r['baseline_median']:>15.4f} | {r['ds_engine_median']:>16.4f} | "
            f"{r['ratio']:>5.3f} | {f'{lo:.3f}-{hi:.3f}':>12} | {r['narrow']:>8} | "
            f"{spread:>14} | {r['verdict']:>7} | {r['cpu_ratio']:>9.3f} | "
            f"{f'{cpu_lo:.3f}-{cpu_hi:.3f}':>12} | "
            f"{passes:>24} | {r['max_loss_rel_diff']:>9.1e}"
        )
    lines += [
        "",
        "ratio: median over all pairs of (ds_engine step / the baseline step run next to it); "
        "s/step: medians.",
        "95% interval: bootstrap of that median (pairs resampled within each round and order); "
        f"'<2% wide': the interval's width is under {WIDE:.0%} (n/a: under {MIN_PAIRS} pairs, no interval); "
        f"the adaptive stop aims at half-width {ci_target:.1%}.",
        "rounds min-max: the median of each round (a separate launch, freshly built trainers) on its own.",
        "vs 1.02: 'below' / 'above' when the whole interval is; 'unsure' when it straddles 1.02 (or n/a).",
        "CPU ratio: the same for CPU seconds per step summed over ranks (blind to other processes' load).",
    ]
    return "\n".join(lines)


def format_ttfs(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    header = (
        f"{'stage':<6} | {'pairs':>5} | {'raw DeepSpeed s':>15} | {'ds_engine s':>11} | {'ratio':>5} | "
        f"{'interval':>11} | {'level':>5} | {'vs 1.1':>6} | {'+ import':>8} | {'raw: prepare / step':>19} | "
        f"{'ds_engine: construct / prepare / step':>37} | same JSON | loss diff"
    )
    import_ms = statistics.median(r["import_s"] for r in rows) * 1e3
    lines = [
        "time to first step: construction + prepare + first optimizer step (slowest rank), each sample "
        "a fresh process forked after importing torch, transformers and deepspeed;",
        "ds_engine/raw pairs ABBA-interleaved after a ds_engine warm-up; same model as above "
        f"({info['num_params'] / 1e6:.2f}M params); seconds: medians",
        "",
        header,
        "-" * len(header),
    ]
    for r in rows:
        raw_phases = " / ".join(f"{x:.3f}" for x in r["raw_phases"])
        ds_phases = " / ".join(f"{x:.3f}" for x in r["ds_engine_phases"])
        interval = f"{r['interval'][0]:.3f}-{r['interval'][1]:.3f}"
        lines.append(
            f"{r['stage']:<6} | {r['pairs']:>5} | {r['raw_s']:>15.3f} | {r['ds_engine_s']:>11.3f} | "
            f"{r['ratio']:>5.3f} | {interval:>11} | {r['coverage']:>5.0%} | {r['verdict']:>6} | "
            f"{r['with_import']:>8.3f} | {raw_phases:>19} | {ds_phases:>37} | "
            f"{'yes' if r['same_json'] else 'NO':>9} | {r['max_loss_rel_diff']:>9.1e}"
        )
    lines += [
        "",
        "ratio: median over the pairs of (ds_engine's time / raw DeepSpeed's); interval: for that median, "
        "from the pairs' order statistics, at the confidence 'level' (95 % when the pairs allow it).",
        f"vs 1.1: 'below' / 'above' when the whole interval is (and its level is at least "
        f"{TTFS_MIN_COVERAGE:.0%}); else 'unsure'.",
        f"+ import: the ratio with `from ds_engine import Engine` added (median {import_ms:.0f} ms, after "
        "torch, transformers and deepspeed).",
        "raw prepare: deepspeed.initialize (forms the process group) + loader; "
        "ds_engine construct: Engine(...), prepare: engine.prepare (forms the process group, then "
        "deepspeed.initialize).",
        "same JSON: every ds_engine child rendered the JSON the raw children ran; loss diff: the first "
        "window's loss (mean over ranks), ds_engine vs raw: the largest relative difference.",
    ]
    return "\n".join(lines)


def format_ttfs_profile(rows: list[dict[str, Any]]) -> str:
    rows = [r for r in rows if r["profile"] is not None]
    if not rows:
        return "construction profile: none"
    lines = [
        "construction profile: one more ds_engine child per stage, Engine(...) + prepare + first step under "
        "cProfile (slowest rank), with DeepSpeed's entry points timed: initialize + init_distributed and its "
        "engine's forward / backward / step, which raw DeepSpeed runs too; the rest is what ds_engine adds "
        "(cProfile slows Python more than C++: that part is, if anything, overstated)",
        "",
    ]
    for r in rows:
        p = r["profile"]
        phases = ", ".join(f"{k} {v:.3f}" for k, v in p["phases"].items())
        inside = ", ".join(f"{k} {v:.3f}" for k, v in p["deepspeed"].items())
        lines.append(
            f"{r['stage']}: {p['wall_s']:.3f} s profiled ({phases}); inside DeepSpeed's entries "
            f"{p['deepspeed_s']:.3f} s ({inside}); outside them {p['outside_s'] * 1e3:.1f} ms "
            f"({p['outside_s'] / p['wall_s']:.1%}), of which ds_engine's own code (self time) "
            f"{p['own_s'] * 1e3:.1f} ms"
        )
        lines.append("  ds_engine functions by cumulative time outside DeepSpeed's entries (ms, calls):")
        for f in p["top"]:
            lines.append(f"    {f['outside_s'] * 1e3:8.1f}  x{f['calls']:<4} {f['name']}")
    return "\n".join(lines)


def format_profile(rows: list[dict[str, Any]]) -> str:
    """ds_engine's share of its profiled steps, one row per setting that ran ds_engine."""
    rows = [r for r in rows if r["profile"] is not None]
    if not rows:
        return "step profile: no setting ran ds_engine"
    header = (
        f"{'setting':<15} | {'profiled s/step':>15} | {'ds_engine own code':>18} | "
        f"{'+ builtins it calls':>19} | largest ds_engine self times per step"
    )
    lines = [
        f"step profile: cProfile over {rows[0]['profile']['steps']} more ds_engine optimizer steps "
        "per setting (round 1, after the timed ones; the rank with the largest share)",
        "",
        header,
        "-" * len(header),
    ]
    for r in rows:
        p = r["profile"]
        top = ", ".join(f"{name} {seconds / p['steps'] * 1e3:.2f} ms" for name, seconds in p["top"])
        lines.append(
            f"{r['setting']:<15} | {p['total_s'] / p['steps']:>15.4f} | {p['own_share']:>18.3%} | "
            f"{p['direct_share']:>19.3%} | {top}"
        )
    lines += [
        "",
        "own code: self time of the functions in the ds_engine package / all self time under the profiler.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def run_steps(
    args: argparse.Namespace, settings: list[str], model: dict[str, int], deadline: float
) -> dict[str, Any]:
    """Rounds until every interval is narrow enough or the time is up (or `--steps` x `--rounds`)."""
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    summaries: dict[str, dict[str, Any]] = {}
    launch_s = 30.0  # a launch's own cost (imports, process group), measured from round 1 on
    setup_s = dict.fromkeys(settings, 10.0)  # building, warming up and closing a setting's pair
    info: dict[str, Any] = {}
    log: list[dict[str, Any]] = []  # per round: its plan, wall time and load
    r = 0
    while True:
        fixed = args.steps > 0
        if fixed:
            if r >= args.rounds:
                break
            pending, slices = list(settings), None
        else:
            pending = list(settings)
            if r >= args.rounds:
                pending = [s for s in settings if summaries[s]["half_width"] > args.ci]
                if not pending:
                    break
            rounds_left = max(args.rounds - r, 1)
            overhead = rounds_left * (launch_s + sum(setup_s[s] for s in pending))
            available = deadline - time.perf_counter() - overhead
            if r >= args.rounds and available / len(pending) < 2 * MIN_SLICE_S:
                break
            slices = plan_slices(
                pending, summaries, available_s=available, rounds_left=rounds_left, ci_target=args.ci
            )
        order = pending[r % len(pending) :] + pending[: r % len(pending)]  # who goes first rotates
        if slices is not None:
            slices = [slices[pending.index(s)] for s in order]
            plan = ", ".join(f"{s} {t:.0f}s" for s, t in zip(order, slices))
            print(f"[bench] round {r + 1}: {plan}", file=sys.stderr, flush=True)
        result = run_round(
            order,
            model=model,
            warmup=args.warmup,
            first=r % 2,
            steps=args.steps,
            seconds=slices,
            profile_steps=args.profile_steps if args.profile and r == 0 else 0,
        )
        info = result["info"]
        log.append({"settings": order, "slices_s": slices, "wall_s": result["wall_s"], "load": LOADS[-2:]})
        inside = 0.0
        for res in result["results"]:
            rounds[res["setting"]].append(res)
            summaries[res["setting"]] = summarize(res["setting"], rounds[res["setting"]])
            spent = res["setup_s"] + res["stepping_s"]
            setup_s[res["setting"]] = max(spent - res["stepping_s"], 1.0) * 1.5  # + warm-up and close
            inside += spent
        launch_s = max(result["wall_s"] - inside, 5.0)
        for s in order:
            x = summaries[s]
            print(
                f"[bench]   {s}: {x['pairs']} pairs, ratio {x['ratio']:.3f} "
                f"[{x['ci'][0]:.3f}, {x['ci'][1]:.3f}]",
                file=sys.stderr,
                flush=True,
            )
        r += 1
    info["rounds"] = r
    return {"info": info, "summaries": [summaries[s] for s in settings], "rounds": rounds, "log": log}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=840, help="seconds for the whole run (adaptive mode); default 840"
    )
    parser.add_argument("--ci", type=float, default=0.005, help="target half-width of the 95%% interval")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds (separate launches): at least this many"
    )
    parser.add_argument(
        "--steps", type=int, default=0, help="fixed timed pairs per setting and round (no adaptive stop)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first, per setting and round")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma list of {', '.join(SETTINGS)} ({NULL_SETTING}: raw DeepSpeed vs itself)",
    )
    parser.add_argument(
        "--ttfs-settings", default="zero0,zero3", help=f"time to first step: {', '.join(TTFS_STAGES)} or none"
    )
    parser.add_argument(
        "--ttfs-repeats",
        default="16,6",
        help="ds_engine/raw pairs: one number, or one per --ttfs-settings stage",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"model sizes for the per-step table, comma list of {', '.join(SIZES)} (default: both; "
        "the budget is shared evenly); ignored when any of --layers/--hidden/--vocab/--seq/--micro-batch "
        "is given",
    )
    parser.add_argument("--layers", type=int, help="a model of your own: layers (default: --sizes)")
    parser.add_argument("--hidden", type=int, help="a model of your own: hidden size")
    parser.add_argument("--vocab", type=int, help="a model of your own: vocabulary")
    parser.add_argument("--seq", type=int, help="a model of your own: sequence length")
    parser.add_argument("--micro-batch", type=int, help="a model of your own: micro batch")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print ds_engine's own share of its step time (cProfile over --profile-steps more steps)",
    )
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        parser.error(f"--settings {args.settings!r}: unknown {unknown}; allowed: {', '.join(SETTINGS)}")
    stages = [s.strip() for s in args.ttfs_settings.split(",") if s.strip() and s.strip() != "none"]
    if [s for s in stages if s not in TTFS_STAGES]:
        parser.error(f"--ttfs-settings {args.ttfs_settings!r}: allowed: {', '.join(TTFS_STAGES)} or none")
    try:
        repeats = [int(n) for n in args.ttfs_repeats.split(",")]
    except ValueError:
        repeats = []
    if len(repeats) == 1:
        repeats *= len(stages)
    if stages and (len(repeats) != len(stages) or min(repeats) < 1):
        parser.error(f"--ttfs-repeats {args.ttfs_repeats!r}: one number >= 1, or one per stage of {stages}")
    if args.steps < 0 or args.warmup < 0 or args.rounds < 1 or args.ci <= 0:
        parser.error("need --steps >= 0, --warmup >= 0, --rounds >= 1, --ci > 0")
    own = {
        "layers": args.layers,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
    }
    if any(v is not None for v in own.values()):
        models = [{k: SIZES["small"][k] if v is None else v for k, v in own.items()}]
    else:
        names = [n.strip() for n in args.sizes.split(",") if n.strip()]
        if not names or [n for n in names if n not in SIZES]:
            parser.error(f"--sizes {args.sizes!r}: allowed: {', '.join(SIZES)}")
        models = [SIZES[n] for n in names]
    start = time.perf_counter()
    ttfs = run_ttfs(stages, repeats=repeats, model=models[0]) if stages else None
    ttfs_s = time.perf_counter() - start
    print(f"[bench] time to first step: {ttfs_s:.0f} s", file=sys.stderr, flush=True)
    every_step = []
    for i, model in enumerate(models):  # the time left shared evenly among the sizes still to run
        deadline = time.perf_counter() + (start + args.budget - time.perf_counter()) / (len(models) - i)
        steps = run_steps(args, settings, model, deadline)
        info, rows = steps["info"], steps["summaries"]
        every_step.append(steps)
        print(("\n" if i else "") + format_table(info, rows, ci_target=args.ci))
        above = [r["setting"] for r in rows if r["verdict"] == "above"]
        unsure = [r["setting"] for r in rows if r["verdict"] == "unsure"]
        wide = [r["setting"] for r in rows if r["narrow"] != "yes"]
        print(
            f"\ntarget: ratio <= {TARGET}; above it: {', '.join(above) or 'none'}; "
            f"unsure: {', '.join(unsure) or 'none'}; "
            f"intervals {WIDE:.0%} wide or wider (or n/a): {', '.join(wide) or 'none'}"
        )
        if args.profile:
            print("\n" + format_profile(rows))
    ttfs_rows = summarize_ttfs(ttfs) if ttfs else []
    if ttfs_rows:
        print("\n" + format_ttfs(ttfs_rows, every_step[0]["info"]))
        print("\n" + format_ttfs_profile(ttfs_rows))
    total_s = time.perf_counter() - start
    rounds_run = " + ".join(str(steps["info"]["rounds"]) for steps in every_step)
    print(
        f"\n({total_s:.0f} s: time to first step {ttfs_s:.0f} s, per-step overhead "
        f"{total_s - ttfs_s:.0f} s in {rounds_run} rounds; 1-minute load average "
        f"{min(LOADS):.1f}-{max(LOADS):.1f} before and after each launch, on {os.cpu_count()} cores, "
        "this run's 2 ranks included)"
    )
    if args.json:
        first = every_step[0]  # the first size keeps the top-level keys; every size under "sizes"
        payload = {
            "info": first["info"],
            "steps": first["summaries"],
            "rounds": first["rounds"],
            "round_log": first["log"],
            "sizes": [{"info": x["info"], "steps": x["summaries"]} for x in every_step],
            "loads": LOADS,
            "ttfs": ttfs,
            "ttfs_rows": ttfs_rows,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
