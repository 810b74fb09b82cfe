"""The memory estimate's result types and how they read: `MemoryBreakdown`, `MemoryEstimate`
(with its text), `Recommendation`, and the byte and count formats used in that text and in
`ds-engine estimate`'s table. The numbers themselves come from `ds_engine.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MemoryBreakdown",
    "MemoryEstimate",
    "OffloadDevice",
    "OptimizerName",
    "Precision",
    "Recommendation",
    "format_bytes",
    "format_count",
]

Precision = Literal["bf16", "fp16", "fp32"]
OffloadDevice = Literal["none", "cpu"]
OptimizerName = Literal["adamw", "adam", "lion", "adagrad", "sgd_momentum", "sgd"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes of model states on one device kind (one accelerator, or one node's host memory)."""

    params: int
    """Model weights (16-bit under mixed precision) held here."""
    gradients: int
    """Gradients held here (16-bit on the accelerator, fp32 on the host when offloaded)."""
    optimizer_states: int
    """fp32 master weights + fp32 gradients for the step + the optimizer's own state."""
    working: int
    """Accelerator: the gathered ZeRO-3 layer and its gradient. Host: the model-loading peak."""
    total: int
    """What must fit: the sum on the accelerator; on the host the larger of states and loading."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states (without the working term)."""
        return self.params + self.gradients + self.optimizer_states


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Model-state memory of one training set-up; see `ds_engine.memory`'s docstring for the formulas."""

    num_params: int
    trainable_params: int
    """Parameters with `requires_grad` (gradients and optimizer states are sized by these)."""
    largest_layer_params: int
    num_gpus_per_node: int
    num_nodes: int
    zero_stage: int
    offload_optimizer: OffloadDevice
    offload_params: OffloadDevice
    precision: Precision
    optimizer: OptimizerName
    zero_init: bool
    accelerator: MemoryBreakdown
    """Bytes on each accelerator."""
    host: MemoryBreakdown
    """Bytes of host (CPU) memory on each node."""

    @property
    def num_gpus(self) -> int:
        """Total number of accelerators (data-parallel ranks)."""
        return self.num_gpus_per_node * self.num_nodes

    @property
    def label(self) -> str:
        """Short name of the stage/offload choice, e.g. `ZeRO-3 + offload optimizer+params`."""
        offload = []
        if self.offload_optimizer != "none":
            offload.append("optimizer")
        if self.offload_params != "none":
            offload.append("params")
        suffix = f" + offload {'+'.join(offload)}" if offload else ""
        return f"ZeRO-{self.zero_stage}{suffix}"

    def describe(self) -> str:
        """A few lines of human-readable text (GB = 1e9 bytes)."""
        a, h = self.accelerator, self.host
        return "\n".join(
            [
                f"{self.label}, {self.precision}, {self.optimizer}: {format_count(self.num_params)} params "
                + (
                    f"({format_count(self.trainable_params)} trainable) "
                    if self.trainable_params != self.num_params
                    else ""
                )
                + f"(largest layer {format_count(self.largest_layer_params)}) on {self.num_nodes} node(s) x "
                f"{self.num_gpus_per_node} accelerator(s)",
                f"  per accelerator: params {format_bytes(a.params)} + grads {format_bytes(a.gradients)}"
                f" + optimizer {format_bytes(a.optimizer_states)} + working layer {format_bytes(a.working)}"
                f" = {format_bytes(a.total)}",
                f"  per host (node): params {format_bytes(h.params)} + grads {format_bytes(h.gradients)}"
                f" + optimizer {format_bytes(h.optimizer_states)}; loading peak {format_bytes(h.working)}"
                f" -> {format_bytes(h.total)}",
            ]
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, kw_only=True, slots=True)
class Recommendation:
    """The cheapest stage/offload choice that fits, why, and every choice considered."""

    estimate: MemoryEstimate
    """The chosen stage/offload and its figures."""
    reason: str
    """Why this choice, in words (what it needs, which cheaper choices did not fit)."""
    candidates: tuple[MemoryEstimate, ...]
    """Every choice in `ds_engine.memory.CHOICES` order."""
    accelerator_memory_bytes: int
    host_memory_bytes: int | None
    headroom: float

    @property
    def zero_stage(self) -> int:
        """The recommended ZeRO stage."""
        return self.estimate.zero_stage

    @property
    def offload_optimizer(self) -> OffloadDevice:
        """The recommended `offload_optimizer` device."""
        return self.estimate.offload_optimizer

    @property
    def offload_params(self) -> OffloadDevice:
        """The recommended `offload_params` device."""
        return self.estimate.offload_params


def format_bytes(num_bytes: float) -> str:
    """`12.35 GB` style (decimal units: 1 GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def format_count(count: float) -> str:
    """`1.30B`, `22.7M` style."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))
