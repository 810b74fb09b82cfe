"""Where `Accelerator.save_state` / `load_state` put and find their folders, as accelerate does.

With `ProjectConfiguration(automatic_checkpoint_naming=True)` a save goes to
``project_dir/checkpoints/checkpoint_<iteration>``; once it is complete the oldest complete
ones beyond `total_limit` are removed, and `load_state()` takes the newest complete one. Each
folder is a ds_engine training checkpoint holding the tag `STATE_TAG`.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from accelerate.utils import ProjectConfiguration

from ds_engine.checkpoint import has_complete_tag

STATE_TAG = "state"
"""The tag `save_state` writes inside its folder."""
CUSTOM_KEY = "accelerate_custom_objects"
"""The client-state key holding the state dicts of the objects `register_for_checkpointing` got."""


def project_configuration(
    project_dir: str | os.PathLike[str] | None, project_config: ProjectConfiguration | None
) -> ProjectConfiguration:
    """accelerate's reading of `project_dir` / `project_config`: the given configuration (its
    `project_dir` set from `project_dir` when it has none), or a new one."""
    configuration = (
        project_config if project_config is not None else ProjectConfiguration(project_dir=project_dir)
    )
    if project_dir is not None and configuration.project_dir is None:
        configuration.set_directories(project_dir)
    return configuration


def automatic_folder(configuration: ProjectConfiguration) -> Path:
    """The folder the next automatically named `save_state` writes (its parent is created).

    Raises:
        ValueError: Without a `project_dir`, or when the folder exists already.
    """
    if configuration.project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project_dir. HINT: ProjectConfiguration(project_dir=...)."
        )
    base = checkpoints_folder(configuration.project_dir)
    base.mkdir(parents=True, exist_ok=True)
    target = base / f"checkpoint_{configuration.iteration}"
    if target.exists():
        raise ValueError(
            f"Checkpoint directory {target} ({configuration.iteration}) already exists. HINT: set "
            "`project_config.iteration` to the iteration to start with."
        )
    return target


def checkpoints_folder(project_dir: str | os.PathLike[str]) -> Path:
    """Where automatically named `save_state` folders go: ``project_dir/checkpoints``."""
    return Path(project_dir) / "checkpoints"


def no_complete_state(base: Path) -> FileNotFoundError:
    """The error of `load_state()` when no folder under `base` holds a complete saved state."""
    others = sorted(path.name for _, path in _numbered(base))
    return FileNotFoundError(
        f"no complete checkpoint_<i> folder under {str(base)!r}"
        + (f" ({', '.join(others)} hold no complete saved state)" if others else "")
        + ". HINT: save_state() first, or pass the folder to load_state(input_dir)."
    )


def iteration_after(folder: Path) -> int | None:
    """The iteration after the one `folder` (``checkpoint_<i>``) was saved at; None without a number."""
    match = re.search(r"(\d+)$", folder.name)
    return int(match.group(1)) + 1 if match else None


def _numbered(base: Path) -> list[tuple[int, Path]]:
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        match = re.search(r"(\d+)$", child.name)
        if child.is_dir() and match:
            found.append((int(match.group(1)), child))
    return found


def complete_states(base: Path) -> list[Path]:
    """The numbered folders under `base` that hold a complete `save_state`, oldest first: what
    "newest" means for `load_state()` and what `total_limit` counts."""
    numbered = sorted(_numbered(base), key=lambda item: item[0])
    return [path for _, path in numbered if not path.is_symlink() and has_complete_tag(path, STATE_TAG)]


def remove_unfinished(target: Path) -> None:
    """Remove `target`, made by a `save_state` that failed, unless it somehow holds a complete
    state (then it is a checkpoint, and stays)."""
    if target.is_dir() and not target.is_symlink() and not has_complete_tag(target, STATE_TAG):
        shutil.rmtree(target, ignore_errors=True)


def rotate_states(base: Path, *, keep: int, newest: Path) -> None:
    """After `newest` was saved: remove the oldest complete `save_state` folders beyond `keep`
    (never `newest`, never a folder that is not a complete one); a failure is a warning."""
    for old in complete_states(base)[: -max(keep, 1)]:
        if old == newest:
            continue
        problems: list[str] = []

        def note(_function: Any, failed: str, info: Any, found: list[str] = problems) -> None:
            found.append(f"{failed}: {info[1]}")

        shutil.rmtree(old, onerror=note)
        if problems:
            warnings.warn(
                f"ds_engine: saved {str(newest)!r}, but could not fully remove {str(old)!r} "
                f"(total_limit={keep}): {problems[0]}. HINT: remove it by hand.",
                stacklevel=3,
            )
