"""Metrics from any training loop: `metrics.jsonl` (what `ds-engine plot` draws) and TensorBoard.

* `JsonlTracker` -- an accelerate tracker (`GeneralTracker`) that appends one JSON object per
  `log` call to `<logging_dir>/metrics.jsonl`, flushed at once, so a run stopped at any moment
  leaves every line it logged. `ds_engine.Accelerator(log_with="jsonl")` uses it, beside
  accelerate's own trackers ("tensorboard", "wandb", ...).
* `RunLog` -- the trackers an `Engine` logs to (`Engine.log_to` / `Engine.log`): JSONL always,
  TensorBoard on request, main process only.

Values are numbers, strings, booleans or None; a one-element tensor is logged as its number.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker

from ds_engine._io import write_text_atomic

__all__ = ["METRICS_FILE", "JsonlTracker", "RunLog", "plain_values"]

METRICS_FILE = "metrics.jsonl"


def plain_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as JSON-able numbers/strings (one-element tensors become numbers).

    Raises:
        TypeError: A value is neither a number, a string, a bool, None nor a one-element tensor.
    """
    plain: dict[str, Any] = {}
    for key, value in values.items():
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (RuntimeError, ValueError):
                raise TypeError(
                    f"`log` got {key}= a tensor of {getattr(value, 'numel', lambda: '?')()} elements; "
                    f"allowed: numbers, strings, booleans, None, one-element tensors. HINT: log "
                    f"`{key}.mean()` or one element."
                ) from None
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise TypeError(
                f"`log` got {key}={value!r} ({type(value).__name__}); allowed: numbers, strings, booleans, "
                "None, one-element tensors. HINT: log a number."
            )
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no inf/nan; the plot skips non-numbers
        plain[str(key)] = value
    return plain


class JsonlTracker(GeneralTracker):
    """One JSON object per `log` call, appended to ``<logging_dir>/metrics.jsonl``."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.directory = Path(logging_dir)
        self.path = self.directory / METRICS_FILE
        self._file: Any = None

    @property
    def tracker(self) -> Any:
        return self._file

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise ValueError(
                f"{str(self.path)!r} exists and is not a regular file; metrics are appended to a plain "
                "file. HINT: log to another folder."
            )
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open until finish()

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Writes the run's configuration to ``run_config.json`` beside the metrics."""
        text = json.dumps({k: v for k, v in values.items()}, indent=2, sort_keys=True, default=str)
        write_text_atomic(self.directory / "run_config.json", text + "\n")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            self.start()
        record = plain_values(values)
        if step is not None:
            record = {"step": int(step), **{k: v for k, v in record.items() if k != "step"}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RunLog:
    """An Engine's trackers: JSONL in `directory`, and TensorBoard in `directory/tensorboard`."""

    def __init__(self, directory: str | os.PathLike[str], *, tensorboard: bool = False) -> None:
        self.directory = Path(directory)
        self.trackers: list[GeneralTracker] = [JsonlTracker("ds_engine", self.directory)]
        if tensorboard:
            from accelerate.tracking import TensorBoardTracker

            self.trackers.append(TensorBoardTracker("tensorboard", self.directory))
        for tracker in self.trackers:
            tracker.start()

    @property
    def metrics_path(self) -> Path:
        return self.directory / METRICS_FILE

    def store_config(self, config: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.store_init_configuration(dict(config))

    def log(self, values: Mapping[str, Any], step: int) -> None:
        record = plain_values(values)
        for tracker in self.trackers:
            if isinstance(tracker, JsonlTracker):
                tracker.log(record, step=step)
            else:  # TensorBoard takes numbers only
                numbers = {
                    k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                }
                tracker.log(numbers, step=step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
