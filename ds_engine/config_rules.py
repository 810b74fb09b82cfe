"""The rules on high-level choices: each field's allowed values, the cross-field rules, and
where a DeepSpeed JSON carries each choice.

The middle of the config layers (`ds_schema` -> `config_rules` -> `config` -> `ds_config`).
The ZeRO stage/offload rules live here once: `combination_problems` applies them to the
choices (an `EngineConfig`), `json_offload_problems` to a raw DeepSpeed JSON, which is what
`validate_ds_config` checks besides `ds_schema.json_problems`. Needs no `EngineConfig`: the
rules read any object with its fields (`Choices`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ds_engine import ds_blocks
from ds_engine._values import AUTO, _is_int, _is_number, parse_size
from ds_engine.ds_schema import OFFLOAD_DEVICES, STEPS_PER_PRINT_OFF, json_problems
from ds_engine.errors import ConfigError, config_error, first_key, raise_problems
from ds_engine.errors import fmt as _fmt

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")


# --------------------------------------------------------------------------- field checks
# Each check returns None when the value is fine, else "what is allowed".
def _int_check(lo: int, hi: int | None = None, *, auto: bool = False) -> Callable[[Any], str | None]:
    rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
    allowed = f"an integer {rng}" + (' or "auto"' if auto else "")

    def check(v: Any) -> str | None:
        if auto and v == AUTO:
            return None
        if not _is_int(v) or v < lo or (hi is not None and v > hi):
            return allowed
        return None

    return check


def _float_check(lo: float) -> Callable[[Any], str | None]:
    allowed = f"a finite number >= {lo:g}"

    def check(v: Any) -> str | None:
        if not _is_number(v) or v < lo:
            return allowed
        return None

    return check


def _whole_check(lo: int) -> Callable[[Any], str | None]:
    allowed = f"a whole number >= {lo} (DeepSpeed reads it as an integer)"

    def check(v: Any) -> str | None:
        if not _is_number(v) or v < lo or not float(v).is_integer():
            return allowed
        return None

    return check


def _choice_check(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in choices else f"one of {', '.join(choices)}"

    return check


def _budget_check(v: Any) -> str | None:
    if v is None or (_is_int(v) and v >= 1):
        return None
    if isinstance(v, str):
        try:
            parse_size(v)
            return None
        except ValueError:
            pass
    return 'bytes (an integer >= 1) or a size such as "40GB" or "79GiB" (or unset)'


def _optional_int_check(v: Any) -> str | None:
    return None if v is None or (_is_int(v) and v >= 1) else "an integer >= 1 (or unset)"


def _bool_check(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _optional_str_check(v: Any) -> str | None:
    return None if v is None or (isinstance(v, str) and v) else "a non-empty path string (or unset)"


def _block_check(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, Mapping) or not isinstance(v.get("type"), str):
        return 'a DeepSpeed block {"type": "...", "params": {...}} (or unset)'
    if "params" in v and not isinstance(v["params"], Mapping):
        return 'a DeepSpeed block whose "params" is an object'
    return None


#: EngineConfig field -> its check: None when a value is allowed, else what is allowed.
FIELD_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "zero_stage": _int_check(0, 3, auto=True),
    "precision": _choice_check(PRECISIONS),
    "gradient_accumulation_steps": _int_check(1),
    "gradient_clipping": _float_check(0.0),
    "micro_batch_size": _int_check(1, auto=True),
    "offload_optimizer": _choice_check((*OFFLOAD_DEVICES, AUTO)),
    "offload_params": _choice_check((*OFFLOAD_DEVICES, AUTO)),
    "nvme_path": _optional_str_check,
    "pin_memory": _bool_check,
    "loss_scale": _float_check(0.0),
    "initial_scale_power": _int_check(0, 64),
    "loss_scale_window": _int_check(1),
    "hysteresis": _int_check(1),
    "min_loss_scale": _whole_check(1),
    "bf16_check_grad_overflow": _bool_check,
    "overlap_comm": _bool_check,
    "contiguous_gradients": _bool_check,
    "reduce_bucket_size": _int_check(1, auto=True),
    "allgather_bucket_size": _int_check(1),
    "stage3_prefetch_bucket_size": _int_check(0, auto=True),
    "stage3_param_persistence_threshold": _int_check(0, auto=True),
    "stage3_max_live_parameters": _int_check(0),
    "stage3_max_reuse_distance": _int_check(0),
    "stage3_gather_16bit_weights_on_model_save": _bool_check,
    "activation_checkpointing": _bool_check,
    "activation_checkpointing_partition": _bool_check,
    "activation_checkpointing_cpu": _bool_check,
    "optimizer": _block_check,
    "scheduler": _block_check,
    "coalesce_grad_reduction": _bool_check,
    "skip_nonfinite_steps": _bool_check,
    "steps_per_print": _int_check(0),
    "max_consecutive_skipped_steps": _int_check(0),
    "dist_timeout_s": _int_check(1),
    "hang_timeout_s": _int_check(0),
    "seq_len": _optional_int_check,
    "memory_budget": _budget_check,
    "memory_margin": _float_check(0.0),
}

_FLOAT_FIELDS = frozenset({"gradient_clipping", "loss_scale", "min_loss_scale", "memory_margin"})
#: Fields whose "auto" is a choice made at `prepare` (`auto_stage`): an "auto" in a DeepSpeed JSON
#: for them is filled by the choice instead, as before.
_CHOSEN_AT_PREPARE = frozenset({"zero_stage", "offload_optimizer", "offload_params"})
_JSON_CHECKS = {
    "zero_stage": _int_check(0, 3),
    "offload_optimizer": _choice_check(OFFLOAD_DEVICES),
    "offload_params": _choice_check(OFFLOAD_DEVICES),
}
#: Fields only the "auto" stage/offload choice reads.
AUTO_STAGE_FIELDS = ("seq_len", "memory_budget", "memory_margin")


def check_field(name: str, value: Any, *, key: str | None = None, where: str = "") -> Any:
    """Validate one `EngineConfig` field value; return it normalized (floats as float).

    Args:
        name: The `EngineConfig` field name.
        value: The candidate value.
        key: The name to report (e.g. the dotted DeepSpeed key it came from); defaults to `name`.
        where: Where the value came from (a file name), added to the message.

    Raises:
        ConfigError: The value is not allowed for the field.
    """
    from_json = key is not None and key != name  # a DeepSpeed JSON's stage and devices are never "auto"
    problem = (_JSON_CHECKS.get(name, FIELD_CHECKS[name]) if from_json else FIELD_CHECKS[name])(value)
    if problem is not None:
        shown = key or name
        raise config_error(shown, value, f"expected {problem}", f"set `{shown}` to {problem}", where=where)
    if name in _FLOAT_FIELDS:
        return float(value)
    if name in ("optimizer", "scheduler") and value is not None:
        raise_problems(ds_blocks.block_problems(name, value))
        return json.loads(json.dumps(dict(value)))  # a private, JSON-clean copy
    return value


# --------------------------------------------------------------------------- combinations
class Choices(Protocol):
    """What the cross-field rules read of the choices (an `EngineConfig`)."""

    @property
    def zero_stage(self) -> int | str: ...
    @property
    def precision(self) -> str: ...
    @property
    def offload_optimizer(self) -> str: ...
    @property
    def offload_params(self) -> str: ...
    @property
    def nvme_path(self) -> str | None: ...
    @property
    def activation_checkpointing(self) -> bool: ...
    @property
    def activation_checkpointing_partition(self) -> bool: ...
    @property
    def activation_checkpointing_cpu(self) -> bool: ...
    @property
    def explicit_fields(self) -> frozenset[str]: ...


Problem = tuple[frozenset[str], str]
"""A broken rule: (the fields involved, the message)."""


def _offload_stage_rules(
    stage: int, offload_optimizer: str, offload_params: str, shown: Mapping[str, str]
) -> list[Problem]:
    """Which ZeRO stage each offload needs (DeepSpeed 0.19 is the reference)."""

    def k(field: str) -> str:
        return shown.get(field, field)

    out: list[Problem] = []
    if offload_params != "none" and stage != 3:
        out.append(
            (
                frozenset({"offload_params", "zero_stage"}),
                f"`{k('offload_params')}` = {_fmt(offload_params)} needs ZeRO stage 3, got "
                f"`{k('zero_stage')}` = {stage}: only ZeRO-3 partitions parameters. "
                'HINT: set zero_stage=3 or offload_params="none"',
            )
        )
    if offload_optimizer != "none" and stage == 0:
        out.append(
            (
                frozenset({"offload_optimizer", "zero_stage"}),
                f"`{k('offload_optimizer')}` = {_fmt(offload_optimizer)} needs ZeRO stage 1-3, got "
                f"`{k('zero_stage')}` = 0 (DeepSpeed ignores offload without ZeRO). "
                "HINT: set zero_stage=1, 2 or 3",
            )
        )
    if offload_optimizer == "nvme" and stage in (1, 2):
        out.append(
            (
                frozenset({"offload_optimizer", "zero_stage"}),
                f'`{k("offload_optimizer")}` = "nvme" needs ZeRO stage 3 (ZeRO-Infinity), got '
                f"`{k('zero_stage')}` = {stage}: DeepSpeed's stage 1/2 optimizer can only offload to cpu. "
                'HINT: set offload_optimizer="cpu" or zero_stage=3',
            )
        )
    return out


def _nvme_path_rule(name: str, device: str, nvme_path: Any, shown: Mapping[str, str]) -> list[Problem]:
    """An NVMe offload (`name`: offload_optimizer or offload_params) needs a folder."""
    if device != "nvme" or nvme_path:
        return []

    def k(field: str) -> str:
        return shown.get(field, field)

    return [
        (
            frozenset({name, "nvme_path"}),
            f'`{k("nvme_path")}` is required when `{k(name)}` = "nvme" (allowed: a folder on a fast local '
            'NVMe drive). HINT: pass nvme_path="/local_nvme/ds_swap"',
        )
    ]


def combination_problems(cfg: Choices, shown: Mapping[str, str] | None = None) -> list[Problem]:
    """Cross-field rules as (fields involved, message); DeepSpeed 0.19 support is the reference.

    Args:
        cfg: The choices to check.
        shown: Field -> the DeepSpeed JSON key its value came from, so a message names the key
            the user wrote (fields not in it are named as themselves).
    """
    names = dict(shown or {})

    def k(field: str) -> str:
        return names.get(field, field)

    stage = cfg.zero_stage
    out = _auto_rules(cfg)
    if stage != AUTO:  # "auto" picks a stage that fits the offloads (auto_stage)
        devices = ["none" if d == AUTO else d for d in (cfg.offload_optimizer, cfg.offload_params)]
        out += _offload_stage_rules(int(stage), devices[0], devices[1], names)
    for name in ("offload_optimizer", "offload_params"):
        out += _nvme_path_rule(name, getattr(cfg, name), cfg.nvme_path, names)

    def problem(fields: set[str], *parts: str) -> None:
        out.append((frozenset(fields), "".join(parts)))

    if cfg.activation_checkpointing_cpu and not cfg.activation_checkpointing_partition:
        problem(
            {"activation_checkpointing_cpu", "activation_checkpointing_partition"},
            f"`{k('activation_checkpointing_cpu')}` = true needs "
            f"`{k('activation_checkpointing_partition')}` = true "
            "(DeepSpeed moves only partitioned activations to CPU). "
            "HINT: set activation_checkpointing_partition=True",
        )
    for name in ("activation_checkpointing_partition", "activation_checkpointing_cpu"):
        if getattr(cfg, name) and not cfg.activation_checkpointing:
            problem(
                {name, "activation_checkpointing"},
                f"`{k(name)}` = true has no effect while `activation_checkpointing` = false. "
                "HINT: set activation_checkpointing=True",
            )
    if stage not in (3, AUTO):
        for name in _STAGE3_FIELDS:
            if name in cfg.explicit_fields:
                problem(
                    {name, "zero_stage"},
                    f"`{name}` = {_fmt(getattr(cfg, name))} applies only to ZeRO stage 3, got "
                    f"`{k('zero_stage')}` = {stage}. HINT: drop `{name}` or set zero_stage=3",
                )
    if cfg.precision != "fp16":
        for name in _FP16_FIELDS:
            if name in cfg.explicit_fields:
                problem(
                    {name, "precision"},
                    f'`{name}` = {_fmt(getattr(cfg, name))} applies only to precision "fp16", got '
                    f'`precision` = {_fmt(cfg.precision)}. HINT: drop `{name}` or set precision="fp16"',
                )
    return out


def _auto_rules(cfg: Choices) -> list[Problem]:
    """An "auto" stage or offload needs `seq_len`; the planner never chooses NVMe (a stage for it
    must be given). (`auto_stage.settle` refuses the budget fields without an "auto".)"""
    autos = [n for n in ("zero_stage", "offload_optimizer", "offload_params") if getattr(cfg, n) == AUTO]
    out: list[Problem] = []
    if autos and getattr(cfg, "seq_len", None) is None:
        out.append(
            (
                frozenset({autos[0], "seq_len"}),
                f'`{autos[0]}` = "auto" needs `seq_len` (tokens per sequence) to estimate the activations, '
                "got none. HINT: pass seq_len=<the longest sequence a batch holds>, e.g. seq_len=2048",
            )
        )
    nvme = [n for n in ("offload_optimizer", "offload_params") if getattr(cfg, n) == "nvme"]
    if cfg.zero_stage == AUTO and nvme:
        out.append(
            (
                frozenset({"zero_stage", nvme[0]}),
                f'`{nvme[0]}` = "nvme" with `zero_stage` = "auto": the planner does not consider NVMe '
                "offload (it needs ZeRO-3). HINT: set zero_stage=3",
            )
        )
    return out


_STAGE3_FIELDS = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
_FP16_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def check_combinations(
    cfg: Choices,
    *,
    only_explicit: bool,
    defer: frozenset[str] = frozenset(),
    shown: Mapping[str, str] | None = None,
) -> None:
    """Raise every broken cross-field rule (see `combination_problems`) in one `ConfigError`.

    Args:
        cfg: The choices.
        only_explicit: Only rules whose fields were all chosen explicitly (a field left at its
            default may still be filled by a base JSON).
        defer: Fields filled later: rules on them wait.
        shown: Field -> the JSON key its value came from (for messages).
    """
    problems = [p for p in combination_problems(cfg, shown) if not p[0] & defer]
    if only_explicit:
        problems = [p for p in problems if p[0] <= cfg.explicit_fields]
    raise_problems(msg for _, msg in problems)


#: EngineConfig offload field -> its block in `zero_optimization`.
_OFFLOAD_BLOCKS = {"offload_optimizer": "offload_optimizer", "offload_params": "offload_param"}


def json_offload_problems(cfg: Mapping[str, Any], partial: bool) -> list[str]:
    """The ZeRO stage/offload rules on a raw DeepSpeed JSON, naming its keys.

    Values the JSON check already found malformed (a stage outside 0-3, an unknown device, an
    offload block that is no object) are left to that check. With `partial` (a base JSON the
    choices complete), a missing stage and NVMe folder are not problems: the choices may give them.
    """
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return []
    devices: dict[str, str] = {}
    paths: dict[str, Any] = {}
    for name, block_key in _OFFLOAD_BLOCKS.items():
        block = zero.get(block_key)
        if isinstance(block, Mapping) and block.get("device", "none") in OFFLOAD_DEVICES:
            devices[name] = block.get("device", "none")
            paths[name] = block.get("nvme_path")
    out: list[Problem] = []
    if not partial:
        for name, device in devices.items():
            dotted = f"zero_optimization.{_OFFLOAD_BLOCKS[name]}"
            keys = {name: f"{dotted}.device", "nvme_path": f"{dotted}.nvme_path"}
            out += _nvme_path_rule(name, device, paths[name], keys)
    stage = zero.get("stage", 0)
    if _is_int(stage) and 0 <= stage <= 3 and not (partial and "stage" not in zero):
        keys = {"zero_stage": "zero_optimization.stage"}
        keys.update({n: f"zero_optimization.{b}.device" for n, b in _OFFLOAD_BLOCKS.items()})
        out += _offload_stage_rules(
            stage,
            devices.get("offload_optimizer", "none"),
            devices.get("offload_params", "none"),
            keys,
        )
    return [msg for _, msg in out]


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
            "auto" values, missing batch sizes, a missing stage or NVMe folder are not problems then.
    """
    return json_problems(cfg, world_size=world_size, partial=partial, zero_rules=json_offload_problems)


