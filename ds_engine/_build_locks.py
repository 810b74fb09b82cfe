"""A stale op-build lock, named before DeepSpeed waits on it forever.

DeepSpeed compiles its CPU ops (the communication op every CPU rank loads when the process
group forms, CPU Adam, ...) through torch's extension builder on first use. The builder takes a
lock file in the op's build folder and every other process waits, polling, until the file is
gone. A build killed midway (Ctrl-C during the first launch, a job killed by its scheduler)
leaves the file behind, and every later launch then waits on it without a word, before
ds_engine's hang watchdog exists. A build takes a minute or two; a lock far older than that
has no builder left.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

#: A lock older than this (seconds) is taken for a leftover: building one op takes a minute or
#: two even on a loaded 2-core machine.
STALE_AFTER_S = 15 * 60


def extensions_root() -> Path:
    """Where torch builds and caches extensions for this interpreter (its own rule)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def stale_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> list[tuple[Path, float]]:
    """The build locks under `root` older than `stale_after_s`, with their age in seconds."""
    root = extensions_root() if root is None else root
    found = []
    now = time.time()
    try:
        candidates = sorted(root.glob("*/lock"))
    except OSError:
        return []
    for lock in candidates:
        try:
            age = now - lock.lstat().st_mtime
        except OSError:  # removed meanwhile: the build finished
            continue
        if age > stale_after_s:
            found.append((lock, age))
    return found


def check_no_stale_build_lock(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> None:
    """Raise, naming the file and the fix, if a DeepSpeed/torch op-build lock was left behind."""
    stale = stale_locks(root, stale_after_s)
    if not stale:
        return
    lines = "\n".join(f"  {lock}  ({age / 60:.0f} min old)" for lock, age in stale)
    removal = " ".join(str(lock) for lock, _ in stale)
    raise RuntimeError(
        "An op-build lock was left behind by a build that was killed midway:\n"
        f"{lines}\n"
        "DeepSpeed would wait on it forever when it loads that op. If no DeepSpeed op is being "
        f"built on this machine now, remove it: rm {removal}"
    )
