"""Report what the launcher gave this rank (world, env) and prove the group works (all_reduce)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import parse_args, write_result

args = parse_args([("--tag", {"default": ""})])
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
write_result(
    args.out,
    {
        "tag": args.tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "group_rank": os.environ.get("GROUP_RANK"),
        "all_reduce": value.item(),
        "DS_ENGINE_CONFIG": os.environ.get("DS_ENGINE_CONFIG"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
    },
)
dist.destroy_process_group()
