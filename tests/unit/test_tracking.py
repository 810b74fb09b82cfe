"""Metrics from any loop: `Engine.log_to` / `Engine.log` and `Accelerator(log_with="jsonl")`.

One process on the accelerate backend (the logging machinery is the same on every backend;
only the main process writes). The file is what `ds-engine plot` reads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from ds_engine import Engine
from ds_engine.plot import read_metrics
from tests.helpers import micro_step, regression_loader


def _engine(**choices) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback says what it cannot honour
        return Engine(backend="accelerate", **choices)


def test_log_writes_one_line_per_call_with_the_engines_facts(tmp_path: Path) -> None:
    engine = _engine(gradient_accumulation_steps=2, gradient_clipping=1.0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, regression_loader(), scheduler)
    engine.log_to(tmp_path / "run", config={"lr": 0.1, "model": "linear"})
    for batch in loader:
        loss = micro_step(engine, model, optimizer, batch, scheduler)
        if engine.sync_gradients:
            engine.log({"loss": loss.detach()})  # a one-element tensor is logged as its number
    engine.log({"eval_loss": 0.5, "eval_accuracy": 0.75})
    engine.end_training()

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 2]
    train = lines[:2]
    assert all({"loss", "lr", "grad_norm", "skipped_steps", "loss_scale"} <= set(r) for r in train)
    assert [r["lr"] for r in train] == pytest.approx([0.05, 0.1 / 3])  # after each applied step
    assert all(isinstance(r["loss"], float) and r["grad_norm"] > 0 for r in train)
    assert json.loads((tmp_path / "run" / "run_config.json").read_text()) == {"lr": 0.1, "model": "linear"}
    records, evals = read_metrics(tmp_path / "run" / "metrics.jsonl")  # what `ds-engine plot` draws
    assert len(records) == 2 and len(evals) == 1


def test_log_before_log_to_and_bad_values_are_clear_errors(tmp_path: Path) -> None:
    engine = _engine()
    with pytest.raises(RuntimeError, match=r"engine\.log_to\('out/run'\)"):
        engine.log({"loss": 1.0})
    engine.log_to(tmp_path)
    with pytest.raises(TypeError, match=r"loss= a tensor of 3 elements.*HINT: log `loss\.mean\(\)`"):
        engine.log({"loss": torch.ones(3)})
    with pytest.raises(TypeError, match=r"cfg=\{'a': 1\} \(dict\).*HINT"):
        engine.log({"cfg": {"a": 1}})
    engine.log({"loss": float("nan")}, step=3)  # JSON has no NaN: kept as a string the plot skips
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "loss": "nan"}
    engine.end_training()


def test_tensorboard_beside_the_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    engine = _engine()
    engine.log_to(tmp_path, tensorboard=True)
    engine.log({"loss": 1.5}, step=1)
    engine.end_training()
    assert (tmp_path / "metrics.jsonl").is_file()
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))


def test_accelerator_log_with_jsonl_uses_the_same_tracker(tmp_path: Path) -> None:
    from ds_engine import Accelerator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path))
    accelerator.init_trackers("run", config={"epochs": 2})
    accelerator.log({"loss": 0.25}, step=1)
    assert accelerator.get_tracker("jsonl").name == "jsonl"
    accelerator.end_training()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.25}
    with pytest.raises(ValueError, match=r'log_with="jsonl".*HINT: pass `project_dir=`'):
        Accelerator(cpu=True, log_with="jsonl")
