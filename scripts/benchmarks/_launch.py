"""Launch a benchmark's worker on N local CPU processes (torchrun, gloo) with a hard timeout.

What `bench_overhead.py`, `bench_mainjob.py` and `bench_memory.py` share; they run as files, so
`scripts/benchmarks/` is `sys.path[0]` and `import _launch` finds this module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a local CPU launch: gloo on loopback, one thread per rank, offline
    Hugging Face libraries, the project root on `PYTHONPATH`; then `extra`."""
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra or {})
    return env


def torchrun_command(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run` on `nproc` local ranks, a free port, no restarts."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        str(script),
        *args,
    ]


def run_command(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in its own session from the project root, stdout and stderr together; past
    `timeout` seconds kill its whole process group and raise `TimeoutError`."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or worker_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(
            f"{' '.join(cmd)} did not finish in {timeout}s; output tail:\n{out[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def run_ranks(
    script: str | Path, out: Path, *args: str, nproc: int = 2, timeout: float
) -> list[dict[str, Any]]:
    """Launch `script --out OUT ARGS` on `nproc` ranks; return each rank's `OUT/rank{R}.json`.

    A run is judged by its results: every rank wrote one, whatever the exit code (torch's
    exit-time abort can strike a finished rank, see docs/reliability.md); else it raises with
    the output's tail."""
    out.mkdir(parents=True, exist_ok=True)
    result = run_command(torchrun_command(script, "--out", str(out), *args, nproc=nproc), timeout=timeout)
    files = [out / f"rank{rank}.json" for rank in range(nproc)]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise RuntimeError(
            f"{script} failed (exit {result.returncode}), no {missing}:\n{result.stdout[-8000:]}"
        )
    return [json.loads(f.read_text()) for f in files]
