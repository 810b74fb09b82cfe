"""build_ds_config / validate_ds_config: golden dicts, every "auto" rule, conflicts, bad inputs."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from ds_engine.config import STEPS_PER_PRINT_OFF, ConfigError, EngineConfig
from ds_engine.ds_config import (
    build_ds_config,
    deepspeed_bucket_fallbacks,
    hidden_size_from_model,
    validate_ds_config,
)
from tests.helpers import backend_alone

COMMON = {
    "zero_allow_untested_optimizer": True,
    "wall_clock_breakdown": False,
    "steps_per_print": STEPS_PER_PRINT_OFF,
}


def test_golden_stage0_fp32() -> None:
    out = build_ds_config(EngineConfig(), world_size=2, micro_batch_size=4)
    assert out == {
        **COMMON,
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False, "check_grad_overflow": True},
        "zero_optimization": {"stage": 0},
    }
    json.dumps(out)  # serializable


def test_golden_stage2_offload_bf16() -> None:
    cfg = EngineConfig(
        zero_stage=2,
        precision="bf16",
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
        offload_optimizer="cpu",
        overlap_comm=True,
        steps_per_print=10,
    )
    out = build_ds_config(cfg, world_size=3, micro_batch_size=2, hidden_size=16)
    assert out == {
        **COMMON,
        "steps_per_print": 10,
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 24,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 256,
            "allgather_bucket_size": 500_000_000,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }


def test_golden_stage3_nvme_fp16() -> None:
    cfg = EngineConfig(
        zero_stage=3,
        precision="fp16",
        offload_optimizer="nvme",
        offload_params="nvme",
        nvme_path="/nvme",
        pin_memory=False,
        initial_scale_power=12,
        min_loss_scale=1.0,
        stage3_gather_16bit_weights_on_model_save=False,
    )
    out = build_ds_config(cfg, world_size=1, micro_batch_size=1, hidden_size=10)
    assert out["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert isinstance(out["fp16"]["min_loss_scale"], int)  # DeepSpeed wants an integer there
    assert out["bf16"] == {"enabled": False, "check_grad_overflow": True}
    assert out["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 100,
        "offload_optimizer": {"device": "nvme", "pin_memory": False, "nvme_path": "/nvme"},
        "offload_param": {"device": "nvme", "pin_memory": False, "nvme_path": "/nvme"},
        "stage3_prefetch_bucket_size": 90,
        "stage3_param_persistence_threshold": 100,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": False,
    }


def test_auto_buckets_from_hidden_size() -> None:
    out = build_ds_config(EngineConfig(zero_stage=3), world_size=1, micro_batch_size=1, hidden_size=768)
    zero = out["zero_optimization"]
    assert zero["reduce_bucket_size"] == 768 * 768
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 768 * 768) == 530841
    assert zero["stage3_param_persistence_threshold"] == 7680
    assert all(
        type(zero[k]) is int
        for k in zero
        if k != "stage3_gather_16bit_weights_on_model_save" and not isinstance(zero[k], bool)
    )


def test_hidden_size_from_real_models_and_configs() -> None:
    from transformers import CLIPConfig, GPT2Config, GPT2LMHeadModel, ResNetConfig

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16))
    assert hidden_size_from_model(model) == 32
    out = build_ds_config(EngineConfig(zero_stage=2), world_size=1, micro_batch_size=1, model=model)
    assert out["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    assert hidden_size_from_model(SimpleNamespace(config=ResNetConfig(hidden_sizes=[8, 64, 16]))) == 64
    clip = CLIPConfig(text_config={"hidden_size": 48})  # a config whose size lives in text_config
    assert hidden_size_from_model(SimpleNamespace(config=clip)) == 48
    assert hidden_size_from_model(torch.nn.Linear(2, 2)) is None
    with pytest.raises(
        ConfigError, match=r"`hidden_size` = 16 contradicts the model's config.hidden_size = 32"
    ):
        build_ds_config(
            EngineConfig(zero_stage=2), world_size=1, micro_batch_size=1, model=model, hidden_size=16
        )


def test_micro_batch_from_dataloader_and_triangle() -> None:
    dl = torch.utils.data.DataLoader(list(range(40)), batch_size=5)
    out = build_ds_config(EngineConfig(gradient_accumulation_steps=2), world_size=4, dataloader=dl)
    assert (out["train_micro_batch_size_per_gpu"], out["train_batch_size"]) == (5, 40)
    with pytest.raises(
        ConfigError, match=r"`train_micro_batch_size_per_gpu` has contradicting sources.*= 3.*= 5"
    ):
        build_ds_config(EngineConfig(micro_batch_size=3), world_size=1, dataloader=dl)


def test_micro_batch_derived_from_base_train_batch_size() -> None:
    out = build_ds_config(
        EngineConfig(gradient_accumulation_steps=2), world_size=2, base={"train_batch_size": 12}
    )
    assert (out["train_micro_batch_size_per_gpu"], out["train_batch_size"]) == (3, 12)
    with pytest.raises(ConfigError, match=r"`train_batch_size` = 10 is not divisible"):
        build_ds_config(
            EngineConfig(gradient_accumulation_steps=2), world_size=2, base={"train_batch_size": 10}
        )


def test_triangle_checked_against_real_world_size_even_when_base_gives_all_three() -> None:
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    assert build_ds_config(EngineConfig(), world_size=1, base=base)["train_batch_size"] == 16
    with pytest.raises(ConfigError, match=r"`train_batch_size` = 16 breaks the batch triangle.*= 32"):
        build_ds_config(EngineConfig(), world_size=2, base=base)


def test_optimizer_and_scheduler_autos_from_torch_optimizer() -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    cfg = EngineConfig(
        optimizer={
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 10},
        },
    )
    out = build_ds_config(cfg, world_size=1, micro_batch_size=1, optimizer=opt)
    assert out["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.98], "eps": 1e-7, "weight_decay": 0.05},
    }
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-5, "warmup_num_steps": 10}
    assert cfg.optimizer is not None and cfg.optimizer["params"]["lr"] == "auto"  # input untouched


def test_leftover_auto_names_every_key_its_filler_and_one_fix() -> None:
    cfg = EngineConfig(
        zero_stage=3,
        reduce_bucket_size="auto",  # asked for explicitly: no DeepSpeed default replaces it
        optimizer={"type": "AdamW", "params": {"lr": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
    )
    with pytest.raises(ConfigError) as info:
        build_ds_config(cfg, world_size=1)
    problems = info.value.problems
    for part in (
        '`train_micro_batch_size_per_gpu` = "auto" is left over: it is filled by the micro batch size',
        '`zero_optimization.reduce_bucket_size` = "auto" is left over: it is filled by hidden_size**2',
        '`optimizer.params.lr` = "auto" is left over: it is filled by the torch optimizer\'s lr',
        '`scheduler.params.total_num_steps` = "auto" is left over: nothing fills it',
    ):
        assert sum(p.startswith(part) for p in problems) == 1, (part, problems)
    # one cause, one problem: train_batch_size follows from the micro batch size
    assert not any(p.startswith("`train_batch_size`") for p in problems)
    # bucket sizes the user did not ask for take DeepSpeed's defaults instead of failing
    assert not any("stage3_prefetch_bucket_size" in p for p in problems)
    assert all(p.count("HINT:") == 1 for p in problems)
    assert str(info.value).startswith(f"{len(problems)} configuration problems:\n  - ")


def test_auto_micro_batch_hint_names_the_engine_calls_not_only_build_ds_config() -> None:
    # What the DeepSpeed backend passes for `engine.prepare(model, optimizer)` without a DataLoader.
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ConfigError,
        match=r'^`train_micro_batch_size_per_gpu` = "auto" is left over: .*HINT: pass '
        r"Engine\(micro_batch_size=8\), or the training DataLoader to engine\.prepare\(model, optimizer, "
        r"train_dl\) \(build_ds_config: micro_batch_size= or dataloader=; ds-engine config: "
        r"--micro-batch-size\)$",
    ):
        build_ds_config(EngineConfig(zero_stage=2), world_size=1, model=model, optimizer=opt, dataloader=None)


def test_every_problem_at_once_unknown_keys_first_with_suggestions() -> None:
    base = {
        "zero_optimisation": {"stage": 2, "reduce_bucket_size": "auto"},
        "gradient_clippin": 1.0,
        "fp16": {"enabled": "yes", "loss_scael": 0},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
    }
    with pytest.raises(ConfigError) as info:
        build_ds_config(EngineConfig(zero_stage=2), base=base, world_size=1, micro_batch_size=1)
    problems = info.value.problems
    assert problems[:3] == (
        "`zero_optimisation` is not a known top-level DeepSpeed key. HINT: did you mean `zero_optimization`?",
        "`gradient_clippin` is not a known top-level DeepSpeed key. HINT: did you mean `gradient_clipping`?",
        "`fp16.loss_scael` is not a known fp16 key. HINT: did you mean `loss_scale`?",
    )
    text = "\n".join(problems)
    assert '`fp16.enabled` = "yes"' in text
    assert "`scheduler.params.warmup_num_steps` = 0 is invalid: expected an integer >= 1" in text
    assert "zero_optimisation.reduce_bucket_size" not in text  # nothing inside an unknown block
    assert len(problems) == 5, problems


def test_the_same_mistake_seen_by_two_checks_is_reported_once() -> None:
    base = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError) as info:
        build_ds_config(EngineConfig(), base=base, world_size=1, micro_batch_size=1)
    assert info.value.problems == (  # not also as `offload_params`: the same setting
        '`zero_optimization.offload_param.device` = "cpu" needs ZeRO stage 3, got `zero_optimization.stage` '
        '= 2: only ZeRO-3 partitions parameters. HINT: set zero_stage=3 or offload_params="none"',
    )
    with pytest.raises(ConfigError) as info:  # the stage chosen, the offload from the JSON
        build_ds_config(
            EngineConfig(zero_stage=2),
            base={"zero_optimization": {"offload_param": {"device": "cpu"}}},
            world_size=1,
            micro_batch_size=1,
        )
    assert info.value.problems == (
        '`zero_optimization.offload_param.device` = "cpu" needs ZeRO stage 3, got `zero_stage` = 2: only '
        'ZeRO-3 partitions parameters. HINT: set zero_stage=3 or offload_params="none"',
    )


def test_unchosen_bucket_sizes_fall_back_to_deepspeed_defaults_as_through_the_engine() -> None:
    facts = {"world_size": 1, "micro_batch_size": 1}
    zero3 = build_ds_config(EngineConfig(zero_stage=3), **facts)["zero_optimization"]
    assert (
        zero3["reduce_bucket_size"],
        zero3["stage3_prefetch_bucket_size"],
        zero3["stage3_param_persistence_threshold"],
    ) == (500_000_000, 50_000_000, 100_000)
    plain = torch.nn.Linear(2, 2)  # no config.hidden_size: the same fallback
    assert build_ds_config(EngineConfig(zero_stage=3), model=plain, **facts)["zero_optimization"] == zero3
    zero1 = build_ds_config(EngineConfig(zero_stage=1), **facts)["zero_optimization"]
    assert zero1["reduce_bucket_size"] == 500_000_000 and "stage3_prefetch_bucket_size" not in zero1
    # the rule itself, shared with the DeepSpeed backend
    assert deepspeed_bucket_fallbacks(EngineConfig(zero_stage=2), None) == {"reduce_bucket_size": 500_000_000}
    assert deepspeed_bucket_fallbacks(EngineConfig(zero_stage=0), None) == {}
    assert deepspeed_bucket_fallbacks(
        EngineConfig(), {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}, zero_stage=3
    ) == {"reduce_bucket_size": 500_000_000, "stage3_param_persistence_threshold": 100_000}
    # an "auto" the user wrote in the JSON still needs a hidden size
    with pytest.raises(
        ConfigError, match=r"^`zero_optimization\.reduce_bucket_size` = \"auto\" is left over"
    ):
        build_ds_config(
            EngineConfig(), base={"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, **facts
        )


@pytest.mark.deepspeed
def test_deepspeed_backend_applies_the_same_bucket_rule() -> None:
    from ds_engine.backends.deepspeed import DeepSpeedBackend

    base = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7}}
    backend = backend_alone(DeepSpeedBackend, EngineConfig(precision="bf16"), base)
    plain = torch.nn.Linear(2, 2)
    facts = {"world_size": 2, "micro_batch_size": 2}
    via_backend = build_ds_config(backend._config_for(plain), model=plain, **facts)  # its base inside
    direct = build_ds_config(EngineConfig(precision="bf16"), model=plain, base=base, **facts)
    assert via_backend == direct
    assert direct["zero_optimization"]["stage3_param_persistence_threshold"] == 7


def test_base_keys_are_kept_and_choices_merged() -> None:
    base = {
        "zero_optimization": {
            "stage": 2,
            "round_robin_gradients": True,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
        "flops_profiler": {"enabled": False},
        "wall_clock_breakdown": True,
        "bfloat16": {"enabled": True},
    }
    out = build_ds_config(
        EngineConfig(gradient_clipping=0.5), world_size=1, micro_batch_size=2, hidden_size=4, base=base
    )
    assert out["zero_optimization"]["round_robin_gradients"] is True
    assert "stage3_gather_fp16_weights_on_model_save" not in out["zero_optimization"]
    assert out["flops_profiler"] == {"enabled": False}
    assert out["wall_clock_breakdown"] is True  # a base's own non-choice key wins over our default
    assert "bfloat16" not in out and out["bf16"]["enabled"] is True
    assert out["gradient_clipping"] == 0.5


def test_base_from_file_and_conflicts_name_the_file(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}))
    out = build_ds_config(EngineConfig(), world_size=1, micro_batch_size=1, hidden_size=4, base=path)
    assert out["zero_optimization"]["stage"] == 1 and out["gradient_accumulation_steps"] == 2
    with pytest.raises(
        ConfigError,
        match=r"ds\.json.*`gradient_accumulation_steps` = 2 in the base vs "
        r"`gradient_accumulation_steps` = 4",
    ):
        build_ds_config(
            EngineConfig(gradient_accumulation_steps=4), world_size=1, micro_batch_size=1, base=str(path)
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, r"`world_size` = 0"),
        ({"world_size": 2.0}, r"`world_size` = 2\.0"),
        ({"world_size": 1, "micro_batch_size": -1}, r"`micro_batch_size` = -1"),
        ({"world_size": 1, "micro_batch_size": 1, "hidden_size": True}, r"`hidden_size` = true"),
        ({"world_size": 1, "base": "zero9"}, r"`zero9` is not a preset.*zero0, zero1.*did you mean"),
        (
            {"world_size": 1, "base": "/no/such/file.json"},
            r"`/no/such/file.json` is neither an existing file",
        ),
        (
            {
                "world_size": 1,
                "micro_batch_size": 1,
                "base": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1e8}},
            },
            r"`zero_optimization.reduce_bucket_size` = 100000000\.0",
        ),
        (
            {
                "world_size": 1,
                "micro_batch_size": 1,
                "base": {"steps_per_print": -3, "zero_optimization": {"stage": 0}},
            },
            r"`steps_per_print` = -3",
        ),
        (
            {"world_size": 1, "micro_batch_size": 1, "base": {"zero_optimization": {"stag": 1}}},
            r"`zero_optimization.stag` is not a known zero_optimization key.*did you mean `stage`",
        ),
        (
            {"world_size": 1, "micro_batch_size": 1, "base": {"train_batch_sise": 1}},
            r"`train_batch_sise` is not a known top-level DeepSpeed key.*`train_batch_size`",
        ),
    ],
)
def test_bad_builder_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_ds_config(EngineConfig(), **kwargs)


def test_validate_reports_every_problem() -> None:
    cfg = {
        "train_batch_size": 10,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": "auto",
        "fp16": {"enabled": True},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 5e8,
            "overlap_comm": "yes",
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "pin_memorie": True},
        },
        "optimiser": {},
    }
    problems = validate_ds_config(cfg, world_size=2)
    text = "\n".join(problems)
    for part in (
        "`optimiser` is not a known top-level DeepSpeed key. HINT: did you mean `optimizer`?",
        '`gradient_clipping` = "auto" is left over',
        "`fp16.enabled` and `bf16.enabled` are both true",
        "`zero_optimization.reduce_bucket_size` = 500000000.0",
        '`zero_optimization.overlap_comm` = "yes"',
        "`zero_optimization.offload_optimizer.pin_memorie` is not a known offload_optimizer key",
        "`zero_optimization.offload_optimizer.nvme_path` is required",
        # the stage/offload rules are the choices' rules (config_rules), naming the JSON's keys
        '`zero_optimization.offload_param.device` = "cpu" needs ZeRO stage 3, got '
        "`zero_optimization.stage` = 2",
        '`zero_optimization.offload_optimizer.device` = "nvme" needs ZeRO stage 3 (ZeRO-Infinity), got '
        "`zero_optimization.stage` = 2",
        "`train_batch_size` = 10 != train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (2) * "
        "world_size (2) = 8",
    ):
        assert part in text, part
    assert all("HINT:" in p for p in problems)


def test_validate_without_world_size_and_missing_batch() -> None:
    assert (
        validate_ds_config(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
        )
        == []
    )
    assert (
        "not a multiple"
        in validate_ds_config(
            {"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
        )[0]
    )
    assert "both missing" in validate_ds_config({"zero_optimization": {"stage": 1}})[0]
    assert "must be a JSON object" in validate_ds_config([1])[0]
    assert validate_ds_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 9}}) == [
        "`zero_optimization.stage` = 9 is invalid: expected 0, 1, 2 or 3. "
        "HINT: set zero_optimization.stage to 0-3"
    ]


@pytest.mark.deepspeed
def test_deepspeed_models_catch_what_our_checks_do_not() -> None:
    # Values only DeepSpeed's own pydantic models know about.
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "fp16": {"enabled": True, "hysteresis": "many"},
    }
    problems = validate_ds_config(cfg)
    assert any(
        p.startswith("`zero_optimization` is rejected by DeepSpeed's DeepSpeedZeroConfig")
        and "Partial offloading" in p
        for p in problems
    ), problems
    assert any(
        p.startswith("`fp16` is rejected by DeepSpeed's DeepSpeedFP16Config") and "hysteresis" in p
        for p in problems
    ), problems
    with pytest.raises(ConfigError, match=r"`zero_optimization` is rejected by DeepSpeed"):
        build_ds_config(
            EngineConfig(),
            world_size=1,
            micro_batch_size=1,
            hidden_size=4,
            base={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
        )


@pytest.mark.deepspeed
def test_every_built_config_passes_deepspeed_models() -> None:
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for stage in range(4):
        for precision in ("fp32", "fp16", "bf16"):
            offload = {"offload_optimizer": "cpu"} if stage else {}
            if stage == 3:
                offload["offload_params"] = "cpu"
            cfg = EngineConfig(zero_stage=stage, precision=precision, **offload)  # type: ignore[arg-type]
            out = build_ds_config(cfg, world_size=2, micro_batch_size=2, hidden_size=8)
            zero = DeepSpeedZeroConfig(**out["zero_optimization"])
            assert int(zero.stage) == stage
            assert DeepSpeedFP16Config(**out["fp16"]).enabled == (precision == "fp16")
            assert DeepSpeedBF16Config(**out["bf16"]).enabled == (precision == "bf16")


# --------------------------------------------------------------------------- optimizer / scheduler
def _sched(kind: str, **params: object) -> dict:
    return {"type": kind, "params": params}


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (
            _sched("WarmupLR", warmup_num_steps=0),
            r"^`scheduler\.params\.warmup_num_steps` = 0 is invalid: expected an integer >= 1\. "
            r"HINT: set scheduler\.params\.warmup_num_steps to an integer >= 1$",
        ),
        (
            _sched("WarmupDecayLR", warmup_num_steps=-5, total_num_steps=10),
            r"`scheduler\.params\.warmup_num_steps` = -5 is invalid",
        ),
        (
            _sched("WarmupCosineLR", warmup_num_steps=10.0, total_num_steps=100),
            r"`scheduler\.params\.warmup_num_steps` = 10\.0 is invalid",
        ),
        (
            _sched("WarmupDecayLR", warmup_num_steps=100, total_num_steps=50),
            r"^`scheduler\.params\.total_num_steps` = 50 is less than `scheduler\.params\.warmup_num_steps` "
            r"= 100: allowed is total_num_steps >= warmup_num_steps .*HINT: set total_num_steps",
        ),
        (
            _sched("WarmupCosineLR", total_num_steps=50),
            r"`scheduler\.params\.warmup_num_steps` = 1000 \(DeepSpeed's default\)",
        ),
        (
            _sched("WarmupDecayLR", warmup_num_steps=10),
            r"^`scheduler\.params\.total_num_steps` is missing: WarmupDecayLR requires it\. HINT: add",
        ),
        (
            _sched("WarmupLR", warmup_steps=10),
            r"^`scheduler\.params\.warmup_steps` is not a known WarmupLR parameter key\. "
            r"HINT: did you mean `warmup_num_steps`\?$",
        ),
        (
            _sched("WarmupLR", warmup_type="cosine"),
            r'`scheduler\.params\.warmup_type` = "cosine" is invalid: expected log or linear',
        ),
        (_sched("WarmupLR", warmup_max_lr="1e-3"), r'`scheduler\.params\.warmup_max_lr` = "1e-3" is invalid'),
        (_sched("OneCycle", cycle_min_lr=0.1), r"`scheduler\.params\.cycle_max_lr` is missing"),
        (
            _sched("OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0),
            r"`scheduler\.params\.cycle_first_step_size` = 0 is invalid: expected a number > 0",
        ),
        (
            _sched("LRRangeTest", lr_range_test_step_size=0),
            r"`scheduler\.params\.lr_range_test_step_size` = 0",
        ),
        (
            _sched("WarmupLinear"),
            r"^`scheduler\.type` = \"WarmupLinear\" is not a scheduler DeepSpeed can build from JSON: "
            r"allowed are LRRangeTest, OneCycle, WarmupLR, .*HINT: did you mean `WarmupLR`\?$",
        ),
        (_sched("LambdaLR", lr_lambda=1), r"`scheduler\.type` = \"LambdaLR\" is not a scheduler DeepSpeed"),
        (_sched("StepLR"), r"`scheduler\.params\.step_size` is missing: StepLR requires it"),
        (
            {"type": "WarmupLR"},
            r"^`scheduler\.params` is missing: allowed is an object \(DeepSpeed calls the scheduler with "
            r"\*\*params",
        ),
        ({"params": {}}, r"`scheduler\.type` is missing"),
    ],
)
def test_scheduler_blocks_are_checked_before_any_process_group(block: dict, match: str) -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "scheduler": block}
    assert any(re.search(match, p) for p in validate_ds_config(cfg)), validate_ds_config(cfg)
    with pytest.raises(ConfigError, match=match):
        build_ds_config(EngineConfig(), world_size=1, micro_batch_size=1, base={"scheduler": block})


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (
            {"type": "AdamW8", "params": {"lr": 1e-5}},
            r"^`optimizer\.type` = \"AdamW8\" is not an optimizer DeepSpeed knows: allowed are Adam, AdamW, "
            r".*HINT: did you mean `AdamW`\?$",
        ),
        (
            {"type": "AdamW", "params": {"lr": "1e-5"}},
            r"^`optimizer\.params\.lr` = \"1e-5\" is invalid: expected a finite number >= 0\.",
        ),
        ({"type": "adamw", "params": {"betas": [0.9]}}, r"`optimizer\.params\.betas` = \[0\.9\] is invalid"),
        ({"type": "SGD", "params": {"weight_decay": -1}}, r"`optimizer\.params\.weight_decay` = -1"),
        (
            {"type": "Adam", "params": {"max_grad_norm": 1.0}},
            r"^`optimizer\.params\.max_grad_norm` = 1\.0 is refused by DeepSpeed: .*gradient_clipping",
        ),
        ({"type": "Adam", "params": [1]}, r"`optimizer\.params` = \[1\] is invalid: expected an object"),
        ({"type": "Adam", "paramz": {}}, r"`optimizer\.paramz` is not a known optimizer key.*`params`"),
    ],
)
def test_optimizer_blocks_are_checked(block: dict, match: str) -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": block}
    assert any(re.search(match, p) for p in validate_ds_config(cfg)), validate_ds_config(cfg)
    with pytest.raises(ConfigError, match=match):
        build_ds_config(EngineConfig(), world_size=1, micro_batch_size=1, base={"optimizer": block})


def test_good_optimizer_and_scheduler_blocks_pass() -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "torch_adam": True}},
        "scheduler": _sched("WarmupDecayLR", warmup_num_steps=10, total_num_steps=10, warmup_type="linear"),
    }
    assert validate_ds_config(cfg) == []
    cfg["scheduler"] = _sched("StepLR", step_size=3, gamma=0.5)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    assert validate_ds_config(cfg) == []


@pytest.mark.deepspeed
def test_deepspeed_refuses_what_we_refuse_and_its_schedulers_match_our_table() -> None:
    import inspect

    from deepspeed.runtime import lr_schedules

    from ds_engine.ds_config import DEEPSPEED_SCHEDULERS

    assert set(DEEPSPEED_SCHEDULERS) == set(lr_schedules.VALID_LR_SCHEDULES)
    for kind, (names, required) in DEEPSPEED_SCHEDULERS.items():
        params = dict(inspect.signature(getattr(lr_schedules, kind)).parameters)
        params.pop("optimizer")
        assert set(params) == names, kind
        assert {n for n, p in params.items() if p.default is inspect.Parameter.empty} == required, kind
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for kind, params in (
        ("WarmupLR", {"warmup_num_steps": 0}),
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": -1}),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2.5}),
        ("LRRangeTest", {"lr_range_test_step_size": 0}),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0}),
    ):
        with pytest.raises(ValueError):
            getattr(lr_schedules, kind)(opt, **params)
        assert validate_ds_config({"train_micro_batch_size_per_gpu": 1, "scheduler": _sched(kind, **params)})
