"""Pure DeepSpeed JSON builder: `EngineConfig` + optional base JSON + facts -> DeepSpeed config dict.

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
import difflib
import inspect
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeGuard

from ds_engine.config import (
    AUTO,
    OFFLOAD_DEVICES,
    STEPS_PER_PRINT_OFF,
    ConfigError,
    EngineConfig,
    config_error,
    load_json_config,
    merge_problems,
    raise_problems,
    resolve_engine_config,
)

#: The preset folder inside the installed package (package data; see `preset_path`).
PRESETS_DIR = Path(str(resources.files("ds_engine") / "configs"))
PRESETS: tuple[str, ...] = (
    "zero0",
    "zero1",
    "zero2",
    "zero2_offload",
    "zero3",
    "zero3_offload",
    "zero3_offload_nvme",
)


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


def preset_path(name: str) -> Path:
    """The JSON file of a preset, looked up in the installed package with `importlib.resources`.

    Args:
        name: One of `PRESETS` (e.g. "zero3_offload").

    Raises:
        ConfigError: `name` is not a preset, or the installed package lacks its file.
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean `{close[0]}`?" if close else "pick one of the presets or pass a JSON file path"
        raise ConfigError(f"`{name}` is not a preset (allowed: {', '.join(PRESETS)}). HINT: {hint}")
    resource = resources.files("ds_engine") / "configs" / f"{name}.json"
    if not resource.is_file():
        raise ConfigError(
            f"preset `{name}` is missing from the installed ds_engine package (looked for {resource}); "
            "allowed: a complete install. HINT: reinstall ds-engine (pip install --force-reinstall ds-engine)"
        )
    return Path(str(resource))


def load_base(base: str | os.PathLike[str] | Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """Load a base config given as a dict, a JSON file path or a preset name.

    Returns:
        The JSON dict (empty for None) and a description of where it came from ('' for a dict).

    Raises:
        ConfigError: A name that is neither an existing file nor a preset, or a bad file.
    """
    if base is None:
        return {}, ""
    if isinstance(base, Mapping):
        return load_json_config(base), ""
    if not isinstance(base, (str, os.PathLike)):
        raise config_error(
            "base", base, "expected a JSON file path, a preset name or a dict", 'pass base="zero2" or a dict'
        )
    path = Path(base)
    if not path.exists() and isinstance(base, str) and os.sep not in base and not base.endswith(".json"):
        path = preset_path(base)
    elif not path.exists():
        raise ConfigError(
            f"DeepSpeed config `{base}` is neither an existing file nor a preset: the file does not exist "
            f"(presets: {', '.join(PRESETS)}). HINT: check the path or use a preset name such as zero2"
        )
    return load_json_config(path), str(path)


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


def _fact_problems(**facts: Any) -> list[str]:
    return [
        str(config_error(name, value, "expected an integer >= 1", f"pass {name}=<positive int>"))
        for name, value in facts.items()
        if value is not None and (not _is_int(value) or value < 1)
    ]


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
#: DeepSpeed 0.19's own defaults (DeepSpeedZeroConfig) for the bucket sizes ds_engine derives
#: from the hidden size; used where no hidden size is known and the user did not ask for one.
DEEPSPEED_BUCKET_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


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
    stage = config.zero_stage if zero_stage is None else zero_stage
    return {
        key: value
        for key, value in DEEPSPEED_BUCKET_DEFAULTS.items()
        if key not in config.explicit_fields
        and key not in written
        and getattr(config, key) == AUTO
        and stage >= (3 if key.startswith("stage3_") else 1)
    }


# --------------------------------------------------------------------------- builder
#: Values a preset leaves as "auto" when the choice was not made explicitly.
ADAPTIVE = frozenset(
    {
        "micro_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "precision",
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "nvme_path",
    }
)

_MICRO_HINT = (
    "pass Engine(micro_batch_size=8), or the training DataLoader to engine.prepare(model, optimizer, "
    "train_dl) (build_ds_config: micro_batch_size= or dataloader=; ds-engine config: --micro-batch-size)"
)


def _bucket_hint(default: int) -> str:
    return (
        f"write an integer there (DeepSpeed's default is {default}), or use a model whose config has "
        "hidden_size (build_ds_config: hidden_size= or model=; ds-engine config: --hidden-size)"
    )


def _optimizer_hint(name: str) -> str:
    return (
        f"write a concrete {name} in the optimizer block (build_ds_config can copy it from a torch "
        "optimizer: optimizer=)"
    )


#: What fills each "auto" (None: nothing can) and the one fix when nothing did: key -> (filler, HINT).
AUTO_FILLERS: dict[str, tuple[str | None, str]] = {
    "train_micro_batch_size_per_gpu": (
        "the micro batch size: a micro_batch_size choice or the DataLoader's batch_size",
        _MICRO_HINT,
    ),
    "train_batch_size": ("micro batch * gradient_accumulation_steps * world_size", _MICRO_HINT),
    "gradient_accumulation_steps": (
        "the gradient_accumulation_steps choice",
        "pass gradient_accumulation_steps=<int>",
    ),
    "gradient_clipping": ("the gradient_clipping choice", "pass gradient_clipping=1.0 (0.0 turns it off)"),
    "zero_optimization.reduce_bucket_size": (
        "hidden_size**2 (the model's config.hidden_size)",
        _bucket_hint(DEEPSPEED_BUCKET_DEFAULTS["reduce_bucket_size"]),
    ),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "0.9*hidden_size**2 (the model's config.hidden_size)",
        _bucket_hint(DEEPSPEED_BUCKET_DEFAULTS["stage3_prefetch_bucket_size"]),
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        "10*hidden_size (the model's config.hidden_size)",
        _bucket_hint(DEEPSPEED_BUCKET_DEFAULTS["stage3_param_persistence_threshold"]),
    ),
    "zero_optimization.offload_optimizer.nvme_path": (
        "the nvme_path choice",
        'pass nvme_path="/local_nvme/ds_swap"',
    ),
    "zero_optimization.offload_param.nvme_path": (
        "the nvme_path choice",
        'pass nvme_path="/local_nvme/ds_swap"',
    ),
    "optimizer.params.lr": ("the torch optimizer's lr", _optimizer_hint("lr")),
    "optimizer.params.betas": ("the torch optimizer's betas", _optimizer_hint("betas")),
    "optimizer.params.eps": ("the torch optimizer's eps", _optimizer_hint("eps")),
    "optimizer.params.weight_decay": ("the torch optimizer's weight_decay", _optimizer_hint("weight_decay")),
    "scheduler.params.warmup_max_lr": (
        "the optimizer's lr",
        "write a concrete warmup_max_lr, or a concrete optimizer.params.lr",
    ),
    "scheduler.params.total_num_steps": (None, "write the number of optimizer steps the run takes"),
}
_NO_FILLER: tuple[str | None, str] = (None, "write a concrete value")


