"""accelerate's experiment trackers for `Accelerator(log_with=...)` / `init_trackers` / `get_tracker`.

accelerate's own tracker classes (TensorBoard, wandb, ...) and ds_engine's "jsonl"
(`ds_engine.tracking.JsonlTracker`, the ``metrics.jsonl`` that ``ds-engine plot`` draws). They
run on the main process only; the Accelerator decides where.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, filter_trackers

from ds_engine.tracking import JsonlTracker


def select_trackers(log_with: Any, logging_dir: str | None) -> list[Any]:
    """accelerate's `filter_trackers`, knowing ds_engine's "jsonl".

    Raises:
        ValueError: "jsonl" without a logging directory.
    """
    names = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    jsonl = [t for t in names if str(t) == JsonlTracker.name]
    others = [t for t in names if str(t) != JsonlTracker.name]
    if jsonl and logging_dir is None:
        raise ValueError(
            '`log_with="jsonl"` writes metrics.jsonl into the logging directory, and none is set. HINT: '
            "pass `project_dir=` (or `ProjectConfiguration(project_dir=..., logging_dir=...)`)."
        )
    return [*jsonl[:1], *(filter_trackers(others, logging_dir) if others else [])]


def start_trackers(
    trackers: list[Any],
    selected: list[Any],
    project_name: str,
    logging_dir: str | None,
    config: dict[str, Any] | None,
    init_kwargs: Mapping[str, Any],
) -> None:
    """accelerate's `init_trackers`: add the `selected` trackers (instances as given, names through
    accelerate's classes) to `trackers`, start every one and store the run's `config` in each."""
    for tracker in selected:
        if isinstance(tracker, GeneralTracker):
            trackers.append(tracker)
            continue
        name = str(tracker)
        cls: Any = JsonlTracker if name == JsonlTracker.name else LOGGER_TYPE_TO_CLASS[name]
        kwargs = init_kwargs.get(str(tracker), {})
        if cls.requires_logging_directory:
            trackers.append(cls(project_name, logging_dir, **kwargs))
        else:
            trackers.append(cls(project_name, **kwargs))
    for started in trackers:
        started.start()
    if config is not None:
        for started in trackers:
            started.store_init_configuration(config)


def find_tracker(trackers: list[Any], name: str, unwrap: bool) -> Any:
    """accelerate's `get_tracker`: the tracker called `name` (its inner object with `unwrap`), or
    a blank tracker when none was started.

    Raises:
        ValueError: Trackers were started and none is called `name`.
    """
    if trackers:
        for tracker in trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`.")
    return GeneralTracker(_blank=True)
