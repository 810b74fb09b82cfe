"""accelerate's `Accelerator(...)` arguments -> Engine choices: one pure function and its table.

`ARGUMENTS` says, for every argument of `accelerate.Accelerator.__init__`, whether it is mapped
(and onto what), ignored (and why) or refused (an error naming it, with the fix);
`map_arguments` applies it. It reads nothing but its arguments (the environment and whether
CUDA is available are passed in) and changes none of them, so it is tested without an Engine.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"

#: accelerate's `split_batches` default: "not given" (the `dataloader_config`'s value stands).
NOT_SET: Any = object()

_SHARDING_HINT = (
    "drop it; choose sharding with the ZeRO stage (`ds-engine launch --config zero3`), "
    "which the fallback maps onto FSDP2 itself"
)

#: Every argument of `accelerate.Accelerator.__init__` (accelerate 1.16): (what happens, how).
#: "mapped": it becomes an Engine choice or the Accelerator's own setting (values it cannot
#: honour raise, naming the argument). "ignored": accepted, with no effect here, for the reason
#: given. "refused": any value but accelerate's default raises a ValueError naming it.
#: `tests/unit/test_accelerate_constructor.py` fails when accelerate gains an argument that is
#: not listed here.
ARGUMENTS: dict[str, tuple[str, str]] = {
    "device_placement": (REFUSED, "False: prepared loaders always place batches on the device"),
    "split_batches": (REFUSED, "True: `batch_size` is per process (give it to the DataLoader)"),
    "mixed_precision": (
        MAPPED,
        "`precision`: 'no' -> fp32, 'fp16', 'bf16' (also from ACCELERATE_MIXED_PRECISION); others refused",
    ),
    "gradient_accumulation_steps": (MAPPED, "`gradient_accumulation_steps`"),
    "cpu": (
        MAPPED,
        "accepted where no GPU is visible (the backend's device is the CPU then); refused where CUDA "
        "is available (hide the GPUs with CUDA_VISIBLE_DEVICES='')",
    ),
    "dataloader_config": (
        MAPPED,
        "kept as `accelerator.dataloader_config`; `split_batches=True`, `dispatch_batches=True`, "
        "`even_batches=False` and a `data_seed` are refused",
    ),
    "deepspeed_plugin": (MAPPED, "its `deepspeed_config` is the Engine's DeepSpeed JSON (`config`)"),
    "fsdp_plugin": (REFUSED, "sharding comes from the ZeRO stage (the fallback maps ZeRO-2/3 onto FSDP2)"),
    "torch_tp_plugin": (REFUSED, "no tensor parallelism"),
    "megatron_lm_plugin": (REFUSED, "no Megatron-LM"),
    "rng_types": (
        IGNORED,
        "nothing to synchronise: a prepared loader shuffles as accelerate's default ('generator') "
        "does, from rank 0's generator on every rank; the process RNGs are left alone (seed them "
        "with `set_seed`)",
    ),
    "log_with": (MAPPED, "the trackers `init_trackers` starts (accelerate's classes, and 'jsonl')"),
    "project_dir": (MAPPED, "the project configuration's `project_dir` (and `logging_dir`)"),
    "project_config": (MAPPED, "the project configuration (`save_state` naming, `total_limit`, logging)"),
    "gradient_accumulation_plugin": (
        MAPPED,
        "`num_steps` -> `gradient_accumulation_steps`; `sync_with_dataloader=False` is refused",
    ),
    "step_scheduler_with_optimizer": (
        MAPPED,
        "False: a prepared scheduler steps once per applied optimizer step (`schedule_sized_from` "
        '"prepared")',
    ),
    "kwargs_handlers": (
        MAPPED,
        "InitProcessGroupKwargs.timeout -> `dist_timeout_s`; GradScalerKwargs -> `initial_scale_power`, "
        "`loss_scale_window`; DistributedDataParallelKwargs, ProfileKwargs and AutocastKwargs() "
        "accepted and ignored; AutocastKwargs(enabled=False) and other handlers refused",
    ),
    "dynamo_backend": (REFUSED, "anything but 'no': call torch.compile yourself"),
    "dynamo_plugin": (REFUSED, "call torch.compile yourself"),
    "deepspeed_plugins": (MAPPED, "one plugin (or a dict of one): as `deepspeed_plugin`"),
    "parallelism_config": (REFUSED, "no composable parallelism"),
}

_MIXED_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def unsupported(argument: str, value: Any, hint: str) -> ValueError:
    """The error for an accelerate argument ds_engine cannot honour (names it, and the fix)."""
    return ValueError(f"ds_engine.Accelerator: `{argument}={value!r}` is not supported. HINT: {hint}")


@dataclass(frozen=True)
class EngineSetup:
    """What `map_arguments` makes of accelerate's constructor arguments."""

    config: Any
    """The Engine's `config` argument: the caller's, or a DeepSpeed plugin's JSON."""
    choices: dict[str, Any] = field(default_factory=dict)
    """Engine keyword choices (the caller's win over those mapped from accelerate's arguments)."""
    dataloader_config: DataLoaderConfiguration = field(default_factory=DataLoaderConfiguration)
    """accelerate's loader settings as given (a copy when `split_batches` overrode one)."""
    step_scheduler_with_optimizer: bool = True
    """accelerate's flag; False reads a prepared schedule's length as sized from the prepared loader."""


