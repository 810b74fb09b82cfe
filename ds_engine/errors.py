"""`ConfigError` and the one way every configuration problem is worded, merged and raised.

A problem is one line: the key (in backticks), the value, what is allowed, and one fix
(`HINT:`). Every check in ds_engine collects problems and raises them together, unknown keys
first, the same setting reported once (`merge_problems`). Imports nothing from ds_engine.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from typing import Any


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


def first_key(problem: str) -> str | None:
    """The first `backticked` name of a problem (the key it is about), or None."""
    match = _KEY.search(problem)
    return None if match is None else match.group(1)


def _problem_key(problem: str) -> str | None:
    key = first_key(problem)
    return None if key is None else _SAME_SETTING.get(key, key)


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


def fmt(value: Any) -> str:
    """A value as a message shows it: strings, booleans and null as JSON, the rest as repr."""
    return json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)


def config_error(key: str, value: Any, allowed: str, hint: str, *, where: str = "") -> ConfigError:
    """Build a `ConfigError` in the standard shape: key, value, what is allowed, one fix."""
    src = f" (in {where})" if where else ""
    return ConfigError(f"`{key}` = {fmt(value)}{src} is invalid: {allowed}. HINT: {hint}")


def show_json(value: Any) -> str:
    """A value as JSON (how the DeepSpeed-key messages show what the file holds)."""
    return json.dumps(value)


def unknown_key(key: str, valid: Iterable[str], where: str) -> str:
    """The problem for a DeepSpeed key that `where` does not know, with the closest valid name."""
    close = difflib.get_close_matches(key.split(".")[-1], sorted(valid), n=1)
    hint = f"did you mean `{close[0]}`?" if close else "remove it (see DeepSpeed's config docs)"
    return f"`{key}` is not a known {where} key. HINT: {hint}"


__all__ = [
    "ConfigError",
    "config_error",
    "first_key",
    "fmt",
    "is_unknown_key_problem",
    "merge_problems",
    "raise_problems",
    "show_json",
    "unknown_key",
]
