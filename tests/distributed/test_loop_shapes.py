"""Every loop shape a user of accelerate writes trains exactly like the canonical loop, or stops at once.

Shapes (workers/loop_shapes.py), on every ZeRO stage and on the fallback (DDP, and FSDP2 with
the platform check pretended). Train like the canonical `accumulate()` loop at GA=2: the same
calls without `accumulate()`; `zero_grad()` first in each micro-step; hand-written
accumulation at Engine(gradient_accumulation_steps=1) (`loss / 2`, `step()` every 2nd
micro-step: gradients add up until the user's `step()`, as in plain torch). Runs its own
windows: `if step % 2 == 0` at GA=1 (windows 1, 2, 2, 2; test_hand_accumulation.py checks each
applied gradient). Stop at once with a RuntimeError saying what to change, each because the
loop cannot mean what it says: hand-written accumulation at GA=2 (two accumulators: the
user's steps fall off the Engine's boundaries); `backward` without a later `step` (GA=2: at
the next micro-step; GA=1: when the epoch ends without any step, as the gradients would never
be applied); `zero_grad` between `backward` and `step` (discards the window before it is
applied); `step` before `backward` in a boundary micro-step; two `backward` calls in one
`accumulate()` micro-step; and `loss.backward()` called directly.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

MESSAGES = {
    "hand_written_ga2": (
        r"`optimizer\.step\(\)` was not called after its `engine\.backward`.*HINT: let the Engine.*"
        r"Accumulating by hand .* needs Engine\(gradient_accumulation_steps=1\)"
    ),
    "backward_without_step_ga2": r"`optimizer\.step\(\)` was not called",
    "backward_without_step_ga1": r"called `engine\.backward` but never `optimizer\.step\(\)`",
    "zero_grad_before_step_ga1": r"`optimizer\.zero_grad\(\)` between `engine\.backward\(loss\)` and",
    "step_before_backward_ga2": r"`optimizer\.step\(\)` before `engine\.backward\(loss\)`",
    "two_backwards_ga2": r"called twice in one `accumulate\(\)` micro-step",
    "direct_loss_backward_ga2": r"`loss\.backward\(\)` was called.*HINT: call `engine\.backward\(loss\)`",
}


def _check(results: list[dict], stages: list[int]) -> None:
    import re

    assert sorted({r["stage"] for r in results}) == stages
    for r in results:
        label = f"{r['backend']} zero{r['stage']} {r['shape']}"
        if r["expected"] == "runs":  # its own windows (1, 2, 2, 2 + one pending micro-step)
            assert r["error"] is None, f"{label}: {r['error']}"
            assert r["optimizer_steps"] == 4 and r["has_unapplied_gradients"], label
        elif r["expected"] == "trains":
            assert r["error"] is None, f"{label}: {r['error']}"
            assert r["optimizer_steps"] == 4, label  # 8 micro-batches, GA=2
            assert not r["has_unapplied_gradients"], label
            # Bit-equal, except where the reduction happens at another point: DDP decides at
            # forward time whether to reduce, so without `accumulate()` (the forward precedes the
            # Engine's boundary decision) the fallback all-reduces every micro-step; and at GA=1
            # (hand-written accumulation) ZeRO-0 and DDP average every backward and then add,
            # where GA=2 adds and then averages once: the same mean, summed in another order.
            reordered = (r["backend"] == "accelerate" and r["shape"] == "no_accumulate_ga2") or (
                r["shape"] == "hand_written_ga1" and (r["backend"] == "accelerate" or r["stage"] == 0)
            )
            tolerance = 1e-6 if reordered else 0.0
            assert r["max_diff_vs_canonical"] <= tolerance, f"{label}: {r['max_diff_vs_canonical']:.2e}"
        else:
            micro_steps, optimizer_steps = r["expected"]
            assert r["error"] is not None, f"{label}: trained on silently"
            expected = MESSAGES[r["shape"]]  # ds_engine's words on every backend and stage
            assert re.search(expected, r["error"], re.S), f"{label}: {r['error']}"
            assert (r["micro_steps"], r["optimizer_steps"]) == (micro_steps, optimizer_steps), label
            if optimizer_steps == 0:
                assert r["weights_unchanged"], label


@pytest.mark.deepspeed
def test_deepspeed_loop_shapes_train_exactly_or_stop_at_once():
    stages = [0, 1, 2, 3]
    ranks = run_workers("loop_shapes.py", "--backend", "deepspeed", "--stages", json.dumps(stages))
    _check(ranks[0]["results"], stages)
    assert ranks[0]["results"] == ranks[1]["results"]  # every rank stopped at the same point


def test_fallback_loop_shapes_train_exactly_or_stop_at_once():
    """ZeRO-0 runs as DDP; ZeRO-2/3 as FSDP2 (platform check pretended on these CPU ranks)."""
    stages = [0, 2, 3]
    ranks = run_workers(
        "loop_shapes.py", "--pretend-fsdp", "--backend", "accelerate", "--stages", json.dumps(stages)
    )
    _check(ranks[0]["results"], stages)
    assert ranks[0]["results"] == ranks[1]["results"]