def map_arguments(
    *,
    device_placement: bool = True,
    split_batches: Any = NOT_SET,
    mixed_precision: Any = None,
    gradient_accumulation_steps: int = 1,
    cpu: bool = False,
    dataloader_config: DataLoaderConfiguration | None = None,
    deepspeed_plugin: Any = None,
    fsdp_plugin: Any = None,
    torch_tp_plugin: Any = None,
    megatron_lm_plugin: Any = None,
    rng_types: Any = None,
    log_with: Any = None,
    project_dir: str | os.PathLike[str] | None = None,
    project_config: Any = None,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
    step_scheduler_with_optimizer: bool = True,
    kwargs_handlers: Sequence[Any] | None = None,
    dynamo_backend: Any = None,
    dynamo_plugin: Any = None,
    deepspeed_plugins: Any = None,
    parallelism_config: Any = None,
    config: Any = None,
    choices: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    cuda_available: bool = False,
) -> EngineSetup:
    """accelerate's constructor arguments (as `ARGUMENTS` classifies them) -> an `EngineSetup`.

    Args:
        config: The Engine's `config` argument, if the caller gave one.
        choices: Engine keyword choices the caller gave (they win over mapped ones).
        environ: The environment (`ACCELERATE_MIXED_PRECISION` is read from it); default: none.
        cuda_available: Whether CUDA devices are visible (`cpu=True` is refused then).
        The others: accelerate's arguments, with accelerate's defaults. `log_with`,
        `project_dir` and `project_config` are the Accelerator's own settings (trackers, state
        folders) and `rng_types` is ignored: they do not change the setup.

    Raises:
        ValueError: For an argument or value ds_engine cannot honour, naming it, with the fix.
    """
    del rng_types, log_with, project_dir, project_config  # the Accelerator's own, or ignored
    mapped: dict[str, Any] = {}
    if not device_placement:
        raise unsupported("device_placement", False, "drop it: prepared loaders always place batches")
    for name, value in (
        ("fsdp_plugin", fsdp_plugin),
        ("torch_tp_plugin", torch_tp_plugin),
        ("megatron_lm_plugin", megatron_lm_plugin),
        ("parallelism_config", parallelism_config),
        ("dynamo_plugin", dynamo_plugin),
    ):
        if value is not None:
            raise unsupported(name, type(value).__name__, _SHARDING_HINT)
    if dynamo_backend not in (None, "no", "NO") and str(dynamo_backend).lower() != "dynamobackend.no":
        raise unsupported("dynamo_backend", dynamo_backend, "drop it; call torch.compile yourself")
    if cpu and cuda_available:
        raise unsupported(
            "cpu", True, "ds_engine trains on the backend's device; hide the GPUs (CUDA_VISIBLE_DEVICES='')"
        )
    loaders = _check_dataloader_config(dataloader_config or DataLoaderConfiguration(), split_batches)
    # ------------------------------------------------------------ precision and accumulation
    if mixed_precision is None:
        mixed_precision = (environ or {}).get("ACCELERATE_MIXED_PRECISION") or None
    if mixed_precision is not None:
        name = str(getattr(mixed_precision, "value", mixed_precision)).lower()
        if name not in _MIXED_PRECISION:
            raise unsupported("mixed_precision", mixed_precision, "use 'no', 'fp16' or 'bf16'")
        mapped["precision"] = _MIXED_PRECISION[name]
    if gradient_accumulation_plugin is not None:
        if gradient_accumulation_steps != 1:
            raise ValueError(
                "ds_engine.Accelerator: pass `gradient_accumulation_steps` or "
                "`gradient_accumulation_plugin`, not both (as accelerate requires)."
            )
        if not gradient_accumulation_plugin.sync_with_dataloader:
            raise unsupported(
                "GradientAccumulationPlugin.sync_with_dataloader",
                False,
                "drop it; the Engine always ends a window at the loader's last batch",
            )
        gradient_accumulation_steps = int(gradient_accumulation_plugin.num_steps)
    if gradient_accumulation_steps != 1:
        mapped["gradient_accumulation_steps"] = int(gradient_accumulation_steps)
    mapped.update(_map_handlers(kwargs_handlers or []))
    # ------------------------------------------------------------ DeepSpeed config
    plugin = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins
    if plugin is not None:
        if config is not None:
            raise ValueError(
                "ds_engine.Accelerator: `deepspeed_plugin` and `config` both give a DeepSpeed config. "
                "HINT: pass one."
            )
        given = "deepspeed_plugin" if deepspeed_plugin is not None else "deepspeed_plugins"
        config = ds_config_from_plugin(plugin, argument=given)
    return EngineSetup(
        config=config,
        choices={**mapped, **(choices or {})},
        dataloader_config=loaders,
        step_scheduler_with_optimizer=bool(step_scheduler_with_optimizer),
    )


