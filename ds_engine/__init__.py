"""ds_engine: a DeepSpeed-first training engine for Hugging Face fine-tuning loops.

Public names are listed in `__all__`; heavy modules load on first use so that
`import ds_engine` stays fast and works without DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ds_engine._version import __version__

_LAZY = {
    "Accelerator": "ds_engine.accelerator",
    "AutocastKwargs": "ds_engine.accelerator",
    "DataLoaderConfiguration": "ds_engine.accelerator",
    "DeepSpeedPlugin": "ds_engine.accelerator",
    "DistributedDataParallelKwargs": "ds_engine.accelerator",
    "DistributedType": "ds_engine.accelerator",
    "DummyOptim": "ds_engine.accelerator",
    "DummyScheduler": "ds_engine.accelerator",
    "GradScalerKwargs": "ds_engine.accelerator",
    "GradientAccumulationPlugin": "ds_engine.accelerator",
    "InitProcessGroupKwargs": "ds_engine.accelerator",
    "LoggerType": "ds_engine.accelerator",
    "PartialState": "ds_engine.accelerator",
    "ProfileKwargs": "ds_engine.accelerator",
    "ProjectConfiguration": "ds_engine.accelerator",
    "find_executable_batch_size": "ds_engine.accelerator",
    "set_seed": "ds_engine.accelerator",
    "skip_first_batches": "ds_engine.accelerator",
    "ConfigError": "ds_engine.config",
    "EngineConfig": "ds_engine.config",
    "build_ds_config": "ds_engine.ds_config",
    "validate_ds_config": "ds_engine.ds_config",
    "Engine": "ds_engine.engine",
    "OverflowAwareScheduler": "ds_engine.scheduler",
    "estimate_memory": "ds_engine.memory",
    "recommend_config": "ds_engine.memory",
    "is_deepspeed_available": "ds_engine._imports",
}

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "ConfigError",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "Engine",
    "EngineConfig",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "LoggerType",
    "OverflowAwareScheduler",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "__version__",
    "build_ds_config",
    "estimate_memory",
    "find_executable_batch_size",
    "is_deepspeed_available",
    "recommend_config",
    "set_seed",
    "skip_first_batches",
    "validate_ds_config",
]

if TYPE_CHECKING:
    from ds_engine._imports import is_deepspeed_available
    from ds_engine.accelerator import (
        Accelerator,
        AutocastKwargs,
        DataLoaderConfiguration,
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        DistributedType,
        DummyOptim,
        DummyScheduler,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        LoggerType,
        PartialState,
        ProfileKwargs,
        ProjectConfiguration,
        find_executable_batch_size,
        set_seed,
        skip_first_batches,
    )
    from ds_engine.config import ConfigError, EngineConfig
    from ds_engine.ds_config import build_ds_config, validate_ds_config
    from ds_engine.engine import Engine
    from ds_engine.memory import estimate_memory, recommend_config
    from ds_engine.scheduler import OverflowAwareScheduler


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
