"""accelerate's `Accelerator` surface: ``from ds_engine.accelerator import Accelerator`` works.

The surface lives in `ds_engine.accelerate_compat` (the class, the constructor mapping, the
views, the state folders, the trackers and the `COMPAT` table); this module re-exports it,
with the accelerate names a port imports from ds_engine (`DistributedType`,
`DataLoaderConfiguration`, `DeepSpeedPlugin`, `ProjectConfiguration`, `DummyOptim`,
`set_seed`, ...), which are accelerate's own where the meaning is the same.
"""

from __future__ import annotations

from accelerate.state import PartialState
from accelerate.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    find_executable_batch_size,
    set_seed,
)
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # also without DeepSpeed

from ds_engine.accelerate_compat.accelerator import Accelerator, skip_first_batches
from ds_engine.accelerate_compat.compat import COMPAT, DIFFERS, NOT_APPLICABLE, SEMANTICS_NOTE, SUPPORTED
from ds_engine.accelerate_compat.views import AcceleratorStateView, DeepSpeedPluginView

__all__ = [
    "COMPAT",
    "DIFFERS",
    "NOT_APPLICABLE",
    "SEMANTICS_NOTE",
    "SUPPORTED",
    "Accelerator",
    "AcceleratorStateView",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedPluginView",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "LoggerType",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "find_executable_batch_size",
    "set_seed",
    "skip_first_batches",
]