def _check_dataloader_config(loaders: DataLoaderConfiguration, split_batches: Any) -> DataLoaderConfiguration:
    if split_batches is not NOT_SET and bool(split_batches) != loaders.split_batches:
        loaders = dataclasses.replace(loaders, split_batches=bool(split_batches))
    if loaders.split_batches:
        raise unsupported(
            "split_batches", True, "give the per-process batch size to the DataLoader (split_batches=False)"
        )
    if loaders.dispatch_batches:
        raise unsupported("dispatch_batches", True, "use a map-style dataset; ds_engine shards it by batch")
    if not loaders.even_batches:
        raise unsupported("even_batches", False, "drop it; gather_for_metrics removes the padded samples")
    if loaders.data_seed is not None:
        raise unsupported(
            "data_seed", loaders.data_seed, "seed the DataLoader's sampler: RandomSampler(generator=...)"
        )
    return loaders


def ds_config_from_plugin(plugin: Any, argument: str = "deepspeed_plugin") -> dict[str, Any]:
    """A DeepSpeedPlugin's JSON (or the one plugin of a dict, `argument` names it in the error), minus
    what accelerate adds that DeepSpeed reads as a default."""
    if isinstance(plugin, Mapping):
        if len(plugin) != 1:
            raise unsupported(argument, f"{{{', '.join(map(repr, plugin))}}}", "pass one DeepSpeedPlugin")
        plugin = next(iter(plugin.values()))
    config = dict(getattr(plugin, "deepspeed_config", None) or {})
    steps = config.get("steps_per_print")
    if isinstance(steps, float) and not math.isfinite(steps):
        config.pop("steps_per_print")  # accelerate's "never print"; ds_engine's default is 0 (never)
    return config


def _map_handlers(handlers: Sequence[Any]) -> dict[str, Any]:
    """Engine choices from accelerate's `kwargs_handlers` (the first of each kind wins)."""
    choices: dict[str, Any] = {}
    for handler in handlers:
        if isinstance(handler, InitProcessGroupKwargs):
            if handler.timeout is not None:
                choices.setdefault("dist_timeout_s", int(handler.timeout.total_seconds()))
        elif isinstance(handler, GradScalerKwargs):
            power = math.log2(handler.init_scale)
            if power != int(power):
                raise unsupported(
                    "GradScalerKwargs.init_scale", handler.init_scale, "use a power of two (2.0**16)"
                )
            choices.setdefault("initial_scale_power", int(power))
            choices.setdefault("loss_scale_window", int(handler.growth_interval))
        elif isinstance(handler, (DistributedDataParallelKwargs, ProfileKwargs)):
            pass  # DDP tuning / profiling: the Engine wraps the model itself; accepted, ignored
        elif isinstance(handler, AutocastKwargs):
            if not handler.enabled:
                raise unsupported(
                    "AutocastKwargs.enabled", False, "choose the precision with mixed_precision='no'"
                )
        else:
            raise unsupported(
                "kwargs_handlers",
                type(handler).__name__,
                "ds_engine maps InitProcessGroupKwargs, GradScalerKwargs, DistributedDataParallelKwargs, "
                "AutocastKwargs and ProfileKwargs; drop the others",
            )
    return choices


