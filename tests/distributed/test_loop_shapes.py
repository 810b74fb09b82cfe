"""Every loop shape a user of accelerate writes trains exactly like the canonical loop, or stops at once.

Shapes (workers/loop_shapes.py), on every ZeRO stage and on the fallback (DDP, and FSDP2 with
the platform check pretended): the canonical `accumulate()` loop; the same calls without
`accumulate()`; `zero_grad()` first in each micro-step; hand-written accumulation
(`loss / gas`, `step()` every gas micro-steps) at GA=1 and off the Engine's boundaries at
GA=2; `backward` without a later `step`; `zero_grad` between `backward` and `step`; `step`
before `backward`; two `backward` calls in one micro-step; and `loss.backward()` called
directly. A shape that trains ends with the canonical loop's weights; one that stops raises a
RuntimeError whose message says what to change, at the first micro-step where training would
diverge, with only the optimizer steps a plain-torch run of the same loop would also take.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

MESSAGES = {
    "hand_written_ga1": (
        r"`optimizer\.step\(\)` was not called after its `engine\.backward`.*HINT: let the Engine"
    ),
    "hand_written_first_step_ga1": r"`optimizer\.step\(\)` was not called",
    "hand_written_ga2": r"`optimizer\.step\(\)` was not called",
    "backward_without_step_ga2": r"`optimizer\.step\(\)` was not called",
    "backward_without_step_ga1": r"`optimizer\.step\(\)` was not called",
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
        if r["expected"] == "trains":
            assert r["error"] is None, f"{label}: {r['error']}"
            assert r["optimizer_steps"] == 4, label  # 8 micro-batches, GA=2
            # Bit-equal, except that DDP decides at forward time whether to reduce: without
            # `accumulate()` the forward precedes the Engine's boundary decision, so the fallback
            # all-reduces every micro-step (the same mean, summed in another order).
            tolerance = 1e-6 if r["backend"] == "accelerate" and r["shape"] == "no_accumulate_ga2" else 0.0
            assert r["max_diff_vs_canonical"] <= tolerance, f"{label}: {r['max_diff_vs_canonical']:.2e}"
        else:
            micro_steps, optimizer_steps = r["expected"]
            assert r["error"] is not None, f"{label}: trained on silently"
            assert re.search(MESSAGES[r["shape"]], r["error"], re.S), f"{label}: {r['error']}"
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
