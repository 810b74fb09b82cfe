"""DeepSpeed's native `optimizer` and `scheduler` JSON blocks: what DeepSpeed 0.19 can build, and checks.

A block is {"type": ..., "params": {...}}. The checks know DeepSpeed's own optimizers and LR
schedules (names, parameters, what it refuses) and the torch.optim classes a JSON block can
drive; "auto" values pass (the builder fills them). Needs nothing but the JSON: the bottom
layer, below `ds_schema` (the whole JSON) and `config` (the `optimizer`/`scheduler` choices).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ds_engine._values import AUTO, _is_int, _is_number, words
from ds_engine.errors import config_error, merge_problems, show_json, unknown_key

#: Keys of the two blocks.
KEYS: dict[str, frozenset[str]] = {
    "optimizer": words("type params legacy_fusion"),
    "scheduler": words("type params"),
}

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
        words(
            "lr_range_test_min_lr lr_range_test_step_size lr_range_test_step_rate "
            "lr_range_test_staircase last_batch_iteration"
        ),
        frozenset(),
    ),
    "OneCycle": (
        words(
            "cycle_min_lr cycle_max_lr decay_lr_rate cycle_first_step_size cycle_second_step_size "
            "cycle_first_stair_count cycle_second_stair_count decay_step_size cycle_momentum "
            "cycle_min_mom cycle_max_mom decay_mom_rate last_batch_iteration"
        ),
        words("cycle_min_lr cycle_max_lr"),
    ),
    "WarmupLR": (
        words("warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration"),
        frozenset(),
    ),
    "WarmupDecayLR": (
        words(
            "total_num_steps warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration"
        ),
        words("total_num_steps"),
    ),
    "WarmupCosineLR": (
        words(
            "total_num_steps warmup_min_ratio warmup_num_steps cos_min_ratio warmup_type last_batch_iteration"
        ),
        words("total_num_steps"),
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
_OPTIMIZER_NUMBERS = words("lr eps weight_decay momentum dampening alpha lr_decay initial_accumulator_value")
_WARMUP_TYPES = ("log", "linear")


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
        if key not in KEYS[name]:
            bad(name, unknown_key(f"{name}.{key}", KEYS[name], name))
    kind = block.get("type")
    if not isinstance(kind, str):
        shown = "missing" if kind is None else show_json(kind)
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
    check_block(name, block, lambda _block, msg: found.append(msg))
    return merge_problems(found)


def check_block(name: str, block: Any, bad: Callable[[str, str], None]) -> None:
    """Report every problem of an `optimizer` or `scheduler` block (None: absent) as bad(name, msg)."""
    check = _check_optimizer if name == "optimizer" else _check_scheduler
    check(block, bad)


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
            f"`optimizer.type` = {show_json(kind)} is not an optimizer DeepSpeed knows: allowed are "
            f"{', '.join(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class. HINT: {hint}",
        )
    elif kind.lower() not in known:  # a torch.optim class: DeepSpeed passes **params to it
        names, _ = _torch_init_params("optim", kind)
        for key in params:
            if key not in names:
                bad(
                    "optimizer",
                    unknown_key(f"optimizer.params.{key}", names, f"torch.optim.{kind} parameter"),
                )
    for key, value in params.items():
        dotted = f"optimizer.params.{key}"
        if value == AUTO:
            continue
        if key == "max_grad_norm":
            bad(
                "optimizer",
                f"`{dotted}` = {show_json(value)} is refused by DeepSpeed: allowed is clipping through the "
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
            f"`scheduler.type` = {show_json(kind)} is not a scheduler DeepSpeed can build from JSON: allowed "
            f"are {', '.join(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class taking plain "
            f"values. HINT: {hint}",
        )
        return
    for key in params:
        if key not in names:
            bad("scheduler", unknown_key(f"scheduler.params.{key}", names, f"{kind} parameter"))
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


__all__ = ["DEEPSPEED_OPTIMIZERS", "DEEPSPEED_SCHEDULERS", "KEYS", "block_problems", "check_block"]
