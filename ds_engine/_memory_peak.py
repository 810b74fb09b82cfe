"""The parts of a training step's peak memory beyond the model states, and the bytes a rank sends
per optimizer step: the shapes of a transformer (from its config, or assumed from a parameter
count), its activations, LoRA adapters, ZeRO-3's gathered parameters, communication buckets,
the framework's own memory, and the ZeRO communication volume. Pure arithmetic on numbers;
`ds_engine.memory` resolves a model into them and documents the formulas (docs/memory.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LORA_TARGET_SHAPES",
    "PLAN_ORDER",
    "CommVolume",
    "LoraShape",
    "TransformerShape",
    "activation_bytes",
    "comm_volume",
    "device_memory",
    "framework_bytes",
    "lora_params",
    "offload_bytes",
    "shape_from_config",
    "shape_from_count",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerShape:
    """What sizes a transformer's activations: read from a transformers config, or assumed."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    """A SwiGLU-style MLP (gate and up projections: Llama, Mistral, Qwen) instead of one GELU MLP."""
    assumed: bool = False
    """True when guessed from a parameter count (`shape_from_count`), not read from a config."""


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def shape_from_config(config: Any) -> TransformerShape | None:
    """The shape a transformers config describes (its text config for a multimodal one), or None
    when it names no layers / hidden size (not a transformer this estimate knows)."""
    config = getattr(config, "text_config", None) or config
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first_int(config, "hidden_size", "n_embd", "d_model")
    vocab = _first_int(config, "vocab_size")
    if layers is None or hidden is None or vocab is None:
        return None
    heads = _first_int(config, "num_attention_heads", "n_head") or max(1, hidden // 64)
    kv_heads = _first_int(config, "num_key_value_heads") or heads
    intermediate = _first_int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    act = str(getattr(config, "hidden_act", getattr(config, "activation_function", "gelu")))
    gated = act in ("silu", "swiglu") or "llama" in str(getattr(config, "model_type", ""))
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        gated_mlp=gated,
    )


