"""What ds_engine knows about DeepSpeed's JSON config, needing nothing but the JSON.

Config layers, bottom first: `_values`, `errors` -> `ds_blocks` -> `ds_schema` (this module)
-> `config_rules` -> `config` -> `ds_config`. Here: the keys DeepSpeed 0.19 knows in each
block, their types, what fills each "auto", the batch triangle, DeepSpeed's own config models,
loading a JSON file, and the presets shipped as package data (`ds_engine/configs/*.json`,
found with `importlib.resources`, so an installed wheel has them too). `json_problems` checks
a raw JSON; `config_rules.validate_ds_config` adds the ZeRO stage/offload rules, which live
once, with the high-level choices.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from ds_engine import ds_blocks
from ds_engine._values import AUTO, _is_int, _is_number, no_duplicate_keys, read_regular_file, words
from ds_engine.errors import ConfigError, config_error, merge_problems, unknown_key

#: ZeRO offload devices (`zero_optimization.offload_*.device`).
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
#: steps_per_print values at or above this mean "off" (the builder writes this for 0).
STEPS_PER_PRINT_OFF = 2**31 - 1

# --------------------------------------------------------------------------- presets
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


#: Largest DeepSpeed JSON file read (a real one is a few KB).
MAX_JSON_CONFIG_BYTES = 16 * 2**20


def load_json_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Load a DeepSpeed JSON config from a path, or copy a mapping.

    Args:
        source: A path to a JSON file (data only, never code) or an already-loaded mapping.

    Returns:
        A deep copy of the JSON object.

    Raises:
        ConfigError: Missing file, corrupt JSON (with line/column) or a non-object top level.
    """
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source)))
    if not isinstance(source, (str, os.PathLike)):
        raise config_error(
            "base", source, "expected a JSON file path or a dict", 'pass base="ds_config.json" or a dict'
        )
    path = Path(source)
    try:  # a regular file of bounded size: a FIFO or /dev/zero given by mistake never hangs
        text = read_regular_file(
            path, MAX_JSON_CONFIG_BYTES, f"DeepSpeed config file `{path}`", "pass a readable UTF-8 JSON file"
        ).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"DeepSpeed config file `{path}` does not exist. "
            "HINT: check the path, or pass a preset name such as zero2"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config file `{path}` cannot be read ({exc}). HINT: pass a readable UTF-8 JSON file"
        ) from None
    except ValueError as exc:  # not a regular file, too large, unreadable
        raise ConfigError(str(exc)) from None
    try:
        data = json.loads(text, object_pairs_hook=no_duplicate_keys(f"DeepSpeed config file `{path}`"))
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config file `{path}` is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}. HINT: fix the JSON there (no comments or trailing commas)"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"DeepSpeed config file `{path}` nests too deeply to read. HINT: pass a DeepSpeed JSON config"
        ) from None
    except ValueError as exc:  # a key written twice (no_duplicate_keys)
        raise ConfigError(str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"DeepSpeed config file `{path}` must hold a JSON object at the top level, got "
            f"{type(data).__name__}. HINT: wrap the settings in {{...}}"
        )
    return data


# --------------------------------------------------------------------------- "auto"
#: DeepSpeed 0.19's own defaults (DeepSpeedZeroConfig) for the bucket sizes ds_engine derives
#: from the hidden size; used where no hidden size is known and the user did not ask for one.
DEEPSPEED_BUCKET_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


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


def leftover_problem(key: str) -> str:
    """The problem for an "auto" at `key` that nothing filled: what fills it, and the one fix."""
    filler, hint = AUTO_FILLERS.get(key, _NO_FILLER)
    why = "nothing fills it" if filler is None else f"it is filled by {filler}, which nothing gave here"
    return f'`{key}` = "auto" is left over: {why}; DeepSpeed would drop it silently. HINT: {hint}'


def leftover_autos(cfg: Mapping[str, Any]) -> list[str]:
    """The "auto" keys to report: none inside unknown blocks, and one for an unknown micro batch."""
    keys = [k for k in auto_keys(cfg) if k.split(".")[0] in TOP_LEVEL_KEYS]
    if "train_micro_batch_size_per_gpu" in keys:  # train_batch_size follows from it: one cause
        keys = [k for k in keys if k != "train_batch_size"]
    return keys


def auto_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys under `node` whose value is "auto" (list items as `key[i]`)."""
    if isinstance(node, Mapping):
        found = []
        for key, value in node.items():
            found += auto_keys(value, f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in auto_keys(v, f"{prefix}[{i}]")]
    return [prefix] if node == AUTO else []


def normalized(base: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with DeepSpeed's legacy `bfloat16` block merged into `bf16` (bf16 wins)."""
    out = copy.deepcopy(dict(base))
    if isinstance(out.get("bfloat16"), Mapping):
        legacy = out.pop("bfloat16")
        bf16 = out.get("bf16")
        out["bf16"] = {**legacy, **(bf16 if isinstance(bf16, Mapping) else {})}
    return out