def _filled_by(key: str) -> str:
    filler, _ = AUTO_FILLERS.get(key, _NO_FILLER)
    return "nothing fills it" if filler is None else f"it is filled by {filler}"


def _leftover_problem(key: str) -> str:
    filler, hint = AUTO_FILLERS.get(key, _NO_FILLER)
    why = "nothing fills it" if filler is None else f"it is filled by {filler}, which nothing gave here"
    return f'`{key}` = "auto" is left over: {why}; DeepSpeed would drop it silently. HINT: {hint}'


def _leftover_autos(cfg: Mapping[str, Any]) -> list[str]:
    """The "auto" keys to report: none inside unknown blocks, and one for an unknown micro batch."""
    keys = [k for k in _auto_keys(cfg) if k.split(".")[0] in TOP_LEVEL_KEYS]
    if "train_micro_batch_size_per_gpu" in keys:  # train_batch_size follows from it: one cause
        keys = [k for k in keys if k != "train_batch_size"]
    return keys


_PRESET_DEFER = frozenset({"nvme_path"})  # a preset leaves the NVMe folder to the user


def _num(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def build_ds_config(
    config: EngineConfig,
    *,
    world_size: int,
    base: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    micro_batch_size: int | None = None,
    hidden_size: int | None = None,
    model: Any = None,
    dataloader: Any = None,
    optimizer: Any = None,
    resolve: bool = True,
) -> dict[str, Any]:
    """Turn high-level choices (plus an optional DeepSpeed JSON base) into a DeepSpeed config.

    Args:
        config: The user's choices; fields not in `config.explicit_fields` may come from `base`.
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
            presets are made, and how `Engine(...)` checks its arguments); no facts are needed
            then, and "auto" values and missing batch sizes are not problems.

    Returns:
        The DeepSpeed config dict (JSON-serializable, integers where DeepSpeed wants them).

    Raises:
        ConfigError: Every problem seen, in one error: unknown keys (with the closest valid
            name) first, then bad values, conflicts with the base, leftover "auto" values, a
            batch-triangle mismatch, unsupported stage/offload combinations, bad optimizer or
            scheduler blocks, and anything DeepSpeed's config models reject.
    """
    if not isinstance(config, EngineConfig):
        raise config_error(
            "config", config, "expected an EngineConfig", "pass EngineConfig(zero_stage=2) (or .from_dict)"
        )
    facts = _fact_problems(world_size=world_size, micro_batch_size=micro_batch_size, hidden_size=hidden_size)
    ws = None if facts else world_size
    base_dict, where = load_base(base)
    if isinstance(base_dict.get("bfloat16"), Mapping):  # DeepSpeed's legacy alias of "bf16"
        legacy = base_dict.pop("bfloat16")
        bf16 = base_dict.get("bf16")
        base_dict["bf16"] = {**legacy, **(bf16 if isinstance(bf16, Mapping) else {})}
    structural = validate_ds_config(base_dict, world_size=ws, partial=True) if base_dict else []
    if _misshapen_blocks(base_dict):  # nothing can be merged into a block that is no object
        raise ConfigError(*merge_problems(facts, structural))
    try:
        cfg = resolve_engine_config(
            config, base_dict, where=where, defer=_PRESET_DEFER if not resolve else frozenset()
        )
    except ConfigError as exc:
        raise ConfigError(*merge_problems(facts, exc.problems, structural)) from None
    if not resolve:
        out = _render(cfg, base_dict, preset=True)
        raise_problems(facts, validate_ds_config(out, world_size=ws, partial=True), structural)
        return out
    if facts:
        raise_problems(facts, structural)
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
    problems += [_leftover_problem(k) for k in _leftover_autos(out)]
    raise_problems(problems, validate_ds_config(out, world_size=world_size), structural)
    return out


def _misshapen_blocks(base: Mapping[str, Any]) -> list[str]:
    """The blocks of `base` that must be JSON objects for the choices to merge in, but are not."""
    bad = [k for k in _OBJECT_BLOCKS if k in base and not isinstance(base[k], Mapping)]
    zero = base.get("zero_optimization")
    if isinstance(zero, Mapping):
        bad += [
            f"zero_optimization.{k}" for k in OFFLOAD_KEYS if k in zero and not isinstance(zero[k], Mapping)
        ]
    return bad


_OBJECT_BLOCKS = ("zero_optimization", "fp16", "bf16", "activation_checkpointing", "optimizer", "scheduler")


def _show(value: Any) -> str:
    return json.dumps(value)


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

    stage = cfg.zero_stage
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


def _auto_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, Mapping):
        found = []
        for key, value in node.items():
            found += _auto_keys(value, f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in _auto_keys(v, f"{prefix}[{i}]")]
    return [prefix] if node == AUTO else []


