"""What a rank sees of its launch: the rank variables, argv, `__name__`, `sys.path[0]` and a
variable the test passes; one all-reduce over the group. `--fail`: rank 1 raises while rank 0
waits in a collective; `--sleep S`: every rank sleeps S seconds first (its pid written
to `pid<RANK>` beforehand)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import parse_args, write_result

KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS", "LAUNCH_PROBE",
)  # fmt: skip

args = parse_args([("--fail", {"action": "store_true"}), ("--sleep", {"type": float, "default": 0.0})])
(Path(args.out) / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(args.sleep)
dist.init_process_group("gloo")
if args.fail and dist.get_rank() == 1:
    raise ValueError("the probe's rank 1 fails on purpose")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
write_result(
    args.out,
    {
        "env": {key: os.environ.get(key) for key in KEYS},
        "error_file": bool(os.environ.get("TORCHELASTIC_ERROR_FILE")),
        "argv": sys.argv[1:],
        "name": __name__,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "sum": total.item(),
        "threads": torch.get_num_threads(),
    },
)
dist.destroy_process_group()
