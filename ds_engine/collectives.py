"""Tensor collectives the Engine offers users: gather (ragged dim 0 allowed) over nested data.

Nested structures (dicts, lists, tuples, HF `ModelOutput`s) are walked and each tensor is
handled on its own; everything else passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist


def iter_tensors(data: Any) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, Mapping):
        for value in data.values():
            yield from iter_tensors(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from iter_tensors(value)


def map_tensors(data: Any, fn: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_tensors(v, fn) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    return data


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """all_gather along dim 0, allowing a different dim-0 size per rank."""
    world = dist.get_world_size()
    t = tensor.detach()
    if t.dim() == 0:
        t = t.unsqueeze(0)
    dtype = t.dtype
    if dtype == torch.bool:
        t = t.to(torch.uint8)
    t = t.contiguous()
    size = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    biggest = max(counts)
    if t.shape[0] < biggest:
        t = torch.cat([t, t.new_zeros((biggest - t.shape[0], *t.shape[1:]))])
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    out = torch.cat([p[:n] for p, n in zip(parts, counts)])
    return out.to(dtype) if dtype == torch.bool else out
