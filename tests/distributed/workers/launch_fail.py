"""Rank 1 exits with code 7 after joining the group; rank 0 would wait forever.

Rank 0 enters a barrier and, should that barrier error out because its peer vanished, keeps
sleeping: the only way this group ends quickly is the launcher stopping it.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    print("launch_fail: rank 1 exits with code 7", flush=True)
    sys.exit(7)
try:
    dist.barrier()
except Exception:
    pass
time.sleep(600)
