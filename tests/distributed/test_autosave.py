"""Preemption and restarts on 2 real ranks through `ds-engine launch`: a run interrupted at a
seeded random optimizer step (SIGTERM or SIGUSR1 to one rank, SIGTERM to the launcher, SIGKILL
of one rank under `--max-restarts 1`) ends with weights, optimizer state, scheduler, RNG,
counters, losses, LRs and data order bit-identical to an uninterrupted run of the same command.

Launches: one uninterrupted reference per backend (2), two per preemption case (the preempted
run, then the same command again) and one per SIGKILL case (torchrun restarts the group itself).
Each launch takes about 10-15 s on 2 idle cores.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ds_engine._imports import is_deepspeed_available
from ds_engine.autosave import newest_complete_tag
from ds_engine.preemption import PREEMPTED_EXIT_CODE
from tests.distributed.launcher import WORKERS, run_command, worker_env

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH = 6  # 48 samples, 2 ranks x micro-batch 2 x GA 2 per optimizer step
TOTAL_STEPS = 18
EVERY = 4
BACKENDS = {
    "fallback": ["--backend", "accelerate"],
    "zero2": ["--backend", "deepspeed", "--zero-stage", "2"],
    "zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
}


def _backend(name: str) -> Any:
    marks = [pytest.mark.deepspeed] if name != "fallback" else []
    if name != "fallback" and not is_deepspeed_available():
        marks.append(pytest.mark.skip(reason="DeepSpeed is not installed"))
    return pytest.param(name, marks=marks)


def launch(out: Path, backend: str, *extra: str, max_restarts: int = 0) -> tuple[int, str, float]:
    """`ds-engine launch` of the worker; (exit status, output, seconds)."""
    cmd = [
        sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), str(WORKERS / "autosave.py"),
        "--out", str(out), "--ckpt", str(out / "ckpt"), *BACKENDS[backend], *extra,
    ]  # fmt: skip
    started = time.monotonic()
    result = run_command(cmd, timeout=600, env=worker_env())
    return result.returncode, result.stdout, time.monotonic() - started


def trained_steps(out: Path) -> list[dict[int, Any]]:
    """Per rank, the last record of every optimizer step trained (step, loss, LR, sample ids)."""
    steps = []
    for rank in range(2):
        last: dict[int, Any] = {}
        for line in (out / f"steps_rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            last[record["step"]] = record
        steps.append(last)
    return steps


def outcome(out: Path) -> dict[str, Any]:
    """What a run ended with: per rank the last record of every step, and the final state's digests."""
    final = json.loads((out / "rank0.json").read_text())
    return {"steps": trained_steps(out), "digests": final["digests"], "counters": final["steps"]}


def starts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "starts_rank0.jsonl").read_text().splitlines()]


_REFERENCES: dict[str, dict[str, Any]] = {}


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory):
    def get(backend: str) -> dict[str, Any]:
        if backend not in _REFERENCES:
            out = tmp_path_factory.mktemp(f"reference_{backend}")
            code, output, _ = launch(out, backend)
            assert code == 0, output[-6000:]
            _REFERENCES[backend] = outcome(out)
            assert len(_REFERENCES[backend]["steps"][0]) == TOTAL_STEPS
        return _REFERENCES[backend]

    return get


def saved_step(fired_at: int) -> int:
    """The first step a signal sent during optimizer step `fired_at + 1` can save: its boundary, or
    the next one when that one ends an epoch (the code after the inner loop runs first)."""
    step = fired_at + 1
    return step + 1 if step % STEPS_PER_EPOCH == 0 else step


def assert_same_end(out: Path, expected: dict[str, Any]) -> None:
    got = outcome(out)
    assert got["counters"] == TOTAL_STEPS
    for rank in range(2):
        assert got["steps"][rank] == expected["steps"][rank], f"rank {rank}: losses, LRs or data order differ"
    for name, digests in expected["digests"].items():
        differing = [key for key, value in digests.items() if got["digests"][name].get(key) != value]
        assert not differing, f"{name}: {differing[:5]} differ from the uninterrupted run"
    assert got["digests"].keys() == expected["digests"].keys()


