"""Non-finite policy worker: skip and count, then `FloatingPointError` after N in a row.

Each scenario trains a small MLP with `max_consecutive_skipped_steps=LIMIT`. Rank 1 alone
multiplies its loss by NaN (so the ranks must agree to skip): once at optimizer step 1 (an
isolated skip: counted, weights untouched, training goes on), then from step 3 on at every
step, until the Engine raises. Per scenario the result records each boundary, the weights
before/after the isolated skip, and where and what the Engine raised.

With `--reraise`, after writing its result the worker raises the last scenario's
FloatingPointError again, uncaught, so the job must end non-zero on every rank.
"""

from __future__ import annotations

import json
import os
import time

import torch
from _common import parse_args, write_result
from torch.utils.data import DataLoader, TensorDataset

LIMIT = 3
ISOLATED = 1
RUN_FROM = 3


def run(s: dict) -> tuple[dict, BaseException | None]:
    from ds_engine import Engine

    engine = Engine(
        backend=s["backend"],
        zero_stage=s.get("zero_stage", 0),
        precision=s["precision"],
        max_consecutive_skipped_steps=LIMIT,
        gradient_clipping=s.get("clip", 0.0),
        dist_timeout_s=60,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(5)
    n = world * 2 * 12
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    module = engine.unwrap_model(model)
    dtype = next(module.parameters()).dtype
    rank = engine.process_index

    def weights() -> list[float]:
        full = engine.get_state_dict(model)  # collective: every rank calls it
        return [] if full is None else [float(v) for v in full["0.weight"].flatten()[:8].float()]

    records: list[dict] = []
    before = after = None
    raised: BaseException | None = None
    error = None
    for step, (x, y) in enumerate(loader):
        poison = step == ISOLATED or step >= RUN_FROM
        if step == ISOLATED:
            before = weights()
        try:
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y.float())
            if poison and rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        except FloatingPointError as exc:
            raised, error = exc, {"step": step, "type": type(exc).__name__, "message": str(exc)}
            break
        records.append(
            {"step": step, "skipped": engine.step_was_skipped, "num_skipped": engine.num_skipped_steps}
        )
        if step == ISOLATED:
            after = weights()
    finite = engine.get_state_dict(model)
    return (
        {
            **s,
            "backend_name": engine.backend_name,
            "records": records,
            "before": before,
            "after": after,
            "error": error,
            "num_optimizer_steps": engine.num_optimizer_steps,
            "num_skipped_steps": engine.num_skipped_steps,
            "weights_finite": None
            if finite is None
            else all(bool(t.float().isfinite().all()) for t in finite.values()),
        },
        raised,
    )


def main() -> None:
    args = parse_args([("--scenarios", {"required": True}), ("--reraise", {"action": "store_true"})])
    results, last = [], None
    for s in json.loads(args.scenarios):
        try:
            result, last = run(s)
        except Exception as exc:  # report per scenario; the test shows which one
            import traceback

            result = {**s, "crash": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
        results.append(result)
    write_result(args.out, {"results": results, "finished_at": time.time()})
    if args.reraise and last is not None:
        raise last


if __name__ == "__main__":
    main()
