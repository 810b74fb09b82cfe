"""Presets (package data in ds_engine/configs/): each equals the builder's output for its choices."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest
import torch

import ds_engine
from ds_engine.config import ConfigError, EngineConfig
from ds_engine.ds_config import (
    PRESETS,
    PRESETS_DIR,
    build_ds_config,
    preset_choices,
    preset_path,
    render_presets,
    write_presets,
)


def test_preset_files_are_exactly_what_the_builder_writes() -> None:
    assert sorted(p.stem for p in PRESETS_DIR.glob("*.json")) == sorted(PRESETS)
    rendered = render_presets()
    for name in PRESETS:
        text = preset_path(name).read_text()
        assert text == rendered[name], (
            f"ds_engine/configs/{name}.json is stale: run python -m ds_engine.ds_config --write-presets"
        )
        assert json.loads(text) == build_ds_config(preset_choices()[name], world_size=1, resolve=False)


def test_write_presets_round_trips(tmp_path) -> None:
    paths = write_presets(tmp_path)
    assert {p.name for p in paths} == {f"{n}.json" for n in PRESETS}
    for p in paths:
        assert p.read_text() == preset_path(p.stem).read_text()


def test_golden_zero3_offload_preset() -> None:
    assert json.loads(preset_path("zero3_offload").read_text()) == {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }


@pytest.mark.parametrize("name", PRESETS)
def test_preset_needs_no_hidden_size(name: str) -> None:
    """A preset asks for no bucket size: a plain nn.Module (no config.hidden_size) takes DeepSpeed's
    defaults, a transformers model its hidden-size rule, as without a preset."""
    extra = {"nvme_path": "/local_nvme"} if "nvme" in name else {}
    facts = {"world_size": 2, "micro_batch_size": 3}
    stage = preset_choices()[name].zero_stage
    plain = build_ds_config(EngineConfig(**extra), base=name, model=torch.nn.Linear(4, 4), **facts)
    zero = plain["zero_optimization"]
    if stage >= 1:
        assert zero["reduce_bucket_size"] == 500_000_000
    if stage == 3:
        assert (zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (
            50_000_000,
            100_000,
        )
    sized = build_ds_config(EngineConfig(**extra), base=name, hidden_size=16, **facts)
    if stage >= 1:
        assert sized["zero_optimization"]["reduce_bucket_size"] == 16 * 16


@pytest.mark.parametrize("name", PRESETS)
def test_preset_as_base_equals_building_from_its_choices(name: str) -> None:
    extra = {"nvme_path": "/local_nvme"} if "nvme" in name else {}
    user = EngineConfig(precision="bf16", gradient_accumulation_steps=2, gradient_clipping=1.0, **extra)
    facts = {"world_size": 2, "micro_batch_size": 3, "hidden_size": 16}
    via_preset = build_ds_config(user, base=name, **facts)
    choices = preset_choices()[name]
    direct_cfg = EngineConfig.from_dict(
        {n: getattr(choices, n) for n in choices.explicit_fields}
        | {n: getattr(user, n) for n in user.explicit_fields}
    )
    assert via_preset == build_ds_config(direct_cfg, **facts)
    assert (
        via_preset["train_batch_size"] == 12
        and via_preset["zero_optimization"]["stage"] == choices.zero_stage
    )


def test_nvme_preset_without_path_names_nvme_path() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^`nvme_path` is required when `zero_optimization\.offload_optimizer\.device` = \"nvme\"",
    ):
        build_ds_config(
            EngineConfig(), world_size=1, micro_batch_size=1, hidden_size=8, base="zero3_offload_nvme"
        )


def test_preset_conflicts_with_explicit_choice() -> None:
    with pytest.raises(ConfigError, match=r"`zero_optimization.stage` = 3 in the base vs `zero_stage` = 2"):
        build_ds_config(EngineConfig(zero_stage=2), world_size=1, micro_batch_size=1, base="zero3")


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(
        ConfigError, match=r"`zero4` is not a preset \(allowed: zero0, zero1, zero2, zero2_offload"
    ):
        preset_path("zero4")


def test_presets_are_package_data_found_through_importlib_resources() -> None:
    package = Path(ds_engine.__file__).resolve().parent
    assert PRESETS_DIR.resolve() == package / "configs"
    for name in PRESETS:
        resource = resources.files("ds_engine") / "configs" / f"{name}.json"
        assert preset_path(name) == Path(str(resource)) and resource.is_file()


def test_top_level_configs_is_a_relative_link_to_the_package_folder() -> None:
    top = Path(ds_engine.__file__).resolve().parents[1] / "configs"
    if not (top.parent / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")  # an installed package has no top-level folder
    assert top.is_symlink() and os.readlink(top) == os.path.join("ds_engine", "configs")
    assert sorted(p.name for p in top.glob("*.json")) == sorted(f"{n}.json" for n in PRESETS)


def test_a_missing_preset_file_says_to_reinstall(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    monkeypatch.setattr(resources, "files", lambda package: tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"^preset `zero3` is missing from the installed ds_engine package .*HINT: reinstall",
    ):
        preset_path("zero3")
