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

from ds_engine._io import remove_tree
from ds_engine.autosave import newest_complete_folder
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
        problems = remove_tree(old)
        if problems:
            warnings.warn(
                f"ds_engine: saved {str(newest)!r}, but could not fully remove {str(old)!r} "
                f"(total_limit={keep}): {problems[0]}. HINT: remove it by hand.",
                stacklevel=3,
            )


def extra_folder(target: Path, index: int) -> Path:
    """Where `save_state` puts the checkpoint of the model trained beside the first one, as
    accelerate numbers its files: ``model_<index>`` (accelerate's index of that model)."""
    return target / f"model_{index}"


def save_state(
    acc: Any,
    output_dir: Any,
    kwargs: dict[str, Any],
    extras: list[tuple[int, Any]],
    custom_objects: list[Any],
) -> str:
    """`Accelerator.save_state` (see there); `extras`: (model index, Engine) of every model trained
    beside the Accelerator's own; `custom_objects`: what `register_for_checkpointing` got."""
    acc.step.refuse_if_ended("accelerator.save_state(...)")
    if kwargs:
        raise TypeError(f"save_state got {sorted(kwargs)}; ds_engine's checkpoints take no extra arguments.")
    pc = acc.project_configuration
    if pc.automatic_checkpoint_naming:
        target = automatic_folder(pc)
        acc.wait_for_everyone()
    elif output_dir is None:
        raise ValueError("save_state() needs an output_dir unless automatic_checkpoint_naming is on.")
    else:
        target = Path(output_dir).expanduser()
    client = {CUSTOM_KEY: [obj.state_dict() for obj in custom_objects]}
    existed = target.exists()
    try:
        for index, engine in extras:
            engine.save_checkpoint(extra_folder(target, index), tag=STATE_TAG)
        acc.save_checkpoint(target, tag=STATE_TAG, client_state=client)  # last: complete means all
    except BaseException:
        # every rank raises (the save agrees on failures); the folder this call made goes
        if pc.automatic_checkpoint_naming and not existed and acc.is_main_process:
            remove_unfinished(target)
        raise
    if pc.automatic_checkpoint_naming:
        pc.iteration += 1
        if acc.is_main_process and pc.total_limit is not None:
            rotate_states(target.parent, keep=int(pc.total_limit), newest=target)
    return str(target)


def load_state(
    acc: Any,
    input_dir: Any,
    load_kwargs: Any,
    kwargs: dict[str, Any],
    extras: list[tuple[int, Any]],
    custom_objects: list[Any],
) -> None:
    """`Accelerator.load_state` (see there); `extras` and `custom_objects` as for `save_state`."""
    acc.step.refuse_if_ended("accelerator.load_state(...)")
    if kwargs or load_kwargs:
        raise TypeError("load_state takes no extra arguments in ds_engine.")
    pc = acc.project_configuration
    if input_dir is not None:
        source = Path(input_dir).expanduser()
        if not source.is_dir():
            raise ValueError(f"Tried to find {source} but folder does not exist")
    elif pc.automatic_checkpoint_naming and acc.project_dir is not None:
        base = checkpoints_folder(acc.project_dir)
        # the newest whose files match what its save recorded (a damaged one is skipped, warned)
        newest = newest_complete_folder(complete_states(base), STATE_TAG)
        if newest is None:
            raise no_complete_state(base)
        source = newest
    else:
        raise ValueError("load_state() needs an input_dir unless automatic_checkpoint_naming is on.")
    missing = [i for i, _ in extras if not has_complete_tag(extra_folder(source, i), STATE_TAG)]
    if missing:
        raise ValueError(
            f"{source} holds no saved state of the model(s) prepared as model {missing} "
            f"(no complete {extra_folder(source, missing[0]).name}/): it was saved by a run that "
            "trained other models. HINT: prepare the same models, in the same order, as the run that "
            "saved it."
        )
    for index, engine in extras:
        engine.load_checkpoint(extra_folder(source, index), tag=STATE_TAG)
    client = acc.load_checkpoint(source, tag=STATE_TAG)  # last: its RNG state is the one kept
    saved = list(client.get(CUSTOM_KEY, []))
    if len(saved) != len(custom_objects):
        raise ValueError(
            f"{source} holds {len(saved)} registered objects, {len(custom_objects)} are "
            "registered. HINT: register_for_checkpointing the same objects as the run that saved it."
        )
    for obj, state in zip(custom_objects, saved):
        obj.load_state_dict(state)
    if pc.automatic_checkpoint_naming:
        iteration = iteration_after(source)
        if iteration is not None:
            pc.iteration = iteration
