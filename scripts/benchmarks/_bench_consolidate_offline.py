"""Memory probes for `bench_consolidate.py`, and its child: one offline consolidation in a fresh process.

`scripts/benchmarks/` is `sys.path[0]` when a script there runs, so `bench_consolidate.py` imports
the probes from here. As a program (started by `bench_consolidate.py`, not meant for users):

    python scripts/benchmarks/_bench_consolidate_offline.py {ds_engine,deepspeed} CKPT OUT
        MAX_SHARD_BYTES RESULT [--pin-malloc]

runs `ds_engine.consolidate.consolidate_checkpoint(CKPT, OUT, max_shard_size=...)` or DeepSpeed's
`convert_zero_checkpoint_to_fp32_state_dict(CKPT, OUT, max_shard_size=..., safe_serialization=True)`
once and writes RESULT (JSON): the seconds of the call alone, this process's RSS and RssAnon
after every import (both tools' modules are imported either way, so the two start alike), and
its peak RSS over the call (VmHWM, reset through /proc/self/clear_refs after the imports), or
the error. The parent samples RssAnon from outside; it subtracts the level after imports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

TOOLS = ("ds_engine", "deepspeed")


# --------------------------------------------------------------------------- /proc probes
def status_bytes(field: str, pid: int | str = "self") -> int:
    """A `kB` field of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, ...) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (False where the kernel refuses)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    return status_bytes("VmHWM")


def malloc_trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def set_mmap_threshold(nbytes: int) -> None:
    """glibc's M_MMAP_THRESHOLD (setting it also disables the dynamic threshold)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)


def pin_malloc_to_mmap() -> None:
    """Serve allocations of 64 KiB and up from mmap (returned to the OS on free) so RSS tracks
    live memory. Without this glibc keeps freed blocks in its heap and later rounds reuse them,
    which hides part of a later round's peak from an RSS-based measure."""
    set_mmap_threshold(1 << 16)
    malloc_trim()


# --------------------------------------------------------------------------- the child
def _run(tool: str, checkpoint: str, out: str, max_shard_bytes: int) -> None:
    if tool == "ds_engine":
        from ds_engine.consolidate import consolidate_checkpoint

        consolidate_checkpoint(checkpoint, out, max_shard_size=max_shard_bytes)
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(
            checkpoint, out, max_shard_size=max_shard_bytes, safe_serialization=True
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=TOOLS)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("max_shard_bytes", type=int)
    parser.add_argument("result")
    parser.add_argument("--pin-malloc", action="store_true")
    args = parser.parse_args()
    if args.pin_malloc:
        pin_malloc_to_mmap()
    with contextlib.redirect_stdout(sys.stderr):  # both tools print progress
        import deepspeed.utils.zero_to_fp32  # noqa: F401
        import huggingface_hub  # noqa: F401  (DeepSpeed's shard splitter)
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401

        import ds_engine.consolidate  # noqa: F401

        gc.collect()
        malloc_trim()
        result: dict[str, Any] = {"base_rss": rss_bytes(), "base_anon": status_bytes("RssAnon")}
        result["peak_reset"] = reset_peak()
        start = time.perf_counter()
        try:
            _run(args.tool, args.checkpoint, args.out, args.max_shard_bytes)
            result["error"] = None
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        result["seconds"] = time.perf_counter() - start
        result["peak_rss"] = (
            peak_bytes()
            if result["peak_reset"]
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
    Path(args.result).write_text(json.dumps(result))
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