# --------------------------------------------------------------------------- validation
def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: DeepSpeed 0.19 top-level config keys.
TOP_LEVEL_KEYS = _words(
    """
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
    managed_gradient_accumulation optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast
    gradient_clipping prescale_gradients gradient_predivide_factor gradient_allreduce_op
    communication_data_type seq_parallel_communication_data_type sparse_gradients zero_optimization
    zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print wall_clock_breakdown
    memory_breakdown dump_state disable_allgather disable_python_gc activation_checkpointing
    flops_profiler comms_logger tensorboard wandb csv_monitor comet autotuning elasticity checkpoint
    data_types dataloader_drop_last pipeline curriculum_learning data_efficiency
    compression_training aio nebula hybrid_engine compile weight_quantization timers
    sparse_attention quantize_training eigenvalue progressive_layer_drop expert_parallel
    use_data_before_expert_parallelism log_level tensor_parallel sequence_parallel_size
    graph_harvesting mics_shard_size mics_hierarchical_params_gather dynamic_batching model_info
    vocabulary_size datastates_ckpt data_parallel
    """
)

#: DeepSpeed 0.19 `zero_optimization` keys (DeepSpeedZeroConfig fields and aliases).
ZERO_KEYS = _words(
    """
    allgather_bucket_size allgather_partitions compute_grad_norm contiguous_gradients cpu_offload
    cpu_offload_param cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks
    ignore_unused_parameters leaf_module legacy_stage1 load_from_fp32_weights
    log_trace_cache_warnings memory_efficient_linear offload_optimizer offload_param overlap_comm
    override_module_apply parameter_alignment pipeline_loading_checkpoint reduce_bucket_size
    reduce_scatter round_robin_gradients save_muon_momentum_buffer_in_memory stage
    stage3_allgather_sequential stage3_gather_16bit_weights_on_model_save
    stage3_gather_fp16_weights_on_model_save stage3_max_live_parameters stage3_max_reuse_distance
    stage3_model_persistence_threshold stage3_module_granularity_threshold
    stage3_param_persistence_threshold stage3_prefetch_bucket_size
    stage3_use_all_reduce_for_fetch_params sub_group_size use_multi_rank_bucket_allreduce zenflow
    zero_hpz_partition_size zero_quantized_gradients zero_quantized_nontrainable_weights
    zero_quantized_weights mics_shard_size mics_hierarchical_params_gather
    """
)

OFFLOAD_KEYS = {
    "offload_optimizer": _words(
        "buffer_count cpuadam_cores_perc device fast_init nvme_path pin_memory pipeline_read "
        "pipeline_write ratio super_offload"
    ),
    "offload_param": _words("buffer_count buffer_size device max_in_cpu nvme_path pin_memory"),
}

#: DeepSpeed 0.19 `fp16` / `bf16` / `activation_checkpointing` / `optimizer` / `scheduler` keys.
BLOCK_KEYS: dict[str, frozenset[str]] = {
    "fp16": _words(
        "enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis "
        "consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads"
    ),
    "bf16": _words(
        "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
        "bf16_optimizer_states"
    ),
    "activation_checkpointing": _words(
        "partition_activations contiguous_memory_optimization cpu_checkpointing number_checkpoints "
        "synchronize_checkpoint_boundary profile"
    ),
    "optimizer": _words("type params legacy_fusion"),
    "scheduler": _words("type params"),
}
BLOCK_KEYS["bfloat16"] = BLOCK_KEYS["bf16"]

#: Optimizer types DeepSpeed 0.19 builds itself (matched case-insensitively), besides any
#: `torch.optim` class name.
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = (
    "Adam",
    "AdamW",
    "Adagrad",
    "Lamb",
    "Lion",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Muon",
)
#: torch.optim classes a JSON optimizer block cannot drive (no closure, no sparse gradients).
_UNUSABLE_TORCH_OPTIMIZERS = frozenset({"Optimizer", "LBFGS", "SparseAdam"})

