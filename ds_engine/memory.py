"""ZeRO-aware memory estimate for model states, and the cheapest stage/offload that fits.

`estimate_memory` returns numbers (bytes per accelerator and per host) for the *model states*
of data-parallel training: parameters, gradients and optimizer states (fp32 master weights,
fp32 gradients handed to the optimizer, and the optimizer's own state). Activations, the
CUDA context, communication buckets and fragmentation are not included; keep headroom for
them (`recommend_config` does).

Formulas
========
P = number of parameters, L = parameters of the largest single module (its direct
parameters: the layer ZeRO-3 gathers at once; from a bare count it is estimated by
`estimate_largest_layer`), N = num_gpus_per_node * num_nodes,
G = num_gpus_per_node, K = optimizer state bytes per parameter (Adam/AdamW 8: two fp32
moments; Lion, Adagrad and SGD with momentum 4; plain SGD 0). T = trainable parameters
(`requires_grad`): all of P unless given, or read from a model with frozen parameters (LoRA /
PEFT adapters): gradients, fp32 masters, fp32 gradients and optimizer state exist for these
only, so every "grad" and optimizer term below is times T, not P.

Bytes per parameter, by precision:

============  ======  =====  ===========  ==================
precision     weight  grad   fp32 master  fp32 grad for step
============  ======  =====  ===========  ==================
bf16 / fp16   2       2      4            4
fp32          4       4      4 (ZeRO>=1)  4 (ZeRO>=1)
============  ======  =====  ===========  ==================

Per accelerator, no offload:

* ZeRO-0: weight*P + grad*P + (master + fp32 grad + K)*P   (fp32 ZeRO-0: 4P + 4P + K*P)
* ZeRO-1: weight*P + grad*P + (master + fp32 grad + K)*P/N
* ZeRO-2: weight*P + grad*P/N + (master + fp32 grad + K)*P/N
* ZeRO-3: (weight + grad + master + fp32 grad + K)*P/N, plus (weight + grad)*L working memory
  for the gathered largest layer and its gradient.

Offload (ZeRO-1/2/3, `offload_optimizer="cpu"`): master weights, fp32 gradients and optimizer
state move to host memory; gradients leave the accelerator as they are reduced, so the
accelerator keeps the weights only (plus the ZeRO-3 working layer). `offload_params="cpu"`
(ZeRO-3 only) also moves the weight partitions (weight*P/N) to the host. Host memory is per
node: the sum over its G ranks, e.g. `(4 + 4 + K)*P/N * G` for the offloaded optimizer.

Host memory also has a loading peak, before optimizer states exist: every rank materialises
the full model in fp32 (4*P*G per node), except under ZeRO-3 with `zero_init` (zero.Init),
where only the largest layer is whole at a time (4*L*G). The host total is the larger of
the loading peak and the offloaded model states.

Where this differs from DeepSpeed's estimators, and why
-------------------------------------------------------
The base is DeepSpeed's `estimate_zero2_model_states_mem_needs` (accelerator:
2P + 18P/N; offload: 2P on the accelerator, 16P on the host) and
`estimate_zero3_model_states_mem_needs` (4L + 18P/N; offload optimizer: 4L + 2P/N on the
accelerator, 16P/nodes on the host; offload both: 4L, 18P/nodes), which this module
reproduces for bf16/fp16 Adam except:

* ZeRO-3 without optimizer offload is 20P/N here, not 18P/N: DeepSpeed 0.19's stage-3
  optimizer holds the 16-bit gradient partition *and* the fp32 gradient partition at the
  optimizer step (measured: `tests/distributed/test_memory_real.py`).
* DeepSpeed only covers 16-bit mixed precision with Adam and stages 2/3. This adds ZeRO-0
  and ZeRO-1, fp32 training, and other optimizers. fp32 under ZeRO-1/2/3 still counts a
  separate fp32 master partition and fp32 gradient partition: DeepSpeed's ZeRO optimizers
  clone the partition even when the model is already fp32 (measured); plain fp32 ZeRO-0
  uses the torch optimizer directly and has no copy.
* DeepSpeed multiplies host memory by `additional_buffer_factor=1.5`; here the numbers are
  the model states themselves and the margin is explicit (`recommend_config(headroom=...)`).
* DeepSpeed's ZeRO-2 host figure ignores the number of nodes; here host memory is per node.
* The estimate is an upper bound at the optimizer step: it counts the 16-bit gradient
  partition and the fp32 gradient copy made from it as alive together, as DeepSpeed does
  (they coexist while the copy is made; just before and after it, only one of them does).
* ZeRO-1 counts full 16-bit gradients on every rank: with gradient accumulation ZeRO-1
  keeps them until the boundary. With gradient_accumulation_steps=1 DeepSpeed reduces them
  during backward and holds only a 2P/N partition, so the ZeRO-1 figure is then high by
  2P - 2P/N.

Measured against DeepSpeed 0.19.8 (2 CPU ranks, bf16, AdamW, 51M-parameter GPT-2, tensor
storages reachable from the engine; `scripts/benchmarks/bench_memory.py`), bytes per parameter per
rank, measured / estimated: ZeRO-0 20.0 / 20 (1.00), ZeRO-2 10.0 / 11 (0.91, the coexisting
gradient copies above), ZeRO-3 10.08 / 10 (1.01, the extra is communication buffers).

NVMe offload is not modelled (what stays in host memory then depends on the swap buffers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Union, get_args

from ds_engine._memory_types import (
    MemoryBreakdown,
    MemoryEstimate,
    OffloadDevice,
    OptimizerName,
    Precision,
    Recommendation,
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
    """Turn an int, `nn.Module`, HF config or model path into (num_params, largest_layer_params).

    Args:
        model_or_num_params: a parameter count, an `nn.Module`, a transformers
            `PretrainedConfig`, or a path to an HF model folder / config JSON file.
        largest_layer_params: overrides the derived largest layer. With an int count and no
            value given, it is `estimate_largest_layer(count)` (usual transformer shapes).

    Raises:
        ValueError: a count that is not a positive integer, or an unsupported type.
        FileNotFoundError: a path that does not exist.
    """
    if isinstance(model_or_num_params, bool):
        raise ValueError(
            f"`model_or_num_params` must be a positive int, an nn.Module, a PretrainedConfig or a path; "
            f"got {model_or_num_params!r}. HINT: pass the parameter count, e.g. 1_300_000_000"
        )
    if isinstance(model_or_num_params, int):
        num_params = model_or_num_params
        largest = estimate_largest_layer(num_params) if num_params > 0 else num_params
    elif isinstance(model_or_num_params, (str, os.PathLike)):
        path = Path(model_or_num_params)
        if not path.exists():
            raise FileNotFoundError(
                f"`model` path {str(path)!r} does not exist. HINT: pass a local Hugging Face model folder "
                "or config JSON file (nothing is downloaded), or a parameter count"
            )
        num_params, largest = count_params(meta_model(path, _limits()))
    else:
        import torch

        if isinstance(model_or_num_params, torch.nn.Module):
            num_params, largest = count_params(model_or_num_params)
        elif hasattr(model_or_num_params, "to_dict") and hasattr(model_or_num_params, "model_type"):
            num_params, largest = count_params(meta_model(model_or_num_params, _limits()))
        else:
            raise ValueError(
                f"`model_or_num_params` has unsupported type {type(model_or_num_params).__name__}; allowed: "
                "int, torch.nn.Module, transformers.PretrainedConfig, or a path to a model folder. "
                "HINT: pass the parameter count"
            )
    if not 0 < num_params <= MAX_COUNTED_PARAMS:
        raise ValueError(
            f"`model_or_num_params` must be a positive parameter count of at most {MAX_COUNTED_PARAMS:.0e}, "
            f"got {num_params}. HINT: pass the number of parameters, e.g. 1_300_000_000"
        )
    if largest_layer_params is not None:
        if isinstance(largest_layer_params, bool) or not isinstance(largest_layer_params, int):
            raise ValueError(
                f"`largest_layer_params` must be an int, got {largest_layer_params!r}. "
                "HINT: pass the parameter count of the largest layer, or leave it out"
            )
        if not 0 < largest_layer_params <= num_params:
            raise ValueError(
                f"`largest_layer_params`={largest_layer_params} must be in 1..{num_params} (the total). "
                "HINT: pass the largest single layer's parameter count, or leave it out"
            )
        largest = largest_layer_params
    return num_params, largest


def resolve_trainable_params(
    model_or_num_params: ModelLike, num_params: int, trainable_params: int | None
) -> int:
    """`trainable_params` checked, or counted from an `nn.Module` (its `requires_grad`
    parameters, shared ones once), or all `num_params` for a count, config or path."""
    if trainable_params is None:
        import torch

        if isinstance(model_or_num_params, torch.nn.Module):
            unique = {id(p): p.numel() for p in model_or_num_params.parameters() if p.requires_grad}
            return sum(unique.values())
        return num_params
    if isinstance(trainable_params, bool) or not isinstance(trainable_params, int):
        raise ValueError(
            f"`trainable_params` must be an int, got {trainable_params!r}. HINT: pass the number of "
            "parameters with requires_grad (e.g. a LoRA adapter's), or leave it out"
        )
    if not 0 <= trainable_params <= num_params:
        raise ValueError(
            f"`trainable_params`={trainable_params} must be in 0..{num_params} (the total). HINT: pass "
            "the number of parameters with requires_grad, or leave it out"
        )
    return trainable_params


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
    "MemoryBreakdown",
    "MemoryEstimate",
    "ModelLike",
    "OffloadDevice",
    "OptimizerName",
    "Precision",
    "Recommendation",
    "SetupChoices",
    "count_params",
    "estimate_all",
    "estimate_largest_layer",
    "estimate_memory",
    "fits",
    "format_bytes",
    "format_count",
    "parse_count",
    "parse_size",
    "recommend_config",
    "resolve_num_params",
    "resolve_trainable_params",
]
