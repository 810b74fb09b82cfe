"""The fine-tuning scripts run unchanged on 2 ranks with DeepSpeed ZeRO-2/3 and on the fallback.

Each scenario trains a handful of steps (the worker `launch_scripts.py` calls the scripts'
`main()`), saves with `engine.save_pretrained`, and reloads with plain `from_pretrained`. A
run resumed from the scripts' own checkpoint ends exactly where the uninterrupted run ends.
The main job (scripts/main.sh's arguments, its default data, `ds-engine launch`) trains on the
real UCI sentences and prints at most 25 lines besides its progress bar.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launcher import WORKERS, run_command, run_workers, worker_env

VALIDATION = 81  # --num-examples 405 with a 20 % split: odd, so the sampler pads a duplicate to drop
STEPS = 12
ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT.parent / "shared" / "data" / "sentiment"  # the UCI sentences on this project's machines
UCI_FILES = ("amazon_cells_labelled.txt", "imdb_labelled.txt", "yelp_labelled.txt")


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


def _train_lines(summary: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {m["step"]: m for m in summary["metrics"] if "loss" in m and "eval_loss" not in m}


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_classification_resumed_from_its_zero2_checkpoint_ends_exactly_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # Run 1: 6 steps, checkpoints at steps 3 and 6. Run 2 (same launch): --resume-from the step-3
    # checkpoint, --max-steps 6, into another output folder.
    args = ["--scenarios", "cls:2", "--max-steps", "6", "--checkpoint-every", "3", "--resume-from-step", "3"]
    results = _ranks(run_workers("launch_scripts.py", *args, timeout=900, out_dir=tmp_path))
    full, resumed = results["cls:2"], results["cls:2+resumed"]
    for summary in (full, resumed):
        assert (summary["backend"], summary["zero_stage"]) == ("deepspeed", 2)
    checkpoints = sorted(p.name for p in (tmp_path / "cls_2" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_3", "step_6"]
    assert full["optimizer_steps"] == resumed["optimizer_steps"] == 6
    full_lines, resumed_lines = _train_lines(full), _train_lines(resumed)
    assert sorted(full_lines) == [1, 2, 3, 4, 5, 6]
    assert sorted(resumed_lines) == [4, 5, 6]  # it went on after step 3 rather than starting over
    # the resumed run started from the step-3 weights, not the pretrained ones
    assert resumed["metrics"][0]["step"] == 3
    assert resumed["untrained_loss"] != full["untrained_loss"]
    # the same batches, dropout draws, schedule and optimizer state: equal to the last bit (fp32)
    for step in (4, 5, 6):
        for key in ("loss", "lr", "grad_norm"):
            assert resumed_lines[step][key] == full_lines[step][key], (step, key)
    assert resumed_lines[6]["lr"] == 0.0  # the linear schedule ends at the restored total (6 steps)
    assert resumed["train_losses"] == full["train_losses"][3:]
    assert (resumed["loss"], resumed["accuracy"]) == (full["loss"], full["accuracy"])
    full_weights = load_file(Path(full["model_dir"]) / "model.safetensors")
    resumed_weights = load_file(Path(resumed["model_dir"]) / "model.safetensors")
    assert sorted(resumed_weights) == sorted(full_weights) and len(full_weights) > 100
    for name, tensor in full_weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(resumed_weights[name], tensor), name


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_the_main_job_trains_on_the_real_sentences_by_default_and_its_console_stays_short(
    tmp_path: Path,
) -> None:
    # scripts/main.sh's own arguments, nothing about data: the default lookup must find the
    # project's shared folder (no environment override, no cache, no download), for 3 steps,
    # launched as main.sh launches it (`ds-engine launch`, fresh processes: what the console
    # shows at start-up is part of the check). Where the shared folder is absent (a clone
    # elsewhere) the job runs on its generated sentences and only the data checks are left out.
    env = {
        "DS_ENGINE_SENTIMENT_DIR": "",
        "DS_ENGINE_SENTIMENT_URL": "",
        "XDG_CACHE_HOME": str(tmp_path / "c"),
    }
    cmd = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2",
           str(WORKERS / "launch_scripts.py"), "--out", str(tmp_path), "--scenarios", "main",
           "--max-steps", "3"]  # fmt: skip
    result = run_command(cmd, timeout=900, env=worker_env(env), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-8000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        s = results[r]["main"]
        if not REAL.is_dir():
            assert s["data"] == "synthetic", s["data_origin"]
            continue
        assert (s["data"], s["data_origin"]) == ("real", "project"), s["data_origin"]
        assert [Path(f).resolve() for f in s["data_files"]] == [(REAL / n).resolve() for n in UCI_FILES]
        assert s["validation_samples"] == 600  # the fixed 20 % of 3000 sentences
        assert not (tmp_path / "main" / "data").exists()  # nothing generated
    s = results[0]["main"]
    assert s["argv"][:2] == ["--zero-stage", "3"]
    assert (s["backend"], s["zero_stage"], s["num_processes"]) == ("deepspeed", 3, 2)
    assert s["optimizer_steps"] == 3 and s["skipped_steps"] == 0
    assert all(math.isfinite(x) for x in s["train_losses"])
    assert s["reloaded_accuracy"] == pytest.approx(s["accuracy"], abs=1 / 600)
    # the console, bar redraws aside: rank 0 speaks, no deprecation chatter
    lines = [line for line in re.split(r"[\r\n]", result.stdout) if line.strip()]
    bar = [line for line in lines if re.match(r"(train|Loading weights|eval\w*):\s", line)]
    others = [line for line in lines if line not in bar]
    assert len(others) <= 25, f"{len(others)} lines besides the progress bar:\n" + "\n".join(others)
    assert not [line for line in others if "deprecated" in line or "FutureWarning" in line], others
    assert any(line.startswith("validation accuracy on") for line in others), others