#: DeepSpeed 0.19 LR schedulers (`deepspeed.runtime.lr_schedules`): type -> (params, required).
DEEPSPEED_SCHEDULERS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "LRRangeTest": (
        _words(
            "lr_range_test_min_lr lr_range_test_step_size lr_range_test_step_rate "
            "lr_range_test_staircase last_batch_iteration"
        ),
        frozenset(),
    ),
    "OneCycle": (
        _words(
            "cycle_min_lr cycle_max_lr decay_lr_rate cycle_first_step_size cycle_second_step_size "
            "cycle_first_stair_count cycle_second_stair_count decay_step_size cycle_momentum "
            "cycle_min_mom cycle_max_mom decay_mom_rate last_batch_iteration"
        ),
        _words("cycle_min_lr cycle_max_lr"),
    ),
    "WarmupLR": (
        _words("warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration"),
        frozenset(),
    ),
    "WarmupDecayLR": (
        _words(
            "total_num_steps warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration"
        ),
        _words("total_num_steps"),
    ),
    "WarmupCosineLR": (
        _words(
            "total_num_steps warmup_min_ratio warmup_num_steps cos_min_ratio warmup_type last_batch_iteration"
        ),
        _words("total_num_steps"),
    ),
}
#: torch.optim.lr_scheduler classes a JSON block cannot drive (they need Python objects or a
#: metric in `step`, which DeepSpeed never passes).
_UNUSABLE_TORCH_SCHEDULERS = frozenset(
    {
        "LRScheduler",
        "_LRScheduler",
        "LambdaLR",
        "MultiplicativeLR",
        "SequentialLR",
        "ChainedScheduler",
        "ReduceLROnPlateau",
    }
)
#: Scheduler params and what DeepSpeed's schedulers need of them: "pos_int" (int >= 1),
#: "int", "number", "pos_number" (> 0), "nonneg_number", "lr" (number or list of numbers), "bool".
_SCHEDULER_PARAM_KINDS: dict[str, str] = {
    "warmup_num_steps": "pos_int",
    "total_num_steps": "pos_int",
    "lr_range_test_step_size": "pos_int",
    "last_batch_iteration": "int",
    "warmup_min_lr": "lr",
    "warmup_max_lr": "lr",
    "lr_range_test_min_lr": "lr",
    "cycle_min_lr": "lr",
    "cycle_max_lr": "lr",
    "cycle_min_mom": "lr",
    "cycle_max_mom": "lr",
    "warmup_min_ratio": "nonneg_number",
    "cos_min_ratio": "nonneg_number",
    "lr_range_test_step_rate": "number",
    "decay_lr_rate": "number",
    "decay_mom_rate": "number",
    "decay_step_size": "nonneg_number",
    "cycle_first_step_size": "pos_number",
    "cycle_second_step_size": "nonneg_number",
    "cycle_first_stair_count": "nonneg_number",
    "cycle_second_stair_count": "nonneg_number",
    "lr_range_test_staircase": "bool",
    "cycle_momentum": "bool",
}
#: Optimizer params that must be numbers (lr, eps, ...); betas is checked on its own.
_OPTIMIZER_NUMBERS = _words("lr eps weight_decay momentum dampening alpha lr_decay initial_accumulator_value")
_WARMUP_TYPES = ("log", "linear")

_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
#: zero_optimization integers and their least allowed value (DeepSpeedZeroConfig's bounds).
_ZERO_INT_KEYS = {
    "reduce_bucket_size": 1,
    "allgather_bucket_size": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "sub_group_size": 0,
}
_ZERO_BOOL_KEYS = (
    "overlap_comm",
    "contiguous_gradients",
    "stage3_gather_16bit_weights_on_model_save",
    "reduce_scatter",
    "allgather_partitions",
)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _unknown(key: str, valid: Iterable[str], where: str) -> str:
    close = difflib.get_close_matches(key.split(".")[-1], sorted(valid), n=1)
    hint = f"did you mean `{close[0]}`?" if close else "remove it (see DeepSpeed's config docs)"
    return f"`{key}` is not a known {where} key. HINT: {hint}"


