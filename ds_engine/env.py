"""What `ds-engine env` reports: versions, the backend `auto` picks, CPU Adam build state."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

from ds_engine._imports import deepspeed_unavailable_reason, deepspeed_version


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _prebuilt_ops() -> dict[str, bool]:
    """DeepSpeed's record of the ops compiled into its install (read without importing it)."""
    spec = importlib.util.find_spec("deepspeed")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "git_version_info_installed.py"
        if path.is_file():
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "installed_ops":
                    return dict(ast.literal_eval(node.value))
    return {}


def torch_extensions_dir() -> Path:
    """Where torch (and so DeepSpeed) caches JIT-compiled ops, as `torch.utils.cpp_extension` decides."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accel}"


def _cpu_adam_built() -> str:
    if deepspeed_version() is None:
        return "n/a (DeepSpeed not installed)"
    if _prebuilt_ops().get("cpu_adam"):
        return "yes (pre-built into the DeepSpeed install)"
    library = torch_extensions_dir() / "cpu_adam" / "cpu_adam.so"
    if library.is_file():
        return f"yes ({library.parent})"
    return f"no (compiled into {library.parent} on first use, about a minute)"


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
