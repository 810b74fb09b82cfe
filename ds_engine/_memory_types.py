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
    "PeakEstimate",
    "Precision",
    "Recommendation",
    "StagePlan",
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


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakEstimate:
    """The whole per-rank peak of one training set-up, term by term (`ds_engine.memory.estimate_peak`).

    Every term is bytes per rank. `states` holds the model states (as `estimate_memory`); the
    others are what a step adds on top of them on the accelerator, and `host_per_rank` is this
    rank's share of the node's host memory (offloaded states).
    """

    states: MemoryEstimate
    activations: int
    """Tensors saved for backward by the layers, embeddings and LoRA adapters (with checkpointing:
    layer inputs plus one layer recomputed)."""
    logits: int
    """A causal LM's vocabulary logits and loss buffers (0 for other heads)."""
    live_params: int
    """ZeRO-3: 16-bit weights gathered beyond the largest layer (up to `stage3_max_live_parameters`)."""
    buckets: int
    """Gradient reduction buckets and the ZeRO-3 prefetch bucket."""
    lora: int
    """LoRA adapters' weights, gradients and optimizer states, shown apart but counted inside
    `states` (which sizes the trainable part by them); their activations are in `activations`.
    0 without adapters."""
    offload_buffers: int
    """Staging copies around the CPU optimizer step (host memory, per rank); 0 without offload."""
    overhead: int
    """The framework's own memory: a fixed part and the copies its optimizers make (per parameter);
    on a GPU also the CUDA context and the caching allocator's slack."""
    device: str
    """"cpu": accelerator and host are one memory (a CPU run); "cuda": separate."""
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool

    @property
    def host_per_rank(self) -> int:
        """This rank's share of host memory: offloaded states and the offload staging buffers."""
        g = self.states.num_gpus_per_node
        return -(-self.states.host.model_states // g) + self.offload_buffers

    @property
    def accelerator_total(self) -> int:
        """Peak bytes on one accelerator: model states, activations, logits, gathered weights,
        buckets, LoRA activations and the framework overhead."""
        return (
            self.states.accelerator.total
            + self.activations
            + self.logits
            + self.live_params
            + self.buckets
            + self.overhead
        )

    @property
    def per_rank_total(self) -> int:
        """What one rank needs at its peak. On a CPU run the accelerator and host are one memory:
        their sum, or the model-loading peak if larger. On a GPU: the accelerator's figure."""
        if self.device != "cpu":
            return self.accelerator_total
        g = self.states.num_gpus_per_node
        loading = -(-self.states.host.working // g) + self.overhead
        return max(self.accelerator_total + self.host_per_rank, loading)

    def terms(self) -> dict[str, int]:
        """Each term by name (bytes per rank), `model_states` split as accelerator and host."""
        return {
            "model_states": self.states.accelerator.total,
            "host_states": self.host_per_rank - self.offload_buffers,
            "activations": self.activations,
            "logits": self.logits,
            "live_params": self.live_params,
            "buckets": self.buckets,
            "lora_states": self.lora,
            "offload_buffers": self.offload_buffers,
            "overhead": self.overhead,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """The ZeRO stage/offload chosen for a memory budget (`ds_engine.memory.choose_zero_stage`)."""

    choice: PeakEstimate
    """The set-up with the least communication that fits, and its peak."""
    runner_up: PeakEstimate | None
    """The next set-up in order that also fits (more communication or offload), if any."""
    budget_bytes: int
    """Memory per accelerator the choice was made for."""
    margin: float
    """Fraction of the budget kept free (the peak times 1 + margin must fit)."""
    log_line: str
    """One line saying what was chosen and why, for a log."""
    candidates: tuple[PeakEstimate, ...]
    """Every set-up considered, least communication first."""

    @property
    def zero_stage(self) -> int:
        """The chosen ZeRO stage."""
        return self.choice.states.zero_stage

    @property
    def offload_optimizer(self) -> OffloadDevice:
        """The chosen `offload_optimizer`."""
        return self.choice.states.offload_optimizer

    @property
    def offload_params(self) -> OffloadDevice:
        """The chosen `offload_params`."""
        return self.choice.states.offload_params


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
