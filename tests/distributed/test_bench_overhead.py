"""Smoke test of `scripts/bench_overhead.py`: the real 2-rank benchmark with tiny settings.

Runs the script as a user does (its own torchrun launch) with a tiny GPT-2 and 2 timed steps,
then checks that it prints the table with a row per setting and that the figures in it are
real: both trainers trained the same thing (their losses agree), and the reduction passes
per optimizer step are what DeepSpeed and DDP do with GA=4.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import ROOT, worker_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]

SCRIPT = ROOT / "scripts" / "bench_overhead.py"
TINY = ["--layers", "2", "--hidden", "32", "--vocab", "128", "--seq", "16", "--micro-batch", "2"]


def test_bench_overhead_prints_the_table_and_finishes(tmp_path: Path) -> None:
    settings = "zero0,zero2-coalesce,zero3,accelerate,zero0-null"
    raw = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--settings", settings, "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(
        [*cmd, "--json", str(raw), *TINY],
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "ds_engine s/step" in out and "passes/step (base, ours)" in out, out
    assert "target: ratio <= 1.02" in out, out
    rows = {}
    number = r"\s+([\d.]+)\s+\|"
    row = re.compile(r"^(\S+)\s+\|" + number * 5 + r"\s+([\d.]+), ([\d.]+)\s+\|\s+[\d.e+-]+$")
    for line in out.splitlines():
        m = row.match(line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.groups()[1:]]
    assert sorted(rows) == sorted(settings.split(",")), out

    figures = {r["setting"]: r for r in json.loads(raw.read_text())["results"]}
    for setting, (base_s, ours_s, ratio, paired, cpu_ratio, base_passes, ours_passes) in rows.items():
        r = figures[setting]
        assert base_s > 0 and ours_s > 0 and paired > 0 and cpu_ratio > 0
        assert ratio == pytest.approx(r["ds_engine"]["median"] / r["baseline"]["median"], abs=1e-3)
        assert len(r["baseline"]["step_times"]) == len(r["ds_engine"]["step_times"]) == 2
        # same seed, data and config: the two trainers' per-step losses agree
        assert r["max_loss_rel_diff"] < 1e-4, (setting, r["baseline"]["losses"], r["ds_engine"]["losses"])
        # same communication pattern on both sides
        assert base_passes == ours_passes, (setting, base_passes, ours_passes)
    # GA=4: ZeRO-0, DDP and coalesced ZeRO-2 reduce once per optimizer step; ZeRO-3 on every micro-step
    assert (
        rows["zero0"][5] == rows["accelerate"][5] == rows["zero2-coalesce"][5] == rows["zero0-null"][5] == 1
    )
    assert rows["zero3"][5] == 4


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
    assert re.search(r"--settings 'zero5': unknown \['zero5'\]; allowed: zero0, zero2", proc.stderr), (
        proc.stderr
    )
