"""ZeRO-aware memory estimate: model states, the whole per-rank peak, communication per step,
and the ZeRO stage/offload to use.

* `estimate_memory` / `estimate_all` / `recommend_config`: the *model states* of data-parallel
  training (parameters, gradients, fp32 master weights and gradients, optimizer state) per
  accelerator and per node's host memory, for each stage/offload choice.
* `estimate_peak`: the whole per-rank peak: model states plus activations for a micro batch and
  sequence length (with or without activation checkpointing; logits and loss buffers), ZeRO-3's
  gathered weights, reduction buckets, LoRA adapters, CPU-offload staging and the framework's
  own memory.
* `choose_zero_stage`: from `estimate_peak`, the set-up with the least communication that fits
  a memory budget with a margin (ZeRO-0 < 1 < 2 < 3 < 3 + offload), the runner-up, one log line.
* `communication_per_step`: the bytes one rank sends per optimizer step for each stage.

The formulas, where they differ from DeepSpeed's own estimators, and the measurements behind
them are in docs/memory.md. In short, with P parameters, T trainable, L the largest layer and N
ranks, bytes per accelerator for bf16 AdamW: ZeRO-0 20P; ZeRO-1 4P + 16T/N (T = P: 4P + 16P/N);
ZeRO-2 2P + 2T/N + 16T/N; ZeRO-3 20P/N + 4L; offloading the optimizer moves the fp32 master,
fp32 gradients and Adam state (16T/N per rank) to host memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Union, get_args

from ds_engine import _model_shapes as _shapes
from ds_engine._memory_peak import (
    CUDA_ALLOCATOR_FRACTION,
    CUDA_CONTEXT_BYTES,
    PLAN_ORDER,
    CommVolume,
    LoraShape,
    activation_bytes,
    comm_volume,
    device_memory,
    framework_bytes,
    offload_bytes,
)
from ds_engine._memory_types import (
    MemoryBreakdown,
    MemoryEstimate,
    OffloadDevice,
    OptimizerName,
    PeakEstimate,
    Precision,
    Recommendation,
    StagePlan,
    format_bytes,
    format_count,
)
from ds_engine._model_shapes import (
    ASSUMED_HIDDEN_PER_LAYER,
    ASSUMED_VOCAB,
    Limits,
    count_params,
    estimate_largest_layer,
    meta_model,
    peak_model,
    resolve_trainable_params,
)
from ds_engine._values import MAX_COUNT, parse_count, parse_size

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

#: fp32 optimizer state bytes per parameter.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,
    "adam": 8,
    "lion": 4,
    "adagrad": 4,
    "sgd_momentum": 4,
    "sgd": 0,
}

#: Every stage/offload combination worth running, cheapest (least offload, lowest stage) first.
CHOICES: tuple[tuple[int, OffloadDevice, OffloadDevice], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (1, "cpu", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
)

#: What "cheapest" means in `recommend_config` (said in its reason).
CHEAPEST = (
    "Cheapest means the fastest step expected, not the least memory: least offload first (offload "
    "moves optimizer work to the CPU and slows every step), then the lowest ZeRO stage (each stage up "
    "adds communication)."
)

ModelLike = Union[int, "torch.nn.Module", Any, str, os.PathLike]


#: Bounds on the work of counting a model from its config (a config is untrusted input). Read at
#: each call: lowering one here bounds every later estimate.
MAX_CONFIG_BYTES = 4 * 2**20
"""Largest config JSON read (bytes); real configs are a few KB (a large label map: a few hundred)."""
MAX_LAYERS = 1024
"""Largest layer or expert count a config may ask for (real models: at most a few hundred)."""
MAX_MODULES = 100_000
"""Most modules built on the meta device while counting (about 10 s of work on one core)."""
MAX_COUNTED_PARAMS = MAX_COUNT
"""Largest parameter count accepted, counted or given."""
MAX_REAL_BYTES = 256 * 2**20
"""Most bytes a model's constructor may allocate off the meta device while it is counted."""