def shape_from_count(num_params: int, *, hidden_per_layer: int, vocab: int) -> TransformerShape:
    """A usual decoder for a bare count: P ~ 12 * layers * hidden^2 with hidden = `hidden_per_layer`
    * layers, heads of 128, a SwiGLU MLP of 8/3 hidden and a `vocab`-token vocabulary."""
    hidden = max(64, round((hidden_per_layer * num_params / 12) ** (1 / 3) / 64) * 64)
    layers = max(1, round(hidden / hidden_per_layer))
    heads = max(1, hidden // 128)
    return TransformerShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        intermediate=round(8 * hidden / 3 / 64) * 64,
        vocab=vocab,
        gated_mlp=True,
        assumed=True,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraShape:
    """LoRA adapters to add to a model given as a config or count: rank and target module names."""

    rank: int
    targets: Sequence[str] = ("q_proj", "v_proj")
    """Module names as peft's `target_modules` (see `LORA_TARGET_SHAPES` for the known ones)."""


#: target name -> (input, output) features, as functions of (hidden, kv width, intermediate).
LORA_TARGET_SHAPES: Mapping[str, tuple[str, str]] = {
    "q_proj": ("h", "h"),
    "k_proj": ("h", "kv"),
    "v_proj": ("h", "kv"),
    "o_proj": ("h", "h"),
    "gate_proj": ("h", "i"),
    "up_proj": ("h", "i"),
    "down_proj": ("i", "h"),
    "query": ("h", "h"),
    "key": ("h", "h"),
    "value": ("h", "h"),
    "c_attn": ("h", "3h"),
    "c_proj": ("h", "h"),
    "c_fc": ("h", "i"),
}


def _features(shape: TransformerShape, code: str) -> int:
    kv = shape.hidden * shape.kv_heads // shape.heads
    return {"h": shape.hidden, "kv": kv, "i": shape.intermediate, "3h": 3 * shape.hidden}[code]


def lora_params(shape: TransformerShape, lora: LoraShape) -> int:
    """Adapter parameters: rank * (in + out) for every target matrix of every layer."""
    total = 0
    for target in lora.targets:
        if target not in LORA_TARGET_SHAPES:
            raise ValueError(
                f"`lora` target {target!r} is not a module this estimate knows; known: "
                f"{', '.join(LORA_TARGET_SHAPES)}. HINT: pass the model itself (a peft model) instead"
            )
        fan_in, fan_out = LORA_TARGET_SHAPES[target]
        total += lora.rank * (_features(shape, fan_in) + _features(shape, fan_out))
    return total * shape.layers


#: Bytes saved for backward per token and per layer, 16-bit activations, memory-efficient
#: attention (transformers' default "sdpa"; no seq^2 score matrix): the layer input's norm
#: (fp32 copy + 16-bit output), the projections' inputs, q/k/v and the attention output, and
#: the MLP's intermediate tensors (GELU: its input and output; SwiGLU: gate, up, SiLU(gate), product).
_PER_HIDDEN = {"gated": 26.0, "gelu": 18.0}
_PER_INTERMEDIATE = {"gated": 8.0, "gelu": 4.0}
#: Bytes per logit of a causal LM's loss: 16-bit logits, the fp32 upcast, the shifted copy, the
#: log-softmax saved for backward and its gradient (transformers' `ForCausalLMLoss`).
LOGIT_BYTES = 18.0


def activation_bytes(
    shape: TransformerShape,
    *,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    causal_lm: bool,
    weight_bytes: int,
    lora: LoraShape | None = None,
) -> dict[str, int]:
    """Activation memory at the start of backward: `layers` (every layer's saved tensors, or with
    checkpointing each layer's input plus one layer recomputed), `logits` (a causal LM's vocabulary
    logits and loss buffers) and `lora` (each adapter's rank-wide intermediate)."""
    tokens = micro_batch * seq_len
    kind = "gated" if shape.gated_mlp else "gelu"
    scale = weight_bytes / 2  # the table is for 16-bit activations
    per_layer = tokens * (_PER_HIDDEN[kind] * shape.hidden + _PER_INTERMEDIATE[kind] * shape.intermediate)
    per_layer = per_layer * scale
    embeddings = 2 * tokens * shape.hidden * weight_bytes
    if checkpointing:
        layers = shape.layers * tokens * shape.hidden * weight_bytes + per_layer
    else:
        layers = shape.layers * per_layer
    logits = LOGIT_BYTES * scale * tokens * shape.vocab if causal_lm else 0
    adapter = 0 if lora is None else tokens * lora.rank * weight_bytes * len(lora.targets) * shape.layers
    return {"layers": math.ceil(layers + embeddings), "logits": math.ceil(logits), "lora": adapter}


#: Memory the framework holds besides the tensors the estimate names, per rank, measured on
#: DeepSpeed 0.19 over 2 CPU ranks (bench_memory_peak.py; docs/memory.md): a fixed part, bytes per
#: model parameter (`a`: the 16-bit casts and flat copies DeepSpeed's ZeRO optimizers make of the
#: whole model) and bytes per trainable parameter (`b`: gradient staging around the step), by stage.
FRAMEWORK_FIXED_BYTES = 16 * 10**6
FRAMEWORK_BYTES_PER_PARAM: Mapping[int, tuple[float, float]] = {
    0: (0.0, 1.0),
    1: (2.4, 0.25),
    2: (2.4, 0.6),
    3: (1.9, 0.0),
}
#: With the optimizer offloaded: extra bytes per trainable parameter for the staging copies around
#: the CPU optimizer step (fp32 gradients gathered for it, the updated 16-bit copies), by stage.
OFFLOAD_BYTES_PER_TRAINABLE: Mapping[int, float] = {1: 4.15, 2: 3.8, 3: 0.85}
#: The backward of a 16-bit embedding table accumulates its gradient in fp32 (bytes per element
#: of the table), measured on CPU.
EMBEDDING_GRAD_BYTES = 4
#: On a CUDA device: the CUDA context and kernels' workspace (cuBLAS, NCCL) per process, and
#: what the caching allocator holds beyond live tensors (fragmentation), as a fraction.
CUDA_CONTEXT_BYTES = 600 * 10**6
CUDA_ALLOCATOR_FRACTION = 0.10


def framework_bytes(stage: int, num_params: int, trainable: int, embedding: int) -> int:
    """The framework's memory per rank besides the named tensors (see `FRAMEWORK_BYTES_PER_PARAM`);
    `embedding`: elements of the (trainable) input embedding table."""
    per_param, per_trainable = FRAMEWORK_BYTES_PER_PARAM[stage]
    return (
        FRAMEWORK_FIXED_BYTES
        + math.ceil(per_param * num_params + per_trainable * trainable)
        + EMBEDDING_GRAD_BYTES * embedding
    )


def offload_bytes(stage: int, trainable: int) -> int:
    """Staging memory around the CPU optimizer step, per rank (`OFFLOAD_BYTES_PER_TRAINABLE`)."""
    return math.ceil(OFFLOAD_BYTES_PER_TRAINABLE.get(stage, 0.0) * trainable)


def device_memory() -> int:
    """Memory of one accelerator (CUDA's device 0); a ValueError asking for a budget without one."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    raise ValueError(
        "`budget_bytes` not given and no CUDA device to read its memory from. "
        "HINT: pass budget_bytes (memory per accelerator, e.g. 80e9)"
    )


#: The set-ups `choose_zero_stage` considers, least communication first.
PLAN_ORDER: tuple[tuple[int, Literal["none", "cpu"], Literal["none", "cpu"]], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommVolume:
    """Bytes one rank sends in one optimizer step, by collective (ring algorithms)."""

    gradient_reduction: float
    """All-reduce (ZeRO-0/1/2) or reduce-scatter (ZeRO-3) of the gradients."""
    parameter_gather: float
    """All-gather of the updated parameter partitions (ZeRO-1/2) or of the weights in forward and
    backward (ZeRO-3)."""
    reductions_per_step: int
    """Gradient reductions per optimizer step (gradient accumulation without coalescing: one per
    micro-step for ZeRO-2/3)."""

    @property
    def total(self) -> float:
        return self.gradient_reduction + self.parameter_gather


def comm_volume(
    *,
    zero_stage: int,
    num_params: int,
    trainable_params: int,
    world_size: int,
    gradient_accumulation_steps: int = 1,
    coalesce: bool = False,
    weight_bytes: int = 2,
    grad_bytes: int = 2,
    regather_in_backward: bool = True,
) -> CommVolume:
    """Bytes one rank sends per optimizer step (formulas: docs/memory.md).

    Ring algorithms over N ranks: an all-reduce sends 2(N-1)/N of the tensor, a reduce-scatter
    or all-gather (N-1)/N of the full tensor. ZeRO-0 and ZeRO-1 all-reduce the gradients once per
    step; ZeRO-2 all-reduces them on every micro-step (once with `coalesce`); ZeRO-1/2 then
    all-gather the updated 16-bit parameters. ZeRO-3 all-gathers the weights on every micro-step's
    forward and, when `regather_in_backward`, again in backward, and reduce-scatters the
    gradients on every micro-step (once with `coalesce`).
    """
    n = world_size
    ring = (n - 1) / n
    grads = grad_bytes * trainable_params
    ga = gradient_accumulation_steps
    reductions = 1 if zero_stage in (0, 1) or coalesce else ga
    if zero_stage == 3:
        reduction = reductions * ring * grads
        gathers = ga * (2 if regather_in_backward else 1)
        gather = gathers * ring * weight_bytes * num_params
    else:
        reduction = reductions * 2 * ring * grads
        gather = ring * weight_bytes * trainable_params if zero_stage in (1, 2) else 0.0
    return CommVolume(gradient_reduction=reduction, parameter_gather=gather, reductions_per_step=reductions)
