"""EngineConfig: defaults, validation, explicit-field tracking, base merging and JSON loading."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_engine.config import ConfigError, EngineConfig, load_json_config, resolve_engine_config


def test_defaults_are_the_documented_ones() -> None:
    c = EngineConfig()
    assert (c.zero_stage, c.precision, c.gradient_accumulation_steps, c.gradient_clipping) == (
        0,
        "fp32",
        1,
        0.0,
    )
    assert c.micro_batch_size == "auto" and c.reduce_bucket_size == "auto"
    assert c.stage3_gather_16bit_weights_on_model_save is True
    assert c.explicit_fields == frozenset()


def test_explicit_fields_record_what_was_passed() -> None:
    c = EngineConfig(zero_stage=0, precision="bf16")
    assert c.explicit_fields == {"zero_stage", "precision"}  # 0 is the default but still explicit
    assert EngineConfig.from_dict({"gradient_clipping": 1}).explicit_fields == {"gradient_clipping"}
    assert EngineConfig.from_kwargs(hysteresis=3, precision="fp16").explicit_fields == {
        "hysteresis",
        "precision",
    }


def test_dataclasses_replace_keeps_explicit_fields_sensible() -> None:
    c = EngineConfig(zero_stage=2)
    d = dataclasses.replace(c, gradient_accumulation_steps=4)
    assert d.explicit_fields == {"zero_stage", "gradient_accumulation_steps"}
    assert d.zero_stage == 2 and d.gradient_accumulation_steps == 4
    # A value that came from a base stays non-explicit through replace.
    r = resolve_engine_config(EngineConfig(precision="bf16"), {"zero_optimization": {"stage": 3}})
    assert dataclasses.replace(r, gradient_clipping=1.0).explicit_fields == {"precision", "gradient_clipping"}


def test_float_fields_are_normalized() -> None:
    c = EngineConfig(gradient_clipping=1, loss_scale=128, precision="fp16")
    assert isinstance(c.gradient_clipping, float) and isinstance(c.loss_scale, float)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 4}, r"`zero_stage` = 4 .*0\.\.3.*HINT"),
        ({"zero_stage": -1}, r"`zero_stage`"),
        ({"zero_stage": True}, r"`zero_stage` = true"),
        ({"zero_stage": 2.0}, r"`zero_stage` = 2\.0"),
        ({"precision": "fp8"}, r"`precision` = \"fp8\".*fp32, fp16, bf16"),
        ({"gradient_accumulation_steps": 0}, r"`gradient_accumulation_steps` = 0.*>= 1"),
        ({"gradient_accumulation_steps": "2"}, r"`gradient_accumulation_steps` = \"2\""),
        ({"gradient_clipping": -1.0}, r"`gradient_clipping` = -1\.0"),
        ({"gradient_clipping": float("nan")}, r"`gradient_clipping`"),
        ({"micro_batch_size": 0}, r"`micro_batch_size` = 0.*\"auto\""),
        ({"micro_batch_size": "big"}, r"`micro_batch_size` = \"big\""),
        ({"reduce_bucket_size": 5e8}, r"`reduce_bucket_size` = 500000000\.0.*integer"),
        ({"allgather_bucket_size": 1.5}, r"`allgather_bucket_size`"),
        ({"stage3_prefetch_bucket_size": 1e6}, r"`stage3_prefetch_bucket_size`"),
        ({"offload_optimizer": "gpu"}, r"`offload_optimizer` = \"gpu\".*none, cpu, nvme"),
        ({"offload_params": "disk"}, r"`offload_params` = \"disk\""),
        ({"pin_memory": 1}, r"`pin_memory` = 1.*true or false"),
        ({"overlap_comm": "yes"}, r"`overlap_comm`"),
        ({"min_loss_scale": 0}, r"`min_loss_scale` = 0"),
        ({"initial_scale_power": 100}, r"`initial_scale_power` = 100"),
        ({"steps_per_print": -5}, r"`steps_per_print` = -5"),
        ({"optimizer": {"params": {}}}, r"`optimizer`.*\"type\""),
        ({"scheduler": "WarmupLR"}, r"`scheduler` = \"WarmupLR\""),
        ({"nvme_path": ""}, r"`nvme_path` = \"\""),
        ({"zero_stag": 3}, r"`zero_stag` is not a known EngineConfig field.*did you mean `zero_stage`"),
        ({"gradient_clip": 1.0}, r"`gradient_clip`.*did you mean `gradient_clipping`"),
        # cross-field rules where every field involved was chosen explicitly
        (
            {"zero_stage": 2, "offload_params": "cpu"},
            r"`offload_params` = \"cpu\" needs ZeRO stage 3.*`zero_stage` = 2",
        ),
        (
            {"zero_stage": 0, "offload_optimizer": "cpu"},
            r"`offload_optimizer` = \"cpu\" needs ZeRO stage 1-3",
        ),
        (
            {"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/x"},
            r"`offload_optimizer` = \"nvme\" needs.*3",
        ),
        (
            {"zero_stage": 3, "offload_params": "nvme", "nvme_path": None},
            r"`nvme_path` is required when `offload_params` = \"nvme\"",
        ),
        (
            {"zero_stage": 1, "stage3_max_live_parameters": 10},
            r"`stage3_max_live_parameters`.*only to ZeRO stage 3",
        ),
        ({"precision": "bf16", "loss_scale": 128.0}, r"`loss_scale`.*only to precision \"fp16\""),
        (
            {
                "activation_checkpointing": True,
                "activation_checkpointing_partition": False,
                "activation_checkpointing_cpu": True,
            },
            r"`activation_checkpointing_cpu` = true needs `activation_checkpointing_partition`",
        ),
    ],
)
def test_bad_choices_raise_config_error_naming_the_key(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        EngineConfig(**kwargs)
    assert "HINT:" in str(info.value)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match=r"`config`.*mapping"):
        EngineConfig.from_dict([("zero_stage", 1)])  # type: ignore[arg-type]


def test_cross_field_rule_waits_for_a_base_when_a_field_is_a_default() -> None:
    # zero_stage was not chosen: a base may still say 3, so no error yet ...
    c = EngineConfig(offload_params="cpu")
    r = resolve_engine_config(c, {"zero_optimization": {"stage": 3}})
    assert (r.zero_stage, r.offload_params) == (3, "cpu")
    # ... but without such a base the rule fires on resolution.
    with pytest.raises(ConfigError, match=r"`offload_params` = \"cpu\" needs ZeRO stage 3"):
        resolve_engine_config(c, None)


def test_resolve_takes_unchosen_values_from_base() -> None:
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale_window": 500, "hysteresis": 4},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": False},
            "offload_param": {"device": "cpu"},
            "overlap_comm": True,
            "stage3_gather_fp16_weights_on_model_save": False,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "steps_per_print": 50,
    }
    r = resolve_engine_config(EngineConfig(), base)
    assert r.zero_stage == 3 and r.precision == "fp16"
    assert (r.micro_batch_size, r.gradient_accumulation_steps, r.gradient_clipping) == (4, 8, 1.0)
    assert (r.offload_optimizer, r.offload_params, r.nvme_path, r.pin_memory) == (
        "nvme",
        "cpu",
        "/nvme",
        False,
    )
    assert (r.loss_scale_window, r.hysteresis, r.overlap_comm) == (500, 4, True)
    assert r.stage3_gather_16bit_weights_on_model_save is False  # legacy alias read
    assert r.optimizer == {"type": "AdamW", "params": {"lr": "auto"}} and r.steps_per_print == 50
    assert r.explicit_fields == frozenset()


def test_resolve_bf16_and_auto_values() -> None:
    r = resolve_engine_config(
        EngineConfig(gradient_accumulation_steps=2),
        {
            "bf16": {"enabled": True, "check_grad_overflow": False},
            "gradient_accumulation_steps": "auto",
            "fp16": {"enabled": "auto"},
        },
    )
    assert (
        r.precision == "bf16" and r.bf16_check_grad_overflow is False and r.gradient_accumulation_steps == 2
    )
    legacy = resolve_engine_config(EngineConfig(), {"bfloat16": {"enabled": True}})
    assert legacy.precision == "bf16"


def test_every_conflict_is_listed_with_both_values() -> None:
    config = EngineConfig(zero_stage=2, precision="bf16", gradient_clipping=1.0, offload_optimizer="none")
    base = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "fp16": {"enabled": True},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,  # not chosen: no conflict
    }
    with pytest.raises(ConfigError) as info:
        resolve_engine_config(config, base, where="my.json")
    msg = str(info.value)
    assert "(my.json)" in msg and "HINT:" in msg
    for part in (
        "`zero_optimization.stage` = 3 in the base vs `zero_stage` = 2",
        '`fp16.enabled` = "fp16" in the base vs `precision` = "bf16"',
        "`gradient_clipping` = 0.5 in the base vs `gradient_clipping` = 1.0",
        '`zero_optimization.offload_optimizer.device` = "cpu" in the base vs `offload_optimizer` = "none"',
    ):
        assert part in msg
    assert "gradient_accumulation_steps" not in msg


def test_equal_values_and_auto_never_conflict() -> None:
    config = EngineConfig(zero_stage=3, gradient_clipping=1, micro_batch_size=2)
    base = {
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": "auto",
    }
    r = resolve_engine_config(config, base)
    assert r.zero_stage == 3 and r.micro_batch_size == 2 and r.explicit_fields == config.explicit_fields


@pytest.mark.parametrize(
    ("base", "match"),
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            r"`fp16.enabled` and `bf16.enabled` are both true",
        ),
        ({"zero_optimization": {"stage": 4}}, r"`zero_optimization.stage` = 4"),
        ({"gradient_accumulation_steps": 0}, r"`gradient_accumulation_steps` = 0"),
        ({"zero_optimization": {"reduce_bucket_size": 1.5e8}}, r"`zero_optimization.reduce_bucket_size`"),
        ({"fp16": {"enabled": "yes"}}, r"`fp16.enabled` = \"yes\""),
        (
            {"zero_optimization": {"offload_param": {"device": "tape"}}},
            r"`zero_optimization.offload_param.device`",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            r"`zero_optimization\.offload_param\.device` = \"cpu\" needs ZeRO stage 3, got "
            r"`zero_optimization\.stage` = 2",
        ),
        (
            {"activation_checkpointing": {"cpu_checkpointing": True}},
            r"^`activation_checkpointing\.cpu_checkpointing` = true needs "
            r"`activation_checkpointing_partition` = true",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            r"`nvme_path` is required",
        ),
    ],
)
def test_bad_base_values_name_the_dotted_key(base: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_engine_config(EngineConfig(), base, where="base.json")


def test_load_json_config_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"`.*nope\.json` does not exist"):
        load_json_config(missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{\n  "train_batch_size": 8,\n}\n')
    with pytest.raises(ConfigError, match=r"`.*corrupt\.json` is not valid JSON: .* line 3 column 1"):
        load_json_config(corrupt)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"`.*list\.json` must hold a JSON object.*list"):
        load_json_config(top)
    with pytest.raises(ConfigError, match=r"`base` = 3"):
        load_json_config(3)  # type: ignore[arg-type]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    loaded = load_json_config(str(good))
    assert loaded == {"zero_optimization": {"stage": 2}}
    src = {"a": {"b": 1}}
    copy = load_json_config(src)
    copy["a"]["b"] = 2
    assert src["a"]["b"] == 1  # a deep copy


# --------------------------------------------------------------------------- every problem at once
def test_config_error_carries_every_problem_and_pickles() -> None:
    import pickle

    one = ConfigError("`a` = 1 is invalid. HINT: x")
    assert one.problems == ("`a` = 1 is invalid. HINT: x",) and str(one) == one.problems[0]
    two = ConfigError("`a` is bad. HINT: x", "`b` is bad. HINT: y")
    assert str(two) == "2 configuration problems:\n  - `a` is bad. HINT: x\n  - `b` is bad. HINT: y"
    assert str(pickle.loads(pickle.dumps(two))) == str(two)


def test_engine_config_reports_every_bad_choice_unknown_names_first() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(zero_stage=5, precision="fp8", gradient_clip=1.0, micro_batch_size=0)
    assert info.value.problems == (
        "`gradient_clip` is not a known EngineConfig field. HINT: did you mean `gradient_clipping`?",
        '`zero_stage` = 5 is invalid: expected an integer in 0..3 or "auto". '
        'HINT: set `zero_stage` to an integer in 0..3 or "auto"',
        '`precision` = "fp8" is invalid: expected one of fp32, fp16, bf16. '
        "HINT: set `precision` to one of fp32, fp16, bf16",
        '`micro_batch_size` = 0 is invalid: expected an integer >= 1 or "auto". '
        'HINT: set `micro_batch_size` to an integer >= 1 or "auto"',
    )


def test_resolve_reports_conflicts_bad_base_values_and_combinations_together() -> None:
    base = {
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "overlap_comm": "yes"},
        "gradient_accumulation_steps": 0,
        "gradient_clipping": 0.5,
    }
    with pytest.raises(ConfigError) as info:
        resolve_engine_config(EngineConfig(gradient_clipping=1.0), base, where="b.json")
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith(
        "the DeepSpeed base config (b.json) contradicts explicit choices: `gradient_clipping` = 0.5 in the "
        "base vs `gradient_clipping` = 1.0"
    )
    assert problems[1].startswith("`gradient_accumulation_steps` = 0 (in b.json) is invalid")
    assert problems[2].startswith('`zero_optimization.overlap_comm` = "yes" (in b.json) is invalid')
    assert problems[3].startswith(
        '`zero_optimization.offload_param.device` = "cpu" needs ZeRO stage 3, got '
        "`zero_optimization.stage` = 2"
    )


def test_engine_reports_choice_and_json_problems_in_one_error_before_any_process_group() -> None:
    import torch.distributed as dist

    from ds_engine import Engine

    base = {
        "zero_optimisation": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "1e-5"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
    }
    with pytest.raises(ConfigError) as info:
        Engine(base, backend="accelerate", zero_stag=3, precision="fp8")
    assert info.value.problems == (
        "`zero_stag` is not a known EngineConfig field. HINT: did you mean `zero_stage`?",
        "`zero_optimisation` is not a known top-level DeepSpeed key. HINT: did you mean `zero_optimization`?",
        '`precision` = "fp8" is invalid: expected one of fp32, fp16, bf16. '
        "HINT: set `precision` to one of fp32, fp16, bf16",
        '`optimizer.params.lr` = "1e-5" is invalid: expected a finite number >= 0. '
        "HINT: write a number for lr",
        "`scheduler.params.warmup_num_steps` = 0 is invalid: expected an integer >= 1. "
        "HINT: set scheduler.params.warmup_num_steps to an integer >= 1",
    )
    assert not (dist.is_available() and dist.is_initialized())


def test_engine_checks_a_scheduler_choice_and_names_the_key() -> None:
    from ds_engine import Engine

    bad = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 10}}
    with pytest.raises(
        ConfigError,
        match=r"^`scheduler\.params\.total_num_steps` = 10 is less than "
        r"`scheduler\.params\.warmup_num_steps` = 100: allowed is total_num_steps >= warmup_num_steps",
    ):
        Engine(backend="accelerate", scheduler=bad)
    with pytest.raises(ConfigError, match=r"`scheduler\.params\.warmup_num_steps` = -1 is invalid"):
        Engine({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}}, backend="accelerate")


def test_engine_json_without_a_batch_size_waits_for_prepare() -> None:
    import warnings

    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback lists choices it cannot honour
        engine = Engine({"zero_optimization": {"stage": 2}}, backend="accelerate")
        assert engine.config.zero_stage == 2
        assert Engine("zero3", backend="accelerate").config.zero_stage == 3  # a preset, by name
