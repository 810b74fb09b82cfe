"""One rendered config: the JSON `deepspeed.initialize` receives from `prepare` is exactly the JSON
`ds-engine config` (or `build_ds_config`) prints for the same choices, for training prepares
(including the GA=1 hand-accumulation mode, `managed_gradient_accumulation: false`) and for
inference-only prepares (a model without an optimizer: ZeRO-1/2 run as ZeRO-0, ZeRO-3 keeps its
stage). Each prepare runs in a fresh one-process Engine (a subprocess) with the real DeepSpeed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ds_engine import EngineConfig, build_ds_config
from tests.distributed.launcher import free_port, worker_env

pytestmark = pytest.mark.deepspeed

PREPARE = textwrap.dedent(
    """
    import json, sys
    import deepspeed, torch
    from ds_engine import Engine
    seen = {}
    real = deepspeed.initialize
    def initialize(*args, **kwargs):
        seen["config"] = json.loads(json.dumps(kwargs["config"]))
        return real(*args, **kwargs)
    deepspeed.initialize = initialize
    choices, train = json.loads(sys.argv[1]), sys.argv[2] == "train"
    engine = Engine(backend="deepspeed", **choices)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    if train:
        engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    else:
        engine.prepare(model)
    print("CONFIG=" + json.dumps(seen["config"]))
    engine.end_training()
    """
)

CASES = [
    ("train", {"zero_stage": 2}, ["--zero-stage", "2"]),
    (
        "train",
        {"zero_stage": 1, "gradient_accumulation_steps": 2},
        ["--zero-stage", "1", "--gradient-accumulation-steps", "2"],
    ),
    ("train", {"zero_stage": 3, "precision": "bf16"}, ["--zero-stage", "3", "--precision", "bf16"]),
    ("inference", {"zero_stage": 2}, None),
    ("inference", {"zero_stage": 3}, None),
]


def _prepared_config(mode: str, choices: dict) -> dict:
    env = worker_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                      "LOCAL_RANK": "0", "WORLD_SIZE": "1"})  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", PREPARE, json.dumps(choices), mode],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CONFIG="))
    return json.loads(line.removeprefix("CONFIG="))


@pytest.mark.parametrize(
    ("mode", "choices", "flags"), CASES, ids=[f"{m}-{json.dumps(c)}" for m, c, _ in CASES]
)
def test_prepare_runs_the_json_the_cli_prints(mode: str, choices: dict, flags: list[str] | None) -> None:
    ran = _prepared_config(mode, choices)
    micro = 1 if mode == "inference" else 4  # an inference-only prepare without a loader: a placeholder
    printed = build_ds_config(
        EngineConfig(**choices), world_size=1, micro_batch_size=micro, inference_only=mode == "inference"
    )
    assert ran == printed
    if flags is not None:
        facts = ["--micro-batch-size", "4", "--world-size", "1"]
        cli = subprocess.run(
            [sys.executable, "-m", "ds_engine.cli", "config", *flags, *facts],
            capture_output=True, text=True, env=worker_env(), timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == ran
    if mode == "inference":
        assert ran["zero_optimization"]["stage"] == (3 if choices["zero_stage"] == 3 else 0)
    if mode == "train" and choices == {"zero_stage": 2}:
        assert ran["managed_gradient_accumulation"] is False  # GA=1 on ZeRO-2: step() is the boundary
