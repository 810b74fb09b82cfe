"""Ray Train: the Engine's training loop in `TorchTrainer` workers, checkpoints through Ray.

    pip install "ds-engine[ray]"
    python scripts/examples/ray_train_loop.py --storage /tmp/ray_runs --name demo --zero-stage 2

starts a local Ray cluster (or joins the one RAY_ADDRESS names) and trains a small regression
model on 2 CPU workers (`ScalingConfig(num_workers=2, use_gpu=False)`; on GPUs, --gpu). Every
`--every` optimizer steps each worker calls `ray_train.report(engine, metrics)`, which saves an
Engine checkpoint and hands it to `ray.train.report`. Run the same command again (same
--storage and --name) and `ray_train.resume(engine)` continues from the run's newest checkpoint.

The loop itself is the README's; `train_loop_per_worker` also runs without Ray, under torchrun:

    ds-engine launch --nproc-per-node 2 scripts/examples/ray_train_loop.py --torchrun --out /tmp/t

and with `--autosave DIR` it resumes from DIR and saves there every 30 minutes and on SIGTERM or
SIGUSR1 (`engine.autosave`; the Slurm job in scripts/examples/slurm_job.sbatch runs it so).

Each rank appends `{"step", "loss"}` per optimizer step to `<out>/losses_rank<R>.jsonl` when --out
is given, and rank 0 writes the final fp32 weights to `<out>/weights.pt`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine

NUM_SAMPLES = 64
MICRO_BATCH = 2
EPOCHS = 2


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return TensorDataset(x, y)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One worker's training loop: under Ray (`config["ray"]`) or under torchrun."""
    use_ray = bool(config.get("ray", True))
    if use_ray:
        from ds_engine import ray_train
    engine = Engine(
        backend=config.get("backend", "auto"),
        zero_stage=int(config.get("zero_stage", 2)),
        gradient_accumulation_steps=2,
        precision="fp32",
        gradient_clipping=1.0,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 40)
    train_dl = DataLoader(
        make_data(), batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    model, optimizer, train_dl, scheduler = engine.prepare(model, optimizer, train_dl, scheduler)
    torch.manual_seed(300 + engine.process_index)  # dropout differs per rank (and is restored)
    if use_ray:
        ray_train.resume(engine)  # Ray's newest checkpoint of this run, if it has one
    elif config.get("autosave"):  # torchrun (e.g. under Slurm): resume, save periodically and on preemption
        engine.autosave(
            config["autosave"],
            every_minutes=30,
            keep_last=2,
            signals=("SIGTERM", "SIGUSR1"),
            requeue=True,  # under Slurm: `scontrol requeue` after the preemption save
        )

    out = Path(config["out"]) if config.get("out") else None
    log = open(out / f"losses_rank{engine.process_index}.jsonl", "a") if out else None  # noqa: SIM115
    every, stop_after = int(config.get("every", 4)), int(config.get("stop_after", 0))
    for _epoch in range(train_dl.epoch, EPOCHS):
        for x, y in train_dl:
            with engine.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not engine.sync_gradients:
                continue
            step = engine.num_optimizer_steps
            if log is not None:
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                log.flush()
            if use_ray:
                metrics = {"step": step, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]}
                ray_train.report(engine, metrics, checkpoint=step % every == 0)
            if step == stop_after:  # an interrupted run, for the resume check
                engine.end_training()
                return
    weights = engine.get_state_dict(model, dtype=torch.float32)  # collective: rank 0 gets them
    if out is not None and weights is not None:
        torch.save(weights, out / "weights.pt")
    engine.end_training()


def fit(config: dict[str, Any], *, workers: int, gpu: bool, storage: str, name: str) -> Any:
    """Run `train_loop_per_worker` on `workers` Ray workers; the Result of `TorchTrainer.fit()`."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**config, "ray": True},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu),
        run_config=RunConfig(name=name, storage_path=storage),
    )
    return trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--torchrun", action="store_true", help="run the loop under torchrun, without Ray")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="auto, deepspeed or accelerate")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N optimizer steps")
    parser.add_argument("--out", default="", help="folder for the per-step losses and final weights")
    parser.add_argument(
        "--autosave", default="", help="with --torchrun: engine.autosave folder (resumes from it)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--storage", default=os.path.abspath("ray_runs"), help="Ray's storage_path")
    parser.add_argument("--name", default="ds_engine_ray_example", help="Ray's run name")
    args = parser.parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    config = {"zero_stage": args.zero_stage, "backend": args.backend, "every": args.every, "out": args.out}
    config["autosave"] = args.autosave
    if args.torchrun:
        train_loop_per_worker({**config, "ray": False})
        return
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    result = fit(config, workers=args.workers, gpu=args.gpu, storage=args.storage, name=args.name)
    print(f"final metrics: {result.metrics}; newest checkpoint: {result.checkpoint}")


if __name__ == "__main__":
    main()
