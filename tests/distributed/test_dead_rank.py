"""A rank that raises or is killed mid-training ends the whole job within 60 s, non-zero.

`ds-engine launch` runs `workers/dead_rank.py` on 2 CPU ranks; at optimizer step 3 rank 1
raises (or SIGKILLs itself) while rank 0 would go on training for ten minutes. The test
checks: the launcher exits 1 with its one-line summary naming rank 1 and how it died; it
does so within 60 s of the failure; rank 0 never finished; and no process of the job is left.
Both backends, both ways to die.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.launcher import WORKERS, run_command

pytestmark = pytest.mark.distributed

LAUNCH = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2"]
#: How the summary names a rank that raised: its exception, whether or not torchrun had to stop
#: its process while it exited.
RAISED = "raised RuntimeError: dead_rank: rank 1 raises on purpose"


@pytest.mark.parametrize(
    ("backend", "mode", "how"),
    [
        pytest.param("accelerate", "raise", RAISED, id="fallback-raise"),
        pytest.param("accelerate", "kill", "was killed by SIGKILL", id="fallback-sigkill"),
        pytest.param("deepspeed", "raise", RAISED, id="deepspeed-raise", marks=pytest.mark.deepspeed),
        pytest.param(
            "deepspeed", "kill", "was killed by SIGKILL", id="deepspeed-sigkill", marks=pytest.mark.deepspeed
        ),
    ],
)
def test_a_dead_rank_ends_every_rank_within_60s(tmp_path: Path, backend: str, mode: str, how: str) -> None:
    script = tmp_path / f"dead_rank_{backend}_{mode}.py"  # a unique path, so leftovers can be found
    shutil.copy(WORKERS / "dead_rank.py", script)
    result = run_command([*LAUNCH, str(script), str(tmp_path), backend, mode], timeout=300)
    ended = time.time()
    out = result.stdout
    assert (tmp_path / "failed_at").exists(), f"rank 1 never reached the failure point:\n{out[-6000:]}"
    elapsed = ended - float((tmp_path / "failed_at").read_text())
    assert result.returncode == 1, out[-6000:]
    print(f"{backend}-{mode}: the job ended {elapsed:.1f}s after rank 1 failed")
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after rank 1 failed"
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(f"ds-engine launch: rank 1 (local rank 1) {how}"), summary
    assert not (tmp_path / "rank0_done").exists(), "rank 0 trained on as if nothing happened"
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == [], f"processes of the job still alive: {leftovers}"
