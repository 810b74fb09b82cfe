"""Presets in configs/: each equals the builder's output for its choices, and resolves as a base."""

from __future__ import annotations

import json

import pytest

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
            f"configs/{name}.json is stale: run python -m ds_engine.ds_config --write-presets"
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
            "reduce_bucket_size": "auto",
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }


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
    with pytest.raises(ConfigError, match=r"`nvme_path` is required when `offload_optimizer` = \"nvme\""):
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
