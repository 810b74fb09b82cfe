"""Crash-during-save host: one per rank; forks a fresh training process for every trial.

Usage: crash_host.py CONTROL_DIR BACKEND   (env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR)

Importing torch / DeepSpeed / transformers costs seconds per rank, so this host imports them
once and then, for each trial, waits for `CONTROL_DIR/go_<trial>` (holding "PORT MODE"), forks
a child, and records the child's pid in `pid_<trial>_rank<R>`. The child forms a NEW process
group on PORT (a fresh group per trial) and:

1. if the checkpoint folder has a `latest`, loads it with `engine.load_checkpoint`, checks the
   restored counters against the tag, trains one more step (finite loss), and writes
   `trial<T>_rank<R>.json`;
2. MODE "save": trains one step and saves in a loop -- `engine.save_checkpoint` (keep_last=2,
   a client_state of varying size) then `engine.save_pretrained` into `pretrained/model_<i%2>`
   (replacing the previous one; a varying max_shard_size, so 1 to several shards) -- until the
   test SIGKILLs it. Rank 0 appends to `progress.log` before and after each save:
   ``<time> <kind>-start|done <i> <name> <fingerprint>``; the fingerprint of the weights being
   saved is taken (collectively) before the save starts.
   MODE "check": stops after step 1 (the last trial: only the reload is checked).

`CONTROL_DIR/stop` ends the host.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import ds_engine  # noqa: F401  (imported once, before the forks)

SHARD_SIZES = ["5GB", "400KB", "150KB"]


def build_model() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=3000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    total = sum(float(t.double().abs().sum()) for t in state.values())
    return f"{total:.6e}:{len(state)}"


def trial(control: Path, backend: str, index: int, mode: str) -> None:
    from ds_engine import Engine

    rank = int(os.environ["RANK"])
    choices = {"zero_stage": 3, "dist_timeout_s": 60} if backend == "deepspeed" else {"dist_timeout_s": 60}
    engine = Engine(backend=backend, **choices)
    with engine.init_context():
        model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3000, (4096, 16), generator=g)
    labels = torch.randint(0, 2, (4096,), generator=g)
    loader = DataLoader(TensorDataset(ids, labels), batch_size=2)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    ckpt, pretrained = control / "ckpt", control / "pretrained"
    batches = iter(loader)

    def step() -> float:
        x, y = next(batches)
        with engine.accumulate(model):
            loss = model(input_ids=x, labels=y).loss
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        return float(loss.detach())

    result: dict = {"trial": index, "loaded": None}
    if (ckpt / "latest").exists():
        latest = (ckpt / "latest").read_text().strip()
        client = engine.load_checkpoint(ckpt)
        restored = engine.num_optimizer_steps
        loss = step()
        result.update(
            loaded=latest,
            restored_steps=restored,
            client_i=int(client["i"]),
            loss_after=loss,
            optimizer_steps_after=engine.num_optimizer_steps,
        )
    (control / f"trial{index}_rank{rank}.json").write_text(json.dumps(result))
    if mode == "check":
        return
    progress = open(control / "progress.log", "a", buffering=1) if rank == 0 else None  # noqa: SIM115
    rng = random.Random(index)

    def log(text: str) -> None:
        if progress is not None:
            progress.write(f"{time.time():.6f} {text}\n")
            progress.flush()

    for i in range(engine.num_optimizer_steps, engine.num_optimizer_steps + 10_000):
        step()
        tag = f"step_{engine.num_optimizer_steps}"
        log(f"ckpt-start {i} {tag} -")
        blob = torch.randn(rng.choice([1, 50_000, 400_000]))
        engine.save_checkpoint(ckpt, client_state={"i": i, "blob": blob}, keep_last=2)
        log(f"ckpt-done {i} {tag} -")
        name = f"model_{i % 2}"
        state = engine.get_state_dict(model)  # collective
        fp = fingerprint(state) if state is not None else "-"
        del state
        log(f"pretrained-start {i} {name} {fp}")
        engine.save_pretrained(model, pretrained / name, max_shard_size=rng.choice(SHARD_SIZES))
        log(f"pretrained-done {i} {name} {fp}")


def main() -> None:
    control, backend = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    # the heavy imports, once, before any fork
    import accelerate  # noqa: F401
    import transformers.models.bert.modeling_bert  # noqa: F401

    if backend == "deepspeed":
        import deepspeed  # noqa: F401
    index = 0
    while not (control / "stop").exists():
        go = control / f"go_{index}"
        if not go.exists():
            time.sleep(0.02)
            continue
        port, mode = go.read_text().split()
        pid = os.fork()
        if pid == 0:  # the trial: a fresh process and a fresh process group
            code = 0
            try:
                os.environ["MASTER_PORT"] = port
                trial(control, backend, index, mode)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        (control / f"pid_{index}_rank{rank}").write_text(str(pid))
        _, status = os.waitpid(pid, 0)
        (control / f"exit_{index}_rank{rank}").write_text(str(status))
        index += 1


if __name__ == "__main__":
    main()
