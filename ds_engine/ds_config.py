"""Pure DeepSpeed JSON builder: a resolved config + facts -> DeepSpeed config dict.

The top of the config layers (`ds_schema` -> `config_rules` -> `config` -> `ds_config`):
`render_ds_config` maps a `config.ResolvedConfig` and the facts of the run (world size, micro
batch, hidden size, model, dataloader, optimizer) to the DeepSpeed JSON, filling every "auto",
and never resolves the choices again. `build_ds_config` is the same for a user's
`EngineConfig` and base JSON: it resolves them once (`config.resolve_config`), then renders.

Nothing here starts a process group, and DeepSpeed is imported only inside
`validate_ds_config` (to run DeepSpeed's own config models when it is installed).

Every problem that can be seen is reported at once: `build_ds_config` raises one
`ConfigError` whose `problems` list unknown keys first (with the closest valid name), then
bad values, conflicts and impossible combinations, each with its own `HINT:`.

Presets ship inside the package as data (`ds_engine/configs/*.json`; the repository's
top-level `configs/` is a link to that folder) and are found with `importlib.resources`, so an
installed wheel has them too. Each one is exactly what `build_ds_config` writes for
`preset_choices()[name]` with `resolve=False`. Regenerate them with::

    python -m ds_engine.ds_config --write-presets
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_engine._values import AUTO, _is_int
from ds_engine.config import (
    STEPS_PER_PRINT_OFF,
    ConfigError,
    EngineConfig,
    JsonSource,
    ResolvedConfig,
    config_error,
    fact_problems,
    merge_problems,
    raise_problems,
    resolve_config,
    validate_ds_config,
)
from ds_engine.ds_blocks import DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, block_problems
from ds_engine.ds_schema import (
    AUTO_FILLERS,
    BLOCK_KEYS,
    DEEPSPEED_BUCKET_DEFAULTS,
    OFFLOAD_KEYS,
    PRESETS,
    PRESETS_DIR,
    TOP_LEVEL_KEYS,
    ZERO_KEYS,
    leftover_autos,
    leftover_problem,
    load_base,
    normalized,
    preset_path,
)
from ds_engine.errors import show_json as _show


# --------------------------------------------------------------------------- presets
def preset_choices() -> dict[str, EngineConfig]:
    """The high-level choices each preset in `ds_engine/configs/` is built from."""
    return {
        "zero0": EngineConfig(zero_stage=0),
        "zero1": EngineConfig(zero_stage=1),
        "zero2": EngineConfig(zero_stage=2),
        "zero2_offload": EngineConfig(zero_stage=2, offload_optimizer="cpu", pin_memory=True),
        "zero3": EngineConfig(zero_stage=3, stage3_gather_16bit_weights_on_model_save=True),
        "zero3_offload": EngineConfig(
            zero_stage=3,
            offload_optimizer="cpu",
            offload_params="cpu",
            pin_memory=True,
            stage3_gather_16bit_weights_on_model_save=True,
        ),
        "zero3_offload_nvme": EngineConfig(
            zero_stage=3,
            offload_optimizer="nvme",
            offload_params="nvme",
            pin_memory=True,
            stage3_gather_16bit_weights_on_model_save=True,
        ),
    }


# --------------------------------------------------------------------------- facts
def hidden_size_from_model(model: Any) -> int | None:
    """The model's hidden size from its Hugging Face config, or None when it has none.

    Looks at `config.hidden_size`, then `max(config.hidden_sizes)`, then
    `config.text_config.hidden_size` (multimodal models).
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    for candidate in (cfg, getattr(cfg, "text_config", None)):
        if candidate is None:
            continue
        size = getattr(candidate, "hidden_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
        sizes = getattr(candidate, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
            return int(max(sizes))
    return None


def _micro_batch(
    cfg: EngineConfig, micro_arg: int | None, dataloader: Any, base: Mapping[str, Any], world_size: int
) -> tuple[int | None, list[str]]:
    facts: list[tuple[str, int]] = []
    if micro_arg is not None:
        facts.append(("micro_batch_size argument", micro_arg))
    dl_bs = getattr(dataloader, "batch_size", None) if dataloader is not None else None
    if isinstance(dl_bs, int) and not isinstance(dl_bs, bool) and dl_bs > 0:
        facts.append(("dataloader.batch_size", dl_bs))
    if cfg.micro_batch_size != AUTO:
        facts.insert(0, ("micro_batch_size choice", int(cfg.micro_batch_size)))
    if len({v for _, v in facts}) > 1:
        listed = ", ".join(f"{src} = {v}" for src, v in facts)
        return None, [
            f"`train_micro_batch_size_per_gpu` has contradicting sources: {listed}; allowed is one "
            "per-rank micro batch size. HINT: make the dataloader's batch_size equal the micro batch size"
        ]
    if facts:
        return facts[0][1], []
    tb = base.get("train_batch_size")
    ga = cfg.gradient_accumulation_steps
    if _is_int(tb) and tb > 0:
        if tb % (ga * world_size):
            return None, [
                f"`train_batch_size` = {tb} is not divisible by gradient_accumulation_steps ({ga}) * "
                f"world_size ({world_size}); allowed: a multiple of {ga * world_size}. "
                f"HINT: set train_batch_size to {ga * world_size * max(1, tb // (ga * world_size))}"
            ]
        return tb // (ga * world_size), []
    return None, []


# --------------------------------------------------------------------------- bucket sizes
def deepspeed_bucket_fallbacks(
    config: EngineConfig, base: Mapping[str, Any] | None, *, zero_stage: int | None = None
) -> dict[str, int]:
    """Bucket sizes that take DeepSpeed's defaults because no hidden size is known.

    A bucket size left at its "auto" default (neither chosen explicitly nor written in the
    base JSON) falls back to DeepSpeed's own default (`DEEPSPEED_BUCKET_DEFAULTS`) for the
    stages that use it, instead of failing; an "auto" the user asked for (a choice, or the
    word in the JSON) still has to be filled. `build_ds_config` applies this rule whenever it
    has no hidden size, and the DeepSpeed backend applies the same rule (this function).

    Args:
        config: The user's choices (`explicit_fields` tells what was asked for).
        base: The base DeepSpeed JSON, or None.
        zero_stage: The effective ZeRO stage (after merging the base); `config.zero_stage`
            when None.

    Returns:
        Field name -> DeepSpeed's default, for every bucket size that falls back.
    """
    zero_base = (base or {}).get("zero_optimization")
    written = set(zero_base) if isinstance(zero_base, Mapping) else set()
    given = config.zero_stage if zero_stage is None else zero_stage
    stage = given if isinstance(given, int) else 0  # "auto" is decided before anything is rendered
    return {
        key: value
        for key, value in DEEPSPEED_BUCKET_DEFAULTS.items()
        if key not in config.explicit_fields
        and key not in written
        and getattr(config, key) == AUTO
        and stage >= (3 if key.startswith("stage3_") else 1)
    }


# --------------------------------------------------------------------------- builder
#: Values a preset leaves as "auto" when the choice was not made explicitly. The bucket sizes
#: are not among them: a preset that wrote `"reduce_bucket_size": "auto"` would ask for a hidden
#: size, and a plain `nn.Module` has none. Left out, they follow the Engine's own rule (from the
#: model's hidden size when it has one, else DeepSpeed's defaults: `deepspeed_bucket_fallbacks`).
ADAPTIVE = frozenset(
    {
        "micro_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "precision",
        "nvme_path",
    }
)


_PRESET_DEFER = frozenset({"nvme_path"})  # a preset leaves the NVMe folder to the user


def _num(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def build_ds_config(
    config: EngineConfig | ResolvedConfig,
    *,
    world_size: int,
    base: JsonSource | None = None,
    micro_batch_size: int | None = None,
    hidden_size: int | None = None,
    model: Any = None,
    dataloader: Any = None,
    optimizer: Any = None,
    resolve: bool = True,
    inference_only: bool = False,
) -> dict[str, Any]:
    """Turn high-level choices (plus an optional DeepSpeed JSON base) into a DeepSpeed config.

    Args:
        config: The user's choices; fields not in `config.explicit_fields` may come from `base`.
            Or a `ResolvedConfig` (choices and base resolved already: no `base` then).
        world_size: Number of data-parallel ranks (the real one: the batch triangle uses it).
        base: A DeepSpeed JSON dict, a path to one, or a preset name; its keys are kept and the
            choices merged in. A base value contradicting an explicit choice is an error.
        micro_batch_size: Per-rank micro batch size, when `config.micro_batch_size` is "auto".
        hidden_size: Model hidden size for the "auto" bucket sizes (else taken from `model`).
            Without one, bucket sizes the user did not ask for take DeepSpeed's defaults
            (`deepspeed_bucket_fallbacks`), exactly as through the Engine.
        model: A Hugging Face model (its `config` gives the hidden size).
        dataloader: Its `batch_size` gives the micro batch size.
        optimizer: A torch optimizer; its first param group fills "auto" optimizer params.
        resolve: False leaves adaptive values as "auto" and omits unchosen ones (how the
            presets are made); no facts are needed then, and "auto" values and missing batch
            sizes are not problems.
        inference_only: The JSON of a model prepared without an optimizer (a frozen teacher or
            reference model), as `prepare(model)` alone runs it (`fit_inference_only`).

    Returns:
        The DeepSpeed config dict (JSON-serializable, integers where DeepSpeed wants them).

    Raises:
        ConfigError: Every problem seen, in one error: unknown keys (with the closest valid
            name) first, then bad values, conflicts with the base, leftover "auto" values, a
            batch-triangle mismatch, unsupported stage/offload combinations, bad optimizer or
            scheduler blocks, and anything DeepSpeed's config models reject.
    """
    if isinstance(config, ResolvedConfig):
        if base is not None:
            raise ConfigError(
                "`base` was given with a ResolvedConfig, which holds its base JSON already. "
                "HINT: drop base= (or pass the EngineConfig and the base)"
            )
        resolved = config
    elif isinstance(config, EngineConfig):
        facts = fact_problems(
            world_size=world_size, micro_batch_size=micro_batch_size, hidden_size=hidden_size
        )
        try:
            resolved = resolve_config(
                config,
                base=base,
                world_size=None if facts else world_size,
                defer=frozenset() if resolve else _PRESET_DEFER,
                report_base_later=True,
            )
        except ConfigError as exc:
            raise ConfigError(*merge_problems(facts, exc.problems)) from None
    else:
        raise config_error(
            "config", config, "expected an EngineConfig", "pass EngineConfig(zero_stage=2) (or .from_dict)"
        )
    return render_ds_config(
        resolved,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        hidden_size=hidden_size,
        model=model,
        dataloader=dataloader,
        optimizer=optimizer,
        preset=not resolve,
        inference_only=inference_only,
    )


def render_ds_config(
    resolved: ResolvedConfig,
    *,
    world_size: int,
    micro_batch_size: int | None = None,
    hidden_size: int | None = None,
    model: Any = None,
    dataloader: Any = None,
    optimizer: Any = None,
    preset: bool = False,
    inference_only: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed JSON of a resolved config and the run's facts; never resolves again.

    This is the one place the JSON DeepSpeed runs with is made: `ds-engine config` prints it and
    `prepare` passes it to `deepspeed.initialize` unchanged.

    Args:
        resolved: The run's resolution (`config.resolve_config`): the effective choices are
            written into a copy of its base JSON.
        world_size: Number of data-parallel ranks (the real one: the batch triangle uses it).
        micro_batch_size: Per-rank micro batch size, when the choice is "auto".
        hidden_size: Model hidden size for the "auto" bucket sizes (else taken from `model`).
            Without one, bucket sizes the user did not ask for take DeepSpeed's defaults
            (`deepspeed_bucket_fallbacks`).
        model: A Hugging Face model (its `config` gives the hidden size).
        dataloader: Its `batch_size` gives the micro batch size.
        optimizer: A torch optimizer; its first param group fills "auto" optimizer params.
        preset: Leave adaptive values as "auto" and omit unchosen ones (how the presets are
            made); no facts are needed then.
        inference_only: The model is prepared without an optimizer (a frozen teacher or a
            reference model): see `fit_inference_only`.

    Returns:
        The DeepSpeed config dict (JSON-serializable, integers where DeepSpeed wants them).

    Raises:
        ConfigError: Every problem seen, in one error (with `resolved.pending_problems`):
            leftover "auto" values, contradicting micro batch sizes, a batch-triangle
            mismatch, and anything the finished JSON breaks (see `validate_ds_config`).
    """
    facts = fact_problems(world_size=world_size, micro_batch_size=micro_batch_size, hidden_size=hidden_size)
    ws = None if facts else world_size
    base_dict = normalized(resolved.base or {})
    cfg = resolved.effective
    pending = resolved.pending_problems
    autos = [n for n in ("zero_stage", "offload_optimizer", "offload_params") if getattr(cfg, n) == AUTO]
    if autos:  # the Engine decides these at prepare (ds_engine.auto_stage), before rendering
        raise ConfigError(
            f'`{autos[0]}` = "auto" is decided at `prepare` from the model; a DeepSpeed JSON needs a stage. '
            'HINT: pass zero_stage=0..3 (`ds-engine estimate --recommend` prints what "auto" would choose)'
        )
    if preset:
        out = _render(cfg, base_dict, preset=True)
        raise_problems(facts, validate_ds_config(out, world_size=ws, partial=True), pending)
        return out
    if facts:
        raise_problems(facts, pending)
    problems: list[str] = []
    micro, micro_problems = _micro_batch(cfg, micro_batch_size, dataloader, base_dict, world_size)
    problems += micro_problems
    model_h = hidden_size_from_model(model) if model is not None else None
    if hidden_size is not None and model_h is not None and hidden_size != model_h:
        problems.append(
            f"`hidden_size` = {hidden_size} contradicts the model's config.hidden_size = {model_h}. "
            "HINT: drop the hidden_size argument"
        )
    h = hidden_size or model_h
    tb = base_dict.get("train_batch_size")
    out = _render(cfg, base_dict, preset=False)
    if micro is not None:
        out["train_micro_batch_size_per_gpu"] = micro
        expected = micro * cfg.gradient_accumulation_steps * world_size
        if tb is not None and tb != AUTO and tb != expected:
            problems.append(
                f"`train_batch_size` = {_show(tb)} breaks the batch triangle: train_micro_batch_size_per_gpu "
                f"({micro}) * gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) * world_size "
                f"({world_size}) = {expected}; allowed: exactly that product. "
                f'HINT: set "train_batch_size": "auto" (or {expected})'
            )
        out["train_batch_size"] = expected
    zero = out["zero_optimization"]
    if h is not None:
        fills = {
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        }
    else:
        fills = deepspeed_bucket_fallbacks(cfg, base_dict)
    for key, value in fills.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    _fill_optimizer_autos(out, optimizer)
    if inference_only:
        fit_inference_only(out)
    elif defers_reduction_to_step(out, coalesce=cfg.coalesce_grad_reduction):
        out["managed_gradient_accumulation"] = False
    problems += [leftover_problem(k) for k in leftover_autos(out)]
    raise_problems(problems, validate_ds_config(out, world_size=world_size), pending)
    return out


#: What the Hugging Face Trainer fills from `TrainingArguments` (`trainer_config_process`): a JSON
#: for it leaves these "auto", and the choices that set them belong to `TrainingArguments`.
TRAINER_FILLS = ("micro_batch_size", "gradient_accumulation_steps", "gradient_clipping", "precision")
_TRAINER_OPTIMIZER = {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), AUTO)}
_TRAINER_SCHEDULER = {
    "type": "WarmupDecayLR",  # TrainingArguments' default schedule: linear warm-up, linear decay
    "params": dict.fromkeys(("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), AUTO),
}


def for_trainer(config: EngineConfig | None = None, *, base: JsonSource | None = None) -> dict[str, Any]:
    """A DeepSpeed JSON for `transformers.TrainingArguments(deepspeed=path)`: the stage, offload and
    other choices written, and every value the Trainer fills left "auto": the micro batch size,
    gradient accumulation, clipping, fp16/bf16, the optimizer's lr/betas/eps/weight_decay and the
    scheduler's warm-up and total steps (an AdamW / WarmupDecayLR block unless the choices or
    `base` have their own), and the bucket sizes it sizes from the model's hidden size
    (`reduce_bucket_size`; under ZeRO-3 also `stage3_prefetch_bucket_size`,
    `stage3_param_persistence_threshold`) unless chosen. `train_batch_size` is left out: DeepSpeed
    derives it from the micro batch, the accumulation and its own world size.

    Raises:
        ConfigError: A choice the Trainer owns (`TRAINER_FILLS`: set it in TrainingArguments), and
            every problem `build_ds_config` finds.
    """
    config = config if config is not None else EngineConfig()
    owned = [name for name in TRAINER_FILLS if name in config.explicit_fields]
    if owned:
        raise ConfigError(
            f"`{owned[0]}` = {getattr(config, owned[0])!r} is filled by the Hugging Face Trainer from its "
            "TrainingArguments in a JSON written for it. HINT: drop it here and set it in TrainingArguments "
            "(per_device_train_batch_size, max_grad_norm, bf16 or fp16, the accumulation steps)"
        )
    out = build_ds_config(config, world_size=1, base=base, resolve=False)
    # DeepSpeed derives it (micro x accumulation x its world size); the Trainer would fill it from
    # accelerate's world size, which is 1 on CPU ranks (DeepSpeed's batch assertion then fails)
    out.pop("train_batch_size", None)
    out.setdefault("optimizer", copy.deepcopy(_TRAINER_OPTIMIZER))
    out.setdefault("scheduler", copy.deepcopy(_TRAINER_SCHEDULER))
    zero = out["zero_optimization"]
    sized = ("reduce_bucket_size",) + (
        ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold") if zero["stage"] == 3 else ()
    )
    for key in sized if zero["stage"] >= 1 else ():
        if key not in config.explicit_fields:
            zero.setdefault(key, AUTO)
    if zero["stage"] == 3:  # the Trainer's save_model gathers the 16-bit weights with it
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return out


def fit_inference_only(ds_config: dict[str, Any]) -> None:
    """Fit the JSON of a model prepared without an optimizer (inference only), in place.

    ZeRO-3 keeps its stage: parameters stay partitioned and are gathered layer by layer for the
    forward (DeepSpeed's optimizer-less `DeepSpeedZeRoOffload`). ZeRO-1/2 shard only optimizer
    states and gradients, which such a model does not have, and DeepSpeed refuses them without
    an optimizer: they run as ZeRO-0 (replicated weights), as TRL prepares its reference model.
    Scheduler settings have nothing to act on.
    """
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) in (1, 2):
        ds_config["zero_optimization"] = {"stage": 0}
    ds_config.pop("scheduler", None)


def defers_reduction_to_step(ds_config: Mapping[str, Any], *, coalesce: bool) -> bool:
    """Whether DeepSpeed must run with `managed_gradient_accumulation: false` (step() is the boundary).

    At GA=1 the user may accumulate by hand (`loss / gas`, `step()` every gas micro-steps). With
    DeepSpeed's own boundary every backward is a boundary, and ZeRO-1/2 then keep only the last
    backward's gradients; in the unmanaged mode `backward` only accumulates and `step()` reduces
    (ZeRO-1) or finalizes what each backward reduced (ZeRO-2), so the applied gradient is the sum
    of every backward since the last step, as in plain torch. The canonical one-backward-per-step
    loop does the same reductions either way. ZeRO-0 and ZeRO-3 already add up across boundaries
    (ZeRO-0 averages in place, ZeRO-3 accumulates its gradient partitions until `step()`) and stay
    managed; so does ZeRO-1 with `overlap_comm` (DeepSpeed refuses it unmanaged) and coalesced
    reduction (`coalesce`, which needs the managed mode). A value in the user's JSON is kept as
    written.
    """
    if "managed_gradient_accumulation" in ds_config:
        return not bool(ds_config["managed_gradient_accumulation"])
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    return (
        int(ds_config.get("gradient_accumulation_steps", 1)) == 1
        and stage in (1, 2)
        and not (stage == 1 and zero.get("overlap_comm"))
        and not coalesce
    )


def _render(cfg: EngineConfig, base: Mapping[str, Any], *, preset: bool) -> dict[str, Any]:
    """Write the choices into a copy of `base`; in preset mode unchosen adaptive values are "auto"."""
    out: dict[str, Any] = copy.deepcopy(dict(base))
    explicit = cfg.explicit_fields

    def val(name: str) -> Any:
        if not preset or name in explicit:
            return getattr(cfg, name)
        return AUTO if name in ADAPTIVE else _OMIT

    def put(d: dict[str, Any], key: str, value: Any) -> None:
        if value is _OMIT:
            return
        d[key] = _num(value) if isinstance(value, float) else value

    stage = int(cfg.zero_stage)  # never "auto" here: render_ds_config refuses it
    micro = val("micro_batch_size")
    if preset:
        put(out, "train_batch_size", AUTO)
        put(out, "train_micro_batch_size_per_gpu", micro)
    elif micro != AUTO:
        out["train_micro_batch_size_per_gpu"] = micro
    else:
        out["train_micro_batch_size_per_gpu"] = AUTO
        out.setdefault("train_batch_size", AUTO)
    put(out, "gradient_accumulation_steps", val("gradient_accumulation_steps"))
    out["gradient_clipping"] = val("gradient_clipping") if preset else float(cfg.gradient_clipping)
    spp = val("steps_per_print")
    put(out, "steps_per_print", spp if spp is _OMIT or spp else STEPS_PER_PRINT_OFF)
    out.setdefault("zero_allow_untested_optimizer", True)
    out.setdefault("wall_clock_breakdown", False)

    precision = val("precision")
    fp16 = dict(out.get("fp16") or {})
    bf16 = dict(out.get("bf16") or {})
    fp16["enabled"] = AUTO if precision == AUTO else precision == "fp16"
    bf16["enabled"] = AUTO if precision == AUTO else precision == "bf16"
    if precision == "fp16" or precision == AUTO:
        for name in (
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "min_loss_scale",
        ):
            put(fp16, name, val(name) if precision == "fp16" or name in explicit else _OMIT)
    put(bf16, "check_grad_overflow", val("bf16_check_grad_overflow"))
    out["fp16"], out["bf16"] = fp16, bf16

    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = stage
    zero.pop("stage3_gather_fp16_weights_on_model_save", None)  # legacy alias of the 16bit key
    if stage >= 1:
        for name in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size"):
            put(zero, name, val(name))
        if stage in (1, 2):
            put(zero, "allgather_bucket_size", val("allgather_bucket_size"))
        _offload_block(zero, "offload_optimizer", cfg.offload_optimizer, cfg, val)
    else:
        zero.pop("offload_optimizer", None)
    if stage == 3:
        _offload_block(zero, "offload_param", cfg.offload_params, cfg, val)
        for name in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_gather_16bit_weights_on_model_save",
        ):
            put(zero, name, val(name))
    else:
        zero.pop("offload_param", None)
    out["zero_optimization"] = zero

    if cfg.activation_checkpointing:
        block = dict(out.get("activation_checkpointing") or {})
        put(block, "partition_activations", val("activation_checkpointing_partition"))
        put(block, "cpu_checkpointing", val("activation_checkpointing_cpu"))
        out["activation_checkpointing"] = block
    else:
        out.pop("activation_checkpointing", None)
    for name in ("optimizer", "scheduler"):
        block = getattr(cfg, name)
        if block is None:
            out.pop(name, None)
        else:
            out[name] = copy.deepcopy(block)
    return out


_OMIT = object()


def _offload_block(zero: dict[str, Any], key: str, device: str, cfg: EngineConfig, val: Any) -> None:
    if device == "none":
        zero.pop(key, None)
        return
    block = dict(zero.get(key) or {})
    block["device"] = device
    pin = val("pin_memory")
    if pin is not _OMIT:
        block["pin_memory"] = pin
    if device == "nvme":
        path = val("nvme_path")
        block["nvme_path"] = AUTO if path is None else path
    else:
        block.pop("nvme_path", None)
    zero[key] = block


def _fill_optimizer_autos(out: dict[str, Any], optimizer: Any) -> None:
    group: Mapping[str, Any] = {}
    groups = getattr(optimizer, "param_groups", None)
    if groups:
        group = groups[0]
    opt = out.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("params"), dict):
        params = opt["params"]
        for key in ("lr", "eps", "weight_decay"):
            if params.get(key) == AUTO and key in group:
                params[key] = float(group[key])
        if params.get("betas") == AUTO and "betas" in group:
            params["betas"] = [float(b) for b in group["betas"]]
    lr: Any = None
    if isinstance(opt, dict) and isinstance(opt.get("params"), dict):
        lr = opt["params"].get("lr")
    if (lr is None or lr == AUTO) and "lr" in group:
        lr = float(group["lr"])
    sched = out.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        params = sched["params"]
        if params.get("warmup_max_lr") == AUTO and lr is not None and lr != AUTO:
            params["warmup_max_lr"] = lr
        if params.get("warmup_min_lr") == AUTO:
            params["warmup_min_lr"] = 0.0  # the conventional start of a warm-up (as in HF Trainer)


# --------------------------------------------------------------------------- preset files
def render_presets() -> dict[str, str]:
    """Preset name -> the exact file text `ds_engine/configs/<name>.json` must hold."""
    return {
        name: json.dumps(build_ds_config(choices, world_size=1, resolve=False), indent=2) + "\n"
        for name, choices in preset_choices().items()
    }


def write_presets(folder: Path = PRESETS_DIR) -> list[Path]:
    """(Re)write every preset file into `folder`; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_presets().items():
        path = folder / f"{name}.json"
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def _main() -> None:
    parser = argparse.ArgumentParser(description="Regenerate the preset JSON files in ds_engine/configs/.")
    parser.add_argument("--write-presets", metavar="DIR", nargs="?", const=str(PRESETS_DIR))
    args = parser.parse_args()
    if args.write_presets:
        for path in write_presets(Path(args.write_presets)):
            print(path)


__all__ = [
    "ADAPTIVE",
    "AUTO_FILLERS",
    "BLOCK_KEYS",
    "DEEPSPEED_BUCKET_DEFAULTS",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "OFFLOAD_KEYS",
    "PRESETS",
    "PRESETS_DIR",
    "TOP_LEVEL_KEYS",
    "TRAINER_FILLS",
    "ZERO_KEYS",
    "block_problems",
    "build_ds_config",
    "deepspeed_bucket_fallbacks",
    "for_trainer",
    "hidden_size_from_model",
    "load_base",
    "preset_choices",
    "preset_path",
    "render_ds_config",
    "render_presets",
    "validate_ds_config",
    "write_presets",
]


if __name__ == "__main__":
    _main()
