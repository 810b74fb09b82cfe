"""The runnable examples run as a user launches them: `ds-engine launch`, 2 CPU processes.

The README's quick start (`scripts/examples/quickstart.py`, the same lines) trains its six
optimizer steps with the LR ending at 0, prints at most 25 lines (rank 0 speaks), and the
folder it saves reloads with plain `from_pretrained` in a process without DeepSpeed's state.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import run_command, worker_env

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "scripts" / "examples" / "quickstart.py"


def test_quickstart_trains_saves_and_reloads(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2", str(QUICKSTART)]
    result = run_command(cmd, timeout=420, env=worker_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    steps = re.findall(r"^step (\d+): loss ([\d.]+), lr ([\d.e+-]+)$", result.stdout, flags=re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3, 4, 5, 6], result.stdout[-4000:]  # rank 0 prints
    assert float(steps[-1][2]) == 0.0, steps  # the schedule ends where its author sized it
    # a quiet console: rank 0 speaks, no deprecation warnings from DeepSpeed's collectives,
    # start-up chatter at most once
    lines = result.stdout.splitlines()
    assert len(lines) <= 25, f"{len(lines)} console lines:\n" + result.stdout
    assert not [line for line in lines if "Warning" in line and "deprecated" in line], result.stdout
    assert sum("Setting accelerator to CPU" in line for line in lines) <= 1, result.stdout
    assert sum("LOAD REPORT" in line for line in lines) <= 1, result.stdout

    from transformers import AutoModelForSequenceClassification

    saved = tmp_path / "out" / "quickstart"
    assert {"config.json", "model.safetensors"} <= {p.name for p in saved.iterdir()}
    model = AutoModelForSequenceClassification.from_pretrained(saved)
    assert model.classifier.weight.shape == (2, model.config.hidden_size)


EXAMPLES = {
    # script, extra launch flags, a line the run must print (rank 0 unless it names the rank)
    "lora": ([], r"^adapter and merged model agree: max logit difference (\S+)$"),
    "distillation": ([], r"^step 2: distillation loss [\d.]+$"),
    "generation": ([], r"^rank 1: 'the film[^']*'$"),
    "accelerate_port": (["--config", "zero2"], r"^epoch 1: accuracy [\d.]+ on 20 examples"),
    "stream_clm": ([], r"^step 6: token loss [\d.]+ over \d+ tokens$"),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_as_launched(name: str, tmp_path: Path) -> None:
    flags, expected = EXAMPLES[name]
    script = ROOT / "scripts" / "examples" / f"{name}.py"
    cmd = [sys.executable, "-m", "ds_engine.cli", "launch", "--nproc-per-node", "2", *flags, str(script)]
    result = run_command(cmd, timeout=420, env=worker_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    found = re.search(expected, result.stdout, flags=re.M)
    assert found, result.stdout[-4000:]
    if name == "lora":
        assert float(found.group(1)) < 1e-4  # the merged model is the adapted model
    if name == "accelerate_port":  # hints name the script's own object
        assert "HINT: set `accelerator.schedule_sized_from = " in result.stdout, result.stdout[-4000:]
    assert (tmp_path / "out" / name).is_dir()
