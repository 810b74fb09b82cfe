"""The Engine's metrics surface: `log_to` a folder, `log` values (main process only), and
`gather` / `gather_for_metrics` / `reduce` values across ranks.

`EngineMetrics` is a part of `ds_engine.engine.Engine` (a base class of it); the files are
written by `ds_engine.tracking.RunLog`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ds_engine.collectives import all_gather_cat, map_tensors

if TYPE_CHECKING:
    from ds_engine.boundary import BoundaryPolicy
    from ds_engine.scheduler import OverflowAwareScheduler, PreparedOptimizer

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """The Engine's metric logging (see `ds_engine.engine.Engine`)."""

    _run_log: Any = None
    """ds_engine.tracking.RunLog once `log_to` was called (main process)."""

    if TYPE_CHECKING:  # provided by the Engine
        _optimizer: PreparedOptimizer | None
        _scheduler: OverflowAwareScheduler | None

        _boundary: BoundaryPolicy

        @property
        def is_main_process(self) -> bool: ...

        @property
        def num_processes(self) -> int: ...

        def _dist(self, call: str | None = None) -> bool: ...

        def _refuse_if_ended(self, call: str) -> None: ...

        @property
        def sync_gradients(self) -> bool: ...

        @property
        def num_optimizer_steps(self) -> int: ...

        @property
        def num_skipped_steps(self) -> int: ...

        @property
        def grad_norm(self) -> float | None: ...

        @property
        def loss_scale(self) -> float | None: ...

    def log_to(
        self,
        directory: str | os.PathLike[str],
        *,
        tensorboard: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """Log this run's metrics into `directory` (main process only; appends).

        `engine.log(...)` then writes one line per call to ``directory/metrics.jsonl`` (what
        `ds-engine plot` draws), and with `tensorboard` to ``directory/tensorboard`` too.

        Args:
            directory: Folder for the metrics (created if missing).
            tensorboard: Also log to TensorBoard (needs the `tensorboard` package).
            config: The run's hyperparameters, written to ``directory/run_config.json``.
        """
        if self._run_log is not None:
            self._run_log.close()
            self._run_log = None
        if self.is_main_process:
            from ds_engine.tracking import RunLog

            self._run_log = RunLog(directory, tensorboard=tensorboard)
            if config is not None:
                self._run_log.store_config(config)

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Log `values` (numbers, strings, one-element tensors) at `step` (main process only).

        At an accumulation boundary the Engine's own facts are added unless `values` has them:
        `lr` (the prepared scheduler's first group), `grad_norm` (pre-clip), `skipped_steps`
        and `loss_scale`. `step` defaults to the number of optimizer steps taken.

        Raises:
            RuntimeError: Before `log_to(directory)`.
        """
        if not self.is_main_process:
            return
        if self._run_log is None:
            raise RuntimeError(
                "`engine.log(...)` before `engine.log_to(directory)`: there is nowhere to write the "
                "metrics. HINT: call `engine.log_to('out/run')` once before the loop."
            )
        record = dict(values)
        if self.sync_gradients and self.num_optimizer_steps + self.num_skipped_steps > 0:
            facts: dict[str, Any] = {
                "grad_norm": self.grad_norm,
                "skipped_steps": self.num_skipped_steps,
                "loss_scale": self.loss_scale,
            }
            if self._scheduler is not None:
                facts["lr"] = self._scheduler.get_last_lr()[0]
            elif self._optimizer is not None:
                facts["lr"] = self._optimizer.param_groups[0]["lr"]
            record = {**facts, **record}
        self._run_log.log(record, step=self.num_optimizer_steps if step is None else int(step))

    def gather(self, data: Any) -> Any:
        """Concatenate tensors (nested structures too) from every rank along dim 0."""
        if not self._dist("gather(...)") or dist.get_world_size() == 1:
            return data
        return map_tensors(data, all_gather_cat)

    def gather_for_metrics(self, data: Any) -> Any:
        """`gather`, minus the duplicates padded into the last batch of an epoch."""
        self._refuse_if_ended("gather_for_metrics(...)")
        gathered = self.gather(data)
        loader = self._boundary.current_loader
        remaining = None if loader is None else loader.last_batch_real_samples()
        if remaining is None:
            return gathered
        return map_tensors(gathered, lambda t: t[:remaining] if t.dim() > 0 else t)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """All-reduce a tensor across ranks ("sum" or "mean"); returns a new tensor."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"`reduction={reduction!r}`; allowed: 'sum', 'mean'. HINT: reduction='mean'.")
        result = tensor.detach().clone()
        if self._dist("reduce(...)") and dist.get_world_size() > 1:
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                result = result / dist.get_world_size()
        return result
