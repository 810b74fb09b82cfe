"""Ray Train with the Engine: checkpoints through `ray.train.report`, resume from
`ray.train.get_checkpoint()`.

The Engine's training loop runs unchanged inside `TorchTrainer(train_loop_per_worker, ...)`: Ray
forms the process group and sets RANK / WORLD_SIZE / LOCAL_RANK, and the Engine uses that group
as it is. Two calls connect the loop to Ray's checkpoints:

* `report(engine, metrics, checkpoint_dir=...)` (every worker calls it): saves an Engine
  checkpoint (`engine.save_checkpoint`: model, optimizer, scheduler, RNG, counters, data
  position) into a fresh folder under `checkpoint_dir` and hands it to `ray.train.report`, which
  copies it into the run's storage; without `checkpoint_dir` only the metrics are reported.
  `report_pretrained(...)` does the same with consolidated `save_pretrained` weights.
* `resume(engine)` (every worker, after `prepare`): loads `ray.train.get_checkpoint()` when Ray
  has one (a restarted or resumed run) and returns its `client_state`; None otherwise.

Needs Ray Train: `pip install "ds-engine[ray]"`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ds_engine.engine import Engine

__all__ = ["RAY_INSTALL_HINT", "checkpoint_from_folder", "report", "report_pretrained", "resume"]

#: How to install what this module needs.
RAY_INSTALL_HINT = 'pip install "ds-engine[ray]"'


def _ray_train() -> Any:
    """`ray.train`, or an ImportError that names the extra."""
    try:
        import ray.train
    except ImportError as exc:
        raise ImportError(
            f"ds_engine.ray_train needs Ray Train, which is not installed ({exc}). HINT: {RAY_INSTALL_HINT}"
        ) from None
    return ray.train


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def checkpoint_from_folder(folder: str | os.PathLike[str]) -> Any:
    """A `ray.train.Checkpoint` of an Engine checkpoint folder or a `save_pretrained` folder.

    Args:
        folder: what `engine.save_checkpoint(folder)` wrote (it holds `latest`), or what
            `engine.save_pretrained(model, folder)` wrote (it holds `config.json` or weights).

    Raises:
        ValueError: `folder` is neither (naming it).
        ImportError: Ray Train is not installed (naming the extra).
    """
    path = Path(folder)
    known = (
        "latest",
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "adapter_config.json",
    )
    if not path.is_dir() or not any((path / name).is_file() for name in known):
        raise ValueError(
            f"`folder`={str(path)!r} is not an Engine checkpoint (no `latest`) nor a `save_pretrained` "
            "folder (no config.json or model.safetensors). HINT: pass the folder given to "
            "engine.save_checkpoint(...) or engine.save_pretrained(...)"
        )
    return _ray_train().Checkpoint.from_directory(str(path))


def _staging(checkpoint_dir: str | os.PathLike[str] | None) -> Path:
    if checkpoint_dir is not None:
        return Path(checkpoint_dir)
    context = _ray_train().get_context()
    # the same path on every worker of a run: the Engine's checkpoint is written by all ranks together
    return Path(tempfile.gettempdir()) / "ds_engine_ray" / context.get_experiment_name()


def _report_folder(train: Any, metrics: dict[str, Any], folder: Path) -> None:
    """Rank 0 hands `folder` to Ray (which copies it into the run's storage), the others report
    the metrics alone; then rank 0 removes `folder` (Ray's copy is what a resume reads)."""
    if _rank() == 0:
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(str(folder)))
        shutil.rmtree(folder, ignore_errors=True)
    else:
        train.report(metrics, checkpoint=None)


def report(
    engine: Engine,
    metrics: dict[str, Any],
    *,
    checkpoint: bool = True,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    client_state: dict[str, Any] | None = None,
) -> None:
    """Report `metrics` to Ray Train, with an Engine checkpoint of this step (collective).

    Every worker calls it at the same step (Ray's `report` is a barrier, and so is the save).
    The checkpoint is written into `checkpoint_dir/step_<N>` by all ranks together, so that folder
    must be one all ranks see (any folder when the workers share a machine; a shared filesystem
    across nodes), then copied by Ray into the run's storage and removed.

    Args:
        engine: the prepared Engine.
        metrics: what to report (numbers, strings).
        checkpoint: False reports the metrics only.
        checkpoint_dir: where the checkpoint is staged; default: a folder named after the Ray run
            under the system's temporary folder (right for workers on one machine).
        client_state: small state of your own saved with the checkpoint (returned by `resume`).

    Raises:
        ImportError: Ray Train is not installed (naming the extra).
    """
    train = _ray_train()
    if not checkpoint:
        train.report(metrics, checkpoint=None)
        return
    step = engine.num_optimizer_steps + engine.num_skipped_steps
    folder = _staging(checkpoint_dir) / f"step_{step}"
    engine.save_checkpoint(folder, client_state=client_state)
    _report_folder(train, metrics, folder)


def report_pretrained(
    engine: Engine,
    model: torch.nn.Module,
    metrics: dict[str, Any],
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **save_kwargs: Any,
) -> None:
    """Report `metrics` with the consolidated weights (`engine.save_pretrained`) as the checkpoint
    (collective: every worker calls it).

    The checkpoint reloads with plain `from_pretrained` (`checkpoint.as_directory()`); it holds no
    optimizer state, so `resume` cannot continue training from it.

    Args:
        engine: the prepared Engine.
        model: the prepared model.
        metrics: what to report.
        checkpoint_dir: where the folder is staged (as in `report`).
        **save_kwargs: passed to `engine.save_pretrained` (`tokenizer=`, `max_shard_size=`, ...).
    """
    train = _ray_train()
    step = engine.num_optimizer_steps + engine.num_skipped_steps
    folder = _staging(checkpoint_dir) / f"pretrained_{step}"
    engine.save_pretrained(model, folder, **save_kwargs)
    _report_folder(train, metrics, folder)


def resume(engine: Engine) -> dict[str, Any] | None:
    """Load Ray's checkpoint of this run into the prepared Engine (collective), if there is one.

    `ray.train.get_checkpoint()` is the newest checkpoint reported by this run before a restart
    (Ray's `FailureConfig`), or by an earlier run of the same `RunConfig(name=, storage_path=)`.

    Returns:
        The `client_state` saved with it, or None when Ray has no checkpoint (a fresh run).

    Raises:
        ImportError: Ray Train is not installed (naming the extra).
    """
    found = _ray_train().get_checkpoint()
    if found is None:
        return None
    with found.as_directory() as folder:
        return engine.load_checkpoint(folder)