def _limits() -> Limits:
    """The bounds above as they are now."""
    return Limits(
        config_bytes=MAX_CONFIG_BYTES,
        layers=MAX_LAYERS,
        modules=MAX_MODULES,
        params=MAX_COUNTED_PARAMS,
        real_bytes=MAX_REAL_BYTES,
    )


class SetupChoices(TypedDict, total=False):
    """The keywords `estimate_all` and `recommend_config` pass on to `estimate_memory` (see there)."""

    largest_layer_params: int | None
    num_gpus_per_node: int
    num_nodes: int
    precision: Precision
    optimizer: OptimizerName
    zero_init: bool
    trainable_params: int | None


def _check_setup_keywords(function: str, setup: Mapping[str, Any]) -> None:
    """A keyword outside `SetupChoices` is a TypeError, as for any function's unknown keyword."""
    for key in setup:
        if key not in SetupChoices.__optional_keys__:
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}")


# --------------------------------------------------------------------------- counting
def resolve_num_params(
    model_or_num_params: ModelLike, largest_layer_params: int | None = None
) -> tuple[int, int]:
    """Turn an int, `nn.Module`, HF config or model path into (num_params, largest_layer_params),
    within this module's `MAX_*` bounds (`_model_shapes.resolve_num_params` says how)."""
    return _shapes.resolve_num_params(model_or_num_params, largest_layer_params, _limits())


# --------------------------------------------------------------------------- estimate
def _check_choice(name: str, value: Any, allowed: tuple[Any, ...], hint: str) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(
            f"`{name}`={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}. {hint}"
        )


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}. HINT: pass e.g. {name}=8")


