"""`ds-engine env`: versions, the backend `auto` picks, whether DeepSpeed's CPU Adam op is built."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from ds_engine import cli
from ds_engine._imports import is_deepspeed_available
from ds_engine.env import collect_env, torch_extensions_dir


def _env_json(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    assert cli.main(["env", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_versions_are_the_installed_ones(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    info = _env_json(capsys)
    assert info["torch"] == torch.__version__
    for dist in ("accelerate", "transformers", "datasets"):
        assert info[dist] == importlib.metadata.version(dist), dist
    if is_deepspeed_available():
        assert info["deepspeed"] == importlib.metadata.version("deepspeed")


def test_text_output_lists_every_fact(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("torch", "deepspeed", "accelerate", "transformers", "datasets", "backend 'auto' picks",
                "DeepSpeed CPU Adam op built"):  # fmt: skip
        assert any(line.startswith(key) for line in out.splitlines()), key


@pytest.mark.deepspeed
def test_with_deepspeed_auto_picks_it_and_cpu_adam_state_follows_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert torch_extensions_dir() == tmp_path
    info = collect_env()
    assert info["backend 'auto' picks"] == "deepspeed"
    assert info["DeepSpeed CPU Adam op built"].startswith("no (compiled into")
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert collect_env()["DeepSpeed CPU Adam op built"] == f"yes ({tmp_path / 'cpu_adam'})"


def test_default_extension_cache_follows_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = torch_extensions_dir()
    assert path.parent.resolve() == (tmp_path / "torch_extensions").resolve()
    assert path.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")


@pytest.mark.nodeepspeed
def test_without_deepspeed_auto_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    info = _env_json(capsys)
    assert info["deepspeed"] == "not installed"
    assert info["backend 'auto' picks"] == "accelerate (DeepSpeed is not installed)"
    assert info["DeepSpeed CPU Adam op built"] == "n/a (DeepSpeed not installed)"
