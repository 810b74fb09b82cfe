"""High-level training choices (`EngineConfig`) and their one resolution (`resolve_config`).

`EngineConfig` is the one config object that flows through ds_engine. It knows which of its
fields the user passed explicitly (`explicit_fields`): a DeepSpeed JSON `base` may fill any
field the user left at its default, but a base value that contradicts an explicit choice is a
`ConfigError` (no silent winner).

`resolve_config` turns what a run was given (an `EngineConfig` or a DeepSpeed JSON, the
keyword choices, the world size) into a frozen `ResolvedConfig`: the user's choices, the
effective choices after merging the JSON, and the JSON itself, every problem reported at once.
The Engine resolves once; the backends and the DeepSpeed JSON builder (`ds_config`) read the
result and never resolve again.

Layers (each imports only those before it): `_values`, `errors` -> `ds_blocks` -> `ds_schema`
(DeepSpeed JSON knowledge) -> `config_rules` (field checks, cross-field rules, JSON -> fields)
-> `config` (this module) -> `ds_config` (resolved config + facts -> DeepSpeed JSON).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from ds_engine._values import AUTO, _is_int
from ds_engine.config_rules import (
    BASE_KEYS,
    FIELD_CHECKS,
    PRECISIONS,
    base_values,
    check_combinations,
    check_field,
    equal,
    fields_of_bad_base_values,
    validate_ds_config,
)
from ds_engine.ds_schema import (
    OFFLOAD_DEVICES,
    STEPS_PER_PRINT_OFF,
    load_base,
    load_json_config,
    misshapen_blocks,
    normalized,
)
from ds_engine.errors import (
    ConfigError,
    config_error,
    is_unknown_key_problem,
    merge_problems,
    raise_problems,
)
from ds_engine.errors import fmt as _fmt

Precision = Literal["fp32", "fp16", "bf16"]
OffloadDevice = Literal["none", "cpu", "nvme"]
OffloadChoice = Literal["none", "cpu", "nvme", "auto"]
"""An offload choice: a device, or "auto" (chosen at `prepare` with the ZeRO stage: `auto_stage`)."""


# --------------------------------------------------------------------------- EngineConfig
@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Typed, validated high-level training choices (see the field docs for each default).

    Construct with keywords (`EngineConfig(zero_stage=3, precision="bf16")`) or from a mapping
    with `EngineConfig.from_dict`. Fields passed explicitly are recorded in `explicit_fields`.
    """

    zero_stage: int | Literal["auto"] = 0
    """ZeRO stage 0-3 (0: data parallel, 1: optimizer states, 2: +gradients, 3: +parameters), or
    "auto": at `prepare`, the stage/offload with the least communication whose estimated peak fits
    `memory_budget` (needs `seq_len`; see `ds_engine.auto_stage` and docs/memory.md)."""
    precision: Precision = "fp32"
    """Training precision: fp32, fp16 (dynamic or static loss scaling) or bf16."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per optimizer step (>= 1)."""
    gradient_clipping: float = 0.0
    """Max global grad norm; 0 turns clipping off. Always written explicitly to the JSON."""
    micro_batch_size: int | Literal["auto"] = "auto"
    """Per-rank micro batch size; "auto" takes it from the dataloader or the builder argument."""

    offload_optimizer: OffloadChoice = "none"
    """Where optimizer states live: none (accelerator), cpu (ZeRO 1-3), nvme (ZeRO-3 only), or
    "auto" (chosen at `prepare`; the default follows the plan when `zero_stage` is "auto")."""
    offload_params: OffloadChoice = "none"
    """Where parameters live between uses: none, cpu or nvme (ZeRO-3 only), or "auto" (as above)."""
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
    hang_timeout_s: int = 600
    """Engine only: an Engine call (a step, a save, ...) that makes no progress for this many
    seconds counts as a hang: every rank prints its stack and what the others were doing, and the
    run stops with status 124 (see docs/reliability.md). 0 turns the watchdog off."""

    seq_len: int | None = None
    """Engine only, for "auto" choices: tokens per sequence (the longest a batch holds)."""
    memory_budget: int | str | None = None
    """Engine only, for "auto" choices: memory per accelerator, bytes or a size such as "40GB" or
    "79GiB"; None: the CUDA device's total memory (a CPU run must give it)."""
    memory_margin: float = 0.2
    """Engine only, for "auto" choices: the fraction of `memory_budget` kept free (the estimated
    peak times 1 + margin must fit), as `ds-engine estimate --headroom`."""

    _explicit: frozenset[str] | None = field(default=None, repr=False, compare=False)
    """Internal: fields passed explicitly (see `explicit_fields`); never pass it yourself."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for f in dataclasses.fields(self):
            if f.name in FIELD_CHECKS:
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


class EngineChoices(TypedDict, total=False):
    """`EngineConfig`'s fields as the keyword choices of `Engine(...)` (for IDEs and type checkers).

    Each has the meaning, default and checks of the `EngineConfig` field of the same name;
    `tests/unit/test_config.py` keeps the two lists equal.
    """

    zero_stage: int | Literal["auto"]
    precision: Precision
    gradient_accumulation_steps: int
    gradient_clipping: float
    micro_batch_size: int | Literal["auto"]
    offload_optimizer: OffloadChoice
    offload_params: OffloadChoice
    nvme_path: str | None
    pin_memory: bool
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float
    bf16_check_grad_overflow: bool
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_bucket_size: int | Literal["auto"]
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int | Literal["auto"]
    stage3_param_persistence_threshold: int | Literal["auto"]
    stage3_max_live_parameters: int
    stage3_max_reuse_distance: int
    stage3_gather_16bit_weights_on_model_save: bool
    activation_checkpointing: bool
    activation_checkpointing_partition: bool
    activation_checkpointing_cpu: bool
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    coalesce_grad_reduction: bool
    skip_nonfinite_steps: bool
    steps_per_print: int
    max_consecutive_skipped_steps: int
    dist_timeout_s: int
    hang_timeout_s: int
    seq_len: int | None
    memory_budget: int | str | None
    memory_margin: float


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
    check_combinations(self, only_explicit=True)


class _Snapshot(frozenset[str]):
    """The explicit-field set, carrying the values the object was built with."""

    values: dict[str, Any]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


EngineConfig.__init__ = _init  # type: ignore[method-assign]


# --------------------------------------------------------------------------- resolution
@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """A run's configuration, resolved once (`resolve_config`): what every later step reads.

    The DeepSpeed JSON builder (`ds_config.render_ds_config`) and the backends take it as it
    is; nothing resolves it again.
    """

    user: EngineConfig
    """The user's choices (`explicit_fields` tells which were chosen)."""
    effective: EngineConfig
    """The choices after merging `base`, every rule checked (same `explicit_fields` as `user`)."""
    base: dict[str, Any] | None = None
    """The user's DeepSpeed JSON as loaded (None: no JSON was given). Read it, never change it."""
    where: str = ""
    """Where `base` came from (its file), for messages; '' for a dict."""
    world_size: int | None = None
    """The data-parallel world size it was checked against (None: unknown)."""
    pending_problems: tuple[str, ...] = ()
    """Problems of `base` left to the builder, which reports them with its own
    (`resolve_config(..., report_base_later=True)`); always empty on the Engine's path."""

    def with_effective(self, **changes: Any) -> ResolvedConfig:
        """This resolution with some effective choices replaced (no new resolution)."""
        return dataclasses.replace(self, effective=dataclasses.replace(self.effective, **changes))


