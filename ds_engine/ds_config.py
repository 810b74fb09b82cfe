"""Pure DeepSpeed JSON builder: `EngineConfig` + optional base JSON + facts -> DeepSpeed config dict.

Nothing here starts a process group, and DeepSpeed is imported only inside
`validate_ds_config` (to run DeepSpeed's own config models when it is installed).

Presets live in the top-level `configs/` folder; each one is exactly what `build_ds_config`
writes for `preset_choices()[name]` with `resolve=False`. Regenerate them with::

    python -m ds_engine.ds_config --write-presets
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_engine.config import (
    AUTO,
    OFFLOAD_DEVICES,
    STEPS_PER_PRINT_OFF,
    ConfigError,
    EngineConfig,
    config_error,
    load_json_config,
    resolve_engine_config,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS_DIR = REPO_ROOT / "configs"
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
    """The high-level choices each preset in `configs/` is built from."""
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
    """The JSON file of a preset.

    Args:
        name: One of `PRESETS` (e.g. "zero3_offload").

    Raises:
        ConfigError: `name` is not a preset.
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean `{close[0]}`?" if close else "pick one of the presets or pass a JSON file path"
        raise ConfigError(f"`{name}` is not a preset (allowed: {', '.join(PRESETS)}). HINT: {hint}")
    return PRESETS_DIR / f"{name}.json"


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


