"""What a training checkpoint holds besides the backend's states: each rank's RNG, and the checks
of `engine_state.pt` (`Engine.state_dict()`) before anything of it is loaded.

`ds_engine.checkpoint` saves and loads them (and re-exports the RNG functions).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_FORMAT", "capture_rng_state", "restore_rng_state", "rng_state_name"]

#: The layout version `ds_engine_meta.json` and `engine_state.pt` record.
CHECKPOINT_FORMAT = 1


def rng_state_name(rank: int) -> str:
    """File name of rank `rank`'s RNG state inside a tag folder."""
    return f"rng_state_rank{rank}.pt"


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (and CUDA) RNG states, as weights-only-safe types."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np = None  # type: ignore[assignment]
    if np is not None:
        numpy_state = np.random.get_state(legacy=False)
        assert isinstance(numpy_state, dict)
        # numpy arrays need an allowlist under weights_only; a tensor of the same words does not
        state["numpy"] = {
            "bit_generator": str(numpy_state["bit_generator"]),
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    import random

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": saved["bit_generator"],
                "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
                "has_gauss": saved["has_gauss"],
                "gauss": saved["gauss"],
            }
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_int(value: Any, low: int, high: float = float("inf")) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# What `Engine.state_dict()` holds, checked before anything is loaded: path -> (check, allowed).
def _count(value: Any) -> bool:
    return _is_int(value, 0)


def _optional_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


_ENGINE_STATE_KEYS: dict[str, tuple[Any, str]] = {
    "format": (lambda v: v == CHECKPOINT_FORMAT, f"{CHECKPOINT_FORMAT}"),
    "counters": (lambda v: isinstance(v, dict), "a dict of step counters"),
    "step_was_skipped": (lambda v: isinstance(v, bool), "True or False"),
    "grad_norm": (_optional_number, "None or a number"),
    "loss_scale": (_optional_number, "None or a number"),
    "scheduler": (lambda v: v is None or isinstance(v, dict), "None or a scheduler's state dict"),
    "dataloaders": (lambda v: isinstance(v, list), "a list of dataloader positions"),
    "client_state": (lambda v: isinstance(v, dict), "a dict (the `client_state` saved)"),
}
_COUNTER_KEYS = ("num_micro_steps", "num_optimizer_steps", "num_skipped_steps", "free_micro_steps")
_POSITION_KEYS: dict[str, tuple[Any, str]] = {
    "epoch": (_count, "an int >= 0"),
    "next_batch": (_count, "an int >= 0"),
    "batch_size": (lambda v: _is_int(v, 1), "an int >= 1"),
    "num_replicas": (lambda v: _is_int(v, 1), "an int >= 1"),
    "num_samples": (_count, "an int >= 0"),
    "epoch_set_explicitly": (lambda v: isinstance(v, bool), "True or False"),
}


def _is_generator_state(value: Any) -> bool:
    """A tensor `torch.Generator.set_state` takes: 1-D uint8 of a CPU generator state's size."""
    size = torch.Generator().get_state().numel()
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.shape == (size,)


def _check_engine_state(saved: Any, path: Path) -> None:
    """Refuse an `engine_state.pt` whose shape or values are not what `Engine.state_dict()` writes.

    Raises:
        ValueError: Names the file and the key (e.g. `dataloaders[0].next_batch`), with a HINT.
    """

    def refuse(key: str, found: str, allowed: str) -> None:
        raise ValueError(
            f"checkpoint file {str(path)!r}: `{key}` {found}; allowed: {allowed}. HINT: the file was "
            "changed after ds_engine wrote it; restore it, or load an older tag with `tag=...`."
        )

    def check(where: Any, keys: dict[str, tuple[Any, str]], prefix: str) -> None:
        for key, (ok, allowed) in keys.items():
            if key not in where:
                refuse(prefix + key, "is missing", allowed)
            elif not ok(where[key]):
                refuse(prefix + key, f"is {_short(where[key])}", allowed)

    if not isinstance(saved, dict):
        refuse(
            "(the whole file)",
            f"is of type {type(saved).__name__}",
            "a dict, as `Engine.state_dict()` writes",
        )
    check(saved, _ENGINE_STATE_KEYS, "")
    check(saved["counters"], {k: (_count, "an int >= 0") for k in _COUNTER_KEYS}, "counters.")
    for index, position in enumerate(saved["dataloaders"]):
        if not isinstance(position, dict):
            refuse(f"dataloaders[{index}]", f"is {_short(position)}", "a dict of a dataloader's position")
        check(position, _POSITION_KEYS, f"dataloaders[{index}].")
        if "shuffle_state" in position and not _is_generator_state(position["shuffle_state"]):
            refuse(
                f"dataloaders[{index}].shuffle_state",
                f"is {_short(position['shuffle_state'])}",
                "a torch.Generator state (a 1-D uint8 tensor of its size)",
            )
        epoch_batches = -(-position["num_samples"] // (position["batch_size"] * position["num_replicas"]))
        if position["next_batch"] > epoch_batches:
            refuse(
                f"dataloaders[{index}].next_batch",
                f"is {position['next_batch']}",
                f"a batch of its epoch ({epoch_batches} batches of {position['batch_size']} x "
                f"{position['num_replicas']} ranks for {position['num_samples']} samples)",
            )
