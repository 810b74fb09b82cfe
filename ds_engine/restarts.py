"""The process group of a group that torchrun restarted (`--max-restarts`).

torchrun keeps one rendezvous store for the whole job, and a restarted group writes and reads its
connection keys under the same names as the group before it: a rank can read a dead rank's
address and fail to connect (gloo: "connectFullMesh failed ... Connection refused"). A restarted
worker (TORCHELASTIC_RESTART_COUNT > 0) therefore forms its default process group itself on that
store with a prefix naming the restart, so every key it and DeepSpeed's or accelerate's later
groups write is new; DeepSpeed and accelerate then adopt the group as it is.
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["init_restarted_process_group"]


def init_restarted_process_group(backend: str, timeout: timedelta) -> bool:
    """Form the default process group on a per-restart prefix of torchrun's store; True if done.

    Does nothing (False) outside a restarted torchrun worker, or when a group already exists.

    Args:
        backend: The communication backend ("gloo", "nccl", ...).
        timeout: The process group's collective timeout.
    """
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    needed = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    if (
        not restart.isdigit()
        or int(restart) == 0
        or dist.is_initialized()
        or not all(k in os.environ for k in needed)
    ):
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=not use_agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=not use_agent_store,
    )
    prefixed = dist.PrefixStore(f"ds_engine_restart_{restart}/", store)
    dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return True
