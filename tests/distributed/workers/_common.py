"""Helpers shared by the worker scripts (they run inside torchrun-launched processes)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


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


def patch_cpu_fp16() -> None:
    """Let DeepSpeed's CPU accelerator accept fp16 (test code only; CPUs here lack native fp16)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True  # type: ignore[method-assign]
