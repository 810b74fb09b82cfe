"""Dotted "auto" filling of the config's `optimizer` / `scheduler` blocks (`Engine.fill_auto`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["filled_auto_blocks"]


def filled_auto_blocks(config: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The `optimizer` / `scheduler` blocks of `config` with their "auto" values filled from `values`.

    Args:
        config: The effective `EngineConfig` (its `optimizer` and `scheduler` blocks are read).
        values: Dotted key -> value, e.g. `{"optimizer.params.lr": 3e-5}`. Only values that are
            "auto" change; a key naming a block the config does not have changes nothing.

    Returns:
        Block name -> the filled copy, for each block a key named (and the config has).

    Raises:
        ValueError: A key outside the two blocks.
    """
    blocks: dict[str, Any] = {}
    for key, value in values.items():
        block, _, rest = key.partition(".")
        if block not in ("optimizer", "scheduler") or not rest:
            raise ValueError(
                f"Engine.fill_auto: {key!r} = {value!r} is not in the `optimizer` or `scheduler` "
                'block; the Engine fills every other "auto" from the model, the dataloader and the '
                "world size. HINT: pass keys like 'optimizer.params.lr'."
            )
        current = blocks.get(block, getattr(config, block))
        if current is None:
            continue  # no such block in the config: nothing is "auto" there
        blocks[block] = _fill_dotted(current, rest.split("."), value)
    return blocks


def _fill_dotted(block: Mapping[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """A copy of `block` with the value at `path` set to `value` if it is "auto" there."""
    out = copy.deepcopy(dict(block))
    node: Any = out
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(path[-1]) == "auto":
        node[path[-1]] = value
    return out
