"""Several models in one run: one Engine per model, all sharing one process group (2 CPU ranks).

One torchrun launch per backend runs both scenarios of `workers/multi_model.py` in one process
per rank, in this order:

- "gan": generator (ZeRO-2 fp16, GA=1) and discriminator (ZeRO-1 bf16, GA=2), two optimizers and
  two LR schedules; an overflow injected into the generator's loss skips the generator's step
  only; the generator's Engine ends first and the discriminator's keeps communicating.
- "distill": the pretrained MiniLM teacher prepared without an optimizer (inference only,
  ZeRO-3 on DeepSpeed) and a 2-layer BERT student (ZeRO-2, GA=2) trained on the distillation
  loss; its losses and weights equal the same loop on one process with one big batch. The
  group is formed once for both scenarios and destroyed by the last `end_training`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import exit_probes, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GAN_STEPS = 8
GAN_INJECT = 3
DISTILL_STEPS = 3


def _launch(backend: str, out: Path) -> list[list[dict]]:
    scenarios = [
        {"name": "gan", "backend": backend, "d_precision": "bf16"},
        {"name": "distill", "backend": backend},
    ]
    ranks = run_workers("multi_model.py", "--scenarios", json.dumps(scenarios), out_dir=out, timeout=600)
    results = [r["results"] for r in ranks]
    for per_rank in results:
        for r in per_rank:
            assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('tb')}"
        assert [r["name"] for r in per_rank] == ["gan", "distill"]
    # the last end_training destroyed the group: nothing was left to interpreter exit
    assert exit_probes(out) == [False, False]
    return results


def _check_gan(r: dict, backend: str) -> None:
    assert r["backends"] == [backend, backend]
    # only the generator's step was skipped, only at the injected step
    assert [rec["skipped"] for rec in r["g_records"]] == [i == GAN_INJECT for i in range(GAN_STEPS)]
    assert (r["g_skipped"], r["g_applied"]) == (1, GAN_STEPS - 1)
    assert [rec["skipped"] for rec in r["d_records"]] == [False] * (GAN_STEPS // 2)
    assert (r["d_skipped"], r["d_applied"]) == (0, GAN_STEPS // 2)
    # each schedule advanced once per applied step of its own optimizer: LambdaLR(1/(k+1))
    applied = 0
    for rec in r["g_records"]:
        applied += not rec["skipped"]
        assert rec["lr"] == pytest.approx(1e-3 / (applied + 1)), r["g_records"]
    assert [rec["lr"] for rec in r["d_records"]] == pytest.approx([1e-3 / (k + 1) for k in range(1, 5)])
    if backend == "deepspeed":  # the generator's real fp16 loss scaler; the discriminator has none
        assert all(isinstance(rec["loss_scale"], float) for rec in r["g_records"]), r["g_records"]
    assert r["g_finite"] and r["d_finite"]
    # the generator's backward through the frozen discriminator left its weights and its
    # (mid-window) accumulated gradients alone
    assert r["d_unchanged_by_g_backward"] == [True] * GAN_STEPS
    # checkpoints: one folder per Engine, each with its own `latest`; a shared folder is refused
    assert r["latest"] == {"g": f"step_{GAN_STEPS}", "d": f"step_{GAN_STEPS // 2}"}
    assert r["same_dir_error"].startswith("ValueError") and "its own folder" in r["same_dir_error"]
    # the generator's Engine ended first: the group lives on for the discriminator's
    assert r["alive_after_g_end"]
    assert r["d_reduce_after_g_end"] == 2.0
    assert r["g_comm_after_end"].startswith("RuntimeError") and "end_training()" in r["g_comm_after_end"]
    assert r["init_calls"] == 1


def _check_distill(r: dict, rank: int, backend: str) -> None:
    assert r["teacher_optimizer"]  # engine.optimizer is None: no optimizer state
    assert r["student_steps"] == DISTILL_STEPS
    assert "inference only" in r["teacher_backward_error"], r["teacher_backward_error"]
    refused = r["teacher_checkpoint_error"]
    assert refused.startswith("RuntimeError") and "save_pretrained" in refused, refused
    second = r["second_model_error"]
    assert second.startswith("ValueError") and "one Engine per model" in second, second
    if backend == "deepspeed":
        assert r["teacher_partitioned"]  # ZeRO-3: each rank holds a shard of the teacher
        config = r["teacher_ds_config"]
        assert config["zero_optimization"]["stage"] == 3 and "optimizer" not in config
    # the second scenario's Engines reused the group the first formed
    assert r["init_calls_before"] == r["init_calls"] == 1
    assert r["alive_after_teacher_end"] and r["student_reduce_after_teacher_end"] == 2.0
    assert not r["alive_after_student_end"]
    assert r["student_latest"]
    if rank != 0:
        return
    # 2 ranks x 2 micro-batches x GA 2 equal one process with the whole window as one batch
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), (r["losses"], r["ref_losses"])
    assert r["num_params_compared"] == len(r["param_diff"]) > 30
    for name, (diff, norm) in r["param_diff"].items():
        assert diff <= 1e-5 * norm + 1e-6, f"{name}: |student - reference| = {diff}, |reference| = {norm}"


@pytest.mark.deepspeed
def test_deepspeed_distillation_and_two_optimizers_share_one_process_group(tmp_path: Path) -> None:
    results = _launch("deepspeed", tmp_path)
    for rank, (gan, distill) in enumerate(results):
        _check_gan(gan, "deepspeed")
        _check_distill(distill, rank, "deepspeed")


def test_fallback_distillation_and_two_optimizers_share_one_process_group(tmp_path: Path) -> None:
    results = _launch("accelerate", tmp_path)
    for rank, (gan, distill) in enumerate(results):
        _check_gan(gan, "accelerate")
        _check_distill(distill, rank, "accelerate")
