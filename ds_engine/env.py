"""What `ds-engine env` reports: versions, the backend `auto` picks, CPU Adam build state."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

from ds_engine._imports import deepspeed_unavailable_reason, deepspeed_version


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_adam_built() -> str:
    if deepspeed_version() is None:
        return "n/a (DeepSpeed not installed)"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    built = sorted(str(p.parent) for p in root.glob("*/cpu_adam/cpu_adam.so")) if root.exists() else []
    return f"yes ({built[0]})" if built else "no (compiled on first use, about a minute)"


def collect_env() -> dict[str, str]:
    """Return the facts a bug report needs, as strings."""
    import torch

    reason = deepspeed_unavailable_reason()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ds-engine": _version("ds-engine"),
        "torch": torch.__version__,
        "cuda available": str(torch.cuda.is_available()),
        "deepspeed": _version("deepspeed"),
        "accelerate": _version("accelerate"),
        "transformers": _version("transformers"),
        "datasets": _version("datasets"),
        "safetensors": _version("safetensors"),
        "backend 'auto' picks": "deepspeed" if not reason else f"accelerate ({reason})",
        "DeepSpeed CPU Adam op built": _cpu_adam_built(),
    }