# --------------------------------------------------------------------------- base merge
def _get(d: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


_MISSING = object()

#: EngineConfig field -> the DeepSpeed JSON key(s) that carry it (first present wins).
BASE_KEYS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization.stage",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "gradient_clipping": ("gradient_clipping",),
    "micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "offload_optimizer": ("zero_optimization.offload_optimizer.device",),
    "offload_params": ("zero_optimization.offload_param.device",),
    "loss_scale": ("fp16.loss_scale",),
    "initial_scale_power": ("fp16.initial_scale_power",),
    "loss_scale_window": ("fp16.loss_scale_window",),
    "hysteresis": ("fp16.hysteresis",),
    "min_loss_scale": ("fp16.min_loss_scale",),
    "bf16_check_grad_overflow": ("bf16.check_grad_overflow", "bfloat16.check_grad_overflow"),
    "overlap_comm": ("zero_optimization.overlap_comm",),
    "contiguous_gradients": ("zero_optimization.contiguous_gradients",),
    "reduce_bucket_size": ("zero_optimization.reduce_bucket_size",),
    "allgather_bucket_size": ("zero_optimization.allgather_bucket_size",),
    "stage3_prefetch_bucket_size": ("zero_optimization.stage3_prefetch_bucket_size",),
    "stage3_param_persistence_threshold": ("zero_optimization.stage3_param_persistence_threshold",),
    "stage3_max_live_parameters": ("zero_optimization.stage3_max_live_parameters",),
    "stage3_max_reuse_distance": ("zero_optimization.stage3_max_reuse_distance",),
    "stage3_gather_16bit_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ),
    "activation_checkpointing_partition": ("activation_checkpointing.partition_activations",),
    "activation_checkpointing_cpu": ("activation_checkpointing.cpu_checkpointing",),
    "optimizer": ("optimizer",),
    "scheduler": ("scheduler",),
    "steps_per_print": ("steps_per_print",),
}

