"""`ds_engine.ray_train` without a Ray cluster: a missing Ray names the extra, and the folders it
turns into Ray checkpoints are checked first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_engine import ray_train


@pytest.fixture
def without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError


@pytest.mark.usefixtures("without_ray")
@pytest.mark.parametrize(
    "call",
    [
        lambda folder: ray_train.resume(object()),  # type: ignore[arg-type]
        lambda folder: ray_train.report(object(), {"loss": 1.0}, checkpoint=False),  # type: ignore[arg-type]
        lambda folder: ray_train.checkpoint_from_folder(folder),
    ],
    ids=["resume", "report", "checkpoint_from_folder"],
)
def test_a_missing_ray_names_the_extra(call, tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_1")
    with pytest.raises(
        ImportError, match=r'needs Ray Train, which is not installed .*pip install "ds-engine\[ray\]"'
    ):
        call(tmp_path)


def test_importing_the_module_needs_no_ray(without_ray: None) -> None:
    import importlib

    assert importlib.reload(ray_train).RAY_INSTALL_HINT == 'pip install "ds-engine[ray]"'


@pytest.mark.parametrize("content", [None, "notes.txt"])
def test_a_folder_that_is_no_checkpoint_is_refused_by_name(tmp_path: Path, content: str | None) -> None:
    folder = tmp_path / "ckpt"
    if content is not None:
        folder.mkdir()
        (folder / content).write_text("x")
    with pytest.raises(ValueError, match=rf"`folder`={str(folder)!r} is not an Engine checkpoint"):
        ray_train.checkpoint_from_folder(folder)


@pytest.mark.parametrize("marker", ["latest", "config.json", "model.safetensors"])
def test_engine_and_pretrained_folders_become_ray_checkpoints(tmp_path: Path, marker: str) -> None:
    pytest.importorskip("ray.train", reason='Ray is not installed: pip install "ds-engine[ray]"')
    (tmp_path / marker).write_text("{}")
    checkpoint = ray_train.checkpoint_from_folder(tmp_path)
    assert Path(checkpoint.path) == tmp_path