def estimate_memory(
    model_or_num_params: ModelLike,
    *,
    largest_layer_params: int | None = None,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    zero_stage: int,
    offload_optimizer: OffloadDevice = "none",
    offload_params: OffloadDevice = "none",
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    zero_init: bool = True,
    trainable_params: int | None = None,
) -> MemoryEstimate:
    """Estimate the model-state memory of data-parallel ZeRO training (formulas: module docstring).

    Args:
        model_or_num_params: a parameter count, an `nn.Module`, a transformers
            `PretrainedConfig`, or a path to a local HF model folder / config JSON (counted on
            the meta device: nothing is allocated or downloaded).
        largest_layer_params: parameters of the largest single module; derived from a model
            when not given (for a bare count: `estimate_largest_layer`, usual transformer shapes).
        num_gpus_per_node: accelerators (ranks) per node.
        num_nodes: number of nodes.
        zero_stage: 0, 1, 2 or 3.
        offload_optimizer: "none" or "cpu" (ZeRO-1/2/3).
        offload_params: "none" or "cpu" (ZeRO-3 only).
        precision: "bf16", "fp16" or "fp32".
        optimizer: one of `OPTIMIZER_STATE_BYTES`.
        zero_init: ZeRO-3 models built under `zero.Init` (no full copy on the host at load).
        trainable_params: parameters with `requires_grad`; counted from an `nn.Module` when
            not given (a LoRA model: its adapter), else all of them.

    Returns:
        A `MemoryEstimate`: bytes per accelerator and per node's host memory.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).
    """
    _check_choice("zero_stage", zero_stage, (0, 1, 2, 3), "HINT: pick a ZeRO stage from 0 to 3")
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        _check_choice(
            name,
            device,
            get_args(OffloadDevice),
            "HINT: use 'cpu' (NVMe offload is not estimated; 'cpu' bounds its accelerator side)",
        )
    _check_choice("precision", precision, get_args(Precision), "HINT: use precision='bf16'")
    _check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES), "HINT: use optimizer='adamw'")
    _check_positive_int("num_gpus_per_node", num_gpus_per_node)
    _check_positive_int("num_nodes", num_nodes)
    if offload_optimizer != "none" and zero_stage == 0:
        raise ValueError(
            f"`offload_optimizer`={offload_optimizer!r} needs ZeRO stage 1, 2 or 3, got `zero_stage`=0. "
            "HINT: use zero_stage=2 with optimizer offload"
        )
    if offload_params != "none" and zero_stage != 3:
        raise ValueError(
            f"`offload_params`={offload_params!r} needs `zero_stage`=3, got {zero_stage} (only ZeRO-3 "
            "partitions the parameters). HINT: use zero_stage=3, or offload_params='none'"
        )
    num_params, largest = resolve_num_params(model_or_num_params, largest_layer_params)
    trainable = resolve_trainable_params(model_or_num_params, num_params, trainable_params)

    p, t, n, g = num_params, trainable, num_gpus_per_node * num_nodes, num_gpus_per_node
    weight = 4 if precision == "fp32" else 2
    grad = weight
    # Plain fp32 ZeRO-0 steps the model's own tensors; every other set-up keeps an fp32
    # master copy and hands the optimizer an fp32 gradient copy (DeepSpeed clones even for fp32).
    copies = 0 if (precision == "fp32" and zero_stage == 0) else 4 + 4
    state = OPTIMIZER_STATE_BYTES[optimizer]

    def part(bytes_per_param: int, partitioned: bool, count: int = p) -> int:
        return math.ceil(bytes_per_param * count / n) if partitioned else bytes_per_param * count

    offload_opt = offload_optimizer != "none"
    # accelerator
    acc_params = 0 if offload_params != "none" else part(weight, zero_stage == 3)
    acc_grads = 0 if offload_opt else part(grad, zero_stage >= 2, t)
    acc_opt = 0 if offload_opt else part(copies + state, zero_stage >= 1, t)
    acc_work = (weight + grad) * largest if zero_stage == 3 else 0
    accelerator = MemoryBreakdown(
        params=acc_params,
        gradients=acc_grads,
        optimizer_states=acc_opt,
        working=acc_work,
        total=acc_params + acc_grads + acc_opt + acc_work,
    )
    # host, per node (g ranks)
    host_params = part(weight, True) * g if offload_params != "none" else 0
    host_grads = part(4, True, t) * g if offload_opt else 0  # fp32 gradient partition for the CPU step
    host_opt = part(4 + state, True, t) * g if offload_opt else 0  # fp32 master + optimizer state
    host_load = 4 * (largest if zero_stage == 3 and zero_init else p) * g
    host = MemoryBreakdown(
        params=host_params,
        gradients=host_grads,
        optimizer_states=host_opt,
        working=host_load,
        total=max(host_params + host_grads + host_opt, host_load),
    )
    return MemoryEstimate(
        num_params=num_params,
        trainable_params=trainable,
        largest_layer_params=largest,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        precision=precision,
        optimizer=optimizer,
        zero_init=zero_init,
        accelerator=accelerator,
        host=host,
    )


def estimate_all(model_or_num_params: ModelLike, **setup: Unpack[SetupChoices]) -> list[MemoryEstimate]:
    """`estimate_memory` for every choice in `CHOICES`, cheapest first (the model is counted once).

    Args:
        model_or_num_params: as for `estimate_memory`.
        **setup: `largest_layer_params`, `num_gpus_per_node`, `num_nodes`, `precision`,
            `optimizer`, `zero_init` and `trainable_params`, as for `estimate_memory`.

    Raises:
        ValueError: as for `estimate_memory`.
        TypeError: a keyword not listed above.
    """
    _check_setup_keywords("estimate_all", setup)
    num_params, largest = resolve_num_params(model_or_num_params, setup.get("largest_layer_params"))
    trainable = resolve_trainable_params(model_or_num_params, num_params, setup.get("trainable_params"))
    counted: SetupChoices = {**setup, "largest_layer_params": largest, "trainable_params": trainable}
    return [
        estimate_memory(
            num_params, zero_stage=stage, offload_optimizer=off_opt, offload_params=off_params, **counted
        )
        for stage, off_opt, off_params in CHOICES
    ]


