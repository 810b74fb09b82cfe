"""A hang is named within the watchdog's timeout, not the process group's half hour.

`ds-engine launch` runs `workers/hang_misuse.py` on 2 CPU ranks with `hang_timeout_s=15` (and a
process-group timeout of 600 s, so only the watchdog can end the run in time). For each classic
mistake the job must end, non-zero, within the timeout plus a margin for the watchdog's poll and
the launcher's teardown, and the console must name the call, the step and the fix. The cases
run side by side (at most `AT_ONCE` launches), as most of each is waiting for the watchdog. A ZeRO-3
model created inside `main_process_first` is refused before anything can hang.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed.launcher import WORKERS, run_command

pytestmark = pytest.mark.distributed

LAUNCH = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2"]
HANG_TIMEOUT_S = 15
MARGIN_S = 30  # the watchdog's poll (1.5 s here) and the launcher stopping the other rank


def _launch(tmp_path: Path, backend: str, case: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / f"hang_{backend}_{case}.py"
    shutil.copy(WORKERS / "hang_misuse.py", script)
    result = run_command([*LAUNCH, str(script), str(tmp_path), backend, case], timeout=400)
    return result, time.time()


def _run(tmp_path: Path, backend: str, case: str) -> tuple[str, float]:
    return _judge(tmp_path, *_launch(tmp_path, backend, case))


def _judge(tmp_path: Path, result: subprocess.CompletedProcess[str], ended: float) -> tuple[str, float]:
    out = result.stdout
    started = [float(p.read_text()) for p in tmp_path.glob("started_rank*")]
    assert started, f"the misuse was never reached:\n{out[-6000:]}"
    assert result.returncode != 0, out[-6000:]
    assert not list(tmp_path.glob("finished_rank*")), "a rank trained on to the end"
    return out, ended - min(started)


SAVED_ALONE = ["`save_pretrained` at optimizer step", "not under `if engine.is_main_process:`"]
GATHERED_ALONE = ["`get_state_dict` at optimizer step", "not under `if engine.is_main_process:`"]
LEFT = ["left the training loop", "decide a `break` together"]
ZERO3 = pytest.mark.deepspeed
# (the fallback's get_state_dict reads replicated weights on the rank that asks: no collective)
CASES = [
    pytest.param("deepspeed", "save_on_main_only", SAVED_ALONE, marks=ZERO3, id="zero3-save_on_main_only"),
    pytest.param(
        "deepspeed", "state_dict_on_main", GATHERED_ALONE, marks=ZERO3, id="zero3-state_dict_on_main"
    ),
    pytest.param("deepspeed", "early_break", LEFT, marks=ZERO3, id="zero3-early_break"),
    pytest.param("accelerate", "save_on_main_only", SAVED_ALONE, id="fallback-save_on_main_only"),
    pytest.param("accelerate", "early_break", LEFT, id="fallback-early_break"),
]


# Most of a hang case is waiting for the watchdog: the selected cases are launched together,
# at most this many at a time, and each test judges its own launch (the time it ended is
# taken when it ended, not when its test looks).
AT_ONCE = 3


@pytest.fixture(scope="module")
def hangs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    selected = [
        (item.callspec.params["backend"], item.callspec.params["case"])
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_a_hang_is_named_within_the_timeout"
    ]
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        launches = {}
        for backend, case in selected:
            folder = tmp_path_factory.mktemp(f"hang_{backend}_{case}")
            launches[backend, case] = (folder, pool.submit(_launch, folder, backend, case))
        yield launches


@pytest.mark.parametrize(("backend", "case", "expected"), CASES)
def test_a_hang_is_named_within_the_timeout(hangs, backend: str, case: str, expected: list[str]) -> None:
    folder, launch = hangs[backend, case]
    out, elapsed = _judge(folder, *launch.result())
    print(f"{backend}/{case}: the job ended {elapsed:.1f} s after the misuse")
    assert elapsed < HANG_TIMEOUT_S + MARGIN_S, f"{elapsed:.0f} s:\n{out[-6000:]}"
    assert "made no progress for" in out and f"hang_timeout_s={HANG_TIMEOUT_S}" in out, out[-6000:]
    for text in expected:
        assert text in out, f"{text!r} missing:\n{out[-6000:]}"
    assert "--- Python stacks of rank" in out and 'File "' in out  # the stacks were dumped


@pytest.mark.deepspeed
def test_a_zero3_model_created_inside_main_process_first_is_refused_at_once(tmp_path: Path) -> None:
    out, elapsed = _run(tmp_path, "deepspeed", "main_first_zero3")
    assert elapsed < HANG_TIMEOUT_S, f"{elapsed:.0f} s:\n{out[-6000:]}"
    assert "made no progress" not in out, "refused only by the watchdog, not at once"
    assert "init_context()` inside `main_process_first()` under ZeRO-3" in out, out[-6000:]
    assert not list(tmp_path.glob("survived_rank*"))