def fact_problems(**facts: Any) -> list[str]:
    """A problem for each fact (world size, micro batch, hidden size) given that is no integer >= 1."""
    return [
        str(config_error(name, value, "expected an integer >= 1", f"pass {name}=<positive int>"))
        for name, value in facts.items()
        if value is not None and (not _is_int(value) or value < 1)
    ]


JsonSource = str | os.PathLike[str] | Mapping[str, Any]
"""A DeepSpeed JSON: a file path, a preset name (see `ds_schema.PRESETS`) or a dict."""


def resolve_config(
    config: EngineConfig | JsonSource | None = None,
    choices: Mapping[str, Any] | None = None,
    *,
    world_size: int | None,
    base: JsonSource | None = None,
    defer: frozenset[str] = frozenset(),
    report_base_later: bool = False,
) -> ResolvedConfig:
    """Resolve what a run was given into the choices everything reads: the one resolution.

    Everything visible before a process group forms is reported in one `ConfigError`: bad or
    misspelt choices, unknown or misspelt JSON keys, wrong types, conflicts between the JSON
    and the choices, impossible stage/offload combinations, bad optimizer/scheduler blocks,
    and the JSON's batch triangle against the world size. "auto" values and a missing micro
    batch size are left to the DeepSpeed JSON builder (the model, the DataLoader and the
    optimizer fill them).

    Args:
        config: An `EngineConfig` (used as is; `choices` merge into its explicit fields), a
            DeepSpeed JSON (path, preset name or dict) whose values fill every field not chosen,
            or None.
        choices: Keyword choices (`EngineConfig` fields); all count as explicit.
        world_size: The number of data-parallel ranks (None: unknown, no batch-triangle check).
        base: A DeepSpeed JSON to merge into an `EngineConfig` `config` (how `build_ds_config`
            is called); not with a JSON `config`.
        defer: Fields filled later (a preset leaves `nvme_path` to its user): their rules wait.
        report_base_later: Keep the JSON's own problems in `pending_problems` instead of raising
            them (when they do not stop the merge), for a builder that reports them together
            with its own.

    Returns:
        The frozen resolution.

    Raises:
        ConfigError: Every problem found, in one error.
    """
    if isinstance(config, EngineConfig):
        user: EngineConfig | None = config
        if choices:
            merged = {name: getattr(config, name) for name in config.explicit_fields}
            merged.update(choices)
            user = EngineConfig.from_kwargs(**merged)
        source = base
    elif config is None or isinstance(config, (str, os.PathLike, Mapping)):
        if config is not None and base is not None:
            raise ConfigError(
                "`config` and `base` are both a DeepSpeed JSON: allowed is one. "
                "HINT: pass the JSON as `config` and the choices as keywords"
            )
        user = None
        source = config if config is not None else base
    else:
        raise ConfigError(
            f"`config` must be an EngineConfig, a JSON path or a dict; got {type(config).__name__}. "
            "HINT: Engine(zero_stage=2) or Engine('ds_config.json')."
        )
    loaded, where = load_base(source)
    json_base = normalized(loaded)  # DeepSpeed's legacy `bfloat16` block read as `bf16`
    facts = fact_problems(world_size=world_size)
    ws = None if facts else world_size
    structural = validate_ds_config(json_base, world_size=ws, partial=True) if json_base else []
    if user is None:
        try:
            user = EngineConfig.from_kwargs(**dict(choices or {}))
        except ConfigError as exc:  # report the JSON's own problems with the choices'
            raise ConfigError(*merge_problems(facts, exc.problems, structural)) from None
    if misshapen_blocks(json_base):  # nothing can be merged into a block that is no object
        raise ConfigError(*merge_problems(facts, structural))
    try:
        effective = resolve_engine_config(user, json_base, where=where, defer=defer)
    except ConfigError as exc:
        raise ConfigError(*merge_problems(facts, exc.problems, structural)) from None
    raise_problems(facts, [] if report_base_later else structural)
    return ResolvedConfig(
        user=user,
        effective=effective,
        base=loaded if source is not None else None,
        where=where,
        world_size=ws,
        pending_problems=tuple(structural) if report_base_later else (),
    )