# --------------------------------------------------------------------------- recommend
def fits(
    estimate: MemoryEstimate, accelerator_memory_bytes: int, host_memory_bytes: int | None, headroom: float
) -> bool:
    """Whether `estimate` times (1 + headroom) fits both budgets (host unchecked when None)."""
    factor = 1.0 + headroom
    if estimate.accelerator.total * factor > accelerator_memory_bytes:
        return False
    return host_memory_bytes is None or estimate.host.total * factor <= host_memory_bytes


def recommend_config(
    model_or_num_params: ModelLike,
    *,
    accelerator_memory_bytes: int,
    host_memory_bytes: int | None = None,
    headroom: float = 0.2,
    **setup: Unpack[SetupChoices],
) -> Recommendation:
    """The cheapest ZeRO stage/offload choice whose model states fit, with headroom.

    Cheapest means least offload first (offload costs step time), then the lowest stage
    (less communication). A choice fits when its estimate times `1 + headroom` is within
    `accelerator_memory_bytes` per accelerator and, when given, `host_memory_bytes` per node.
    The headroom is for what the estimate leaves out: activations, buffers, fragmentation.

    Args:
        model_or_num_params: as for `estimate_memory`.
        accelerator_memory_bytes: memory of one accelerator, in bytes.
        host_memory_bytes: host memory of one node, in bytes; None leaves the host unchecked.
        headroom: fraction kept free on top of the estimate (0.2 = 20 %).
        **setup: `largest_layer_params`, `num_gpus_per_node` (accelerators per node),
            `num_nodes`, `precision`, `optimizer`, `zero_init` and `trainable_params`, as for
            `estimate_memory`.

    Returns:
        A `Recommendation` with the chosen estimate, the reason in words and all candidates.

    Raises:
        ValueError: bad arguments, or no choice fits (the message names the budget and the
            smallest requirement).
        TypeError: a keyword not listed above.
    """
    _check_setup_keywords("recommend_config", setup)
    for name, value in (
        ("accelerator_memory_bytes", accelerator_memory_bytes),
        ("host_memory_bytes", host_memory_bytes),
    ):
        if value is None and name == "host_memory_bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number of bytes, got {value!r}. HINT: e.g. 80e9")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 10:
        raise ValueError(
            f"`headroom` must be a fraction >= 0 (e.g. 0.2 for 20 %), got {headroom!r}. HINT: headroom=0.2"
        )
    candidates = estimate_all(model_or_num_params, **setup)
    budget = f"{format_bytes(accelerator_memory_bytes)} per accelerator" + (
        f" and {format_bytes(host_memory_bytes)} host memory per node"
        if host_memory_bytes is not None
        else ""
    )
    margin = f"{headroom:.0%} headroom"
    skipped: list[str] = []
    for est in candidates:
        if fits(est, accelerator_memory_bytes, host_memory_bytes, headroom):
            reason = (
                f"{est.label} is the cheapest choice that fits {budget} with {margin}: it needs "
                f"{format_bytes(est.accelerator.total)} per accelerator and {format_bytes(est.host.total)} "
                f"host memory per node. {CHEAPEST}"
            )
            if skipped:
                reason += " Cheaper choices need more: " + "; ".join(skipped) + "."
            return Recommendation(
                estimate=est,
                reason=reason,
                candidates=tuple(candidates),
                accelerator_memory_bytes=int(accelerator_memory_bytes),
                host_memory_bytes=None if host_memory_bytes is None else int(host_memory_bytes),
                headroom=float(headroom),
            )
        skipped.append(
            f"{est.label} {format_bytes(est.accelerator.total)}/accelerator, "
            f"{format_bytes(est.host.total)}/host"
        )

    def shortfall(est: MemoryEstimate) -> float:
        ratios = [est.accelerator.total / accelerator_memory_bytes]
        if host_memory_bytes is not None:
            ratios.append(est.host.total / host_memory_bytes)
        return max(ratios)

    best = min(candidates, key=shortfall)
    raise ValueError(
        f"no ZeRO stage/offload choice fits the budget of {budget} with {margin}: the smallest "
        f"requirement is {best.label} at {format_bytes(best.accelerator.total)} per accelerator and "
        f"{format_bytes(best.host.total)} host memory per node (before headroom). HINT: add accelerators "
        "(num_gpus_per_node / num_nodes), or train fewer parameters (e.g. LoRA adapters)"
    )