#: steps_per_print values at or above this mean "off" (the builder writes this for 0).


def _nvme_path_from_base(base: Mapping[str, Any]) -> tuple[str, Any]:
    for key in ("zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"):
        value = _get(base, key)
        if value is not _MISSING and value is not None and value != AUTO:
            return key, value
    return "", _MISSING


def _pin_memory_from_base(base: Mapping[str, Any]) -> tuple[str, Any]:
    for key in (
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_param.pin_memory",
    ):
        value = _get(base, key)
        if value is not _MISSING and value != AUTO:
            return key, value
    return "", _MISSING


def _precision_from_base(base: Mapping[str, Any], where: str, problems: list[str]) -> tuple[str, Any]:
    enabled = {}
    for block in ("fp16", "bf16", "bfloat16"):
        value = _get(base, f"{block}.enabled")
        if value is _MISSING or value == AUTO:
            continue
        if not isinstance(value, bool):
            problems.append(
                str(
                    config_error(
                        f"{block}.enabled",
                        value,
                        'expected true, false or "auto"',
                        f'set "{block}": {{"enabled": true}} or false',
                        where=where,
                    )
                )
            )
            continue
        enabled[block] = value
    on = [b for b, v in enabled.items() if v]
    if len(on) > 1:
        problems.append(
            f"`fp16.enabled` and `bf16.enabled` are both true{f' (in {where})' if where else ''}: allowed is "
            "at most one half precision. HINT: keep one of them and set the other to false"
        )
        return "", _MISSING
    if on:
        return f"{on[0]}.enabled", "fp16" if on[0] == "fp16" else "bf16"
    if enabled:  # every present block says false
        return next(f"{b}.enabled" for b in enabled), "fp32"
    return "", _MISSING