@pytest.mark.parametrize(
    ("backend", "sig"),
    [pytest.param("fallback", "USR1"), pytest.param("zero2", "TERM", marks=pytest.mark.deepspeed)],
)
def test_a_signal_to_one_rank_saves_the_same_step_on_both_and_the_rerun_ends_identical(
    tmp_path: Path, reference, backend: str, sig: str
) -> None:
    if backend != "fallback" and not is_deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    rng = random.Random(f"one-rank-{backend}")
    fired_at, rank = rng.randrange(1, 16), rng.randrange(2)
    code, output, _ = launch(tmp_path, backend, "--fire", f"{fired_at}:{rank}:{sig}")
    exited = time.time()
    assert code == PREEMPTED_EXIT_CODE, output[-6000:]
    found = re.search(rf"ds_engine: preempted \(SIG{sig} received\): saved optimizer step (\d+) to ", output)
    assert found, output[-6000:]
    step = int(found.group(1))  # the first boundary the ranks agreed at (they agree at most 1 s apart)
    assert saved_step(fired_at) <= step < TOTAL_STEPS
    assert f"every rank saved optimizer step {step} to" in output and "the run was preempted" in output
    for r in range(2):  # both ranks stopped right after that step
        assert max(trained_steps(tmp_path)[r]) == step
    assert newest_complete_tag(tmp_path / "ckpt") == (f"step_{step}", [])
    fired = json.loads((tmp_path / "fired").read_text())
    print(f"\n{backend}: SIG{sig} to rank {rank} during step {fired_at + 1}: saved step {step}, "
          f"signal to launcher exit {exited - fired['time']:.1f} s")  # fmt: skip

    code, output, _ = launch(tmp_path, backend, "--fire", f"{fired_at}:{rank}:{sig}")  # the same command
    assert code == 0, output[-6000:]
    assert f"ds_engine: resumed from {str(tmp_path / 'ckpt' / f'step_{step}')!r}" in output
    assert [s["step"] for s in starts(tmp_path)] == [0, step]
    assert_same_end(tmp_path, reference(backend))


@pytest.mark.deepspeed
def test_sigterm_to_the_launcher_is_forwarded_saved_and_resumed(tmp_path: Path, reference) -> None:
    if not is_deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    fired_at = random.Random("launcher").randrange(1, 16)
    code, output, _ = launch(tmp_path, "zero2", "--fire", f"{fired_at}:1:LAUNCHER")
    assert code == PREEMPTED_EXIT_CODE, output[-6000:]
    found = re.search(
        r"ds-engine launch: the run was preempted \(SIGTERM\): every rank saved optimizer step (\d+) to "
        r"'[^']*step_(\d+)' and exited with status 143\. Run the same command again",
        output,
    )
    assert found and found.group(1) == found.group(2), output[-3000:]
    assert saved_step(fired_at) <= int(found.group(1)) < TOTAL_STEPS
    assert "failed" not in output.split("ds-engine launch:")[-1]
    code, output, _ = launch(tmp_path, "zero2", "--fire", f"{fired_at}:1:LAUNCHER")
    assert code == 0, output[-6000:]
    assert_same_end(tmp_path, reference("zero2"))


@pytest.mark.parametrize(
    "backend",
    # ZeRO-3's case launches its own reference too: 43 s idle, over 100 s on a loaded machine
    [
        _backend("fallback"),
        _backend("zero2"),
        pytest.param(*_backend("zero3").values, marks=[pytest.mark.slow, *_backend("zero3").marks]),
    ],
)
def test_a_sigkilled_rank_restarts_and_ends_identical(tmp_path: Path, reference, backend: str) -> None:
    if backend != "fallback" and not is_deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    rng = random.Random(f"kill-{backend}")
    fired_at, rank = rng.randrange(1, 17), rng.randrange(2)
    code, output, _ = launch(tmp_path, backend, "--fire", f"{fired_at}:{rank}:KILL", max_restarts=1)
    assert code == 0, output[-6000:]
    resumed = [s["step"] for s in starts(tmp_path)]
    assert len(resumed) == 2 and resumed[0] == 0
    assert fired_at - EVERY - 1 <= resumed[1] <= fired_at, resumed  # at most one interval lost
    assert_same_end(tmp_path, reference(backend))
