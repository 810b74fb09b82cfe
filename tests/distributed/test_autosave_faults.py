"""Faults at the worst moments of a long run, on 2 real ranks through `ds-engine launch`.

- A rank SIGKILLed inside an autosave (before its first file is written, after it, or with that
  file torn in half) under `--max-restarts 1`: torchrun restarts the group, which resumes from the
  checkpoint before the interrupted one (that one never became complete) and ends bit-identical
  to an uninterrupted run: weights, optimizer state, scheduler, RNG, counters, losses, LRs, data
  order.
- SIGTERM arriving in the middle of a backward: the ranks still agree on one boundary, save it
  together, exit 143, and the same command again ends identical.

The uninterrupted references are shared with `test_autosave.py` (one launch per backend).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from ds_engine.autosave import newest_complete_tag
from ds_engine.preemption import PREEMPTED_EXIT_CODE
from tests.distributed import test_autosave as base
from tests.distributed.test_autosave import (
    EVERY,
    TOTAL_STEPS,
    _backend,
    assert_same_end,
    launch,
    saved_step,
    starts,
    trained_steps,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(name="reference")
def _reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of a backend, launched once per pytest process (cache shared)."""

    def get(backend: str) -> dict[str, Any]:
        if backend not in base._REFERENCES:
            out = tmp_path_factory.mktemp(f"reference_{backend}")
            code, output, _ = launch(out, backend)
            assert code == 0, output[-6000:]
            base._REFERENCES[backend] = base.outcome(out)
        return base._REFERENCES[backend]

    return get


@pytest.mark.parametrize(
    ("backend", "where"),
    [
        pytest.param(b, where, marks=_backend(b).marks, id=f"{b}-{where}")
        for b, where in [("fallback", "torn"), ("zero2", "before"), ("zero2", "after")]
    ],
)
def test_a_rank_killed_inside_a_save_restarts_from_the_one_before_and_ends_identical(
    tmp_path: Path, reference, backend: str, where: str
) -> None:
    rng = random.Random(f"kill-in-save-{backend}-{where}")
    save_step, rank = rng.choice([EVERY, 2 * EVERY, 3 * EVERY]), rng.randrange(2)
    code, output, _ = launch(
        tmp_path, backend, "--fire", f"{save_step}:{rank}:KILLSAVE:{where}", max_restarts=1
    )
    print(f"\n{backend}: rank {rank} killed inside the save of step {save_step} ({where} its first file)")
    assert (tmp_path / "fired").exists(), f"the save never wrote a file through torch.save:\n{output[-6000:]}"
    assert code == 0, output[-6000:]
    resumed = [s["step"] for s in starts(tmp_path)]
    assert resumed == [0, save_step - EVERY], resumed  # the interrupted save never counted
    assert_same_end(tmp_path, reference(backend))


@pytest.mark.parametrize("backend", [_backend("fallback"), _backend("zero2")])
def test_sigterm_in_the_middle_of_a_backward_saves_one_agreed_step_and_the_rerun_ends_identical(
    tmp_path: Path,
    reference,
    backend: str,
) -> None:
    rng = random.Random(f"term-in-backward-{backend}")
    fired_at, rank = rng.randrange(1, 16), rng.randrange(2)
    code, output, _ = launch(tmp_path, backend, "--fire", f"{fired_at}:{rank}:TERMBACKWARD")
    assert code == PREEMPTED_EXIT_CODE, output[-6000:]
    found = re.search(r"ds_engine: preempted \(SIGTERM received\): saved optimizer step (\d+) to ", output)
    assert found, output[-6000:]
    step = int(found.group(1))
    assert saved_step(fired_at) <= step < TOTAL_STEPS
    for r in range(2):
        assert max(trained_steps(tmp_path)[r]) == step
    assert newest_complete_tag(tmp_path / "ckpt") == (f"step_{step}", [])
    code, output, _ = launch(tmp_path, backend, "--fire", f"{fired_at}:{rank}:TERMBACKWARD")
    assert code == 0, output[-6000:]
    assert [s["step"] for s in starts(tmp_path)] == [0, step]
    assert_same_end(tmp_path, reference(backend))