def validate_ds_config(cfg: Any, *, world_size: int | None = None, partial: bool = False) -> list[str]:
    """Every problem in a DeepSpeed config, as one message each (empty list: valid).

    Our own checks (unknown keys with a suggestion, types, leftover "auto", the batch triangle,
    stage/offload combinations, the optimizer and scheduler blocks) run always; when DeepSpeed
    is importable its own config models (ZeRO, fp16, bf16) are run too, without a process group.
    Unknown keys come first.

    Args:
        cfg: The DeepSpeed config dict.
        world_size: The real number of data-parallel ranks, for the batch triangle.
        partial: Check a config that is still to be completed (a base JSON or a preset):
            "auto" values and missing batch sizes are not problems then.
    """
    if not isinstance(cfg, Mapping):
        return [
            f"the DeepSpeed config must be a JSON object, got {type(cfg).__name__}. HINT: wrap it in {{...}}"
        ]
    problems: list[str] = []
    bad_blocks: set[str] = set()

    def bad(block: str, msg: str) -> None:
        problems.append(msg)
        bad_blocks.add(block)

    def wrong(block: str, key: str, value: Any, allowed: str, hint: str) -> None:
        bad(block, str(config_error(key, value, allowed, hint)))

    for key in cfg:
        if key not in TOP_LEVEL_KEYS:
            bad("", _unknown(str(key), TOP_LEVEL_KEYS, "top-level DeepSpeed"))
    if not partial:
        for key in _leftover_autos(cfg):
            bad(
                key.split(".")[0],
                f'`{key}` = "auto" is left over ({_filled_by(key)}); DeepSpeed would drop it silently. '
                "HINT: write a concrete value, or build the file with `ds-engine config --base FILE`",
            )
    for key in _INT_KEYS:
        v = cfg.get(key)
        if v is not None and v != AUTO and (not _is_int(v) or v < 1):
            wrong("", key, v, "expected an integer >= 1", f"set `{key}` to a positive integer")
    clip = cfg.get("gradient_clipping")
    if clip is not None and clip != AUTO and (not _is_number(clip) or clip < 0):
        wrong(
            "",
            "gradient_clipping",
            clip,
            "expected a number >= 0 (0 = off)",
            "set gradient_clipping to 1.0 or 0.0",
        )
    spp = cfg.get("steps_per_print")
    if spp is not None and (not _is_int(spp) or spp < (0 if partial else 1)):  # the builder writes 0 as off
        wrong(
            "",
            "steps_per_print",
            spp,
            "expected an integer >= 1 (DeepSpeed divides by it)",
            f"set steps_per_print to {STEPS_PER_PRINT_OFF} to turn printing off",
        )
    enabled = []
    for block in ("fp16", "bf16", "bfloat16", "activation_checkpointing"):
        b = cfg.get(block)
        if b is None:
            continue
        if not isinstance(b, Mapping):
            wrong(block, block, b, "expected an object", f'write "{block}": {{"enabled": true}}')
            continue
        for sub in b:
            if sub not in BLOCK_KEYS[block]:
                bad(block, _unknown(f"{block}.{sub}", BLOCK_KEYS[block], block))
        if block == "activation_checkpointing":
            continue
        e = b.get("enabled", False)
        if e != AUTO and not isinstance(e, bool):
            wrong(
                block,
                f"{block}.enabled",
                e,
                "expected true or false",
                f"set {block}.enabled to true or false",
            )
        elif e is True:
            enabled.append(block)
    if len(enabled) > 1:
        bad(
            "fp16",
            "`fp16.enabled` and `bf16.enabled` are both true: allowed is at most one half precision. "
            "HINT: set one of them to false",
        )
    _check_zero(cfg, bad, partial=partial)
    _check_optimizer(cfg.get("optimizer"), bad)
    _check_scheduler(cfg.get("scheduler"), bad)
    problems += _triangle_problems(cfg, world_size, partial=partial)
    problems += _deepspeed_model_problems(cfg, bad_blocks)
    return merge_problems(problems)


def _check_zero(cfg: Mapping[str, Any], bad: Callable[[str, str], None], *, partial: bool) -> None:
    """zero_optimization: keys, types, offload blocks and stage/offload combinations (via `bad`).

    With `partial`, rules that need a value the high-level choices may still supply (the stage,
    an NVMe folder) wait for `resolve_engine_config`, which checks them on the merged choices.
    """
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        bad(
            "zero_optimization",
            str(
                config_error(
                    "zero_optimization", zero, "expected an object", 'write "zero_optimization": {"stage": 2}'
                )
            ),
        )
        return
    for key in zero:
        if key not in ZERO_KEYS:
            bad("zero_optimization", _unknown(f"zero_optimization.{key}", ZERO_KEYS, "zero_optimization"))
    stage = zero.get("stage", 0)
    if not _is_int(stage) or not 0 <= stage <= 3:
        bad(
            "zero_optimization",
            str(
                config_error(
                    "zero_optimization.stage",
                    stage,
                    "expected 0, 1, 2 or 3",
                    "set zero_optimization.stage to 0-3",
                )
            ),
        )
        stage = -1
    for key, least in _ZERO_INT_KEYS.items():
        v = zero.get(key)
        if v is not None and v != AUTO and (not _is_int(v) or v < least):
            allowed = "a positive integer" if least else "a non-negative integer"
            bad(
                "zero_optimization",
                str(
                    config_error(
                        f"zero_optimization.{key}",
                        v,
                        f"expected {allowed}",
                        f"write an integer such as {int(5e8)}",
                    )
                ),
            )
    for key in _ZERO_BOOL_KEYS:
        v = zero.get(key)
        if v is not None and not isinstance(v, bool):
            bad(
                "zero_optimization",
                str(
                    config_error(
                        f"zero_optimization.{key}",
                        v,
                        "expected true or false",
                        f"set zero_optimization.{key} to true or false",
                    )
                ),
            )
    devices: dict[str, str] = {}
    for key, valid in OFFLOAD_KEYS.items():
        block = zero.get(key)
        if block is None:
            continue
        dotted = f"zero_optimization.{key}"
        if not isinstance(block, Mapping):
            bad(
                "zero_optimization",
                str(config_error(dotted, block, "expected an object", f'write "{key}": {{"device": "cpu"}}')),
            )
            continue
        for sub in block:
            if sub not in valid:
                bad("zero_optimization", _unknown(f"{dotted}.{sub}", valid, key))
        device = block.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            bad(
                "zero_optimization",
                str(
                    config_error(
                        f"{dotted}.device",
                        device,
                        "expected none, cpu or nvme",
                        f"set {dotted}.device to cpu",
                    )
                ),
            )
            continue
        devices[key] = device
        if device == "nvme" and not block.get("nvme_path") and not partial:
            bad(
                "zero_optimization",
                f'`{dotted}.nvme_path` is required when `{dotted}.device` = "nvme". '
                "HINT: set it to a folder on a local NVMe drive",
            )
    if partial and "stage" not in zero:
        return
    if devices.get("offload_param", "none") != "none" and stage in (0, 1, 2):
        bad(
            "zero_optimization",
            f'`zero_optimization.offload_param.device` = "{devices["offload_param"]}" '
            f"needs `zero_optimization.stage` = 3, got {stage}. HINT: set stage 3 or remove offload_param",
        )
    opt_dev = devices.get("offload_optimizer", "none")
    if opt_dev != "none" and stage == 0:
        bad(
            "zero_optimization",
            f'`zero_optimization.offload_optimizer.device` = "{opt_dev}" needs ZeRO stage '
            "1-3, got 0 (DeepSpeed ignores it). HINT: set zero_optimization.stage to 1, 2 or 3",
        )
    if opt_dev == "nvme" and stage in (1, 2):
        bad(
            "zero_optimization",
            '`zero_optimization.offload_optimizer.device` = "nvme" needs ZeRO stage 3, got '
            f"{stage} (stage 1/2 offload only to cpu). HINT: use device cpu or stage 3",
        )
    return


