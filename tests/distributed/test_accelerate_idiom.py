"""accelerate's original DeepSpeed loop runs verbatim: hand-written accumulation, is_overflow, saving.

workers/accelerate_idiom.py runs, on 2 ranks with Engine(gradient_accumulation_steps=1):

    model, optimizer, train_dl, lr_scheduler = engine.prepare(model, optimizer, train_dl, lr_scheduler)
    for step, batch in enumerate(train_dl):
        loss = model(**batch).loss / gradient_accumulation_steps
        engine.backward(loss)
        if step % gradient_accumulation_steps == 0:
            optimizer.step(); optimizer.zero_grad()
            if not optimizer.is_overflow:
                lr_scheduler.step()
    engine.wait_for_everyone()
    unwrapped_model = engine.unwrap_model(model)
    unwrapped_model.save_pretrained(output_dir, state_dict=engine.get_state_dict(model),
                                    save_function=engine.save)

with rank 0's loss made inf in micro-step 2 (fp16: DeepSpeed's loss scaler; the fallback on
CPU: its own non-finite check). Checked: the step of that window is skipped on every rank and
`optimizer.is_overflow`, `engine.step_was_skipped` and `engine.optimizer_step_was_skipped`
say so exactly then; the scheduler advanced once per applied step (the user's guard and the
Engine's own overflow-aware scheduler never double-skip or double-step); only rank 0 wrote
model files; the folder reloads with plain `from_pretrained` to exactly
`engine.get_state_dict(model)`, no tensor empty; a sharded model's own `save_pretrained`
without `state_dict=` is refused (ZeRO-3) instead of writing empty shards; `engine.save`
writes on rank 0 only, atomically (no temporary file left), torch or safetensors.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = pytest.mark.distributed

LR = 1e-3
USER_STEPS = [0, 2, 4, 6]  # step % 2 == 0 over 8 micro-batches per rank
SKIPPED = 2  # the window holding the injected inf (micro-steps 1, 2)


def _check(results: list[dict], rank1: list[dict]) -> None:
    for r, other in zip(results, rank1):
        label = f"{r['backend']} zero{r['zero_stage']} {r['precision']}"
        assert "error" not in r, f"{label}: {r.get('error')}\n{r.get('tb')}"
        assert [x["step"] for x in r["records"]] == USER_STEPS, label
        for x in r["records"]:
            skipped = x["step"] == SKIPPED
            assert x["is_overflow"] is skipped, (label, x)
            assert x["step_was_skipped"] is skipped and x["optimizer_step_was_skipped"] is skipped, (label, x)
        assert (r["num_optimizer_steps"], r["num_skipped_steps"]) == (3, 1), label
        # the scheduler advanced exactly once per applied step; the LR held on the skipped one
        assert r["scheduler_steps"] == r["scheduler_last_epoch"] == 3, label
        lrs = [x["lr"] for x in r["records"]]
        total = len(USER_STEPS)
        assert lrs == pytest.approx([LR * (1 - k / total) for k in (1, 1, 2, 3)]), (label, lrs)
        # the save idiom: rank 0 alone wrote, the folder reloads exactly
        assert other["writes"] == [], f"{label}: rank 1 wrote {other['writes']}"
        assert r["writes"] == ["model.safetensors"], (label, r["writes"])
        reload = r["reload"]
        assert {"config.json", "model.safetensors"} <= set(reload["files"]), (label, reload["files"])
        assert reload["missing"] == [] and reload["differ"] == [] and reload["empty"] == [], (label, reload)
        if r["zero_stage"] == 3:
            assert "sharded (ZeRO-3 / FSDP) without `state_dict=`" in r["own_save"], (label, r["own_save"])
        else:
            assert r["own_save"] == "saved", (label, r["own_save"])
        assert r["engine_save_ok"] and other["engine_save_ok"], label
        assert r["leftovers"] == [], (label, r["leftovers"])


@pytest.mark.deepspeed
def test_deepspeed_accelerate_loop_with_overflow_and_save_idiom_runs_verbatim():
    scenarios = [{"backend": "deepspeed", "zero_stage": z, "precision": "fp16"} for z in (0, 1, 2, 3)]
    ranks = run_workers("accelerate_idiom.py", "--scenarios", json.dumps(scenarios))
    _check(ranks[0]["results"], ranks[1]["results"])


def test_fallback_accelerate_loop_with_overflow_and_save_idiom_runs_verbatim():
    scenarios = [{"backend": "accelerate", "zero_stage": 0, "precision": "fp16"}]
    ranks = run_workers("accelerate_idiom.py", "--scenarios", json.dumps(scenarios))
    _check(ranks[0]["results"], ranks[1]["results"])