# --------------------------------------------------------------------------- the whole peak
def estimate_peak(
    model: ModelLike,
    *,
    zero_stage: int,
    micro_batch: int,
    seq_len: int,
    world_size: int = 1,
    gpus_per_node: int | None = None,
    offload_optimizer: OffloadDevice = "none",
    offload_params: OffloadDevice = "none",
    lora: LoraShape | None = None,
    activation_checkpointing: bool = False,
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    causal_lm: bool | None = None,
    device: str = "cuda",
    largest_layer_params: int | None = None,
    reduce_bucket_size: int | None = None,
    stage3_max_live_parameters: int = 10**9,
    zero_init: bool = True,
) -> PeakEstimate:
    """The whole per-rank peak memory of a training step, term by term (formulas: docs/memory.md).

    Args:
        model: a parameter count, an `nn.Module` (a peft model too), a transformers
            `PretrainedConfig`, or a local model folder / config.json. The activations come
            from its config (layers, hidden, heads, intermediate size, vocabulary); for a bare
            count from the usual shapes (`shape_from_count`, marked `assumed`).
        zero_stage: 0-3. micro_batch, seq_len: sequences per rank per micro-step, their tokens.
        world_size: data-parallel ranks; gpus_per_node: ranks per node (default: one node).
        offload_optimizer, offload_params: "none" or "cpu", as for `estimate_memory`.
        lora: LoRA adapters added to a config or count (`LoraShape(rank=16, targets=(...))`):
            their parameters are the trainable ones. A peft model is read as it is.
        activation_checkpointing: layers recompute their activations in backward.
        precision, optimizer, largest_layer_params, zero_init: as for `estimate_memory`.
        causal_lm: the loss is over a vocabulary (logits term); default: read from the model.
        device: "cuda" (accelerator and host apart; adds the CUDA context and allocator slack)
            or "cpu" (one memory: `per_rank_total` adds the host share to the accelerator's).
        reduce_bucket_size: gradient bucket elements (default: hidden size squared, as the
            Engine's "auto"). stage3_max_live_parameters: most weights ZeRO-3 keeps gathered.

    Raises: ValueError for an argument outside what is allowed (the message names it).
    """
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("world_size", world_size)):
        _check_positive_int(name, value)
    gpn = world_size if gpus_per_node is None else gpus_per_node
    _check_positive_int("gpus_per_node", gpn)
    if world_size % gpn:
        raise ValueError(
            f"`world_size`={world_size} is not a multiple of `gpus_per_node`={gpn}. "
            "HINT: world_size = gpus_per_node * nodes"
        )
    _check_choice("device", device, ("cuda", "cpu"), "HINT: device='cuda' for GPUs")
    counted = peak_model(model, lora, largest_layer_params, _limits())
    num_params, largest, trainable, adapter, shape, lora = counted[:6]
    states = estimate_memory(
        num_params,
        largest_layer_params=largest,
        num_gpus_per_node=gpn,
        num_nodes=world_size // gpn,
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        precision=precision,
        optimizer=optimizer,
        zero_init=zero_init,
        trainable_params=trainable,
    )
    weight = 4 if precision == "fp32" else 2
    acts = activation_bytes(
        shape,
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=activation_checkpointing,
        causal_lm=counted[6] if causal_lm is None else causal_lm,
        weight_bytes=weight,
        lora=lora,
    )
    bucket = shape.hidden**2 if reduce_bucket_size is None else reduce_bucket_size
    buckets = (
        0 if zero_stage == 0 else bucket * weight + (int(0.9 * bucket) * weight if zero_stage == 3 else 0)
    )
    live = weight * max(0, min(num_params, stage3_max_live_parameters) - largest) if zero_stage == 3 else 0
    offloaded = offload_optimizer != "none"
    embedding = shape.vocab * shape.hidden  # its fp32 gradient accumulation, when it trains
    overhead = framework_bytes(zero_stage, num_params, trainable, embedding if trainable > adapter else 0)
    per_param = OPTIMIZER_STATE_BYTES[optimizer] + 8 + 2 * weight
    if device == "cuda":
        tensors = states.accelerator.total + acts["layers"] + acts["lora"] + acts["logits"] + live + buckets
        overhead += CUDA_CONTEXT_BYTES + math.ceil(CUDA_ALLOCATOR_FRACTION * tensors)
    return PeakEstimate(
        states=states,
        activations=acts["layers"] + acts["lora"],
        logits=acts["logits"],
        live_params=live,
        buckets=buckets,
        lora=adapter * per_param,
        offload_buffers=offload_bytes(zero_stage, trainable) if offloaded else 0,
        overhead=overhead,
        device=device,
        seq_len=seq_len,
        micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing,
    )


