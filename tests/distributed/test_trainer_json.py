"""`ds-engine config --for-trainer` writes a DeepSpeed JSON the Hugging Face Trainer accepts: a short
real 2-rank Trainer run (torchrun, gloo, CPU) per ZeRO stage with `TrainingArguments(deepspeed=path)`
on a tiny BERT classifier built from a config (offline); the Trainer fills every "auto" value and
the loss stays finite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_engine.cli import main as cli_main
from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]


def _leftover_autos(value, key=""):
    if isinstance(value, dict):
        return [k for name, v in value.items() for k in _leftover_autos(v, f"{key}.{name}".lstrip("."))]
    return [key] if value == "auto" else []


@pytest.mark.parametrize("stage", [2, 3])
def test_the_trainer_runs_the_json_for_trainer(stage: int, tmp_path: Path, capsys) -> None:
    assert cli_main(["config", "--zero-stage", str(stage), "--for-trainer"]) == 0
    path = tmp_path / f"zero{stage}.json"
    path.write_text(capsys.readouterr().out)
    written = json.loads(path.read_text())
    ranks = run_workers("trainer_json.py", "--config", str(path), timeout=600)
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["stage"] == stage
        assert rank["finite"] and rank["global_step"] == 3, rank["losses"]
        filled = rank["filled"]
        assert _leftover_autos(filled) == [], _leftover_autos(filled)
        assert _leftover_autos(written)  # it was a template
        assert (
            filled["optimizer"]["params"]["lr"] == 1e-3
            and filled["optimizer"]["params"]["weight_decay"] == 0.01
        )
        assert filled["scheduler"]["params"]["total_num_steps"] == 3
        assert filled["train_micro_batch_size_per_gpu"] == 2 and filled["gradient_accumulation_steps"] == 2
        zero = filled["zero_optimization"]
        assert zero["reduce_bucket_size"] == 64 * 64
        if stage == 3:
            assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
            assert zero["stage3_param_persistence_threshold"] == 10 * 64
