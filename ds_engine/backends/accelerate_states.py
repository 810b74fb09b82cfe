"""The accelerate backend's checkpoint state files: full model and optimizer states (DDP or FSDP2).

Full states do not depend on the number of ranks, so a tag resumes on any world size. Under
FSDP2 the shards are gathered with torch's distributed-checkpoint helpers and the optimizer
state is keyed by parameter name (`optimizer_format: "fqn"`); otherwise torch's own
`state_dict()`s are written (`"index"`). Rank 0 writes; every rank reads the full files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine._io import current_rank, load_safe, save_safe

__all__ = ["FALLBACK_MODEL_NAME", "FALLBACK_OPTIMIZER_NAME", "load_full_states", "save_full_states"]

FALLBACK_MODEL_NAME = "model_states.pt"
FALLBACK_OPTIMIZER_NAME = "optimizer_states.pt"


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _fqn_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """A `optimizer.state_dict()` (parameters numbered) keyed by parameter name instead.

    The numbering is the order of `optimizer.param_groups`, which `load_state_dict` relies
    on too; torch's distributed-checkpoint loader needs names to place FSDP shards.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {order[int(index)]: value for index, value in saved.get("state", {}).items()}
    groups = []
    start = 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": order[start : start + count]})
        start += count
    return {"state": state, "param_groups": groups}


def save_full_states(tag_dir: Path, *, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """The fallback's world-size-independent files: full model and optimizer states.

    Collective: every rank calls it; rank 0 writes. Under FSDP the shards are gathered with
    torch's distributed-checkpoint `get_state_dict` (full, on rank 0's CPU) and the optimizer
    state is keyed by parameter name (`optimizer_format: "fqn"`); otherwise the plain
    `state_dict()`s are written (`"index"`, torch's own format).
    """
    inner = _inner_optimizer(optimizer)
    if _is_fsdp(model) and inner.state:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        module_state, optimizer_state = get_state_dict(model, inner, options=options)
        optimizer_format = "fqn"
    elif _is_fsdp(model):  # no step taken yet: nothing sharded in the optimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module_state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        optimizer_state, optimizer_format = inner.state_dict(), "index"
    else:
        module_state, optimizer_state, optimizer_format = model.state_dict(), inner.state_dict(), "index"
    if current_rank() != 0:
        return
    save_safe({"module": module_state}, tag_dir / FALLBACK_MODEL_NAME, "the model state")
    save_safe(
        {
            "optimizer": optimizer_state,
            "optimizer_format": optimizer_format,
            "scaler": scaler.state_dict() if scaler is not None else None,
        },
        tag_dir / FALLBACK_OPTIMIZER_NAME,
        "the optimizer state",
    )


def load_full_states(tag_dir: Path, *, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """Inverse of `save_full_states`, on every rank (FSDP or not, any world size)."""
    for name in (FALLBACK_MODEL_NAME, FALLBACK_OPTIMIZER_NAME):
        if not os.path.lexists(tag_dir / name):  # a link or special file: refused by name below
            raise ValueError(
                f"{str(tag_dir)!r} has no `{name}`; it is not a checkpoint of the accelerate fallback. "
                "HINT: load it with the backend that wrote it (see its ds_engine_meta.json)."
            )
    module_state = load_safe(tag_dir / FALLBACK_MODEL_NAME)["module"]
    states = load_safe(tag_dir / FALLBACK_OPTIMIZER_NAME)
    inner = _inner_optimizer(optimizer)
    optimizer_state = states["optimizer"]
    fqn = states.get("optimizer_format", "index") == "fqn"
    if fqn or _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)  # every rank read the full file
        set_model_state_dict(model, module_state, options=options)
        if not fqn and not optimizer_state.get("state"):
            # Saved before the first step: nothing to place. (torch's loader would take a
            # zero-lr step to create the state, which starts Adam's step count at 1.)
            inner.load_state_dict(optimizer_state)
        else:
            if not fqn:
                optimizer_state = _fqn_optimizer_state(model, inner, optimizer_state)
            set_optimizer_state_dict(model, inner, optimizer_state, options=options)
    else:
        model.load_state_dict(module_state)
        inner.load_state_dict(optimizer_state)
    if scaler is not None and states.get("scaler") is not None:
        scaler.load_state_dict(states["scaler"])
