"""Untrusted files: no code from a checkpoint or a config is ever executed.

Every checkpoint file ds_engine or DeepSpeed unpickles goes through torch's weights-only
unpickler with an explicit allowlist (`ds_engine.safety`); nothing predicts what a pickle
will do from its opcodes. The hostile corpus (`tests/hostile_corpus.py`, one file per shape)
is first shown to run its payload under an unrestricted `torch.load` in a fresh process; then
each file goes through the restricted loader, the restricted scope DeepSpeed's loads run in,
`Engine.load_checkpoint` of a fallback checkpoint and `ds-engine consolidate`, and must be
refused with an error naming the file and leave no trace (no marker, no import). The same
corpus goes through a real 2-rank DeepSpeed run in `tests/distributed/test_hostile_checkpoints.py`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_engine.cli import main
from ds_engine.config import ConfigError
from ds_engine.consolidate import consolidate_checkpoint
from ds_engine.safety import (
    UnsafeCheckpointError,
    deepspeed_safe_globals,
    restricted_load,
    restricted_torch_load,
)
from tests.helpers import micro_step, prepared_linear, quiet_fallback
from tests.hostile_corpus import CASES, SENTINEL_MODULES, extensions_registered, traces, write

# torch warns when the weights-only unpickler meets a protocol other than 2 (then refuses it)
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

_CONTROL = """
import json, sys, warnings
from pathlib import Path
import torch
from tests.hostile_corpus import CASES, extensions_registered, traces, write

warnings.simplefilter("ignore")
folder = Path(sys.argv[1])
left = {}
with extensions_registered():
    for case in CASES:
        path = write(case, folder / f"{case.name}.pt", folder)
        before = set(traces(folder))
        try:
            torch.load(path, weights_only=False)
        except Exception:
            pass  # some payloads run before the rest of the file fails to load
        left[case.name] = sorted(set(traces(folder)) - before)
print(json.dumps(left))
"""


@pytest.fixture
def markers(tmp_path: Path) -> Iterator[Path]:
    """Where payloads would leave their markers; the EXT codes are registered meanwhile."""
    assert not [m for m in SENTINEL_MODULES if m in sys.modules], "a sentinel module is imported already"
    folder = tmp_path / "markers"
    folder.mkdir()
    with extensions_registered():
        yield folder
    assert traces(folder) == [], "a checkpoint ran code"


def test_every_corpus_file_runs_its_payload_when_unpickled_without_restrictions(tmp_path: Path) -> None:
    """The control, in a fresh process: an unrestricted `torch.load` of each file leaves its trace."""
    assert len({c.build for c in CASES}) >= 15  # shapes, each its own builder
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _CONTROL, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0, result.stderr[-3000:]
    left = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {c.name: [f"import {c.sentinel}" if c.sentinel else c.name] for c in CASES}
    assert left == expected


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_restricted_loader_and_scope_refuse_every_corpus_file(case: Any, markers: Path) -> None:
    path = write(case, markers.parent / "mp_rank_00_model_states.pt", markers)
    refused = rf"refusing to load `{re.escape(str(path))}`: unpickling it needs .*HINT: "
    with pytest.raises(UnsafeCheckpointError, match=refused):
        restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
    with restricted_torch_load(deepspeed_safe_globals()), pytest.raises(UnsafeCheckpointError, match=refused):
        torch.load(path, map_location="cpu", weights_only=False)  # as DeepSpeed asks


# --------------------------------------------------------------------------- fallback checkpoints
def _prepared() -> tuple[Any, ...]:
    return prepared_linear(quiet_fallback())


def _saved(tmp_path: Path) -> Path:
    engine, model, optimizer, loader = _prepared()
    micro_step(engine, model, optimizer, next(iter(loader)))
    engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
    return tmp_path / "ckpt"


def test_a_fallback_checkpoint_with_any_corpus_file_is_refused(tmp_path: Path, markers: Path) -> None:
    ckpt = _saved(tmp_path)
    engine, *_ = _prepared()
    victims = ["engine_state.pt", "model_states.pt", "optimizer_states.pt", "rng_state_rank0.pt"]
    for index, case in enumerate(CASES):
        tag, victim = f"h{index}", victims[index % len(victims)]
        shutil.copytree(ckpt / "t1", ckpt / tag)
        write(case, ckpt / tag / victim, markers)
        with pytest.raises(UnsafeCheckpointError, match=rf"refusing to load `.*/{tag}/{victim}`: .*HINT"):
            engine.load_checkpoint(ckpt, tag=tag)
    assert engine.load_checkpoint(ckpt, tag="t1") == {}  # the control: the untouched tag loads


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


def test_consolidate_refuses_every_corpus_file(
    tmp_path: Path, markers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ds-engine consolidate`: the model-states file, or the optimizer file it reads the stage from."""
    root = _zero0_checkpoint(tmp_path)
    victims = ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for index, case in enumerate(CASES):
        tag, victim, out = f"h{index}", victims[index % len(victims)], tmp_path / f"out{index}"
        shutil.copytree(root / "global_step1", root / tag)
        write(case, root / tag / victim, markers)
        assert main(["consolidate", str(root), str(out), "--tag", tag]) == 2
        error = capsys.readouterr().err
        assert re.fullmatch(rf"ds-engine: error: refusing to load `.*/{tag}/{victim}`: .*HINT: .*\n", error)
        assert not out.exists()


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_an_optimizer_file_without_a_stage_is_never_read_as_zero0(tmp_path: Path, zip_format: bool) -> None:
    """The stage decides what is read: an unknown optimizer file stops consolidation, named."""
    root = _zero0_checkpoint(tmp_path)
    path = root / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer": {}}, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(
        ValueError,
        match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt' holds no `optimizer_state_dict` \(found "
        r"\['optimizer'\]\), so its ZeRO stage is unknown\. HINT: ",
    ):
        consolidate_checkpoint(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_consolidate_never_opens_a_pytorch_model_bin(tmp_path: Path, markers: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "t").mkdir(parents=True)
    (root / "latest").write_text("t")
    write(CASES[0], root / "t" / "pytorch_model.bin", markers)
    with pytest.raises(ValueError, match=r"is not a DeepSpeed checkpoint"):
        consolidate_checkpoint(root, tmp_path / "out")


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
