"""The Engine's training loop under Ray Train (`scripts/examples/ray_train_loop.py`) on a real local
Ray cluster: a run of 2 `TorchTrainer` workers, stopped after a checkpoint and started again
(same run name and storage), trains step for step what 2 torchrun ranks train without a stop,
and ends with the same weights.

One Ray cluster serves the whole module (`num_cpus=2`, no dashboard): starting it costs a few
seconds, each `fit` 20-30 s on 2 shared cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_engine._imports import is_deepspeed_available
from tests.distributed.launcher import ROOT, run_command, worker_env

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "ds-engine[ray]"')

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # each test: 1-2 minutes on 2 shared cores

EXAMPLES = ROOT / "scripts" / "examples"
EXAMPLE = EXAMPLES / "ray_train_loop.py"
STEPS = 16  # 64 samples, 2 workers x micro-batch 2 x GA 2 per step, 2 epochs
# Ray's part (forming the group, reporting a checkpoint folder, handing it back) does not depend
# on the stage: the fallback and ZeRO-3 (the partitioned checkpoint) cover it; ZeRO-2's
# checkpoints are exercised by the torchrun resume tests.
BACKENDS = {
    "fallback": {"backend": "accelerate", "zero_stage": 0},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
}


def _backend(name: str) -> Any:
    if name == "fallback":
        return pytest.param(name)
    marks = [pytest.mark.deepspeed]
    if not is_deepspeed_available():
        marks.append(pytest.mark.skip(reason="DeepSpeed is not installed"))
    return pytest.param(name, marks=marks)


PARAMS = [_backend(name) for name in BACKENDS]


@pytest.fixture(scope="module")
def one_ray_cluster_at_a_time() -> Any:
    """Hold the machine's Ray lock while this module's cluster runs: a second local cluster
    started at the same time (the other environment's half of the suite) could find this one
    through Ray's "latest cluster" file and join it."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "ds_engine_tests_ray.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def example(one_ray_cluster_at_a_time: Any) -> Any:
    """The example module, imported by name here and (through PYTHONPATH) in Ray's workers."""
    env = worker_env()
    pythonpath = f"{EXAMPLES}:{env['PYTHONPATH']}"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
    sys.path.insert(0, str(EXAMPLES))
    try:
        import ray_train_loop

        yield ray_train_loop
    finally:
        sys.path.remove(str(EXAMPLES))
        ray.shutdown()


def _losses(out: Path) -> list[dict[int, float]]:
    per_rank = []
    for rank in range(2):
        lines = (out / f"losses_rank{rank}.jsonl").read_text().splitlines()
        per_rank.append({r["step"]: r["loss"] for r in map(json.loads, lines)})
    return per_rank


def _fit(example: Any, backend: str, out: Path, storage: Path, name: str, **config: Any) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return example.fit(
        {**BACKENDS[backend], "out": str(out), "every": 4, **config},
        workers=2,
        gpu=False,
        storage=str(storage),
        name=name,
    )


def _torchrun(backend: str, out: Path) -> None:
    """The same loop on 2 torchrun ranks (`ds-engine launch ... --torchrun`), no Ray involved."""
    settings = BACKENDS[backend]
    cmd = [
        sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE), "--torchrun",
        "--backend", str(settings["backend"]), "--zero-stage", str(settings["zero_stage"]),
        "--out", str(out),
    ]  # fmt: skip
    result = run_command(cmd, timeout=420, env=worker_env(), finished=lambda: (out / "weights.pt").exists())
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.parametrize("backend", PARAMS)
def test_a_ray_run_stopped_and_resumed_trains_step_for_step_what_torchrun_ranks_train(
    backend: str, example: Any, tmp_path: Path
) -> None:
    """One comparison covers both promises: Ray's workers train what torchrun's ranks train, and
    a run stopped after a checkpoint and started again (same name and storage) resumes through
    `ray.train.get_checkpoint()` to the end an uninterrupted run reaches, exactly."""
    _torchrun(backend, tmp_path / "torchrun")
    expected = _losses(tmp_path / "torchrun")
    storage = tmp_path / "storage"
    first = _fit(example, backend, tmp_path / "first", storage, "resumed", stop_after=10)
    assert first.error is None, first.error
    assert first.checkpoint is not None and (Path(first.checkpoint.path) / "step_8").is_dir()
    got = _losses(tmp_path / "first")
    for rank in range(2):
        assert sorted(got[rank]) == list(range(1, 11)), "the first run did not stop after step 10"
        worst = max(abs(got[rank][s] - expected[rank][s]) for s in got[rank])
        assert worst <= 1e-6, f"rank {rank}: Ray's losses differ from torchrun's by up to {worst}"
    # the same run name and storage: Ray hands the workers its newest checkpoint (step 8)
    second = _fit(example, backend, tmp_path / "second", storage, "resumed")
    assert second.error is None, second.error
    assert second.metrics["step"] == STEPS
    got = _losses(tmp_path / "second")
    for rank in range(2):
        assert sorted(got[rank]) == list(range(9, STEPS + 1)), "the second run did not start after step 8"
        worst = max(abs(got[rank][s] - expected[rank][s]) for s in got[rank])
        assert worst <= 1e-6, f"rank {rank}: the resumed run's losses differ from torchrun's by up to {worst}"
    weights = torch.load(tmp_path / "second" / "weights.pt")
    reference = torch.load(tmp_path / "torchrun" / "weights.pt")
    assert weights.keys() == reference.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-6, atol=1e-6, msg=key)