def _block_head(
    block: Any, name: str, bad: Callable[[str, str], None]
) -> tuple[str, Mapping[str, Any]] | None:
    """The `type` and `params` of an optimizer/scheduler block, or None (problems reported)."""
    if block is None:
        return None
    example = (
        '{"type": "AdamW", "params": {"lr": 1e-5}}'
        if name == "optimizer"
        else ('{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}')
    )
    if not isinstance(block, Mapping):
        bad(name, str(config_error(name, block, "expected an object", f'write "{name}": {example}')))
        return None
    for key in block:
        if key not in BLOCK_KEYS[name]:
            bad(name, _unknown(f"{name}.{key}", BLOCK_KEYS[name], name))
    kind = block.get("type")
    if not isinstance(kind, str):
        shown = "missing" if kind is None else _show(kind)
        bad(
            name,
            f"`{name}.type` is {shown}: allowed is the name of a {name} DeepSpeed knows (without it "
            f'DeepSpeed ignores the block silently). HINT: write "{name}": {example}',
        )
        return None
    params = block.get("params")
    if params is None and name == "scheduler":
        bad(
            name,
            "`scheduler.params` is missing: allowed is an object (DeepSpeed calls the scheduler with "
            '**params and fails without it). HINT: add "params": {} (or the schedule\'s settings)',
        )
        return None
    if params is not None and not isinstance(params, Mapping):
        bad(name, str(config_error(f"{name}.params", params, "expected an object", 'write "params": {...}')))
        return None
    return kind, params or {}


def block_problems(name: str, block: Any) -> list[str]:
    """The problems of a DeepSpeed-native `optimizer` or `scheduler` block ("auto" allowed).

    Args:
        name: "optimizer" or "scheduler".
        block: The block, e.g. {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}.
    """
    found: list[str] = []
    check = _check_optimizer if name == "optimizer" else _check_scheduler
    check(block, lambda _block, msg: found.append(msg))
    return merge_problems(found)


def _check_optimizer(block: Any, bad: Callable[[str, str], None]) -> None:
    """optimizer: type known to DeepSpeed 0.19 (or torch.optim), params an object of numbers."""
    head = _block_head(block, "optimizer", bad)
    if head is None:
        return
    kind, params = head
    known = {n.lower() for n in DEEPSPEED_OPTIMIZERS}
    torch_names = _torch_classes("optim")
    if kind.lower() not in known and kind not in torch_names:
        choices = sorted({*DEEPSPEED_OPTIMIZERS, *torch_names})
        close = difflib.get_close_matches(kind, choices, n=1)
        hint = f"did you mean `{close[0]}`?" if close else "use AdamW"
        bad(
            "optimizer",
            f"`optimizer.type` = {_show(kind)} is not an optimizer DeepSpeed knows: allowed are "
            f"{', '.join(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class. HINT: {hint}",
        )
    elif kind.lower() not in known:  # a torch.optim class: DeepSpeed passes **params to it
        names, _ = _torch_init_params("optim", kind)
        for key in params:
            if key not in names:
                bad("optimizer", _unknown(f"optimizer.params.{key}", names, f"torch.optim.{kind} parameter"))
    for key, value in params.items():
        dotted = f"optimizer.params.{key}"
        if value == AUTO:
            continue
        if key == "max_grad_norm":
            bad(
                "optimizer",
                f"`{dotted}` = {_show(value)} is refused by DeepSpeed: allowed is clipping through the "
                "top-level gradient_clipping. HINT: remove it and set gradient_clipping (Engine: "
                "gradient_clipping=...)",
            )
        elif key == "betas":
            if not (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and all(_is_number(b) and 0 <= b < 1 for b in value)
            ):
                bad(
                    "optimizer",
                    str(config_error(dotted, value, "expected two numbers in [0, 1)", "write [0.9, 0.999]")),
                )
        elif key in _OPTIMIZER_NUMBERS and (not _is_number(value) or value < 0):
            bad(
                "optimizer",
                str(
                    config_error(dotted, value, "expected a finite number >= 0", f"write a number for {key}")
                ),
            )
    return