def misshapen_blocks(base: Mapping[str, Any]) -> list[str]:
    """The blocks of `base` that must be JSON objects for the choices to merge in, but are not."""
    bad = [k for k in _OBJECT_BLOCKS if k in base and not isinstance(base[k], Mapping)]
    zero = base.get("zero_optimization")
    if isinstance(zero, Mapping):
        bad += [
            f"zero_optimization.{k}" for k in OFFLOAD_KEYS if k in zero and not isinstance(zero[k], Mapping)
        ]
    return bad


_OBJECT_BLOCKS = ("zero_optimization", "fp16", "bf16", "activation_checkpointing", "optimizer", "scheduler")


# --------------------------------------------------------------------------- keys
#: DeepSpeed 0.19 top-level config keys.
TOP_LEVEL_KEYS = words(
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
ZERO_KEYS = words(
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
    "offload_optimizer": words(
        "buffer_count cpuadam_cores_perc device fast_init nvme_path pin_memory pipeline_read "
        "pipeline_write ratio super_offload"
    ),
    "offload_param": words("buffer_count buffer_size device max_in_cpu nvme_path pin_memory"),
}

#: DeepSpeed 0.19 `fp16` / `bf16` / `activation_checkpointing` / `optimizer` / `scheduler` keys.
BLOCK_KEYS: dict[str, frozenset[str]] = {
    "fp16": words(
        "enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis "
        "consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads"
    ),
    "bf16": words(
        "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
        "bf16_optimizer_states"
    ),
    "activation_checkpointing": words(
        "partition_activations contiguous_memory_optimization cpu_checkpointing number_checkpoints "
        "synchronize_checkpoint_boundary profile"
    ),
    **ds_blocks.KEYS,
}
BLOCK_KEYS["bfloat16"] = BLOCK_KEYS["bf16"]

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


# --------------------------------------------------------------------------- checks
#: The ZeRO stage/offload rules, given from above (`config_rules.json_offload_problems`):
#: (the JSON, partial) -> problems. They live once, with the high-level choices.
ZeroRules = Callable[[Mapping[str, Any], bool], list[str]]


def json_problems(
    cfg: Any, *, world_size: int | None = None, partial: bool = False, zero_rules: ZeroRules | None = None
) -> list[str]:
    """Every problem in a DeepSpeed config that the JSON alone shows, one message each.

    Our own checks (unknown keys with a suggestion, types, leftover "auto", the batch triangle,
    the optimizer and scheduler blocks) run always, and `zero_rules` on the ZeRO block; when
    DeepSpeed is importable its own config models (ZeRO, fp16, bf16) are run too, on blocks
    with no problem of ours, without a process group. Unknown keys come first.
    `config_rules.validate_ds_config` is this with the stage/offload rules.

    Args:
        cfg: The DeepSpeed config dict.
        world_size: The real number of data-parallel ranks, for the batch triangle.
        partial: Check a config that is still to be completed (a base JSON or a preset):
            "auto" values and missing batch sizes are not problems then.
        zero_rules: The ZeRO stage/offload rules (None: not checked).
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
            bad("", unknown_key(str(key), TOP_LEVEL_KEYS, "top-level DeepSpeed"))
    if not partial:
        for key in leftover_autos(cfg):
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
                bad(block, unknown_key(f"{block}.{sub}", BLOCK_KEYS[block], block))
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
    _check_zero(cfg, bad)
    if zero_rules is not None:
        for msg in zero_rules(cfg, partial):
            bad("zero_optimization", msg)
    for name in ("optimizer", "scheduler"):
        ds_blocks.check_block(name, cfg.get(name), bad)
    problems += triangle_problems(cfg, world_size, partial=partial)
    problems += deepspeed_model_problems(cfg, bad_blocks)
    return merge_problems(problems)


def _check_zero(cfg: Mapping[str, Any], bad: Callable[[str, str], None]) -> None:
    """zero_optimization: keys, types and offload blocks (via `bad`); the stage/offload
    combinations are `zero_rules` (see `json_problems`)."""
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
            bad("zero_optimization", unknown_key(f"zero_optimization.{key}", ZERO_KEYS, "zero_optimization"))
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
                bad("zero_optimization", unknown_key(f"{dotted}.{sub}", valid, key))
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


def _pos_int(v: Any) -> int | None:
    return v if _is_int(v) and v > 0 else None


def triangle_problems(cfg: Mapping[str, Any], world_size: int | None, *, partial: bool) -> list[str]:
    """The batch triangle: train_batch_size == micro batch * gradient_accumulation_steps * world size."""
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


def deepspeed_model_problems(cfg: Mapping[str, Any], bad_blocks: set[str]) -> list[str]:
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
        if not isinstance(block, Mapping) or key in bad_blocks or auto_keys(block):
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


__all__ = [
    "AUTO_FILLERS",
    "BLOCK_KEYS",
    "DEEPSPEED_BUCKET_DEFAULTS",
    "OFFLOAD_DEVICES",
    "OFFLOAD_KEYS",
    "PRESETS",
    "PRESETS_DIR",
    "STEPS_PER_PRINT_OFF",
    "TOP_LEVEL_KEYS",
    "ZERO_KEYS",
    "ZeroRules",
    "auto_keys",
    "deepspeed_model_problems",
    "json_problems",
    "leftover_autos",
    "leftover_problem",
    "load_base",
    "load_json_config",
    "misshapen_blocks",
    "normalized",
    "preset_path",
    "triangle_problems",
]
