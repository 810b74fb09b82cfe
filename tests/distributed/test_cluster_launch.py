"""`ds-engine launch` on a cluster, simulated on 127.0.0.1 with real launchers, torchrun and gloo.

* Slurm: two launchers started as `srun` would (the `SLURM_*` variables of a 2-node job step and
  a stand-in `scontrol` on PATH), with no rendezvous flags, form one group of 2 and train what
  one process trains (weights within 4e-4 relative).
* Elastic membership (c10d rendezvous, `--nnodes 1:2 --max-restarts N`): a "node" killed mid-run
  leaves the other to restart and resume from the newest autosave on 1 process; a node that
  joins later makes the group grow to 2 at the next restart. Both end where one uninterrupted
  process ends (weights within 4e-4 relative).

The elastic runs launch through `elastic_launch.py`, which shortens the c10d rendezvous' last
call (30 s, torchrun's default) in the rounds where no late node is expected; they are `slow`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ds_engine.slurm import port_for_job
from tests.distributed.launcher import ROOT, WORKERS, free_port, run_command, worker_env

pytestmark = pytest.mark.distributed

LAUNCH = [sys.executable, "-m", "ds_engine.cli", "launch"]
WORKER = WORKERS / "cluster_train.py"
TOTAL_STEPS = 24  # 64 samples in global batches of 8, 3 epochs
RELATIVE = 4e-4


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as sink:
        return subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def _finish(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        _kill(procs)
        tails = "\n----\n".join(log.read_text(errors="replace")[-4000:] for log in logs)
        raise TimeoutError(f"launchers did not finish in {timeout}s:\n{tails}") from None
    return codes


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _kill_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher and every process under it, at once (torchrun starts its workers in
    sessions of their own, so the launcher's process group alone would leave them running)."""
    family = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _steps(out: Path) -> list[dict[str, int]]:
    records = []
    for path in sorted(out.glob("steps_rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def _wait_for(
    check, timeout: float, what: str, procs: list[subprocess.Popen[bytes]], logs: list[Path]
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _kill(procs)
            tails = "\n----\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
            raise AssertionError(f"{what} did not happen in {timeout}s:\n{tails}")
        time.sleep(0.2)


_REFERENCE: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture
def one_process(tmp_path_factory: pytest.TempPathFactory):
    """The final weights of one process training the whole run (computed once per module)."""
    if "weights" not in _REFERENCE:
        out = tmp_path_factory.mktemp("one_process")
        result = run_command([*LAUNCH, "--nproc-per-node", "1", str(WORKER), "--out", str(out)], timeout=300)
        assert result.returncode == 0, result.stdout[-4000:]
        assert json.loads((out / "rank0.json").read_text())["steps"] == TOTAL_STEPS
        _REFERENCE["weights"] = torch.load(out / "weights.pt")
    return _REFERENCE["weights"]


def assert_close_to(weights_file: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(weights_file)
    assert weights.keys() == reference.keys()
    for key, value in weights.items():
        relative = ((value - reference[key]).norm() / reference[key].norm()).item()
        assert relative <= RELATIVE, f"{key}: {relative:.2e} relative to one process"


def _free_job_port() -> str:
    """A job id whose derived port is free here."""
    for _ in range(200):
        job = str(random.randrange(10**5, 10**7))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_for_job(job)))
            except OSError:
                continue
            return job
    raise RuntimeError("no free port in the Slurm range")


def test_srun_launchers_need_no_rendezvous_flags_and_train_like_one_process(
    tmp_path: Path, one_process: dict[str, torch.Tensor]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    scontrol = bin_dir / "scontrol"
    # this machine's two "hosts" are 127.0.0.1 and 127.0.0.2: both reach the loopback interface
    scontrol.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
        "echo 127.0.0.1\necho 127.0.0.2\n"
    )
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    job = _free_job_port()
    out = tmp_path / "out"
    envs = [
        worker_env(
            {
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "SLURM_JOB_ID": job,
                "SLURM_JOB_NAME": "finetune",
                "SLURM_NNODES": "2",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_JOB_NODELIST": "simnode[01-02]",
                "SLURM_NODELIST": "simnode[01-02]",
                "SLURM_NTASKS": "2",
                "SLURM_NTASKS_PER_NODE": "1",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_STEP_NODELIST": "simnode[01-02]",
                "SLURM_NODEID": str(node),
                "SLURM_PROCID": str(node),
                "SLURM_LOCALID": "0",
            }
        )
        for node in (0, 1)
    ]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    cmd = [*LAUNCH, str(WORKER), "--out", str(out)]
    procs = [_start(cmd, env, log) for env, log in zip(envs, logs)]
    codes = _finish(procs, logs, timeout=300)
    texts = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n----\n".join(t[-4000:] for t in texts)
    for node, text in enumerate(texts):
        info = [line for line in text.splitlines() if line.startswith("ds-engine launch: INFO:")]
        assert info == [
            f"ds-engine launch: INFO: from Slurm job {job}: nnodes=2 (SLURM_STEP_NUM_NODES), "
            f"node_rank={node} (SLURM_NODEID), "
            "master_addr=127.0.0.1 (first host of SLURM_STEP_NODELIST=simnode[01-02]), "
            f"master_port={port_for_job(job)} (from SLURM_JOB_ID={job})"
        ], text[-3000:]
    assert calls.read_text().splitlines() == ["show hostnames simnode[01-02]"] * 2
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in results] == [2, 2]
    assert [r["steps"] for r in results] == [TOTAL_STEPS, TOTAL_STEPS]
    assert_close_to(out / "weights.pt", one_process)


