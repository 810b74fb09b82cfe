"""A built wheel ships the presets: `Engine("zero3")` works from a non-editable install.

The wheel is built from a copy of the package sources (`pip wheel --no-build-isolation`, no
network), installed with `--no-deps` into a fresh virtual environment, and used from a
folder outside the source tree; the current environment's site-packages come after the
wheel's on PYTHONPATH so torch and friends resolve. Runs with and without DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import ds_engine
from ds_engine.ds_config import PRESETS

REPO = Path(ds_engine.__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import json, sys, warnings
    from pathlib import Path

    import ds_engine
    from ds_engine import Engine, EngineConfig, build_ds_config
    from ds_engine.ds_config import PRESETS, load_base, preset_path, render_presets
    from ds_engine.launch import resolve_config

    package = Path(ds_engine.__file__).resolve().parent
    report = {"file": ds_engine.__file__, "presets": {}}
    for name in PRESETS:
        extra = {"nvme_path": "/local_nvme"} if "nvme" in name else {}
        base, where = load_base(name)
        assert Path(where).resolve().parent == package / "configs", where
        assert json.dumps(base, indent=2) + "\\n" == render_presets()[name], name
        built = build_ds_config(
            EngineConfig(**extra), world_size=1, micro_batch_size=1, hidden_size=8, base=name
        )
        assert resolve_config(name) == preset_path(name).resolve()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback lists choices it cannot honour
            engine = Engine(name, backend="accelerate", **extra)
        report["presets"][name] = [built["zero_optimization"]["stage"], engine.config.zero_stage]
    print(json.dumps(report))
    """
)


def _run(
    cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_wheel_ships_every_preset_and_loads_it_by_name(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "ds_engine", src / "ds_engine", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("ds_engine-*.whl")

    venv = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    fresh_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = Path(fresh_site.stdout.strip())
    shipped = sorted(p.name for p in (site / "ds_engine" / "configs").glob("*.json"))
    assert shipped == sorted(f"{n}.json" for n in PRESETS)
    assert not (site / "configs").exists()  # the data lives inside the package, nowhere else
    assert (site / "ds_engine" / "py.typed").is_file()  # type checkers read its annotations
    (dist_info,) = site.glob("ds_engine-*.dist-info")
    assert "Apache License" in "".join(p.read_text() for p in dist_info.rglob("LICENSE*"))
    metadata = (dist_info / "METADATA").read_text()
    assert "Classifier: Typing :: Typed" in metadata
    core = [
        line.split()[1].split(">")[0].split("=")[0].split("<")[0]
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(core) == ["accelerate", "numpy", "packaging", "safetensors", "torch", "transformers"], core

    outside = tmp_path / "elsewhere"  # run away from the source tree
    outside.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
        "PYTHONNOUSERSITE": "1",
    }
    result = _run([str(python), "-c", CHECK], cwd=outside, env=env)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve().is_relative_to(venv.resolve()), report["file"]
    assert set(report["presets"]) == set(PRESETS)
    assert all(built == effective for built, effective in report["presets"].values()), report

    cli = venv / "bin" / "ds-engine"
    args = ["config", "--base", "zero3_offload", "--micro-batch-size", "2", "--hidden-size", "8"]
    out = json.loads(_run([str(cli), *args], cwd=outside, env=env).stdout)
    assert out["zero_optimization"]["offload_param"]["device"] == "cpu" and out["train_batch_size"] == 2
