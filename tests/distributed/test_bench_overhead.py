"""Smoke test of `scripts/benchmarks/bench_overhead.py`: the real 2-rank benchmark with tiny settings.

Runs the script as a user does (its own torchrun launches) with a tiny GPT-2, its default
settings (the noise-floor row among them), 2 timed pairs per setting and one round, and one
time-to-first-step pair, then checks that it prints the three tables and that the figures in
them are real: the ratio and its interval come from the pairs, both trainers trained the same
thing (their losses agree), the reduction passes per optimizer step are what DeepSpeed and DDP
do with GA=4, and the time-to-first-step runs rendered the same JSON. No timing threshold is
asserted: speed goals live in the benchmark, not in tests.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import ROOT, worker_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]

SCRIPT = ROOT / "scripts" / "benchmarks" / "bench_overhead.py"
TINY = ["--layers", "2", "--hidden", "32", "--vocab", "128", "--seq", "16", "--micro-batch", "2"]
DEFAULT_SETTINGS = ["zero0-null", "zero0", "zero2", "zero2-coalesce", "zero3", "zero3-coalesce", "accelerate"]

NUM = r"([\d.]+)"
RANGE = r"([\d.]+)-([\d.]+)"
STEP_ROW = re.compile(
    rf"^(\S+)\s+\|\s+{NUM}\s+\|\s+{NUM}\s+\|\s+{NUM}\s+\|\s+{RANGE}\s+\|\s+(yes|no|n/a)\s+\|\s+{RANGE}\s+\|"
    rf"\s+(below|above|unsure)\s+\|\s+{NUM}\s+\|\s+{RANGE}\s+\|\s+([\d.]+), ([\d.]+)\s+\|\s+[\d.e+-]+$"
)
TTFS_ROW = re.compile(
    rf"^(zero\d)\s+\|\s+(\d+)\s+\|\s+{NUM}\s+\|\s+{NUM}\s+\|\s+{NUM}\s+\|\s+{RANGE}\s+\|\s+(\d+)%\s+\|"
    rf"\s+(below|above|unsure)\s+\|\s+{NUM}\s+\|[\d./ ]+\|[\d./ ]+\|\s+(yes|NO)\s+\|\s+([\d.e+-]+)$"
)


def bench_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_overhead
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_overhead


def test_bench_overhead_prints_the_tables_and_finishes(tmp_path: Path) -> None:
    raw = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", "2", "--rounds", "1", "--warmup", "1"]
    cmd += ["--ttfs-settings", "zero0", "--ttfs-repeats", "1", "--json", str(raw), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=worker_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for column in ("95% interval", "<2% wide", "rounds min-max", "vs 1.02", "CPU 95% int.", "passes/step"):
        assert column in out, (column, out)
    assert "target: ratio <= 1.02" in out, out
    rows = {m.group(1): m.groups()[1:] for line in out.splitlines() if (m := STEP_ROW.match(line))}
    # the default table has every setting, the noise floor (raw DeepSpeed against itself) first
    assert list(rows) == DEFAULT_SETTINGS, out

    figures = json.loads(raw.read_text())
    steps = {r["setting"]: r for r in figures["steps"]}
    for setting, groups in rows.items():
        base_s, ours_s, ratio, lo, hi, narrow, round_lo, round_hi = (groups[i] for i in range(8))
        base_passes, ours_passes = float(groups[-2]), float(groups[-1])
        r = steps[setting]
        (rnd,) = figures["rounds"][setting]
        pairs = [o / b for o, b in zip(rnd["ds_engine"]["step_times"], rnd["baseline"]["step_times"])]
        assert len(pairs) == r["pairs"] == 2
        assert float(base_s) > 0 and float(ours_s) > 0
        # the ratio is the median of the pairs' ratios, inside its interval; one round: its median
        assert float(ratio) == pytest.approx(statistics.median(pairs), abs=1e-3)
        assert float(lo) <= float(ratio) + 1e-3 and float(ratio) <= float(hi) + 1e-3
        assert narrow == "n/a"  # 2 pairs are too few for an interval
        assert float(round_lo) == float(round_hi) == pytest.approx(float(ratio), abs=1e-3)
        # same seed, data and config: the two trainers' per-step losses agree
        assert r["max_loss_rel_diff"] < 1e-4, (setting, rnd["baseline"]["losses"], rnd["ds_engine"]["losses"])
        # same communication pattern on both sides
        assert base_passes == ours_passes, (setting, base_passes, ours_passes)
    # GA=4: ZeRO-0, DDP and coalesced ZeRO-2/3 reduce once per optimizer step; ZeRO-3 on every micro-step
    passes = {s: float(g[-1]) for s, g in rows.items()}
    for setting in ("zero0-null", "zero0", "accelerate", "zero2-coalesce", "zero3-coalesce"):
        assert passes[setting] == 1, (setting, passes)
    assert passes["zero3"] == 4, passes

    # time to first step: its own table, from fresh processes that rendered the same JSON
    assert "time to first step" in out and "ds_engine: construct / prepare / step" in out, out
    ttfs = {m.group(1): m.groups()[1:] for line in out.splitlines() if (m := TTFS_ROW.match(line))}
    assert list(ttfs) == ["zero0"], out
    n_pairs, raw_s, ours_s, ratio, lo, hi, level, verdict, _with_import, same_json, loss_diff = ttfs["zero0"]
    (row,) = figures["ttfs_rows"]
    assert n_pairs == "1" and float(raw_s) > 0 and float(ours_s) > 0
    assert float(ratio) == pytest.approx(row["ratio"], abs=1e-3)
    # one pair: its ratio is the interval, at level 0 %, too little for a verdict
    assert float(lo) == float(hi) == pytest.approx(float(ratio), abs=1e-3)
    assert level == "0" and verdict == "unsure"
    # the same JSON and the same first-window losses (same model, data and config)
    assert same_json == "yes" and float(loss_diff) < 1e-4, out
    # the construction profile splits the time into DeepSpeed's entries and what ds_engine adds
    assert "construction profile" in out and "inside DeepSpeed's entries" in out, out
    profile = row["profile"]
    assert profile["deepspeed"]["initialize"] > 0 and profile["top"], profile
    assert any(f["name"].startswith("engine.py:") for f in profile["top"]), profile["top"]


def test_bench_overhead_statistics() -> None:
    bench = bench_module()
    # the interval is around the median and narrows with more pairs (the same spread of ratios)
    few = [[0.9, 1.0, 1.1, 1.05, 0.95]]
    lo, hi = bench.bootstrap_median_ci(few)
    assert lo <= 1.0 <= hi
    lo_many, hi_many = bench.bootstrap_median_ci([few[0] * 40])
    assert lo <= lo_many <= 1.0 <= hi_many <= hi and hi_many - lo_many < hi - lo

    def one_round(base: list[float], ours: list[float]) -> dict:
        figures = {"reduction_passes_per_step": 1.0}
        return {
            "baseline": {**figures, "step_times": base, "cpu_step_times": base},
            "ds_engine": {**figures, "step_times": ours, "cpu_step_times": ours},
            "ours_first": [i % 2 == 1 for i in range(len(base))],
            "max_loss_rel_diff": 0.0,
            "warnings": [],
        }

    rounds = [one_round([1.0, 2.0] * 10, [1.1, 2.2] * 10), one_round([1.0] * 10, [1.3] * 10)]
    s = bench.summarize("zero0", rounds)
    assert s["pairs"] == 30 and s["ratio"] == pytest.approx(1.1)
    assert s["verdict"] == "above" and s["narrow"] == "yes"
    assert bench.summarize("zero0", rounds[1:])["narrow"] == "n/a"  # 10 pairs: too few
    # the time-to-first-step interval: order statistics, at least 95 % where the pairs allow it
    assert bench.median_interval([1.0, 1.2, 0.9, 1.1, 1.05, 0.95]) == (0.9, 1.2, pytest.approx(1 - 2 / 64))
    lo, hi, level = bench.median_interval([float(i) for i in range(16)])
    assert (lo, hi) == (3.0, 12.0) and 0.95 <= level < 0.99
    assert s["round_medians"] == pytest.approx([1.1, 1.3])
    # adaptive plan: a setting with a narrow interval gets the floor, one without data a full share
    s["half_width"] = 0.001
    slices = bench.plan_slices(
        ["zero0", "zero3"], {"zero0": s}, available_s=120, rounds_left=2, ci_target=0.005
    )
    assert slices == [bench.MIN_SLICE_S, 30.0]


def test_bench_overhead_rejects_an_unknown_setting() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--settings", "zero5"],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert re.search(
        r"--settings 'zero5': unknown \['zero5'\]; allowed: zero0-null, zero0, zero2", proc.stderr
    ), proc.stderr
