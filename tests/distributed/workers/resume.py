"""Resume worker: train, save a checkpoint mid-epoch, resume in new processes, compare weights.

Phases (--phase), each a separate launch so that resuming really happens in new processes:

* ``reference``: for every scenario, an uninterrupted run of TOTAL optimizer steps (final fp32
  weights saved as ``<out>/<name>/reference.pt``), then a fresh run of SAVE_AT steps that calls
  `save_checkpoint` mid-epoch (``<out>/<name>/ckpt``).
* ``resume``: for every scenario, `load_checkpoint` from ``--from-dir`` and train to TOTAL steps;
  the final weights go into the result for the test to compare.
* ``save``: like the second half of ``reference`` only (a checkpoint written by this world size).

Every run uses a seeded shuffled dataloader, a linear LR decay, GA (2 on 2 ranks, 4 on 1 rank:
the same 8 samples per optimizer step), AdamW, dropout and python/numpy noise drawn per rank,
so the dataloader position, the schedule, the optimizer and every RNG must be restored for
the weights to match.

Scenarios come in --scenarios as JSON: [{"name", "backend", "zero_stage", "stochastic" (python and
numpy noise), "dropout" (torch RNG), "control" (disturb numpy's RNG after loading),
"from_dir" (where to resume from), "phases" (the phases this scenario runs in)}].
"""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from _common import parse_args, pretend_fsdp_platform, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

NUM_SAMPLES = 48
MICRO_BATCH = 2
SAMPLES_PER_STEP = 8
TOTAL = 10  # optimizer steps; 6 per epoch, so the run crosses into epoch 1
SAVE_AT = 4  # mid-epoch 0


class Net(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    return TensorDataset(x, y)


def seed_everything() -> None:
    random.seed(100 + rank())
    np.random.seed(200 + rank())
    torch.manual_seed(300 + rank())


def build(scenario: dict, world: int):
    from ds_engine import Engine

    ga = SAMPLES_PER_STEP // (MICRO_BATCH * world)
    engine = Engine(
        backend=scenario["backend"],
        zero_stage=scenario.get("zero_stage", 0),
        gradient_accumulation_steps=ga,
        precision="fp32",
        gradient_clipping=1.0,
    )
    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    model = Net(0.2 if scenario.get("dropout") else 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (TOTAL + 2))
    loader = DataLoader(
        make_data(), batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    seed_everything()
    return engine, model, optimizer, loader, scheduler


def train(engine, model, optimizer, loader, scheduler, *, stochastic, step, stop, save_dir=None):
    """Train from optimizer step `step` to `stop`; save a checkpoint when reaching `stop` if asked."""
    lrs = []
    while step < stop:
        for x, y in loader:
            with engine.accumulate(model):
                if stochastic:  # noise drawn from python's and numpy's RNG, per rank
                    x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape)).float()
                    y = y * (1.0 + 0.05 * random.random())
                loss = torch.nn.functional.mse_loss(model(x), y)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if engine.sync_gradients:
                step += 1
                lrs.append(scheduler.get_last_lr()[0])
                if step == stop:
                    if save_dir is not None:  # mid-epoch, inside the loop
                        engine.save_checkpoint(save_dir, client_state={"step": step, "note": "mid-epoch"})
                    break
    return lrs


def full_weights(engine, model) -> dict[str, torch.Tensor]:
    return engine.get_state_dict(model, dtype=torch.float32) or {}


def run_phase(phase: str, scenario: dict, out: Path, args) -> dict:
    name, stochastic = scenario["name"], scenario["stochastic"]
    world = int(os.environ["WORLD_SIZE"])
    base = name.removesuffix("_control")
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    if phase == "reference":
        parts = build(scenario, world)
        initial = full_weights(parts[0], parts[1])
        result["lrs"] = train(*parts, stochastic=stochastic, step=0, stop=TOTAL)
        result["fsdp"] = hasattr(parts[1], "set_requires_gradient_sync")
        weights = full_weights(parts[0], parts[1])
        if rank() == 0:
            torch.save(weights, folder / "reference.pt")
            result["trained_distance"] = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    if phase in ("reference", "save"):
        parts = build(scenario, world)
        train(*parts, stochastic=stochastic, step=0, stop=SAVE_AT, save_dir=folder / "ckpt")
        result["saved_counters"] = [parts[0].num_optimizer_steps, parts[0].num_micro_steps]
    if phase == "resume":
        engine, model, optimizer, loader, scheduler = build(scenario, world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client = engine.load_checkpoint(Path(scenario.get("from_dir") or args.from_dir) / base / "ckpt")
        result["warnings"] = [str(w.message) for w in caught if "ds_engine" in str(w.message)]
        result["client_state"] = client
        result["loaded_counters"] = [engine.num_optimizer_steps, engine.num_micro_steps]
        result["fsdp"] = hasattr(model, "set_requires_gradient_sync")
        result["lr_after_load"] = [scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"]]
        if scenario.get("control"):  # sensitivity check: a disturbed RNG must change the outcome
            np.random.seed(999)
        result["lrs"] = train(
            engine,
            model,
            optimizer,
            loader,
            scheduler,
            stochastic=stochastic,
            step=client["step"],
            stop=TOTAL,
        )
        weights = full_weights(engine, model)
        if rank() == 0:
            reference = torch.load(Path(args.reference_dir) / base / "reference.pt")
            result["max_abs_diff"] = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
            result["bitwise_equal"] = all(torch.equal(weights[k], reference[k]) for k in reference)
    return result


def main() -> None:
    args = parse_args(
        [
            ("--phase", {"required": True}),
            ("--scenarios", {"required": True}),
            ("--from-dir", {"default": None}),
            ("--reference-dir", {"default": None}),
            ("--pretend-fsdp", {"action": "store_true"}),
        ]
    )
    if args.pretend_fsdp:  # the fallback's ZeRO-2/3 run as FSDP2 on these CPU ranks
        pretend_fsdp_platform()
    results = {}
    for phase in args.phase.split(","):
        for scenario in json.loads(args.scenarios):
            if phase in scenario.get("phases", [phase]):
                results[f"{phase}:{scenario['name']}"] = run_phase(phase, scenario, Path(args.out), args)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