def choose_zero_stage(
    model: ModelLike,
    *,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    budget_bytes: int | None = None,
    margin: float = 0.1,
    **options: Any,
) -> StagePlan:
    """The ZeRO stage/offload with the least communication whose whole peak fits the budget.

    Set-ups are tried in `PLAN_ORDER`: ZeRO-0 < 1 < 2 < 3 < 3 + optimizer offload < 3 + optimizer
    and parameter offload (each later one communicates more or moves work to the CPU). One fits
    when `estimate_peak(...).per_rank_total * (1 + margin)` is at most `budget_bytes` (on a GPU the
    accelerator's peak; with device="cpu" accelerator and host are one memory, so offload saves none).

    Args:
        model: the user's model object (an `nn.Module`, peft model), config, folder or count.
        world_size: data-parallel ranks.
        micro_batch, seq_len: the micro batch per rank and its sequence length.
        budget_bytes: memory per accelerator; default: the CUDA device's total memory.
        margin: fraction kept free (0.1 = 10 %).
        **options: passed to `estimate_peak` (gpus_per_node, lora, activation_checkpointing,
            precision, optimizer, device, ...).

    Returns: a `StagePlan`: the choice, the runner-up, one log line and every candidate.

    Raises:
        ValueError: bad arguments, or nothing fits: the message names the smallest need and what
            would fit (a budget, activation checkpointing, a smaller micro batch, more ranks).
    """
    budget = device_memory() if budget_bytes is None else budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(
            f"`budget_bytes` must be a positive number of bytes, got {budget!r}. HINT: e.g. 80e9"
        )
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10:
        raise ValueError(f"`margin` must be a fraction >= 0, got {margin!r}. HINT: margin=0.1 (10 %)")
    common = dict(world_size=world_size, micro_batch=micro_batch, seq_len=seq_len, **options)
    if isinstance(model, (str, os.PathLike)):
        model = meta_model(Path(model), _limits()) if Path(model).exists() else model
    candidates = tuple(
        estimate_peak(model, zero_stage=st, offload_optimizer=oo, offload_params=op, **common)
        for st, oo, op in PLAN_ORDER
    )
    factor = 1 + margin
    fitting = [c for c in candidates if c.per_rank_total * factor <= budget]
    if not fitting:
        raise ValueError(_nothing_fits(model, candidates, budget, margin, common))
    choice = fitting[0]
    runner_up = fitting[1] if len(fitting) > 1 else None
    skipped = candidates[: candidates.index(choice)]
    line = (
        f"{choice.states.label}: peak {format_bytes(choice.per_rank_total)} per {_unit(choice)} fits "
        f"{format_bytes(budget)} with a {margin:.0%} margin (least communication that fits"
        + (
            f"; {skipped[-1].states.label} needs {format_bytes(skipped[-1].per_rank_total)}"
            if skipped
            else ""
        )
        + (f"; runner-up {runner_up.states.label}" if runner_up else "")
        + ")"
    )
    return StagePlan(
        choice=choice,
        runner_up=runner_up,
        budget_bytes=int(budget),
        margin=float(margin),
        log_line=line,
        candidates=candidates,
    )


