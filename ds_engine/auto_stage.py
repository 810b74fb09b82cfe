"""`zero_stage="auto"` and `offload_optimizer` / `offload_params` = "auto": the set-up chosen at `prepare`.

Once `prepare` has the model (and the micro batch size, from the choice or the DataLoader), the
planner (`ds_engine.memory.choose_zero_stage`, the same call `ds-engine estimate --recommend`
makes) estimates the whole per-rank peak of every ZeRO stage/offload set-up and takes the one
with the least communication whose peak times 1 + `memory_margin` fits `memory_budget` (the CUDA
device's memory when none is given). Everything here runs before any process-group work: a
budget nothing fits is a `ConfigError` naming what would fit. The decision is a pure function of
the inputs, which are the same on every rank; `settle` still compares it across ranks once the
group exists, and the rendered DeepSpeed config carries the decided stage and offloads.

On a backend that cannot partition (the accelerate fallback), "auto" is data parallel: ZeRO-0,
no offload, said in the same one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ds_engine import memory
from ds_engine._values import AUTO, parse_size
from ds_engine.config import EngineConfig
from ds_engine.config_rules import AUTO_STAGE_FIELDS
from ds_engine.errors import ConfigError

__all__ = ["AUTO_FIELDS", "PlanInputs", "is_auto", "optimizer_kind", "plan_inputs", "plan_setup", "settle"]

_log = logging.getLogger("ds_engine")

#: The choices "auto" may stand for.
AUTO_FIELDS = ("zero_stage", "offload_optimizer", "offload_params")
_OFFLOAD_CODES = {"none": 0, "cpu": 1}


def is_auto(config: EngineConfig) -> bool:
    """True when the stage or an offload is still "auto" (decided at `prepare`)."""
    return any(getattr(config, name) == AUTO for name in AUTO_FIELDS)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """Everything the decision depends on besides the model (the same on every rank)."""

    world_size: int
    gpus_per_node: int
    micro_batch: int
    seq_len: int
    budget_bytes: int
    margin: float
    precision: str
    optimizer: str
    activation_checkpointing: bool
    device: str
    """"cuda" (the budget is one GPU's memory) or "cpu" (a CPU rank: accelerator and host are one)."""
    stage3_max_live_parameters: int = 10**9
    """ZeRO-3 keeps this many gathered weights alive (the choice of the same name)."""
    reduce_bucket_size: int | None = None
    """Gradient bucket elements; None: the hidden size squared (the choice's "auto")."""
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Choices the user fixed (a stage, an offload device): only set-ups with them are taken."""


def optimizer_kind(optimizer: Any, block: Mapping[str, Any] | None = None) -> str:
    """The estimator's optimizer name (sizes its state) for a torch optimizer or a DeepSpeed block;
    Adam-like (8 bytes per parameter, the most) when unknown."""
    name = type(optimizer).__name__.lower() if optimizer is not None else str((block or {}).get("type", ""))
    name = name.lower()
    if "lion" in name:
        return "lion"
    if "adagrad" in name:
        return "adagrad"
    if name == "sgd":
        groups = getattr(optimizer, "param_groups", None) or [{}]
        return "sgd_momentum" if groups[0].get("momentum", 0) else "sgd"
    return "adamw"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else default


def _budget(config: EngineConfig, device: torch.device) -> int:
    if config.memory_budget is not None:
        return parse_size(config.memory_budget, name="memory_budget")
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    raise ConfigError(
        f'`zero_stage` = "auto" on a {device.type.upper()} rank needs `memory_budget` (the memory one rank '
        'may use), got none: there is no CUDA device to read it from. HINT: pass memory_budget="16GB" '
        "(bytes or a size such as 40GB / 79GiB)"
    )


def plan_inputs(
    config: EngineConfig, *, model: Any, optimizer: Any, dataloader: Any, device: torch.device
) -> PlanInputs:
    """The decision's inputs from the effective choices, the model, optimizer and DataLoader
    `prepare` got, the launcher's world size and this rank's device (before any process group).

    Raises:
        ConfigError: No micro batch size (neither chosen nor a DataLoader's), no budget on a CPU rank.
    """
    import torch.distributed as dist

    chosen = config.micro_batch_size
    micro = getattr(dataloader, "batch_size", None) if chosen == AUTO else chosen
    if not isinstance(micro, int) or micro < 1:
        raise ConfigError(
            '`zero_stage` = "auto" needs the micro batch size: `micro_batch_size` is "auto" and `prepare` '
            "got no DataLoader with a batch_size. HINT: pass micro_batch_size=8, or prepare the DataLoader "
            "with the model"
        )
    world = (
        dist.get_world_size() if dist.is_available() and dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    )
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    fixed = {n: getattr(config, n) for n in AUTO_FIELDS if getattr(config, n) != AUTO}
    if config.zero_stage == AUTO:  # an offload left at its default follows the plan
        fixed = {n: v for n, v in fixed.items() if n in config.explicit_fields or v != "none"}
    checkpointing = config.activation_checkpointing or bool(
        getattr(model, "is_gradient_checkpointing", False)
    )
    return PlanInputs(
        world_size=world,
        gpus_per_node=per_node if per_node <= world and world % per_node == 0 else world,
        micro_batch=micro,
        seq_len=int(config.seq_len or 0),
        budget_bytes=_budget(config, device),
        margin=config.memory_margin,
        precision=config.precision,
        optimizer=optimizer_kind(optimizer, config.optimizer),
        activation_checkpointing=checkpointing,
        device="cuda" if device.type == "cuda" else "cpu",
        stage3_max_live_parameters=config.stage3_max_live_parameters,
        reduce_bucket_size=None if config.reduce_bucket_size == AUTO else int(config.reduce_bucket_size),
        fixed=fixed,
    )


def _flag_terms(text: str) -> str:
    return text.replace("micro_batch=", "micro_batch_size=").replace("world_size=", "world size ")


def plan_setup(model: Any, inputs: PlanInputs) -> memory.StagePlan:
    """The decision: `choose_zero_stage` over every set-up (what `ds-engine estimate --recommend`
    prints for the same inputs), narrowed to the choices the user fixed.

    The model counts as built already (it exists when `prepare` runs: `zero_init=False`).

    Raises:
        ConfigError: Nothing fits: the message names the smallest peak and what would fit (a
            budget, activation checkpointing, a smaller micro batch, more ranks, or dropping a
            fixed choice).
    """
    try:
        plan = memory.choose_zero_stage(
            model,
            world_size=inputs.world_size,
            gpus_per_node=inputs.gpus_per_node,
            micro_batch=inputs.micro_batch,
            seq_len=inputs.seq_len,
            budget_bytes=inputs.budget_bytes,
            margin=inputs.margin,
            precision=inputs.precision,
            optimizer=inputs.optimizer,
            activation_checkpointing=inputs.activation_checkpointing,
            device=inputs.device,
            zero_init=False,
            stage3_max_live_parameters=inputs.stage3_max_live_parameters,
            reduce_bucket_size=inputs.reduce_bucket_size,
        )
    except ValueError as exc:
        raise ConfigError(f'`zero_stage` = "auto": {_flag_terms(str(exc))}') from None
    if not inputs.fixed:
        return plan

    def allowed(peak: memory.PeakEstimate) -> bool:
        st = peak.states
        have = {
            "zero_stage": st.zero_stage,
            "offload_optimizer": st.offload_optimizer,
            "offload_params": st.offload_params,
        }
        return all(have[k] == v for k, v in inputs.fixed.items())

    factor = 1 + inputs.margin
    fitting = [c for c in plan.candidates if allowed(c) and c.per_rank_total * factor <= inputs.budget_bytes]
    fixed = ", ".join(f"{k}={v!r}" for k, v in inputs.fixed.items())
    if not fitting:
        raise ConfigError(
            f'"auto" with {fixed}: no set-up with these fits {memory.format_bytes(inputs.budget_bytes)} '
            f"with a {inputs.margin:.0%} margin. HINT: what would fit: {plan.choice.states.label} "
            f"(drop {fixed})"
        )
    if fitting[0] is plan.choice:
        return plan
    runner = fitting[1] if len(fitting) > 1 else None
    line = (
        f"{fitting[0].states.label}: peak {memory.format_bytes(fitting[0].per_rank_total)} fits "
        f"{memory.format_bytes(inputs.budget_bytes)} with a {inputs.margin:.0%} margin (least "
        f"communication that fits with {fixed}"
        + (f"; runner-up {runner.states.label}" if runner else "")
        + ")"
    )
    return dataclasses.replace(plan, choice=fitting[0], runner_up=runner, log_line=line)


def _refuse_unread_fields(config: EngineConfig) -> None:
    """`seq_len` / `memory_budget` / `memory_margin` chosen while nothing is "auto" would be unread."""
    given = [name for name in AUTO_STAGE_FIELDS if name in config.explicit_fields]
    if given:
        raise ConfigError(
            f"`{given[0]}` = {getattr(config, given[0])!r} is read only when `zero_stage` or an offload "
            f'is "auto", got `zero_stage` = {config.zero_stage}. HINT: drop `{given[0]}` or set '
            'zero_stage="auto"'
        )


def _agree_across_ranks(plan: memory.StagePlan, device: torch.device) -> None:
    """Every rank decided the same (the inputs are the same; a rank with another GPU is not)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = [plan.zero_stage, _OFFLOAD_CODES[plan.offload_optimizer], _OFFLOAD_CODES[plan.offload_params]]
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[:3].tolist() != [-v for v in both[3:].tolist()]:
        raise ConfigError(
            f'`zero_stage` = "auto" was decided differently across ranks (rank {dist.get_rank()}: '
            f"{plan.choice.states.label} for a budget of {memory.format_bytes(plan.budget_bytes)}): their "
            'GPUs differ in memory. HINT: pass memory_budget="<the smallest GPU\'s memory>" so every rank '
            "decides the same"
        )


def settle(backend: Any, model: Any = None, optimizer: Any = None, dataloader: Any = None) -> EngineConfig:
    """Decide the "auto" choices of `backend`'s run and write them into its effective config.

    Called by the Engine when it is built (no model: only the fallback decides then) and by
    `prepare` with the model, before any process group work; after the decision the group is
    formed and the decision compared across ranks. Rank 0 logs one line: the decision and the
    runner-up. Returns the effective config (unchanged without an "auto").

    Raises:
        ConfigError: No budget on a CPU rank, no micro batch size, nothing fits (what would),
            or ranks that decided differently.
    """
    config = backend.effective
    if not is_auto(config):
        if model is None:
            _refuse_unread_fields(config)
        return config
    rank0 = _env_int("RANK", 0) == 0
    if not backend.plans_auto_stage:  # an "auto" stage is ZeRO-0, an "auto" offload none; the rest stays
        stage = 0 if config.zero_stage == AUTO else int(config.zero_stage)
        devices = ["none" if d == AUTO else d for d in (config.offload_optimizer, config.offload_params)]
        _decide(backend, config, stage, devices[0], devices[1])
        if rank0:
            _log.warning(
                'ds_engine: "auto" on the %s fallback: ZeRO-%d, offload %s; the planner\'s choice needs '
                "DeepSpeed",
                backend.name,
                stage,
                "/".join(devices) if stage == 3 else devices[0],
            )
        return backend.effective
    if model is None:
        return config
    inputs = plan_inputs(
        config, model=model, optimizer=optimizer, dataloader=dataloader, device=backend.device
    )
    plan = plan_setup(model, inputs)
    _decide(backend, config, plan.zero_stage, plan.offload_optimizer, plan.offload_params)
    backend.setup_distributed()
    _agree_across_ranks(plan, backend.device)
    if rank0:
        none = "" if plan.runner_up else " (no runner-up fits)"
        _log.warning('ds_engine: zero_stage="auto" chose %s%s', plan.log_line, none)
    return backend.effective


def _decide(
    backend: Any, config: EngineConfig, stage: int, offload_optimizer: str, offload_params: str
) -> None:
    """Write the decision into the backend's effective config: the decided fields count as chosen;
    ZeRO-3's own options are unread on another stage (and no longer chosen)."""
    explicit = set(config.explicit_fields) | set(AUTO_FIELDS)
    if stage != 3:
        explicit -= {name for name in EngineConfig.field_names() if name.startswith("stage3_")}
    backend.update_effective(
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        _explicit=frozenset(explicit),
    )