def base_values(
    base: Mapping[str, Any], *, where: str = "", problems: list[str] | None = None
) -> dict[str, tuple[str, Any]]:
    """The `EngineConfig` values a DeepSpeed JSON sets: field -> (dotted key, validated value).

    "auto" values are left out (the high-level choice fills them), except for fields that
    accept "auto" themselves (micro batch and bucket sizes).

    Args:
        base: The loaded DeepSpeed JSON.
        where: Its file name, for messages.
        problems: Where to append a message for every invalid value (those fields are left
            out of the result); without it the first invalid value raises.

    Raises:
        ConfigError: An invalid value, when `problems` is None (all of them, in one error).
    """
    collected: list[str] = []
    found: dict[str, tuple[str, Any]] = {}

    def take(name: str, key: str, value: Any) -> None:
        try:
            found[name] = (key, check_field(name, value, key=key, where=where))
        except ConfigError as exc:
            collected.extend(exc.problems)

    for name, keys in BASE_KEYS.items():
        for key in keys:
            value = _get(base, key)
            if value is _MISSING:
                continue
            if value == AUTO and (FIELD_CHECKS[name](AUTO) is not None or name in _CHOSEN_AT_PREPARE):
                break  # "auto" for a field that cannot be auto: filled by the choice
            if name == "steps_per_print" and _is_int(value) and value >= STEPS_PER_PRINT_OFF:
                value = 0
            take(name, key, value)
            break
    key, prec = _precision_from_base(base, where, collected)
    if prec is not _MISSING:
        found["precision"] = (key, prec)
    key, path = _nvme_path_from_base(base)
    if path is not _MISSING:
        take("nvme_path", key, path)
    key, pin = _pin_memory_from_base(base)
    if pin is not _MISSING:
        take("pin_memory", key, pin)
    ac = _get(base, "activation_checkpointing")
    if isinstance(ac, Mapping):
        found["activation_checkpointing"] = ("activation_checkpointing", True)
    if problems is None:
        raise_problems(collected)
    else:
        problems.extend(collected)
    return found


def fields_of_bad_base_values(problems: list[str]) -> frozenset[str]:
    """The `EngineConfig` fields whose base keys are named in `problems` (their rules wait)."""
    named = {key for key in map(first_key, problems) if key is not None}
    fields = {name for name, keys in BASE_KEYS.items() if named & set(keys)}
    if named & {"fp16.enabled", "bf16.enabled", "bfloat16.enabled"}:
        fields.add("precision")
    if any(k.endswith(".nvme_path") for k in named):
        fields.add("nvme_path")
    return frozenset(fields)


def equal(a: Any, b: Any) -> bool:
    """A base value equals a choice (numbers by value, booleans only to booleans)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_number(a) and _is_number(b):
        return float(a) == float(b)
    return bool(a == b)


__all__ = [
    "AUTO_STAGE_FIELDS",
    "BASE_KEYS",
    "FIELD_CHECKS",
    "PRECISIONS",
    "Choices",
    "base_values",
    "check_combinations",
    "check_field",
    "combination_problems",
    "equal",
    "fields_of_bad_base_values",
    "json_offload_problems",
    "validate_ds_config",
]
