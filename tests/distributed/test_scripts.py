"""The fine-tuning scripts run unchanged on 2 ranks with DeepSpeed ZeRO-2/3 and on the fallback.

Each scenario trains a handful of steps (the worker `launch_scripts.py` calls the scripts'
`main()`), saves with `engine.save_pretrained`, and reloads with plain `from_pretrained`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launcher import WORKERS, run_command, run_workers, worker_env

VALIDATION = 81  # --num-examples 405 with a 20 % split: odd, so the sampler pads a duplicate to drop
STEPS = 12


def _check_common(name: str, s: dict[str, Any]) -> None:
    assert s["num_processes"] == 2, name
    assert s["optimizer_steps"] == STEPS, name
    assert s["skipped_steps"] == 0, name
    assert s["validation_samples"] == VALIDATION, name  # gather_for_metrics dropped the padding
    assert len(s["train_losses"]) == STEPS and all(math.isfinite(x) for x in s["train_losses"]), name
    steps = [m for m in s["metrics"] if "loss" in m and "eval_loss" not in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), name
    for m in steps:
        assert {"loss", "lr", "grad_norm", "skipped_steps", "loss_scale", "samples_per_s"} <= set(m), name
        assert m["grad_norm"] is not None and m["grad_norm"] > 0 and m["samples_per_s"] > 0, name
    assert "config.json" in s["model_files"], name
    assert "model.safetensors" in s["model_files"], name
    assert "tokenizer.json" in s["model_files"] or "vocab.txt" in s["model_files"], name


def _check_classification(name: str, s: dict[str, Any]) -> None:
    _check_common(name, s)
    assert s["loss"] < s["untrained_loss"] - 0.01, (name, s["untrained_loss"], s["loss"])  # loss goes down
    assert s["train_losses"][-1] < s["train_losses"][0], (name, s["train_losses"])
    # the plainly reloaded model (rank 0, no DeepSpeed involved) scores what the engine scored
    assert abs(s["reloaded_accuracy"] - s["accuracy"]) <= 1 / VALIDATION, name


def _check_clm(name: str, s: dict[str, Any]) -> None:
    _check_common(name, s)
    assert s["perplexity"] < 0.8 * s["untrained_perplexity"], (
        name,
        s["untrained_perplexity"],
        s["perplexity"],
    )
    assert s["reloaded_perplexity"] == pytest.approx(s["perplexity"], rel=1e-3), name


def _ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    # every rank computed the same gathered metrics; rank 0 also reloaded the saved model
    for scenario, summary in results[1].items():
        for key in ("accuracy", "loss", "perplexity", "validation_samples", "train_losses"):
            if key in summary:
                assert summary[key] == pytest.approx(results[0][scenario][key]), (scenario, key)
    return results[0]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_scripts_with_deepspeed_zero2_and_zero3() -> None:
    results = _ranks(run_workers("launch_scripts.py", "--scenarios", "cls:2,cls:3,clm:2,clm:3", timeout=900))
    for name in ("cls:2", "cls:3"):
        assert results[name]["backend"] == "deepspeed" and results[name]["zero_stage"] == int(name[-1])
        _check_classification(name, results[name])
    for name in ("clm:2", "clm:3"):
        assert results[name]["backend"] == "deepspeed" and results[name]["zero_stage"] == int(name[-1])
        _check_clm(name, results[name])
    # A model built inside engine.init_context() (ZeRO-3 zero.Init) starts from exactly the weights
    # it gets when built normally (ZeRO-2), for the same seed: same untrained loss.
    assert results["clm:3"]["untrained_perplexity"] == pytest.approx(
        results["clm:2"]["untrained_perplexity"], rel=1e-4
    )
    assert results["cls:3"]["untrained_loss"] == pytest.approx(results["cls:2"]["untrained_loss"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_scripts_on_the_accelerate_fallback_through_ds_engine_launch(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2",
           str(WORKERS / "launch_scripts.py"), "--out", str(tmp_path), "--scenarios",
           "cls:accelerate,clm:accelerate"]  # fmt: skip
    result = run_command(cmd, timeout=900, env=worker_env())
    assert result.returncode == 0, result.stdout[-8000:]
    results = _ranks([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)])
    assert results["cls:accelerate"]["backend"] == "accelerate"
    assert results["clm:accelerate"]["backend"] == "accelerate"
    _check_classification("cls:accelerate", results["cls:accelerate"])
    _check_clm("clm:accelerate", results["clm:accelerate"])