def _check_scheduler(block: Any, bad: Callable[[str, str], None]) -> None:
    """scheduler: type known to DeepSpeed 0.19 (or torch), params it accepts, values it accepts."""
    head = _block_head(block, "scheduler", bad)
    if head is None:
        return
    kind, params = head
    if kind in DEEPSPEED_SCHEDULERS:
        names, required = DEEPSPEED_SCHEDULERS[kind]
    elif kind in _torch_classes("lr_scheduler"):
        names, required = _torch_init_params("lr_scheduler", kind)
    else:
        choices = sorted({*DEEPSPEED_SCHEDULERS, *_torch_classes("lr_scheduler")})
        close = difflib.get_close_matches(kind, choices, n=1)
        hint = f"did you mean `{close[0]}`?" if close else "use WarmupLR or WarmupDecayLR"
        bad(
            "scheduler",
            f"`scheduler.type` = {_show(kind)} is not a scheduler DeepSpeed can build from JSON: allowed "
            f"are {', '.join(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class taking plain "
            f"values. HINT: {hint}",
        )
        return
    for key in params:
        if key not in names:
            bad("scheduler", _unknown(f"scheduler.params.{key}", names, f"{kind} parameter"))
    for key in sorted(required - set(params)):
        bad(
            "scheduler",
            f'`scheduler.params.{key}` is missing: {kind} requires it. HINT: add "{key}" to scheduler.params',
        )
    for key, value in params.items():
        kind_of_value = _SCHEDULER_PARAM_KINDS.get(key)
        if value == AUTO or kind_of_value is None or key not in names:
            continue
        allowed = _scheduler_value_problem(kind_of_value, value)
        if allowed:
            fix = f"set scheduler.params.{key} to {allowed.removeprefix('expected ')}"
            bad("scheduler", str(config_error(f"scheduler.params.{key}", value, allowed, fix)))
    warmup_type = params.get("warmup_type")
    if "warmup_type" in names and warmup_type is not None and warmup_type not in _WARMUP_TYPES:
        bad(
            "scheduler",
            str(
                config_error(
                    "scheduler.params.warmup_type",
                    warmup_type,
                    "expected log or linear (DeepSpeed silently falls back to log otherwise)",
                    'set scheduler.params.warmup_type to "linear" or "log"',
                )
            ),
        )
    default = " (DeepSpeed's default)" if "warmup_num_steps" not in params else ""
    warmup = params.get("warmup_num_steps", 1000 if "warmup_num_steps" in names else None)
    total = params.get("total_num_steps")
    if _is_int(warmup) and _is_int(total) and warmup >= 1 and total >= 1 and total < warmup:
        bad(
            "scheduler",
            f"`scheduler.params.total_num_steps` = {total} is less than `scheduler.params.warmup_num_steps` "
            f"= {warmup}{default}: allowed is total_num_steps >= warmup_num_steps (DeepSpeed would end the "
            f"schedule inside its warm-up). HINT: set total_num_steps to the run's optimizer steps (at "
            f"least {warmup}) or lower warmup_num_steps",
        )
    return


def _scheduler_value_problem(kind: str, value: Any) -> str | None:
    """None when `value` fits `kind` (see `_SCHEDULER_PARAM_KINDS`), else "expected ..."."""
    if kind == "pos_int":
        ok = _is_int(value) and value >= 1
        return None if ok else "expected an integer >= 1"
    if kind == "int":
        return None if _is_int(value) else "expected an integer"
    if kind == "bool":
        return None if isinstance(value, bool) else "expected true or false"
    if kind == "lr":
        values = value if isinstance(value, list) and value else [value]
        ok = all(_is_number(v) and v >= 0 for v in values)
        return None if ok else "expected a number >= 0 (or a list of them, one per param group)"
    if kind == "pos_number":
        return None if _is_number(value) and value > 0 else "expected a number > 0"
    if kind == "nonneg_number":
        return None if _is_number(value) and value >= 0 else "expected a number >= 0"
    return None if _is_number(value) else "expected a finite number"


def _torch_classes(module: str) -> frozenset[str]:
    """Public class names of `torch.optim` ("optim") or `torch.optim.lr_scheduler` usable from JSON."""
    import torch

    if module == "optim":
        base: type = torch.optim.Optimizer
        namespace: Any = torch.optim
        unusable = _UNUSABLE_TORCH_OPTIMIZERS
    else:
        base = torch.optim.lr_scheduler.LRScheduler
        namespace = torch.optim.lr_scheduler
        unusable = _UNUSABLE_TORCH_SCHEDULERS
    return frozenset(
        name
        for name in dir(namespace)
        if not name.startswith("_")
        and name not in unusable
        and inspect.isclass(getattr(namespace, name))
        and issubclass(getattr(namespace, name), base)
    )