def _nothing_fits(
    model: ModelLike, candidates: tuple[PeakEstimate, ...], budget: float, margin: float, common: dict
) -> str:
    """Why no set-up fits, and what would: a budget, checkpointing, micro batch 1, more ranks."""
    best = min(candidates, key=lambda c: c.per_rank_total)
    ideas = [f"a budget of {format_bytes(best.per_rank_total * (1 + margin))}"]
    world = common["world_size"]
    for change, text in (
        ({"activation_checkpointing": True}, "activation_checkpointing=True"),
        ({"micro_batch": 1}, "micro_batch=1"),
        ({"world_size": world * 8, "gpus_per_node": common.get("gpus_per_node")}, f"world_size={world * 8}"),
    ):
        if all(common.get(k) == v for k, v in change.items()):
            continue
        tried = estimate_peak(
            model, zero_stage=3, offload_optimizer="cpu", offload_params="cpu", **{**common, **change}
        )
        if tried.per_rank_total * (1 + margin) <= budget:
            ideas.append(text)
    return (
        f"no ZeRO stage/offload fits {format_bytes(budget)} per {_unit(best)} with a {margin:.0%} margin at "
        f"micro_batch={common['micro_batch']}, seq_len={common['seq_len']}, world_size={world}: the "
        f"smallest peak is {best.states.label} at {format_bytes(best.per_rank_total)}. "
        "HINT: what would fit: " + " or ".join(ideas)
    )


def _unit(peak: PeakEstimate) -> str:
    return "rank" if peak.device == "cpu" else "accelerator"


def communication_per_step(
    model: ModelLike,
    *,
    world_size: int,
    gradient_accumulation_steps: int = 1,
    coalesce: bool = False,
    precision: Precision = "bf16",
    trainable_params: int | None = None,
    stage3_max_live_parameters: int = 10**9,
) -> dict[int, CommVolume]:
    """Bytes one rank sends per optimizer step for ZeRO-0/1/2/3 (ring algorithms; docs/memory.md).

    ZeRO-3 gathers the weights again in backward when the model is larger than
    `stage3_max_live_parameters` (DeepSpeed keeps them gathered otherwise).
    `coalesce`: one gradient reduction per optimizer step under gradient accumulation
    (DeepSpeed's `coalesce_grad_reduction`) instead of one per micro-step for ZeRO-2/3.
    """
    _check_positive_int("world_size", world_size)
    _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    num_params, _ = resolve_num_params(model)
    trainable = resolve_trainable_params(model, num_params, trainable_params)
    weight = 4 if precision == "fp32" else 2
    return {
        stage: comm_volume(
            zero_stage=stage,
            num_params=num_params,
            trainable_params=trainable,
            world_size=world_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            coalesce=coalesce,
            weight_bytes=weight,
            grad_bytes=weight,
            regather_in_backward=num_params > stage3_max_live_parameters,
        )
        for stage in (0, 1, 2, 3)
    }


__all__ = [
    "ASSUMED_HIDDEN_PER_LAYER",
    "ASSUMED_VOCAB",
    "CHEAPEST",
    "CHOICES",
    "MAX_CONFIG_BYTES",
    "MAX_COUNTED_PARAMS",
    "MAX_LAYERS",
    "MAX_MODULES",
    "MAX_REAL_BYTES",
    "OPTIMIZER_STATE_BYTES",
    "PLAN_ORDER",
    "CommVolume",
    "LoraShape",
    "MemoryBreakdown",
    "MemoryEstimate",
    "ModelLike",
    "OffloadDevice",
    "OptimizerName",
    "PeakEstimate",
    "Precision",
    "Recommendation",
    "SetupChoices",
    "StagePlan",
    "choose_zero_stage",
    "communication_per_step",
    "count_params",
    "estimate_all",
    "estimate_largest_layer",
    "estimate_memory",
    "estimate_peak",
    "fits",
    "format_bytes",
    "format_count",
    "parse_count",
    "parse_size",
    "recommend_config",
    "resolve_num_params",
    "resolve_trainable_params",
]
