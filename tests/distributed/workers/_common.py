"""Helpers shared by the worker scripts (they run inside torchrun-launched processes)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def error_of(fn: Any) -> str:
    """`fn()`'s exception as "Type: message", or "" when it returns."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def parse_args(extra: list[tuple[str, dict[str, Any]]] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    for name, kwargs in extra or []:
        parser.add_argument(name, **kwargs)
    return parser.parse_args()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_result(out: str, result: dict[str, Any]) -> None:
    path = Path(out) / f"rank{rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    # No rank leaves (and risks torch's exit-time abort, see launcher._aborted_after_finishing)
    # before every rank has written its result.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        return
    # The worker ended its process group already (e.g. to test `end_training`): wait on the
    # other ranks' files instead. A rank that fails never writes one, and torchrun then stops
    # this rank; the deadline only bounds a hang.
    import time

    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + 600
    while not all((Path(out) / f"rank{r}.json").exists() for r in range(world)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


def probe_exit(out: str) -> None:
    """Record, at interpreter exit, whether the process group was still alive.

    Registered before any Engine exists, so it runs after the Engine's own exit handler
    (atexit runs handlers last-in, first-out).
    """
    import atexit

    def record() -> None:
        import torch.distributed as dist

        alive = dist.is_available() and dist.is_initialized()
        (Path(out) / f"exit{rank()}.json").write_text(json.dumps({"group_alive_at_exit": alive}))

    atexit.register(record)


def patch_cpu_fp16() -> None:
    """Let DeepSpeed's CPU accelerator accept fp16 (test code only; CPUs here lack native fp16)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True  # type: ignore[method-assign]


def pretend_fsdp_platform() -> None:
    """Let accelerate grant FSDP on these CPU ranks, as it does on GPUs (test code only).

    accelerate enables FSDP only for GPU-type distributed setups, so on CPU the fallback runs
    DDP. The one thing that cannot exist here, a GPU, is replaced by two switches: the
    backend's platform check says yes, and when an Accelerator is given an FSDP plugin its
    state turns from MULTI_CPU into FSDP. Everything after that is real: accelerate's FSDP2
    preparation, torch's `fully_shard` on gloo, ds_engine's engine and checkpoints.
    """
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from ds_engine.backends.accelerate import AccelerateBackend

    AccelerateBackend._platform_offers_fsdp = lambda self: True  # type: ignore[method-assign]
    original = accelerate.Accelerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
            if self.state.mixed_precision != "no":
                plugin.set_mixed_precision(self.state.mixed_precision)
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin
            # as accelerate does for FSDP: every later AcceleratorState() copies this back
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate.Accelerator.__init__ = init  # type: ignore[method-assign]