def _torch_init_params(module: str, kind: str) -> tuple[frozenset[str], frozenset[str]]:
    """(parameter names, required names) of a `torch.optim` / `lr_scheduler` class, beyond the first."""
    import torch

    namespace: Any = torch.optim if module == "optim" else torch.optim.lr_scheduler
    first = "params" if module == "optim" else "optimizer"
    signature = inspect.signature(getattr(namespace, kind))
    params = [
        p
        for name, p in signature.parameters.items()
        if name != first and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return (
        frozenset(p.name for p in params),
        frozenset(p.name for p in params if p.default is inspect.Parameter.empty),
    )


def _pos_int(v: Any) -> int | None:
    return v if _is_int(v) and v > 0 else None


def _triangle_problems(cfg: Mapping[str, Any], world_size: int | None, *, partial: bool) -> list[str]:
    tb, mb, ga = (_pos_int(cfg.get(k)) for k in _INT_KEYS)
    if tb is None and mb is None:
        missing = cfg.get("train_batch_size") is None and cfg.get("train_micro_batch_size_per_gpu") is None
        if missing and not partial:
            return [
                "`train_batch_size` and `train_micro_batch_size_per_gpu` are both missing: DeepSpeed needs "
                "one of them. HINT: set train_micro_batch_size_per_gpu"
            ]
        return []
    ws = world_size or 1
    hint = 'HINT: set "train_batch_size": "auto" and let the builder compute it'
    if tb is not None and mb is not None and ga is not None:
        if world_size is not None and tb != mb * ga * world_size:
            return [
                f"`train_batch_size` = {tb} != train_micro_batch_size_per_gpu ({mb}) * "
                f"gradient_accumulation_steps ({ga}) * world_size ({world_size}) = "
                f"{mb * ga * world_size}. {hint}"
            ]
        if world_size is None and tb % (mb * ga):
            return [
                f"`train_batch_size` = {tb} is not a multiple of train_micro_batch_size_per_gpu ({mb}) * "
                f"gradient_accumulation_steps ({ga}). {hint}"
            ]
    elif tb is not None and (mb is not None or ga is not None):
        other = mb if mb is not None else (ga or 1)
        if tb % (other * ws):
            name = "train_micro_batch_size_per_gpu" if mb else "gradient_accumulation_steps"
            return [
                f"`train_batch_size` = {tb} is not divisible by {name} ({other}) * world_size ({ws}). {hint}"
            ]
    return []


def _deepspeed_model_problems(cfg: Mapping[str, Any], bad_blocks: set[str]) -> list[str]:
    """Run DeepSpeed's own pydantic config models on blocks our checks found no fault in."""
    from ds_engine._imports import is_deepspeed_available

    if not is_deepspeed_available():
        return []
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    problems = []
    for key, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("fp16", DeepSpeedFP16Config),
        ("bf16", DeepSpeedBF16Config),
    ):
        block = cfg.get(key)
        if not isinstance(block, Mapping) or key in bad_blocks or _auto_keys(block):
            continue
        try:
            model(**block)
        except Exception as exc:  # pydantic.ValidationError, or an assert/ValueError in a validator
            detail = " ".join(str(exc).split())
            problems.append(
                f"`{key}` is rejected by DeepSpeed's {model.__name__}: {detail}. "
                f"HINT: fix `{key}` as the message says"
            )
    return problems


# --------------------------------------------------------------------------- Engine arguments
def check_engine_arguments(
    config: EngineConfig | str | os.PathLike[str] | Mapping[str, Any] | None,
    choices: Mapping[str, Any],
    *,
    world_size: int,
) -> tuple[EngineConfig, dict[str, Any] | None]:
    """Check what `Engine(config, **choices)` was given, as far as it can be without facts.

    Everything visible before a process group forms is reported in one `ConfigError`: bad or
    misspelt choices, unknown or misspelt JSON keys, wrong types, conflicts between the JSON
    and the choices, impossible stage/offload combinations, bad optimizer/scheduler blocks,
    and the batch triangle against the real world size. "auto" values and a missing micro
    batch size are left to `prepare` (the model, the DataLoader and the optimizer fill them).

    Args:
        config: An `EngineConfig` (the choices merge into its explicit fields), a DeepSpeed
            JSON path, a preset name, a dict, or None.
        choices: The keyword choices (`EngineConfig` fields).
        world_size: The number of data-parallel ranks this run will have.

    Returns:
        The user's choices and the base JSON dict (None when `config` is no JSON).

    Raises:
        ConfigError: Every problem found.
    """
    base: dict[str, Any] | None = None
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None
    if isinstance(config, EngineConfig):
        merged = {name: getattr(config, name) for name in config.explicit_fields}
        merged.update(choices)
        user = EngineConfig.from_kwargs(**merged)
    elif config is None or isinstance(config, (str, os.PathLike, Mapping)):
        if config is not None:
            base, _ = load_base(config)  # a JSON path, a preset name, or a dict
            source = config if not isinstance(config, Mapping) else base
        try:
            user = EngineConfig.from_kwargs(**choices)
        except ConfigError as exc:  # report the JSON's own problems with the choices'
            structural = validate_ds_config(base, world_size=world_size, partial=True) if base else []
            raise ConfigError(*merge_problems(exc.problems, structural)) from None
    else:
        raise ConfigError(
            f"`config` must be an EngineConfig, a JSON path or a dict; got {type(config).__name__}. "
            "HINT: Engine(zero_stage=2) or Engine('ds_config.json')."
        )
    build_ds_config(user, world_size=world_size, base=source, resolve=False)
    return user, base


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


if __name__ == "__main__":
    _main()