def _check_fact(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise config_error(name, value, "expected an integer >= 1", f"pass {name}=<positive int>")


def _micro_batch(
    cfg: EngineConfig, micro_arg: int | None, dataloader: Any, base: Mapping[str, Any], world_size: int
) -> int | None:
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
        raise ConfigError(
            f"`train_micro_batch_size_per_gpu` has contradicting sources: {listed}; allowed is one "
            "per-rank micro batch size. HINT: make the dataloader's batch_size equal the micro batch size"
        )
    if facts:
        return facts[0][1]
    tb = base.get("train_batch_size")
    ga = cfg.gradient_accumulation_steps
    if isinstance(tb, int) and not isinstance(tb, bool) and tb > 0:
        if tb % (ga * world_size):
            raise ConfigError(
                f"`train_batch_size` = {tb} is not divisible by gradient_accumulation_steps ({ga}) * "
                f"world_size ({world_size}); allowed: a multiple of {ga * world_size}. "
                f"HINT: set train_batch_size to {ga * world_size * max(1, tb // (ga * world_size))}"
            )
        return tb // (ga * world_size)
    return None


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

#: What fills each "auto" (used in the leftover-"auto" error).
AUTO_FILLERS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "micro_batch_size= or a dataloader with a batch_size",
    "train_batch_size": "micro batch * gradient_accumulation_steps * world_size",
    "gradient_accumulation_steps": "the gradient_accumulation_steps choice",
    "gradient_clipping": "the gradient_clipping choice",
    "zero_optimization.reduce_bucket_size": "hidden_size**2: pass hidden_size= or model=",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9*hidden_size**2: pass hidden_size= or model=",
    "zero_optimization.stage3_param_persistence_threshold": "10*hidden_size: pass hidden_size= or model=",
    "zero_optimization.offload_optimizer.nvme_path": "the nvme_path choice",
    "zero_optimization.offload_param.nvme_path": "the nvme_path choice",
    "optimizer.params.lr": "the torch optimizer's lr: pass optimizer=",
    "optimizer.params.betas": "the torch optimizer's betas: pass optimizer=",
    "optimizer.params.eps": "the torch optimizer's eps: pass optimizer=",
    "optimizer.params.weight_decay": "the torch optimizer's weight_decay: pass optimizer=",
    "scheduler.params.warmup_max_lr": "the optimizer's lr: pass optimizer= or a concrete optimizer lr",
}


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
        model: A Hugging Face model (its `config` gives the hidden size).
        dataloader: Its `batch_size` gives the micro batch size.
        optimizer: A torch optimizer; its first param group fills "auto" optimizer params.
        resolve: False leaves adaptive values as "auto" and omits unchosen ones (how the
            presets in `configs/` are made); no facts are needed then.

    Returns:
        The DeepSpeed config dict (JSON-serializable, integers where DeepSpeed wants them).

    Raises:
        ConfigError: Conflicts with the base, a leftover "auto", a batch-triangle mismatch, an
            unsupported stage/offload combination, or anything DeepSpeed's config models reject.
    """
    _check_fact("world_size", world_size)
    _check_fact("micro_batch_size", micro_batch_size)
    _check_fact("hidden_size", hidden_size)
    base_dict, where = load_base(base)
    if "bfloat16" in base_dict:  # DeepSpeed's legacy alias of "bf16"
        legacy = base_dict.pop("bfloat16")
        if isinstance(legacy, Mapping):
            base_dict["bf16"] = {**legacy, **base_dict.get("bf16", {})}
    cfg = resolve_engine_config(
        config, base_dict, where=where, defer=_PRESET_DEFER if not resolve else frozenset()
    )
    if not resolve:
        return _render(cfg, base_dict, preset=True)

    micro = _micro_batch(cfg, micro_batch_size, dataloader, base_dict, world_size)
    model_h = hidden_size_from_model(model) if model is not None else None
    if hidden_size is not None and model_h is not None and hidden_size != model_h:
        raise ConfigError(
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
            raise ConfigError(
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
        for key, value in fills.items():
            if zero.get(key) == AUTO:
                zero[key] = value
    _fill_optimizer_autos(out, optimizer)
    leftovers = [k for k in _auto_keys(out)]
    if leftovers:
        parts = [
            f"`{k}` (filled by {AUTO_FILLERS.get(k, 'nothing: set a concrete value')})" for k in leftovers
        ]
        raise ConfigError(
            f'leftover "auto" values that nothing can fill: {"; ".join(parts)}. DeepSpeed would silently '
            "drop them. HINT: pass the facts named above to build_ds_config, or set concrete values"
        )
    problems = validate_ds_config(out, world_size=world_size)
    if problems:
        raise ConfigError("invalid DeepSpeed config: " + " | ".join(problems))
    return out


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

_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ZERO_INT_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
)
_ZERO_BOOL_KEYS = (
    "overlap_comm",
    "contiguous_gradients",
    "stage3_gather_16bit_weights_on_model_save",
    "reduce_scatter",
    "allgather_partitions",
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unknown(key: str, valid: frozenset[str], where: str) -> str:
    close = difflib.get_close_matches(key.split(".")[-1], sorted(valid), n=1)
    hint = f"did you mean `{close[0]}`?" if close else "remove it (see DeepSpeed's config docs)"
    return f"`{key}` is not a known {where} key. HINT: {hint}"


def validate_ds_config(cfg: Any, *, world_size: int | None = None) -> list[str]:
    """Every problem in a DeepSpeed config, as one message each (empty list: valid).

    Our own checks (unknown keys with a suggestion, types, leftover "auto", the batch triangle,
    stage/offload combinations) run always; when DeepSpeed is importable its own config models
    (ZeRO, fp16, bf16) are run too, without a process group.

    Args:
        cfg: The DeepSpeed config dict.
        world_size: The real number of data-parallel ranks, for the batch triangle.
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

    for key in cfg:
        if key not in TOP_LEVEL_KEYS:
            bad("", _unknown(str(key), TOP_LEVEL_KEYS, "top-level DeepSpeed"))
    for key in _auto_keys(cfg):
        filler = AUTO_FILLERS.get(key, "nothing here: set a concrete value")
        bad(
            key.split(".")[0],
            f'`{key}` = "auto" is left over (filled by {filler}). HINT: use ds-engine config '
            "or build_ds_config to resolve it, or write a concrete value",
        )
    for key in _INT_KEYS:
        v = cfg.get(key)
        if v is not None and v != AUTO and (not _is_int(v) or v < 1):
            bad(
                "",
                str(config_error(key, v, "expected an integer >= 1", f"set `{key}` to a positive integer")),
            )
    clip = cfg.get("gradient_clipping")
    if (
        clip is not None
        and clip != AUTO
        and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0)
    ):
        bad(
            "",
            str(
                config_error(
                    "gradient_clipping",
                    clip,
                    "expected a number >= 0 (0 = off)",
                    "set gradient_clipping to 1.0 or 0.0",
                )
            ),
        )
    spp = cfg.get("steps_per_print")
    if spp is not None and (not _is_int(spp) or spp < 1):
        bad(
            "",
            str(
                config_error(
                    "steps_per_print",
                    spp,
                    "expected an integer >= 1 (DeepSpeed divides by it)",
                    f"set steps_per_print to {STEPS_PER_PRINT_OFF} to turn printing off",
                )
            ),
        )
    enabled = []
    for block in ("fp16", "bf16", "bfloat16"):
        b = cfg.get(block)
        if b is None:
            continue
        if not isinstance(b, Mapping):
            bad(
                block,
                str(config_error(block, b, "expected an object", f'write "{block}": {{"enabled": true}}')),
            )
            continue
        e = b.get("enabled", False)
        if e != AUTO and not isinstance(e, bool):
            bad(
                block,
                str(
                    config_error(
                        f"{block}.enabled",
                        e,
                        "expected true or false",
                        f"set {block}.enabled to true or false",
                    )
                ),
            )
        elif e is True:
            enabled.append(block)
    if len(enabled) > 1:
        bad(
            "fp16",
            "`fp16.enabled` and `bf16.enabled` are both true: allowed is at most one half precision. "
            "HINT: set one of them to false",
        )
    zero = cfg.get("zero_optimization", {})
    stage: Any = 0
    if not isinstance(zero, Mapping):
        bad(
            "zero_optimization",
            str(
                config_error(
                    "zero_optimization", zero, "expected an object", 'write "zero_optimization": {"stage": 2}'
                )
            ),
        )
        zero = {}
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
    for key in _ZERO_INT_KEYS:
        v = zero.get(key)
        if v is not None and v != AUTO and (not _is_int(v) or v < 0):
            bad(
                "zero_optimization",
                str(
                    config_error(
                        f"zero_optimization.{key}",
                        v,
                        "expected a non-negative integer",
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
        if device == "nvme" and not block.get("nvme_path"):
            bad(
                "zero_optimization",
                f'`{dotted}.nvme_path` is required when `{dotted}.device` = "nvme". '
                "HINT: set it to a folder on a local NVMe drive",
            )
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
    problems += _triangle_problems(cfg, world_size)
    problems += _deepspeed_model_problems(cfg, bad_blocks)
    return problems


def _pos_int(v: Any) -> int | None:
    return v if _is_int(v) and v > 0 else None


def _triangle_problems(cfg: Mapping[str, Any], world_size: int | None) -> list[str]:
    tb, mb, ga = (_pos_int(cfg.get(k)) for k in _INT_KEYS)
    if tb is None and mb is None:
        if cfg.get("train_batch_size") is None and cfg.get("train_micro_batch_size_per_gpu") is None:
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


# --------------------------------------------------------------------------- preset files
def render_presets() -> dict[str, str]:
    """Preset name -> the exact file text `configs/<name>.json` must hold."""
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
    parser = argparse.ArgumentParser(description="Regenerate the preset JSON files in configs/.")
    parser.add_argument("--write-presets", metavar="DIR", nargs="?", const=str(PRESETS_DIR))
    args = parser.parse_args()
    if args.write_presets:
        for path in write_presets(Path(args.write_presets)):
            print(path)


if __name__ == "__main__":
    _main()
