"""The canonical loop of accelerate's original DeepSpeed support, verbatim, with an injected overflow.

Engine(gradient_accumulation_steps=1); the user accumulates by hand (`loss / gas`, steps on
`step % gas == 0`), steps the scheduler only `if not optimizer.is_overflow`, and saves with
``unwrap_model(model).save_pretrained(dir, state_dict=engine.get_state_dict(model),
save_function=engine.save)`` on every rank. Rank 0's loss is multiplied by inf in one
micro-step, so the step of that window must be skipped on every rank.

Records per user step: `optimizer.is_overflow`, `engine.step_was_skipped`,
`engine.optimizer_step_was_skipped`, the LR after the (conditional) scheduler call; the
scheduler's own step count; which ranks wrote model files; and, on rank 0, whether the saved
folder reloads with plain `from_pretrained` to exactly `engine.get_state_dict(model)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from _common import parse_args, patch_cpu_fp16, rank, write_result
from torch.utils.data import DataLoader

SEQ = 8
VOCAB = 32
MICRO_BATCH = 2
NUM_BATCHES = 8  # per rank
GAS = 2
INJECT_AT = 2  # micro-step whose loss is inf on rank 0: the step at micro-step 2 is skipped
LR = 1e-3

WRITES: list[str] = []


def spy_on_writes() -> None:
    """Record every model file transformers writes from this rank."""
    from transformers import modeling_utils

    original = modeling_utils.safe_save_file

    def recording(tensors, filename, *args, **kwargs):
        WRITES.append(os.path.basename(filename))
        return original(tensors, filename, *args, **kwargs)

    modeling_utils.safe_save_file = recording


def make_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0
    )
    cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def make_data(world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (world * MICRO_BATCH * NUM_BATCHES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def run(s: dict, out: Path) -> dict:
    from transformers import GPT2LMHeadModel, get_linear_schedule_with_warmup

    from ds_engine import Engine

    engine = Engine(
        backend=s["backend"],
        zero_stage=s["zero_stage"],
        precision=s["precision"],
        gradient_accumulation_steps=1,
        gradient_clipping=0.0,
        initial_scale_power=8,
    )
    gradient_accumulation_steps = GAS
    world = int(os.environ["WORLD_SIZE"])
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_dl = DataLoader(make_data(world), batch_size=MICRO_BATCH)
    total = NUM_BATCHES // GAS  # the user's steps on one rank's share
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total)
    output_dir = out / f"model_{s['backend']}_zero{s['zero_stage']}"
    records = []
    WRITES.clear()

    # ---- accelerate's canonical loop, verbatim (accelerator -> engine) ----
    model, optimizer, train_dl, lr_scheduler = engine.prepare(model, optimizer, train_dl, lr_scheduler)
    for step, batch in enumerate(train_dl):
        outputs = model(**batch)
        loss = outputs.loss / gradient_accumulation_steps
        if step == INJECT_AT and engine.process_index == 0:
            loss = loss * float("inf")  # injected overflow (rank 0 only: every rank must skip)
        engine.backward(loss)
        if step % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer.is_overflow:
                lr_scheduler.step()
            records.append(
                {
                    "step": step,
                    "is_overflow": optimizer.is_overflow,
                    "step_was_skipped": engine.step_was_skipped,
                    "optimizer_step_was_skipped": engine.optimizer_step_was_skipped,
                    "lr": lr_scheduler.get_last_lr()[0],
                }
            )
    engine.wait_for_everyone()
    unwrapped_model = engine.unwrap_model(model)
    unwrapped_model.save_pretrained(
        output_dir, state_dict=engine.get_state_dict(model), save_function=engine.save
    )
    # ---- end of the idiom ----
    writes = list(WRITES)

    engine.wait_for_everyone()
    expected = engine.get_state_dict(model)  # collective again, for the comparison
    reload = None
    if rank() == 0:
        reloaded = GPT2LMHeadModel.from_pretrained(output_dir).state_dict()
        missing = sorted(set(expected) - set(reloaded))
        differ = sorted(
            k for k in expected if k in reloaded and not torch.equal(reloaded[k].float(), expected[k].float())
        )
        empty = sorted(k for k, v in expected.items() if v.numel() == 0)
        reload = {
            "files": sorted(p.name for p in output_dir.iterdir()),
            "missing": missing,
            "differ": differ,
            "empty": empty,
            "num_tensors": len(expected),
        }
    # sharded model's own save_pretrained without state_dict: an error on rank 0, not empty tensors
    own = None
    try:
        unwrapped_model.save_pretrained(out / f"own_{s['backend']}_zero{s['zero_stage']}")
        own = "saved"
    except ValueError as exc:
        own = str(exc)
    engine.wait_for_everyone()
    # engine.save: main process only, atomic
    target = out / f"obj_{s['backend']}_zero{s['zero_stage']}.pt"
    engine.save({"w": torch.arange(4.0)}, target)
    safe_target = target.with_suffix(".safetensors")
    engine.save({"w": torch.arange(4.0)}, safe_target, safe_serialization=True)
    engine.wait_for_everyone()
    from safetensors.torch import load_file

    saved_ok = torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(4.0)) and torch.equal(
        load_file(str(safe_target))["w"], torch.arange(4.0)
    )
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    return {
        **s,
        "records": records,
        "num_optimizer_steps": engine.num_optimizer_steps,
        "num_skipped_steps": engine.num_skipped_steps,
        "scheduler_steps": lr_scheduler.num_steps,
        "scheduler_last_epoch": lr_scheduler.scheduler.last_epoch,
        "writes": writes,
        "reload": reload,
        "own_save": own,
        "engine_save_ok": saved_ok,
        "leftovers": leftovers,
    }


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    scenarios = json.loads(args.scenarios)
    if any(s["backend"] == "deepspeed" and s["precision"] == "fp16" for s in scenarios):
        patch_cpu_fp16()
    spy_on_writes()
    out = Path(args.out)
    results = []
    for s in scenarios:
        try:
            results.append(run(s, out))
        except Exception as exc:  # report per scenario; the test shows which one
            import traceback

            results.append(
                {**s, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
            )
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
