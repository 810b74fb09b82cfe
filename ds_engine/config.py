"""High-level training choices: `EngineConfig`, its validation, and merging a DeepSpeed JSON base.

`EngineConfig` is the one config object that flows through ds_engine. It knows which of its
fields the user passed explicitly (`explicit_fields`): a DeepSpeed JSON `base` may fill any
field the user left at its default, but a base value that contradicts an explicit choice is a
`ConfigError` (no silent winner). `resolve_engine_config` performs that merge.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Precision = Literal["fp32", "fp16", "bf16"]
OffloadDevice = Literal["none", "cpu", "nvme"]

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
AUTO = "auto"


class ConfigError(ValueError):
    """Configuration mistakes: each names the key, the value, what is allowed, and one fix (`HINT:`).

    One error carries every problem that could be seen at once (`problems`); its message is
    the single problem, or a header with their count followed by one problem per line.

    Args:
        *problems: One message per problem, each in the shape above.
    """

    def __init__(self, *problems: str) -> None:
        self.problems: tuple[str, ...] = tuple(str(p) for p in problems)
        super().__init__(_format_problems(self.problems))


def _format_problems(problems: tuple[str, ...]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} configuration problems:\n  - " + "\n  - ".join(problems)


_KEY = re.compile(r"`([^`]+)`")

#: DeepSpeed JSON keys that carry the same setting as an `EngineConfig` field (for de-duplication).
_SAME_SETTING = {
    "zero_optimization.offload_param.device": "offload_params",
    "zero_optimization.offload_optimizer.device": "offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "nvme_path",
    "zero_optimization.offload_param.nvme_path": "nvme_path",
    "zero_optimization.stage": "zero_stage",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
}


def _problem_key(problem: str) -> str | None:
    match = _KEY.search(problem)
    if match is None:
        return None
    key = match.group(1)
    return _SAME_SETTING.get(key, key)


def is_unknown_key_problem(problem: str) -> bool:
    """True for a problem that reports a misspelt or unknown key (these are listed first)."""
    return " is not a known " in problem


def merge_problems(*groups: Any) -> list[str]:
    """Every problem of `groups` once: unknown keys first, then the rest in the given order.

    A problem about a key (its first `backticked` name, with DeepSpeed keys mapped to the
    `EngineConfig` field they carry) that an earlier problem already reported is dropped, so
    the same mistake seen by two checks is reported once.

    Args:
        *groups: Iterables of problem messages, most specific check first.
    """
    flat = [str(p) for group in groups for p in group]
    ordered = [p for p in flat if is_unknown_key_problem(p)] + [
        p for p in flat if not is_unknown_key_problem(p)
    ]
    seen_keys: set[str] = set()
    out: list[str] = []
    for problem in ordered:
        key = _problem_key(problem)
        if problem in out or (key is not None and key in seen_keys):
            continue
        out.append(problem)
        if key is not None:
            seen_keys.add(key)
    return out


def raise_problems(*groups: Any) -> None:
    """Raise one `ConfigError` with every problem of `groups` (see `merge_problems`), if any."""
    problems = merge_problems(*groups)
    if problems:
        raise ConfigError(*problems)


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)


def config_error(key: str, value: Any, allowed: str, hint: str, *, where: str = "") -> ConfigError:
    """Build a `ConfigError` in the standard shape: key, value, what is allowed, one fix."""
    src = f" (in {where})" if where else ""
    return ConfigError(f"`{key}` = {_fmt(value)}{src} is invalid: {allowed}. HINT: {hint}")


# --------------------------------------------------------------------------- field checks
# Each check returns None when the value is fine, else "what is allowed".
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "zero_stage": _int_check(0, 3),
    "precision": _choice_check(PRECISIONS),
    "gradient_accumulation_steps": _int_check(1),
    "gradient_clipping": _float_check(0.0),
    "micro_batch_size": _int_check(1, auto=True),
    "offload_optimizer": _choice_check(OFFLOAD_DEVICES),
    "offload_params": _choice_check(OFFLOAD_DEVICES),
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
}

_FLOAT_FIELDS = frozenset({"gradient_clipping", "loss_scale", "min_loss_scale"})


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
    problem = _CHECKS[name](value)
    if problem is not None:
        shown = key or name
        raise config_error(shown, value, f"expected {problem}", f"set `{shown}` to {problem}", where=where)
    if name in _FLOAT_FIELDS:
        return float(value)
    if name in ("optimizer", "scheduler") and value is not None:
        from ds_engine.ds_config import block_problems  # DeepSpeed's optimizers and schedulers

        raise_problems(block_problems(name, value))
        return json.loads(json.dumps(dict(value)))  # a private, JSON-clean copy
    return value


# --------------------------------------------------------------------------- EngineConfig
@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Typed, validated high-level training choices (see the field docs for each default).

    Construct with keywords (`EngineConfig(zero_stage=3, precision="bf16")`) or from a mapping
    with `EngineConfig.from_dict`. Fields passed explicitly are recorded in `explicit_fields`.
    """

    zero_stage: int = 0
    """ZeRO stage 0-3 (0: data parallel, 1: optimizer states, 2: +gradients, 3: +parameters)."""
    precision: Precision = "fp32"
    """Training precision: fp32, fp16 (dynamic or static loss scaling) or bf16."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per optimizer step (>= 1)."""
    gradient_clipping: float = 0.0
    """Max global grad norm; 0 turns clipping off. Always written explicitly to the JSON."""
    micro_batch_size: int | Literal["auto"] = "auto"
    """Per-rank micro batch size; "auto" takes it from the dataloader or the builder argument."""

    offload_optimizer: OffloadDevice = "none"
    """Where optimizer states live: none (accelerator), cpu (ZeRO 1-3), nvme (ZeRO-3 only)."""
    offload_params: OffloadDevice = "none"
    """Where parameters live between uses: none, cpu or nvme (ZeRO-3 only)."""
    nvme_path: str | None = None
    """Folder for NVMe offload swap files; required when any offload device is nvme."""
    pin_memory: bool = True
    """Page-lock offloaded CPU memory (faster transfers, more host memory)."""

    loss_scale: float = 0.0
    """fp16 static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """fp16 dynamic loss scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 dynamic loss scaling: overflow-free steps before the scale is raised."""
    hysteresis: int = 2
    """fp16 dynamic loss scaling: overflows tolerated before the scale is lowered."""
    min_loss_scale: float = 1.0
    """fp16 dynamic loss scaling never goes below this scale (a whole number >= 1)."""
    bf16_check_grad_overflow: bool = True
    """bf16: skip optimizer steps with inf/nan gradients (DeepSpeed `bf16.check_grad_overflow`)."""

    overlap_comm: bool = False
    """Overlap gradient reduction with backward (ZeRO 1-3)."""
    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer as they are produced (ZeRO 1-3)."""
    reduce_bucket_size: int | Literal["auto"] = "auto"
    """Elements reduced at a time; "auto" = hidden_size**2."""
    allgather_bucket_size: int = 500_000_000
    """Elements all-gathered at a time after the optimizer step (ZeRO 1-2)."""
    stage3_prefetch_bucket_size: int | Literal["auto"] = "auto"
    """ZeRO-3 parameter prefetch size in elements; "auto" = int(0.9 * hidden_size**2)."""
    stage3_param_persistence_threshold: int | Literal["auto"] = "auto"
    """ZeRO-3 keeps parameters smaller than this unpartitioned; "auto" = 10 * hidden_size."""
    stage3_max_live_parameters: int = 1_000_000_000
    """ZeRO-3: max gathered parameter elements kept alive per rank."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """ZeRO-3: keep a gathered parameter if it is reused within this many elements."""
    stage3_gather_16bit_weights_on_model_save: bool = True
    """ZeRO-3: allow gathering full 16-bit weights for saving (needed by `get_state_dict`)."""

    activation_checkpointing: bool = False
    """Write DeepSpeed's `activation_checkpointing` block (the model must checkpoint its layers)."""
    activation_checkpointing_partition: bool = False
    """Partition checkpointed activations across model-parallel ranks."""
    activation_checkpointing_cpu: bool = False
    """Move checkpointed activations to CPU (needs activation_checkpointing_partition)."""

    optimizer: dict[str, Any] | None = None
    """DeepSpeed-native optimizer block {"type": ..., "params": {...}}; may contain "auto"."""
    scheduler: dict[str, Any] | None = None
    """DeepSpeed-native scheduler block {"type": ..., "params": {...}}; may contain "auto"."""

    coalesce_grad_reduction: bool = False
    """Engine only: reduce gradients once per optimizer step on ZeRO 1-3 (more memory)."""
    skip_nonfinite_steps: bool = True
    """Engine only (fallback backend): skip an optimizer step whose gradients are non-finite."""
    steps_per_print: int = 0
    """DeepSpeed's own progress print every N steps; 0 turns it off."""
    max_consecutive_skipped_steps: int = 100
    """Engine only: raise after this many optimizer steps in a row were skipped (non-finite
    gradients / overflow), instead of training on silently; 0 never raises."""
    dist_timeout_s: int = 1800
    """Engine only: process-group timeout in seconds (a dead rank ends the job after this)."""

    _explicit: frozenset[str] | None = field(default=None, repr=False, compare=False)
    """Internal: fields passed explicitly (see `explicit_fields`); never pass it yourself."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for f in dataclasses.fields(self):
            if f.name in _CHECKS:
                try:
                    setattr(self, f.name, check_field(f.name, getattr(self, f.name)))
                except ConfigError as exc:
                    problems += exc.problems
        raise_problems(problems)

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Names of the fields the user chose explicitly (a base JSON may fill all others)."""
        return frozenset(self._explicit or ())

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """All public field names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))

    @classmethod
    def from_dict(cls, choices: Mapping[str, Any]) -> EngineConfig:
        """Build from a mapping of field names; every key given counts as explicit.

        Raises:
            ConfigError: An unknown key (with the closest valid name) or an invalid value.
        """
        if not isinstance(choices, Mapping):
            raise config_error(
                "config",
                choices,
                "expected a mapping of EngineConfig fields",
                "pass a dict such as {'zero_stage': 2}",
            )
        return cls(**dict(choices))

    @classmethod
    def from_kwargs(cls, **choices: Any) -> EngineConfig:
        """Same as `EngineConfig(**choices)`; every keyword given counts as explicit."""
        return cls(**choices)


def _unknown_key_error(key: str, valid: tuple[str, ...], what: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean `{close[0]}`?" if close else f"valid names: {', '.join(valid)}"
    return ConfigError(f"`{key}` is not a known {what}. HINT: {hint}")


_generated_init = EngineConfig.__init__


def _init(self: EngineConfig, **kwargs: Any) -> None:
    # Record which fields were passed. `dataclasses.replace` passes every field plus the old
    # `_explicit` (a _Snapshot carrying the old values): there, a field counts as explicit if it
    # was explicit before or its value changed.
    names = EngineConfig.field_names()
    unknown = [
        _unknown_key_error(key, names, "EngineConfig field")
        for key in kwargs
        if key not in names and key != "_explicit"
    ]
    if unknown:  # report the misspelt names together with every bad value among the others
        known = {k: v for k, v in kwargs.items() if k in names}
        try:
            _generated_init(self, **known)
        except ConfigError as exc:
            raise ConfigError(*merge_problems([str(e) for e in unknown], exc.problems)) from None
        raise ConfigError(*[str(e) for e in unknown])
    prior = kwargs.get("_explicit")
    _generated_init(self, **kwargs)
    given = {k for k in kwargs if k != "_explicit"}
    if isinstance(prior, _Snapshot):
        given = set(prior) | {k for k in given if not _same(kwargs[k], prior.values.get(k))}
    elif prior is not None:  # internal (resolve_engine_config): the explicit set is given as is
        given = set(prior)
    snap = _Snapshot(given)
    snap.values = {n: getattr(self, n) for n in names}
    object.__setattr__(self, "_explicit", snap)
    _check_combinations(self, only_explicit=True)


class _Snapshot(frozenset[str]):
    """The explicit-field set, carrying the values the object was built with."""

    values: dict[str, Any]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


EngineConfig.__init__ = _init  # type: ignore[method-assign]
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(EngineConfig) if not f.name.startswith("_")
}


# --------------------------------------------------------------------------- combinations
def _combination_problems(
    cfg: EngineConfig, shown: Mapping[str, str] | None = None
) -> list[tuple[frozenset[str], str]]:
    """Cross-field rules as (fields involved, message); DeepSpeed 0.19 support is the reference.

    Args:
        cfg: The choices to check.
        shown: Field -> the DeepSpeed JSON key its value came from, so a message names the key
            the user wrote (fields not in it are named as themselves).
    """
    out: list[tuple[frozenset[str], str]] = []
    names = dict(shown or {})

    def k(field: str) -> str:
        return names.get(field, field)

    def problem(fields: set[str], *parts: str) -> None:
        out.append((frozenset(fields), "".join(parts)))

    stage = cfg.zero_stage
    if cfg.offload_params != "none" and stage != 3:
        problem(
            {"offload_params", "zero_stage"},
            f"`{k('offload_params')}` = {_fmt(cfg.offload_params)} needs ZeRO stage 3, got "
            f"`{k('zero_stage')}` = {stage}: only ZeRO-3 partitions parameters. "
            'HINT: set zero_stage=3 or offload_params="none"',
        )
    if cfg.offload_optimizer != "none" and stage == 0:
        problem(
            {"offload_optimizer", "zero_stage"},
            f"`{k('offload_optimizer')}` = {_fmt(cfg.offload_optimizer)} needs ZeRO stage 1-3, got "
            f"`{k('zero_stage')}` = 0 (DeepSpeed ignores offload without ZeRO). "
            "HINT: set zero_stage=1, 2 or 3",
        )
    if cfg.offload_optimizer == "nvme" and stage in (1, 2):
        problem(
            {"offload_optimizer", "zero_stage"},
            f'`{k("offload_optimizer")}` = "nvme" needs ZeRO stage 3 (ZeRO-Infinity), got '
            f"`{k('zero_stage')}` = {stage}: DeepSpeed's stage 1/2 optimizer can only offload to cpu. "
            'HINT: set offload_optimizer="cpu" or zero_stage=3',
        )
    for name in ("offload_optimizer", "offload_params"):
        if getattr(cfg, name) == "nvme" and not cfg.nvme_path:
            problem(
                {name, "nvme_path"},
                f'`nvme_path` is required when `{k(name)}` = "nvme" (allowed: a folder on a fast local '
                'NVMe drive). HINT: pass nvme_path="/local_nvme/ds_swap"',
            )
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
    if stage != 3:
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


_STAGE3_FIELDS = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
_FP16_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def _check_combinations(
    cfg: EngineConfig,
    *,
    only_explicit: bool,
    defer: frozenset[str] = frozenset(),
    shown: Mapping[str, str] | None = None,
) -> None:
    problems = [p for p in _combination_problems(cfg, shown) if not p[0] & defer]
    if only_explicit:
        # A field left at its default may still be filled by a base JSON: defer those rules.
        problems = [p for p in problems if p[0] <= cfg.explicit_fields]
    raise_problems(msg for _, msg in problems)


# --------------------------------------------------------------------------- JSON loading
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
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"DeepSpeed config file `{path}` does not exist. "
            "HINT: check the path, or pass a preset name such as zero2"
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"DeepSpeed config file `{path}` cannot be read ({exc}). HINT: pass a readable UTF-8 JSON file"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config file `{path}` is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}. HINT: fix the JSON there (no comments or trailing commas)"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"DeepSpeed config file `{path}` must hold a JSON object at the top level, got "
            f"{type(data).__name__}. HINT: wrap the settings in {{...}}"
        )
    return data


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
STEPS_PER_PRINT_OFF = 2**31 - 1


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
            if value == AUTO and _CHECKS[name](AUTO) is not None:
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


def _fields_of_bad_base_values(base: Mapping[str, Any], problems: list[str]) -> frozenset[str]:
    """The `EngineConfig` fields whose base keys are named in `problems` (their rules wait)."""
    named = {_KEY.search(p).group(1) for p in problems if _KEY.search(p)}  # type: ignore[union-attr]
    fields = {name for name, keys in BASE_KEYS.items() if named & set(keys)}
    if named & {"fp16.enabled", "bf16.enabled", "bfloat16.enabled"}:
        fields.add("precision")
    if any(k.endswith(".nvme_path") for k in named):
        fields.add("nvme_path")
    return frozenset(fields)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_number(a) and _is_number(b):
        return float(a) == float(b)
    return bool(a == b)


def resolve_engine_config(
    config: EngineConfig,
    base: Mapping[str, Any] | None,
    *,
    where: str = "",
    defer: frozenset[str] = frozenset(),
) -> EngineConfig:
    """Merge a DeepSpeed JSON base into the high-level choices.

    A base value fills any field the user did not choose explicitly; a base value that
    contradicts an explicit choice is a conflict. "auto" in the base never conflicts.

    Args:
        config: The user's choices.
        base: A loaded DeepSpeed JSON (see `load_json_config`), or None.
        where: The base's file name, for messages.
        defer: Fields filled later (e.g. {"nvme_path"} for a preset): rules on them are skipped.

    Returns:
        The effective choices (same `explicit_fields` as `config`), with every cross-field
        rule checked.

    Raises:
        ConfigError: Every conflict (with both values), invalid base value and impossible
            combination, in one error.
    """
    values = {n: getattr(config, n) for n in EngineConfig.field_names()}
    explicit = config.explicit_fields
    problems: list[str] = []
    bad_fields: frozenset[str] = frozenset()
    from_base: dict[str, str] = {}  # field -> the JSON key its value came from
    if base:
        conflicts = []
        invalid: list[str] = []
        for name, (key, value) in base_values(base, where=where, problems=invalid).items():
            if value == AUTO:
                continue
            if name in explicit:
                if not _equal(values[name], value):
                    conflicts.append(
                        f"`{key}` = {_fmt(value)} in the base vs `{name}` = {_fmt(values[name])}"
                    )
            else:
                values[name] = value
                if name != "precision":  # its key holds a flag, not the precision itself
                    from_base[name] = key
        if conflicts:
            src = f" ({where})" if where else ""
            problems.append(
                f"the DeepSpeed base config{src} contradicts explicit choices: {'; '.join(conflicts)}. "
                'HINT: remove those keys from the base (or set them to "auto"), or drop the explicit choices'
            )
        problems += invalid
        bad_fields = _fields_of_bad_base_values(base, invalid)
    resolved = EngineConfig(**values, _explicit=frozenset(explicit))
    try:
        _check_combinations(resolved, only_explicit=False, defer=defer | bad_fields, shown=from_base)
    except ConfigError as exc:
        problems += exc.problems
    raise_problems(problems)
    return resolved
