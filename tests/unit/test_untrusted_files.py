"""Untrusted files: no code from a checkpoint or a config is ever executed.

A malicious pickle is a file whose unpickling calls a function of the attacker's choice (its
`__reduce__` names `builtins.exec`); here that function would create a marker file. Each test
puts such a file where ds_engine reads one, runs the ordinary user call, and asserts that the
marker never appears and that the call is refused with an error saying why.

Where ds_engine hands a file to DeepSpeed, DeepSpeed unpickles it with
`torch.load(weights_only=False)` (`deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py`
and `deepspeed/utils/zero_to_fp32.py`), so ds_engine must refuse such a file before DeepSpeed
opens it: the DeepSpeed load and the offline consolidate cases show that it does.
"""

from __future__ import annotations

import json
import pickle
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.checkpoint import consolidate_checkpoint
from ds_engine.config import ConfigError


class Payload:
    """Unpickling this runs `exec(code)`, which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


def plant(path: Path, marker: Path, *, zip_format: bool = True) -> None:
    """Write a malicious pickle to `path`: torch.save's zip archive, or a bare pickle stream."""
    obj = {"module": Payload(marker), "optimizer_state_dict": {"zero_stage": 2}}
    if zip_format:
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj, protocol=2))


def test_the_payload_really_runs_code_when_unpickled(tmp_path: Path) -> None:
    """The control: loading the planted file without `weights_only` creates the marker."""
    marker = tmp_path / "marker"
    plant(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# --------------------------------------------------------------------------- fallback checkpoints
def _prepared() -> tuple[Any, ...]:
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(backend="accelerate")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    return engine, *engine.prepare(model, optimizer, loader)


def _saved(tmp_path: Path) -> Path:
    engine, model, optimizer, loader = _prepared()
    x, y = next(iter(loader))
    with engine.accumulate(model):
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch_save_zip", "bare_pickle"])
@pytest.mark.parametrize(
    "name", ["engine_state.pt", "model_states.pt", "optimizer_states.pt", "rng_state_rank0.pt"]
)
def test_malicious_file_in_a_fallback_checkpoint_is_refused(
    tmp_path: Path, name: str, zip_format: bool
) -> None:
    ckpt = _saved(tmp_path)
    marker = tmp_path / "marker"
    plant(ckpt / "t1" / name, marker, zip_format=zip_format)
    engine, *_ = _prepared()
    # a torch.save zip is refused for what it would call; a bare pickle is not a torch.save file at all
    expected = "could execute code" if zip_format else "truncated or corrupt"
    with pytest.raises(ValueError, match=rf"(?s){name}.*{expected}.*HINT") as info:
        engine.load_checkpoint(ckpt)
    assert not marker.exists(), "the checkpoint ran code"
    if zip_format:
        assert "exec" in str(info.value)  # names the callable it refused


# --------------------------------------------------------------------------- offline consolidate
def _zero0_checkpoint(tmp_path: Path) -> Path:
    root = tmp_path / "ds_ckpt"
    (root / "global_step1").mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    torch.save(
        {"module": torch.nn.Linear(4, 1).state_dict()}, root / "global_step1" / "mp_rank_00_model_states.pt"
    )
    return root


def test_a_benign_zero0_checkpoint_consolidates(tmp_path: Path) -> None:
    """The control for the consolidate cases: the same layout, benign, is read fine."""
    out = consolidate_checkpoint(_zero0_checkpoint(tmp_path), tmp_path / "out")
    assert (out / "model.safetensors").is_file()


def test_consolidate_refuses_a_malicious_model_states_file(tmp_path: Path) -> None:
    root = _zero0_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    plant(root / "global_step1" / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states\.pt"):
        consolidate_checkpoint(root, tmp_path / "out")
    assert not marker.exists(), "consolidate ran code from the checkpoint"


def test_consolidate_refuses_a_malicious_optimizer_states_file(tmp_path: Path) -> None:
    root = _zero0_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    plant(root / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(ValueError, match=r"optim_states\.pt"):
        consolidate_checkpoint(root, tmp_path / "out")
    assert not marker.exists(), "consolidate ran code from the checkpoint"


def test_consolidate_never_opens_a_pytorch_model_bin(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "t").mkdir(parents=True)
    (root / "latest").write_text("t")
    marker = tmp_path / "marker"
    plant(root / "t" / "pytorch_model.bin", marker)
    with pytest.raises(ValueError, match=r"is not a DeepSpeed checkpoint"):
        consolidate_checkpoint(root, tmp_path / "out")
    assert not marker.exists()


# --------------------------------------------------------------------------- configs are data
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("ds_config.yaml", "zero_optimization:\n  stage: 2\n"),
        ("ds_config.py", "open({marker!r}, 'w').close()\nconfig = {{'zero_optimization': {{'stage': 2}}}}\n"),
        ("ds_config.json", "__import__('os').system('touch {marker}')"),
    ],
    ids=["yaml", "python", "python_in_json_file"],
)
def test_a_config_that_is_not_json_is_refused_and_never_run(tmp_path: Path, name: str, text: str) -> None:
    from ds_engine import Engine

    marker = tmp_path / "marker"
    path = tmp_path / name
    path.write_text(text.format(marker=str(marker)))
    with pytest.raises(ConfigError, match=rf"{name}.*not valid JSON.*HINT"):
        Engine(config=str(path), backend="accelerate")
    from ds_engine.cli import main

    assert main(["config", "--base", str(path)]) == 2
    assert main(["launch", "--config", str(path), str(path)]) == 2
    assert not marker.exists()


def test_a_json_config_is_only_data(tmp_path: Path) -> None:
    """Strings that look like code stay strings: nothing in a JSON value is evaluated."""
    from ds_engine.config import load_json_config

    marker = tmp_path / "marker"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps_per_print": 0, "comment": code}))
    assert load_json_config(path)["comment"] == code
    assert not marker.exists()


# --------------------------------------------------------------------------- DeepSpeed's loader
_DS_SCRIPT = textwrap.dedent(
    """
    import json, pickle, sys, warnings
    from pathlib import Path
    import torch
    sys.path.insert(0, {tests!r})
    from test_untrusted_files import plant
    from ds_engine import Engine

    out, stage, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    warnings.simplefilter("ignore")
    engine = Engine(backend="deepspeed", zero_stage=stage, micro_batch_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.ones(2, 4)).sum())
    optimizer.step(); optimizer.zero_grad()
    engine.save_checkpoint(out / "ckpt", tag="t1")
    files = sorted(p.name for p in (out / "ckpt" / "t1").iterdir())
    victim = next(p for p in (out / "ckpt" / "t1").iterdir() if p.name.endswith(name))
    plant(victim, out / "marker")
    try:
        engine.load_checkpoint(out / "ckpt")
        error = None
    except Exception as exc:
        error = f"{{type(exc).__name__}}: {{exc}}"
    (out / "result.json").write_text(json.dumps(
        {{"files": files, "victim": victim.name, "error": error, "ran": (out / "marker").exists()}}
    ))
    """
)


def _deepspeed_load(tmp_path: Path, stage: int, name: str) -> dict[str, Any]:
    from tests.distributed.launcher import run_command, torchrun_command, worker_env

    script = tmp_path / "ds_load.py"
    script.write_text(_DS_SCRIPT.format(tests=str(Path(__file__).parent)))
    cmd = torchrun_command(script, str(tmp_path), str(stage), name, nproc=1)
    result = run_command(cmd, timeout=240, env=worker_env())
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("stage", "name"), [(0, "model_states.pt"), (2, "optim_states.pt")], ids=["zero0", "zero2"]
)
def test_deepspeed_checkpoint_with_a_malicious_file_is_refused(tmp_path: Path, stage: int, name: str) -> None:
    result = _deepspeed_load(tmp_path, stage, name)
    assert result["error"] is not None and result["victim"] in result["error"], result
    assert not result["ran"], f"loading {result['victim']} ran code from the checkpoint"
