"""Token-weighted accumulation, every window length: the applied gradient is the window's token mean.

For one backend setting and every GA in the scenario, a tiny GPT-2 trains on sequences whose
labels are padded with -100 to a different length each, so the token mean of a window differs
from the mean of its micro-batches' means. The loop is the one `Engine.windows` documents:

    for window in engine.windows(loader):
        num_items = engine.reduce(<label tokens in the window on this rank>, "sum")
        for batch in window:
            with engine.accumulate(model):
                engine.backward(<summed token loss of the batch>, num_items=num_items)
                optimizer.step(); optimizer.zero_grad()

Windows ``[GA, r]`` for every ``r`` in ``1..GA``; SGD without momentum, clipping off, so the
applied gradient is ``(w_before - w_after) / lr``. A one-process reference takes each window's
sequences (of every rank) as one batch and its exact token mean. The worker also reports how
far the mean of per-batch means is from the token mean, so a test knows the data tells them
apart.
"""

from __future__ import annotations

import json
import os

import torch
from _common import parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset
from window_grads import LR, MICRO_BATCH, SEQ, VOCAB, compare, full_params, make_model


def make_data(ga: int, last: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 * ga + last)
    n = world * MICRO_BATCH * (ga + last)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = ids.clone()
    kept = torch.randint(2, SEQ + 1, (n,), generator=g)  # 1..SEQ-1 label tokens after the shift
    for i, k in enumerate(kept.tolist()):
        labels[i, k:] = -100
    return TensorDataset(ids, labels)


def token_loss_sum(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def reference(gas: list[int], world: int) -> tuple[list[dict[str, torch.Tensor]], float]:
    """Token-mean gradients of each window taken as one batch; and the largest relative gap
    between a window's token mean and the mean of its micro-batches' token means."""
    grads, gap = [], 0.0
    for ga in gas:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for last in range(1, ga + 1):
            ids, labels = make_data(ga, last, world).tensors
            start = 0
            for window in (ga, last):
                n = window * world * MICRO_BATCH
                x, y = ids[start : start + n], labels[start : start + n]
                start += n
                opt.zero_grad()
                (token_loss_sum(model, x, y) / tokens(y)).backward()
                exact = {k: p.grad.detach().double().clone() for k, p in model.named_parameters()}
                opt.zero_grad()
                for b in range(0, n, MICRO_BATCH):
                    xb, yb = x[b : b + MICRO_BATCH], y[b : b + MICRO_BATCH]
                    (token_loss_sum(model, xb, yb) / tokens(yb) / (n // MICRO_BATCH)).backward()
                means = {k: p.grad.detach().double().clone() for k, p in model.named_parameters()}
                gap = max(gap, compare(means, exact)[0])
                for k, p in model.named_parameters():
                    p.grad = exact[k].to(p.dtype)
                grads.append(exact)
                opt.step()
    return grads, gap


def run(scenario: dict, world: int) -> dict:
    from ds_engine import Engine

    windows, applied = [], []
    for ga in scenario["gas"]:
        engine = Engine(
            backend=scenario["backend"],
            zero_stage=scenario["zero_stage"],
            gradient_accumulation_steps=ga,
            precision="fp32",
            gradient_clipping=0.0,
            coalesce_grad_reduction=scenario.get("coalesce", False),
            micro_batch_size=MICRO_BATCH,
        )
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = engine.prepare(model, optimizer)
        before = full_params(engine, model)
        for last in range(1, ga + 1):
            loader = engine.prepare(DataLoader(make_data(ga, last, world), batch_size=MICRO_BATCH))
            sizes, boundaries = [], []
            for window in engine.windows(loader):
                sizes.append(len(window))
                num_items = engine.reduce(torch.tensor(float(sum(tokens(y) for _, y in window))), "sum")
                for ids, labels in window:
                    with engine.accumulate(model):
                        engine.backward(token_loss_sum(model, ids, labels), num_items=num_items)
                        optimizer.step()
                        optimizer.zero_grad()
                    boundaries.append(engine.sync_gradients)
                    if engine.sync_gradients:
                        after = full_params(engine, model)
                        applied.append({k: (before[k] - after[k]) / LR for k in after})
                        before = after
            windows.append({"ga": ga, "last": last, "sizes": sizes, "boundaries": boundaries})
    return {"windows": windows, "applied": applied}


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for scenario in json.loads(args.scenarios):
        out = run(scenario, world)
        ref, gap = reference(scenario["gas"], world)
        errors = [compare(got, r) for got, r in zip(out["applied"], ref)]
        results.append(
            {
                **scenario,
                "windows": out["windows"],
                "num_boundaries": len(out["applied"]),
                "num_reference_windows": len(ref),
                "errors": [e for e, _, _ in errors],
                "tensor_errors": [e for _, e, _ in errors],
                "worst_tensor": [w for _, _, w in errors],
                "mean_of_means_gap": gap,
            }
        )
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