def _listening(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


# `ds-engine launch` with torchrun's rendezvous last call (30 s) shortened where the test
# needs no late node: the wait in the first round, then in every round after a restart
ELASTIC_LAUNCH = Path(__file__).parent / "elastic_launch.py"


def _elastic_cmd(
    endpoint: str, run_id: str, out: Path, max_restarts: int, last_call: tuple[float, float]
) -> list[str]:
    return [
        sys.executable, str(ELASTIC_LAUNCH), *map(str, last_call),
        "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--max-restarts", str(max_restarts), "--nproc-per-node", "1", str(WORKER),
        "--out", str(out), "--ckpt", str(out / "ckpt"), "--step-sleep", "0.4",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_killed_node_leaves_a_smaller_group_that_resumes_from_the_newest_autosave(
    tmp_path: Path, one_process: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    # node B must join node A's first round (torchrun's 30 s); after B dies, A waits 3 s alone
    cmd = _elastic_cmd(endpoint, "shrink", out, max_restarts=2, last_call=(30, 3))
    logs = [tmp_path / "node_a.log", tmp_path / "node_b.log"]
    # node A starts first and hosts the rendezvous store (the endpoint): the job lives as long
    # as that host does, as with torchrun on a real cluster; node B is the one that dies
    procs = [_start(cmd, worker_env(), logs[0])]
    _wait_for(lambda: _listening(endpoint), 60, "the rendezvous store", procs, logs[:1])
    procs.append(_start(cmd, worker_env(), logs[1]))
    _wait_for(
        lambda: any(r["step"] >= 6 and r["world"] == 2 for r in _steps(out)), 240, "step 6 on 2", procs, logs
    )
    _kill_node(procs[1])
    codes = _finish([procs[0]], [logs[0]], timeout=300)
    text = logs[0].read_text(errors="replace")
    assert codes == [0], text[-4000:]
    records = _steps(out)
    on_two = [r["step"] for r in records if r["world"] == 2]
    on_one = [r for r in records if r["world"] == 1]
    assert on_one, text[-4000:]
    assert all(r["restart"] >= 1 for r in on_one), "the smaller group is torchrun's restart"
    first_alone = min(r["step"] for r in on_one)
    # it resumed from the newest autosave (every step; a checkpoint being written when the node
    # died may be incomplete, then the one before): no step trained twice beyond that one
    assert max(on_two) - 1 <= first_alone <= max(on_two) + 1, (max(on_two), first_alone)
    assert max(r["step"] for r in on_one) == TOTAL_STEPS
    assert json.loads((out / "rank0.json").read_text()) == {"steps": TOTAL_STEPS, "world": 1}
    assert_close_to(out / "weights.pt", one_process)


@pytest.mark.slow
def test_a_node_that_joins_later_grows_the_group_at_the_next_restart(
    tmp_path: Path, one_process: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    # node A starts alone after 3 s; the round node B joins ends as soon as both are in
    cmd = _elastic_cmd(endpoint, "grow", out, max_restarts=2, last_call=(3, 30))
    logs = [tmp_path / "node_a.log", tmp_path / "node_b.log"]
    first = _start(cmd, worker_env(), logs[0])
    _wait_for(
        lambda: any(r["step"] >= 3 and r["world"] == 1 for r in _steps(out)),
        240,
        "step 3 on 1",
        [first],
        logs[:1],
    )
    second = _start(cmd, worker_env(), logs[1])
    codes = _finish([first, second], logs, timeout=400)
    texts = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n----\n".join(t[-4000:] for t in texts)
    records = _steps(out)
    on_one = [r["step"] for r in records if r["world"] == 1]
    on_two = [r for r in records if r["world"] == 2]
    assert on_one and on_two, records
    assert min(r["step"] for r in on_two) > min(on_one), "the group grew after training alone"
    assert max(r["step"] for r in on_two) == TOTAL_STEPS
    assert json.loads((out / "rank0.json").read_text()) == {"steps": TOTAL_STEPS, "world": 2}
    assert_close_to(out / "weights.pt", one_process)