def check_dummies(
    optims: list[Any], scheds: list[Any], config: Any, backend: str, deepspeed: bool, models: int = 1
) -> None:
    """Refuse DummyOptim / DummyScheduler that nothing would stand behind (`config`: the Engine's
    resolved choices; `deepspeed`: the run uses DeepSpeed; `models`: the models prepared beside
    the Accelerator's own, and in this call)."""
    if models > 1:
        raise ValueError(
            "ds_engine.Accelerator.prepare: DummyOptim / DummyScheduler stand for the one optimizer and "
            f"scheduler of the DeepSpeed config, and this Accelerator prepares {models} models. HINT: "
            "pass a torch optimizer (and scheduler) for each trained model."
        )
    hint = (
        "put an `optimizer` / `scheduler` block in the DeepSpeed config (DS_ENGINE_CONFIG or "
        "deepspeed_plugin), or pass a torch optimizer / scheduler"
    )
    if not deepspeed:
        raise ValueError(
            "ds_engine.Accelerator.prepare: DummyOptim / DummyScheduler stand for DeepSpeed's configured "
            f"optimizer and scheduler, and this run uses the {backend!r} backend. HINT: pass a "
            "torch optimizer and scheduler (or install DeepSpeed)."
        )
    if optims and config.optimizer is None:
        raise ValueError(
            "ds_engine.Accelerator.prepare: DummyOptim but the config has no `optimizer` block. "
            f"HINT: {hint}."
        )
    for sched in scheds:
        if config.scheduler is None and sched.lr_scheduler_callable is None:
            raise ValueError(
                "ds_engine.Accelerator.prepare: DummyScheduler without `lr_scheduler_callable` but the "
                f"config has no `scheduler` block. HINT: {hint}."
            )


def dummy_values(
    optims: list[Any], scheds: list[Any], split_batches: bool, num_processes: int
) -> tuple[dict[str, Any], Any]:
    """What accelerate writes into the config's "auto" values from DummyOptim / DummyScheduler, and
    the parameters (or groups) the config's optimizer trains (None: the model's).

    DummyOptim: `optimizer.params.lr` / `weight_decay`, and its `params` (groups). DummyScheduler
    (without a callable): `warmup_min_lr` 0, `warmup_max_lr` the optimizer's lr,
    `warmup_num_steps` (at least 1), and `total_num_steps` divided by the number of processes
    (accelerate's reading: the scripts size it from the un-prepared dataloader). Only "auto"
    values change (`Engine.fill_auto`).
    """
    values: dict[str, Any] = {}
    params = None
    for optim in optims:
        values |= {"optimizer.params.lr": optim.lr, "optimizer.params.weight_decay": optim.weight_decay}
        params = optim.params
    for sched in scheds:
        if sched.lr_scheduler_callable is not None:
            continue
        opt = sched.optimizer
        defaults = getattr(opt, "defaults", None)
        max_lr = getattr(opt, "lr", None) if defaults is None else defaults["lr"]
        if max_lr is None and optims:  # DummyScheduler(None, ...): the DummyOptim's lr
            max_lr = optims[0].lr
        values |= {
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_num_steps": max(1, int(sched.warmup_num_steps)),
        }
        if max_lr is not None:
            values["scheduler.params.warmup_max_lr"] = max_lr
        if sched.total_num_steps is not None:
            total = int(sched.total_num_steps)
            values["scheduler.params.total_num_steps"] = (
                total if split_batches else math.ceil(total / num_processes)
            )
    return values, params
