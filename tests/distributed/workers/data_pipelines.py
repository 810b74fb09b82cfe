"""Streams and custom batch samplers on real ranks: the weights equal a one-process reference.

Per scenario (--scenarios, JSON: [{"name", "backend", "zero_stage", "data": "stream" | "hf_stream" |
"batches", "api": "engine" | "accelerator"}]; "hf_stream": a `datasets` stream with a shuffle buffer,
reshuffled per epoch), every rank:

* trains EPOCHS epochs (SGD, GA=4, fp32) over the scenario's data and reports its batches' sample
  ids; rank 0 compares the final weights with a plain-torch reference that applies, per window,
  the mean over the window's world x length micro-batches of each one's mean-loss gradient,
  the global batches being rebuilt here independently of ds_engine (the stream: consecutive
  global batches of batch x world samples, the last completed from the stream's start; the
  batch sampler: its batches dealt round robin, the last round completed by its first batches);
* trains again to SAVE_AT optimizer steps (mid-epoch 0), saves a checkpoint, and a fresh Engine
  loads it and trains to the end: the weights must equal the uninterrupted run's;
* runs an evaluation pass over a prepared loader of the same data with `gather_for_metrics`:
  every sample id exactly once;
* checks that a batch sampler drawing different batches on each rank is refused;
* reports the stream agreements (count, seconds) and one agreement's cost with the ranks in step.

The stream has N=23 samples (not a multiple of 2 x 2): 6 global batches per epoch, windows of 4
and 2 batches (the short last one), the last global batch one sample short (padded with id 0).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from _common import error_of, parse_args, rank, write_result
from torch.utils.data import DataLoader, Dataset, IterableDataset

N = 23
BATCH = 2
GA = 4
EPOCHS = 2
LR = 0.1
SAVE_AT = 1  # optimizer steps: after the first window, mid-epoch 0
BUDGET = 12  # the length-grouped sampler's tokens per batch (longest x count)
AGREEMENT_REPEATS = 200


def make_tensors() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    lengths = torch.randint(1, 7, (N,), generator=g).tolist()
    return x, y, lengths


X, Y, LENGTHS = make_tensors()


class Samples(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": X[i], "y": Y[i]}


class Stream(IterableDataset):
    """A stream with no length (as `datasets.load_dataset(..., streaming=True)` gives)."""

    def __iter__(self):
        for i in range(N):
            yield {"id": i, "x": X[i], "y": Y[i]}


class LengthGroupedBatches:
    """Whole batches of similar length under a token budget (a bucketing batch sampler): shuffled
    by seed + epoch, grouped in mega-batches of 8 sorted by length, cut at BUDGET; no `__len__`."""

    def __init__(self, seed: int = 3) -> None:
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        batches: list[list[int]] = []
        for start in range(0, N, 8):
            batch: list[int] = []
            for i in sorted(order[start : start + 8], key=lambda i: -LENGTHS[i]):
                if batch and max(LENGTHS[j] for j in [*batch, i]) * (len(batch) + 1) > BUDGET:
                    batches.append(batch)
                    batch = []
                batch.append(i)
            batches.append(batch)
        return iter(batches)


def hf_stream():
    """A `datasets` stream over 3 shards with a shuffle buffer (reshuffled per epoch by `set_epoch`)."""
    import datasets

    table = {"id": list(range(N)), "x": X.tolist(), "y": Y.tolist()}
    stream = datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=3)
    return stream.shuffle(seed=5, buffer_size=8).with_format("torch")


def make_loader(data: str) -> DataLoader:
    if data == "stream":
        return DataLoader(Stream(), batch_size=BATCH)
    if data == "hf_stream":
        return DataLoader(hf_stream(), batch_size=BATCH)
    return DataLoader(Samples(), batch_sampler=LengthGroupedBatches())


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


# ------------------------------------------------------------------- the reference's global batches
def rounds(data: str, epoch: int, world: int) -> list[list[list[int]]]:
    """Per global batch, each rank's sample ids (rebuilt here, independently of ds_engine)."""
    if data in ("stream", "hf_stream"):
        order = list(range(N))
        if data == "hf_stream":  # the stream's own order this epoch, read in one process
            stream = hf_stream()
            stream.set_epoch(epoch)
            order = [int(sample["id"]) for sample in stream]
        global_batch = BATCH * world
        count = -(-N // global_batch)
        ids = order + [order[i % N] for i in range(count * global_batch - N)]
        return [
            [ids[b * global_batch + r * BATCH : b * global_batch + (r + 1) * BATCH] for r in range(world)]
            for b in range(count)
        ]
    sampler = LengthGroupedBatches()
    sampler.set_epoch(epoch)
    batches = list(sampler)
    count = -(-len(batches) // world)
    return [[batches[(b * world + r) % len(batches)] for r in range(world)] for b in range(count)]


def reference(data: str, world: int) -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        epoch_rounds = rounds(data, epoch, world)
        for start in range(0, len(epoch_rounds), GA):
            window = epoch_rounds[start : start + GA]
            optimizer.zero_grad()
            for per_rank in window:
                for ids in per_rank:
                    loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
                    (loss / (world * len(window))).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------- ds_engine
def build(scenario: dict):
    if scenario.get("api") == "accelerator":
        from ds_engine import Accelerator

        engine = Accelerator(
            cpu=True,
            gradient_accumulation_steps=GA,
            backend=scenario["backend"],
            zero_stage=scenario["zero_stage"],
            gradient_clipping=0.0,
        )
    else:
        from ds_engine import Engine

        engine = Engine(
            backend=scenario["backend"],
            zero_stage=scenario["zero_stage"],
            gradient_accumulation_steps=GA,
            precision="fp32",
            gradient_clipping=0.0,
        )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = engine.prepare(model, optimizer, make_loader(scenario["data"]))
    return engine, model, optimizer, loader


def train(engine, model, optimizer, loader, *, stop: int | None = None, save_dir: Path | None = None):
    """Train until EPOCHS epochs are done (or `stop` optimizer steps: save there, mid-epoch)."""
    seen: list[list[int]] = []
    while loader.epoch < EPOCHS:
        for batch in loader:
            seen.append(batch["id"].tolist())
            with engine.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if stop is not None and engine.sync_gradients and engine.num_optimizer_steps == stop:
                engine.save_checkpoint(save_dir)
                return seen
    return seen


def weights(engine, model) -> dict[str, torch.Tensor]:
    return engine.get_state_dict(model, dtype=torch.float32) or {}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def run(scenario: dict, out: Path, world: int) -> dict:
    result: dict = {"name": scenario["name"]}
    engine, model, optimizer, loader = build(scenario)
    result["kind"] = loader.kind
    began = time.perf_counter()
    result["seen"] = train(engine, model, optimizer, loader)
    result["train_seconds"] = time.perf_counter() - began
    result["steps"] = engine.num_optimizer_steps
    result["micro_steps"] = engine.num_micro_steps
    result["agreements"] = [loader.agreements, loader.agreement_seconds]
    if (
        loader.kind == "stream" and scenario["data"] == "stream"
    ):  # one agreement's cost, ranks in step (a barrier first)
        torch.distributed.barrier()
        began = time.perf_counter()
        for _ in range(AGREEMENT_REPEATS):
            loader._agree(1)
        result["agreement_us"] = (time.perf_counter() - began) / AGREEMENT_REPEATS * 1e6
    result["expected_seen"] = [
        per_rank[rank()] for epoch in range(EPOCHS) for per_rank in rounds(scenario["data"], epoch, world)
    ]
    full = weights(engine, model)
    if rank() == 0:
        result["max_abs_diff"] = max_diff(full, reference(scenario["data"], world))
        result["trained_distance"] = max_diff(full, make_model().state_dict())

    # resume mid-epoch in a fresh Engine (the same processes): the same final weights
    folder = out / scenario["name"] / "ckpt"
    engine2, model2, optimizer2, loader2 = build(scenario)
    train(engine2, model2, optimizer2, loader2, stop=SAVE_AT, save_dir=folder)
    engine3, model3, optimizer3, loader3 = build(scenario)
    engine3.load_checkpoint(folder)
    result["resumed_position"] = loader3.checkpoint_state()
    result["resumed_seen"] = train(engine3, model3, optimizer3, loader3)
    resumed = weights(engine3, model3)
    if rank() == 0:
        result["resume_max_abs_diff"] = max_diff(resumed, full)

    # evaluation: gather_for_metrics keeps every sample once
    evaluation = engine3.prepare(make_loader(scenario["data"]))
    gathered: list[int] = []
    with torch.no_grad():
        for batch in evaluation:
            gathered += engine3.gather_for_metrics(batch["id"]).tolist()
    result["gathered_ids"] = gathered
    if scenario["data"] == "batches":  # a batch sampler drawing other batches on each rank
        differing = DataLoader(Samples(), batch_sampler=[[rank()], [2]])
        result["refused"] = error_of(lambda: engine3.prepare(differing))
    return result


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    world = int(os.environ["WORLD_SIZE"])
    results = [run(s, Path(args.out), world) for s in json.loads(args.scenarios)]
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
