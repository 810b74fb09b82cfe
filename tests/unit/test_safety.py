"""The restricted loader: torch's weights-only unpickler with DeepSpeed's classes allowlisted.

`restricted_load` reads one file; `restricted_torch_load` restricts every `torch.load` made
inside it (DeepSpeed's loads ask for `weights_only=False`), also in processes started inside
it. The hostile corpus runs through both in `test_untrusted_files.py`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_engine.safety import (
    DEEPSPEED_GLOBALS,
    UnsafeCheckpointError,
    deepspeed_safe_globals,
    restricted_load,
    restricted_torch_load,
)


class _Copy:
    """Unpickling this creates `marker` (a copy of `source`, by `shutil.copyfile`)."""

    def __init__(self, source: Path, marker: Path) -> None:
        self.source, self.marker = source, marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (shutil.copyfile, (str(self.source), str(self.marker)))


def _hostile(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    (tmp_path / "source").write_text("x")
    path = tmp_path / "evil.pt"
    torch.save({"state": _Copy(tmp_path / "source", marker)}, path)
    return path, marker


def test_tensors_and_containers_load(tmp_path: Path) -> None:
    state = {
        "w": torch.ones(3),
        "p": torch.nn.Parameter(torch.zeros(2)),
        "od": collections.OrderedDict(a=torch.zeros(1, dtype=torch.bfloat16)),
        "size": torch.Size([2]),
        "n": 3,
        "s": {1, 2},
        "t": (1.5, "x", None, b"raw"),
    }
    torch.save(state, tmp_path / "ok.pt")
    loaded = restricted_load(tmp_path / "ok.pt")
    assert loaded.keys() == state.keys() and torch.equal(loaded["w"], state["w"])
    assert restricted_load(tmp_path / "ok.pt", mmap=True)["s"] == {1, 2}


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    path, marker = _hostile(tmp_path)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"refusing to load `.*evil\.pt`: unpickling it needs the global `shutil\.copyfile`.*HINT:",
    ):
        restricted_load(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: unrestricted, the file runs its payload
    assert marker.exists()


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_a_truncated_file_names_the_file(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "model_states.pt"
    torch.save({"w": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    with pytest.raises(ValueError, match=r"model_states\.pt' is truncated or corrupt \(.*\)\. HINT: "):
        restricted_load(path, mmap=True)


def test_a_truncated_legacy_file_and_a_non_torch_file_name_the_file(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(100)}, legacy, _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"legacy\.pt' is truncated or corrupt .*HINT: write it again"):
        restricted_load(legacy, hint="write it again")
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"notes\.pt' is truncated or corrupt"):
        restricted_load(text)


def test_a_truncated_safetensors_file_names_the_file(tmp_path: Path) -> None:
    """torch.load hands `.safetensors` paths to safetensors: no pickle, still a clear error."""
    import safetensors.torch

    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(100)}, str(path))
    assert torch.equal(restricted_load(path)["w"], torch.ones(100))
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ValueError, match=r"model\.safetensors' is truncated or corrupt"):
        restricted_load(path)


@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore:'torch.load' received a zip file:UserWarning"
)
def test_a_torchscript_archive_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    with pytest.raises(UnsafeCheckpointError, match=r"scripted\.pt`: it is a TorchScript archive.*HINT"):
        restricted_load(path)


@pytest.mark.deepspeed
def test_deepspeed_classes_load_only_where_allowed(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    assert [f"{g.__module__}.{g.__qualname__}" for g in deepspeed_safe_globals()] == list(DEEPSPEED_GLOBALS)
    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, False)
    state = {
        "zero_stage": ZeroStageEnum.gradients,
        "loss_scaler": scaler,
        "static": LossScaler(128),
        "slices": [{"w": fragment_address(numel=4, start=0)}],
    }
    torch.save(state, tmp_path / "ds.pt")
    loaded = restricted_load(tmp_path / "ds.pt", safe_globals=deepspeed_safe_globals())
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["slices"][0]["w"].numel == 4
    assert loaded["loss_scaler"].__dict__ == scaler.__dict__ and loaded["static"].cur_scale == 128
    with pytest.raises(UnsafeCheckpointError, match=r"ds\.pt`: unpickling it needs .*ZeroStageEnum"):
        restricted_load(tmp_path / "ds.pt")  # ds_engine's own files: torch's defaults only


@pytest.mark.deepspeed
def test_a_deepspeed_function_is_refused(tmp_path: Path) -> None:
    import deepspeed.utils.zero_to_fp32 as z

    class CallsDeepSpeedFunction:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (z.convert_zero_checkpoint_to_fp32_state_dict, (str(tmp_path), str(tmp_path / "out")))

    torch.save({"x": CallsDeepSpeedFunction()}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"convert_zero_checkpoint_to_fp32_state_dict"):
        restricted_load(tmp_path / "bad.pt", safe_globals=deepspeed_safe_globals())
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the scope
def test_the_scope_restricts_every_spelling_of_torch_load_and_restores_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, marker = _hostile(tmp_path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user's setting, put back after
    original = torch.load
    with torch.serialization.safe_globals([collections.Counter]):
        with restricted_torch_load([collections.Counter]):
            with (
                restricted_torch_load(),  # re-entrant
                pytest.raises(UnsafeCheckpointError, match=r"evil\.pt`.*shutil\.copyfile"),
            ):
                torch.load(path, weights_only=False)  # what DeepSpeed asks for
            # torch itself enforces it too (the environment), for loads that bypass torch.load
            with pytest.raises(Exception, match=r"Weights only load failed"):
                torch.serialization.load(path, weights_only=False)
        assert collections.Counter in torch.serialization.get_safe_globals()  # the user's entry stays
    assert torch.load is original
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    assert not marker.exists()


def _load_unrestricted(path: str) -> str:
    try:
        torch.load(path, weights_only=False)
    except Exception as exc:
        return type(exc).__name__
    return "loaded"


def test_a_forked_worker_inside_the_scope_is_restricted(tmp_path: Path) -> None:
    """`ds_to_universal` runs its extract/merge steps in a ProcessPoolExecutor (fork on Linux)."""
    path, marker = _hostile(tmp_path)
    context = multiprocessing.get_context("fork")
    with restricted_torch_load(), concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        assert pool.submit(_load_unrestricted, str(path)).result(timeout=60) == "UnsafeCheckpointError"
    assert not marker.exists()


def test_a_new_process_started_inside_the_scope_is_restricted(tmp_path: Path) -> None:
    path, marker = _hostile(tmp_path)
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    with restricted_torch_load():
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0 and "Weights only load failed" in result.stderr, result.stderr[-2000:]
    assert not marker.exists()
