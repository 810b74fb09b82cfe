"""`ds-engine launch` as users run it: real launcher processes, real torchrun, real gloo groups."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.launcher import ROOT, WORKERS, free_port, run_command, worker_env

pytestmark = pytest.mark.distributed

LAUNCH = [sys.executable, "-m", "ds_engine.cli", "launch"]


def _env_without(*names: str, **extra: str) -> dict[str, str]:
    env = worker_env(extra)
    for name in names:
        env.pop(name, None)
    return env


def _run_nodes(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    """Start one launcher per "node" at once; kill every group if any overruns."""
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        for cmd, env in zip(cmds, envs)
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tails = "\n----\n".join(p.communicate()[0][-3000:] for p in procs)
        raise TimeoutError(f"launchers did not finish in {timeout}s:\n{tails}") from None
    return results


def _read(out: Path, rank: int) -> dict[str, object]:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_failing_rank_stops_the_whole_group(tmp_path: Path) -> None:
    script = tmp_path / "launch_fail_copy.py"  # a unique path, so leftover workers can be found
    shutil.copy(WORKERS / "launch_fail.py", script)
    start = time.monotonic()
    result = run_command([*LAUNCH, "--nproc-per-node", "2", str(script)], timeout=180)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout[-4000:]
    # rank 0 would sleep 600 s: finishing this fast means torchrun stopped it
    assert elapsed < 90, f"took {elapsed:.0f}s"
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("ds-engine launch: rank 1 (local rank 1) exited with code 7"), last
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_two_nodes_static_rendezvous_over_loopback(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    cmds = [
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--nproc-per-node",
            "1",
            "--config",
            str(config),
            str(WORKERS / "launch_env.py"),
            "--out",
            str(out),
            "--tag",
            f"node{node}",
        ]
        for node in (0, 1)
    ]
    # node 0: the launcher chooses OMP_NUM_THREADS and GLOO_SOCKET_IFNAME; node 1: the user did
    envs = [
        _env_without("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"),
        worker_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}),
    ]
    for rc, text in _run_nodes(cmds, envs, timeout=240):
        assert rc == 0, text[-4000:]
    results = [_read(out, r) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert [r["env_world_size"] for r in results] == ["2", "2"]
    assert [r["group_rank"] for r in results] == ["0", "1"]  # --node-rank reached torchrun
    assert [r["tag"] for r in results] == ["node0", "node1"]  # the script's own args passed through
    assert [r["all_reduce"] for r in results] == [3.0, 3.0]
    assert {r["DS_ENGINE_CONFIG"] for r in results} == {str(config.resolve())}
    assert results[0]["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() or 1))
    assert results[0]["GLOO_SOCKET_IFNAME"] == "lo"
    assert results[1]["OMP_NUM_THREADS"] == "1"


def test_two_nodes_elastic_rendezvous_over_loopback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = [
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "t1",
            "--nproc-per-node",
            "1",
            str(WORKERS / "launch_env.py"),
            "--out",
            str(out),
        ]
        for _ in (0, 1)
    ]
    for rc, text in _run_nodes(cmds, [worker_env(), worker_env()], timeout=240):
        assert rc == 0, text[-4000:]
    results = [_read(out, r) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert sorted(str(r["group_rank"]) for r in results) == ["0", "1"]
    assert [r["all_reduce"] for r in results] == [3.0, 3.0]
    assert [r["DS_ENGINE_CONFIG"] for r in results] == [None, None]
