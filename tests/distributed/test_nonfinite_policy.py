"""The non-finite policy on 2 real ranks, both backends, fp32 and bf16.

Policy (see `EngineConfig.max_consecutive_skipped_steps`): an optimizer step whose gradients
are non-finite on any rank is skipped on every rank and counted (`step_was_skipped`,
`num_skipped_steps`), the weights stay as they were; after `max_consecutive_skipped_steps`
skipped steps in a row the Engine raises `FloatingPointError` on every rank, and a job that
does not catch it exits non-zero, without hanging.

The worker poisons rank 1's loss only (NaN) at step 1, then at every step from step 3 on, with
the limit set to 3: step 1 is skipped alone, steps 3 and 4 are skipped, and step 5 raises.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.distributed.launcher import WORKERS, run_command, shared_scenarios, torchrun_command, worker_env

pytestmark = pytest.mark.distributed

LIMIT, ISOLATED, RUN_FROM = 3, 1, 3


def _launch(tmp_path: Path, scenarios: list[dict]) -> tuple[int, str, list[dict], float]:
    cmd = torchrun_command(
        WORKERS / "nonfinite_policy.py",
        "--out",
        str(tmp_path),
        "--scenarios",
        json.dumps(scenarios),
        "--reraise",
    )
    result = run_command(cmd, timeout=400, env=worker_env())
    end = time.time()
    ranks = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing:\n{result.stdout[-6000:]}"
        ranks.append(json.loads(path.read_text()))
    # from the last result written to the job's end: the raise ended the job promptly
    return result.returncode, result.stdout, ranks, end - max(r["finished_at"] for r in ranks)


def _check(ranks: list[dict], index: int) -> None:
    keys = ("backend", "zero_stage", "precision", "clip")
    label = json.dumps({k: v for k, v in ranks[0]["results"][index].items() if k in keys})
    for rank, data in enumerate(ranks):
        r = data["results"][index]
        assert "crash" not in r, f"{label} rank {rank}: {r.get('crash')}\n{r.get('tb')}"
        skipped = [rec["step"] for rec in r["records"] if rec["skipped"]]
        assert skipped == [ISOLATED, RUN_FROM, RUN_FROM + 1], f"{label} rank {rank}: {r['records']}"
        assert r["num_skipped_steps"] == 1 + LIMIT, label  # the isolated skip and the run of LIMIT
        assert r["num_optimizer_steps"] == RUN_FROM - 1, label  # steps 0 and 2 applied
        error = r["error"]
        assert error is not None, f"{label} rank {rank}: no FloatingPointError"
        assert error["type"] == "FloatingPointError" and error["step"] == RUN_FROM + LIMIT - 1, (label, error)
        assert "3 optimizer steps in a row were skipped" in error["message"], error
        assert "max_consecutive_skipped_steps" in error["message"] and "HINT" in error["message"]
    r0 = ranks[0]["results"][index]
    assert r0["before"] == r0["after"], f"{label}: the skipped step changed the weights"
    assert r0["weights_finite"], f"{label}: non-finite weights after the run"


def _check_job(code: int, out: str, tail: float) -> None:
    assert code != 0, "the uncaught FloatingPointError did not fail the job"
    assert out.count("FloatingPointError: 3 optimizer steps in a row") >= 2, out[-6000:]  # both ranks
    assert tail < 60, f"the job took {tail:.0f}s to end after the error"


def _run_and_check(tmp_path: Path, scenarios: list[dict]) -> None:
    code, out, ranks, tail = _launch(tmp_path, scenarios)
    _check_job(code, out, tail)
    for index in range(len(scenarios)):
        _check(ranks, index)


def test_fallback_fp32_and_bf16_skip_count_then_raise_on_every_rank(tmp_path: Path) -> None:
    _run_and_check(tmp_path, [{"backend": "accelerate", "precision": p} for p in ("fp32", "bf16")])


DEEPSPEED = {
    f"test_deepspeed_{precision}_skip_count_then_raise_on_every_rank": [
        {"backend": "deepspeed", "zero_stage": z, "precision": precision} for z in (0, 2, 3)
    ]
    for precision in ("bf16", "fp32")
}
# fp32 ZeRO-0 with clipping: the step is skipped inside DeepSpeed's own step(), where it clips
DEEPSPEED["test_deepspeed_fp32_skip_count_then_raise_on_every_rank"].append(
    {"backend": "deepspeed", "zero_stage": 0, "precision": "fp32", "clip": 1.0}
)


@pytest.fixture(scope="module")
def deepspeed_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One launch for the scenarios of both DeepSpeed tests (those selected); the job re-raises
    the last scenario's error. Each test checks the job's end and its own scenarios."""
    scenarios, slices = shared_scenarios(request, DEEPSPEED)
    code, out, ranks, tail = _launch(tmp_path_factory.mktemp("nonfinite_deepspeed"), scenarios)
    return code, out, ranks, tail, slices


def _check_deepspeed(job, name: str) -> None:
    code, out, ranks, tail, slices = job
    _check_job(code, out, tail)
    indices = range(len(ranks[0]["results"]))[slices[name]]
    assert len(indices) == len(DEEPSPEED[name])
    for index in indices:
        _check(ranks, index)


@pytest.mark.deepspeed
def test_deepspeed_bf16_skip_count_then_raise_on_every_rank(deepspeed_job) -> None:
    _check_deepspeed(deepspeed_job, "test_deepspeed_bf16_skip_count_then_raise_on_every_rank")


@pytest.mark.deepspeed
def test_deepspeed_fp32_skip_count_then_raise_on_every_rank(deepspeed_job) -> None:
    _check_deepspeed(deepspeed_job, "test_deepspeed_fp32_skip_count_then_raise_on_every_rank")