def resolve_engine_config(
    config: EngineConfig,
    base: Mapping[str, Any] | None,
    *,
    where: str = "",
    defer: frozenset[str] = frozenset(),
) -> EngineConfig:
    """Merge a DeepSpeed JSON base into the high-level choices (the merge step of `resolve_config`).

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
                if not equal(values[name], value):
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
        bad_fields = fields_of_bad_base_values(invalid)
    resolved = EngineConfig(**values, _explicit=frozenset(explicit))
    try:
        check_combinations(resolved, only_explicit=False, defer=defer | bad_fields, shown=from_base)
    except ConfigError as exc:
        problems += exc.problems
    raise_problems(problems)
    return resolved


__all__ = [
    "AUTO",
    "BASE_KEYS",
    "OFFLOAD_DEVICES",
    "PRECISIONS",
    "STEPS_PER_PRINT_OFF",
    "ConfigError",
    "EngineChoices",
    "EngineConfig",
    "JsonSource",
    "OffloadChoice",
    "OffloadDevice",
    "Precision",
    "ResolvedConfig",
    "base_values",
    "check_field",
    "config_error",
    "fact_problems",
    "is_unknown_key_problem",
    "load_json_config",
    "merge_problems",
    "raise_problems",
    "resolve_config",
    "resolve_engine_config",
    "validate_ds_config",
]
