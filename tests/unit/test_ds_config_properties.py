"""Property-based tests of the config builder (Hypothesis).

Noisy inputs: random high-level choices, facts and a base JSON with valid and invalid keys
and values, nested, go into `EngineConfig` + `build_ds_config` (and into the Engine's own
argument check). Either a `ConfigError` comes out whose every problem names a key and carries
one fix, naming every misspelt key of the input, unknown keys first; or a complete config.

Valid inputs: random choices, facts and base JSON that agree with each other must always
build, and the config must hold the batch triangle (train_batch_size == micro * GA * world),
have no "auto" left anywhere, pass our own validation and, where DeepSpeed is installed,
DeepSpeed's own `DeepSpeedConfig` (with the real world size, no process group) and its
optimizer/scheduler constructors.

The examples are bounded by the Hypothesis profile in tests/conftest.py ("ci": a fixed
number of examples, no deadline); HYPOTHESIS_PROFILE=thorough searches longer.
"""

from __future__ import annotations

import json
import re
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ds_engine.config import ConfigError, EngineConfig, resolve_config
from ds_engine.ds_config import DEEPSPEED_SCHEDULERS, build_ds_config, validate_ds_config

AUTO = st.just("auto")
POS = st.integers(1, 8)


def _mostly(good: st.SearchStrategy[Any], *bad: Any) -> st.SearchStrategy[Any]:
    """`good` three times out of four, else one of the `bad` values."""
    return st.one_of(good, good, good, st.sampled_from(bad))


#: Keys the strategies below misspell on purpose: each must be named in the error.
MISSPELT = frozenset(
    {
        "zero_stag",
        "gradient_clip",
        "zero_optimisation",
        "gradient_clippin",
        "loss_scael",
        "stag",
        "pin_memorie",
        "warmup_steps",
        "paramz",
    }
)

LR = st.floats(1e-6, 1e-1)

OPTIMIZER = st.fixed_dictionaries(
    {"type": _mostly(st.sampled_from(["AdamW", "Adam", "adamw", "SGD"]), "AdamW8")},
    optional={
        "params": st.fixed_dictionaries(
            {},
            optional={
                "lr": _mostly(LR | AUTO, "1e-5", -1.0),
                "betas": _mostly(st.lists(st.floats(0, 0.999), min_size=2, max_size=2) | AUTO, [0.9]),
                "eps": st.floats(1e-10, 1e-6) | AUTO,
                "weight_decay": _mostly(st.floats(0, 0.1) | AUTO, -0.1),
                "max_grad_norm": st.just(1.0),
            },
        ),
        "paramz": st.just({}),
    },
)

_WARMUP = {
    "warmup_num_steps": _mostly(st.integers(1, 50), 0, -3, 10.0),
    "warmup_type": _mostly(st.sampled_from(["log", "linear"]), "cosine"),
}
SCHEDULER = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("WarmupLR"),
            "params": st.fixed_dictionaries(
                {},
                optional={
                    **_WARMUP,
                    "warmup_min_lr": st.floats(0, 1e-5) | AUTO,
                    "warmup_max_lr": _mostly(LR | AUTO, "1e-3"),
                    "warmup_steps": st.just(3),
                },
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("WarmupDecayLR"),
            "params": st.fixed_dictionaries(
                {"total_num_steps": _mostly(st.integers(1, 100), "auto", 0)},
                optional={**_WARMUP, "warmup_max_lr": LR | AUTO},
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("WarmupCosineLR"),
            "params": st.fixed_dictionaries(
                {"total_num_steps": st.integers(1, 2000)},
                optional={**_WARMUP, "warmup_min_ratio": st.floats(0, 1), "cos_min_ratio": st.floats(0, 1)},
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("StepLR"), "params": st.fixed_dictionaries({"step_size": st.integers(1, 9)})}
    ),
    st.sampled_from([{"type": "WarmupLinear", "params": {}}, {"type": "WarmupLR"}]),
)

OFFLOAD_DEVICE = _mostly(st.sampled_from(["none", "cpu", "nvme"]), "gpu")

CHOICES = st.fixed_dictionaries(
    {},
    optional={
        "zero_stage": _mostly(st.integers(0, 3), 4, -1, "2", 2.0, True),
        "precision": _mostly(st.sampled_from(["fp32", "fp16", "bf16"]), "fp8"),
        "gradient_accumulation_steps": _mostly(POS, 0, 1.5),
        "gradient_clipping": _mostly(st.floats(0, 10), -1.0, float("nan")),
        "micro_batch_size": _mostly(POS | AUTO, 0),
        "offload_optimizer": OFFLOAD_DEVICE,
        "offload_params": OFFLOAD_DEVICE,
        "nvme_path": _mostly(st.sampled_from(["/local_nvme", None]), ""),
        "pin_memory": st.booleans(),
        "loss_scale": st.sampled_from([0.0, 128.0]) | st.floats(0, 2.0**20),
        "initial_scale_power": st.integers(0, 32),
        "loss_scale_window": st.integers(1, 2000),
        "hysteresis": st.integers(1, 4),
        "min_loss_scale": _mostly(st.integers(1, 8).map(float) | st.integers(1, 8), 0.0, 0.5),
        "bf16_check_grad_overflow": st.booleans(),
        "overlap_comm": st.booleans(),
        "contiguous_gradients": st.booleans(),
        "reduce_bucket_size": _mostly(st.integers(1, 2 * 10**9) | AUTO, 0, 1.5e8),
        "allgather_bucket_size": st.integers(1, 2 * 10**9),
        "stage3_prefetch_bucket_size": st.integers(0, 10**9) | AUTO,
        "stage3_param_persistence_threshold": st.integers(0, 10**6) | AUTO,
        "stage3_max_live_parameters": st.integers(0, 10**9),
        "stage3_max_reuse_distance": st.integers(0, 10**9),
        "stage3_gather_16bit_weights_on_model_save": st.booleans(),
        "activation_checkpointing": st.booleans(),
        "activation_checkpointing_partition": st.booleans(),
        "activation_checkpointing_cpu": st.booleans(),
        "optimizer": st.none() | OPTIMIZER,
        "scheduler": st.none() | SCHEDULER,
        "coalesce_grad_reduction": st.booleans(),
        "steps_per_print": st.integers(0, 100),
        "zero_stag": st.just(3),
        "gradient_clip": st.just(1.0),
    },
)


def _offload(key: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"device": _mostly(st.sampled_from(["none", "cpu", "nvme"]), "tape")},
        optional={
            "pin_memory": st.booleans(),
            "nvme_path": st.sampled_from(["/local_nvme", "auto"]),
            **({"pin_memorie": st.booleans()} if key == "offload_optimizer" else {}),
        },
    )


ZERO = st.fixed_dictionaries(
    {},
    optional={
        "stage": _mostly(st.integers(0, 3), 4, "3"),
        "offload_optimizer": _mostly(_offload("offload_optimizer"), "cpu"),
        "offload_param": _offload("offload_param"),
        "overlap_comm": _mostly(st.booleans(), "yes"),
        "reduce_bucket_size": _mostly(st.integers(1, 10**9) | AUTO, 5e8, 0),
        "allgather_bucket_size": st.integers(0, 10**9),
        "stage3_prefetch_bucket_size": st.integers(0, 10**9) | AUTO,
        "stage3_param_persistence_threshold": st.integers(0, 10**6) | AUTO,
        "stage3_gather_16bit_weights_on_model_save": st.booleans(),
        "round_robin_gradients": st.booleans(),
        "sub_group_size": st.integers(1, 10**9),
        "stag": st.just(1),
    },
)

BASE = st.fixed_dictionaries(
    {},
    optional={
        "train_batch_size": _mostly(st.integers(1, 64) | AUTO, 0),
        "train_micro_batch_size_per_gpu": POS | AUTO,
        "gradient_accumulation_steps": _mostly(POS | AUTO, 0),
        "gradient_clipping": _mostly(st.floats(0, 5) | AUTO, -1),
        "fp16": st.fixed_dictionaries(
            {"enabled": _mostly(st.booleans() | AUTO, "yes")},
            optional={
                "loss_scale": st.floats(0, 2.0**16),
                "initial_scale_power": st.integers(0, 32),
                "loss_scale_window": st.integers(1, 1000),
                "hysteresis": st.integers(1, 4),
                "min_loss_scale": st.integers(1, 4),
                "loss_scael": st.just(0),
            },
        ),
        "bf16": _mostly(
            st.fixed_dictionaries(
                {"enabled": st.booleans() | AUTO}, optional={"check_grad_overflow": st.booleans()}
            ),
            True,
        ),
        "zero_optimization": _mostly(ZERO, 3),
        "zero_optimisation": st.just({"stage": 2}),
        "gradient_clippin": st.just(1.0),
        "steps_per_print": _mostly(st.integers(1, 100), 0),
        "wall_clock_breakdown": st.booleans(),
        "activation_checkpointing": st.fixed_dictionaries(
            {}, optional={"partition_activations": st.booleans(), "cpu_checkpointing": st.booleans()}
        ),
        "optimizer": _mostly(OPTIMIZER, "AdamW"),
        "scheduler": _mostly(SCHEDULER, "WarmupLR"),
    },
)

FACTS = st.fixed_dictionaries(
    {
        "world_size": _mostly(POS, 0),
        "micro_batch_size": st.none() | POS,
        "hidden_size": st.none() | st.integers(1, 4096),
    }
)


# --------------------------------------------------------------------------- valid inputs
@st.composite
def valid_inputs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Random choices, base JSON and facts that are all allowed and agree with each other.

    Each setting is drawn once and then written either as a choice or into the base JSON, so
    every combination of the two sources is exercised without contradicting itself.
    """
    choices: dict[str, Any] = {}
    base: dict[str, Any] = {}
    zero: dict[str, Any] = {}

    def put(name: str, value: Any, dotted: str) -> None:
        if draw(st.booleans()):
            choices[name] = value
            return
        *parents, leaf = dotted.split(".")
        node = base
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    world = draw(POS)
    facts: dict[str, Any] = {"world_size": world, "hidden_size": draw(st.none() | st.integers(1, 4096))}
    stage = draw(st.integers(0, 3))
    put("zero_stage", stage, "zero_optimization.stage")
    precision = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    if draw(st.booleans()):
        choices["precision"] = precision
    elif precision != "fp32" or draw(st.booleans()):
        base["fp16"] = {"enabled": precision == "fp16"}
        base["bf16"] = {"enabled": precision == "bf16"}
    ga = draw(POS)
    put("gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    micro = draw(POS)
    source = draw(st.sampled_from(["choice", "fact", "base_micro", "base_total"]))
    if source == "choice":
        choices["micro_batch_size"] = micro
    elif source == "fact":
        facts["micro_batch_size"] = micro
    elif source == "base_micro":
        base["train_micro_batch_size_per_gpu"] = micro
    else:
        base["train_batch_size"] = micro * ga * world
    if draw(st.booleans()):
        put("gradient_clipping", draw(st.floats(0, 10)), "gradient_clipping")
    devices = ["none", "cpu", "nvme"] if stage == 3 else ["none", "cpu"] if stage else ["none"]
    offload_optimizer = draw(st.sampled_from(devices))
    offload_params = draw(st.sampled_from(devices if stage == 3 else ["none"]))
    if offload_optimizer != "none" or draw(st.booleans()):
        put("offload_optimizer", offload_optimizer, "zero_optimization.offload_optimizer.device")
    if offload_params != "none" or draw(st.booleans()):
        put("offload_params", offload_params, "zero_optimization.offload_param.device")
    if "nvme" in (offload_optimizer, offload_params):
        choices["nvme_path"] = "/local_nvme"
    if draw(st.booleans()):
        choices["pin_memory"] = draw(st.booleans())
    if precision == "fp16":
        for name, strategy in (
            ("loss_scale", st.sampled_from([0.0, 128.0]) | st.floats(0, 2.0**20)),
            ("initial_scale_power", st.integers(0, 32)),
            ("loss_scale_window", st.integers(1, 2000)),
            ("hysteresis", st.integers(1, 4)),
            ("min_loss_scale", st.integers(1, 8).map(float) | st.integers(1, 8)),
        ):
            if draw(st.booleans()):
                put(name, draw(strategy), f"fp16.{name}")
    if precision == "bf16" and draw(st.booleans()):
        put("bf16_check_grad_overflow", draw(st.booleans()), "bf16.check_grad_overflow")
    sized = facts["hidden_size"] is not None
    buckets = {"reduce_bucket_size": (1, 1)} if stage else {}
    if stage == 3:
        buckets |= {"stage3_prefetch_bucket_size": (0, 3), "stage3_param_persistence_threshold": (0, 3)}
    for name, (least, _) in buckets.items():
        if draw(st.booleans()):
            value = draw(st.integers(least, 2 * 10**9) | (AUTO if sized else st.integers(least, 10)))
            put(name, value, f"zero_optimization.{name}")
    if stage:
        for name in ("overlap_comm", "contiguous_gradients"):
            if draw(st.booleans()):
                put(name, draw(st.booleans()), f"zero_optimization.{name}")
    if stage in (1, 2) and draw(st.booleans()):
        put(
            "allgather_bucket_size",
            draw(st.integers(1, 2 * 10**9)),
            "zero_optimization.allgather_bucket_size",
        )
    if stage == 3:
        for name in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
            if draw(st.booleans()):
                put(name, draw(st.integers(0, 10**9)), f"zero_optimization.{name}")
        if draw(st.booleans()):
            choices["stage3_gather_16bit_weights_on_model_save"] = draw(st.booleans())
    if stage and draw(st.booleans()):
        zero["round_robin_gradients"] = draw(st.booleans())
    if zero:
        base.setdefault("zero_optimization", {}).update(zero)
    if draw(st.booleans()):
        partition = draw(st.booleans())
        choices |= {
            "activation_checkpointing": True,
            "activation_checkpointing_partition": partition,
            "activation_checkpointing_cpu": partition and draw(st.booleans()),
        }
    if draw(st.booleans()):
        put("steps_per_print", draw(st.integers(0, 100)), "steps_per_print")
    lr = draw(LR)
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["AdamW", "Adam", "adamw", "SGD"]))
        params: dict[str, Any] = {"lr": lr}
        if kind != "SGD":
            params |= {
                "betas": draw(st.lists(st.floats(0, 0.999), min_size=2, max_size=2)),
                "eps": draw(st.floats(1e-10, 1e-6)),
            }
        params["weight_decay"] = draw(st.floats(0, 0.1))
        put("optimizer", {"type": kind, "params": params}, "optimizer")
    if draw(st.booleans()):
        warmup = draw(st.integers(1, 50))
        kind = draw(st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "StepLR"]))
        params = {"warmup_num_steps": warmup, "warmup_type": draw(st.sampled_from(["log", "linear"]))}
        if kind == "WarmupLR":
            params |= {"warmup_min_lr": 0.0, "warmup_max_lr": lr}
        elif kind == "WarmupDecayLR":
            params |= {"total_num_steps": draw(st.integers(warmup, 500)), "warmup_max_lr": lr}
        elif kind == "WarmupCosineLR":
            params |= {
                "total_num_steps": draw(st.integers(warmup, 500)),
                "cos_min_ratio": draw(st.floats(0, 1)),
            }
        else:
            params = {"step_size": draw(st.integers(1, 9)), "gamma": draw(st.floats(0.1, 1))}
        put("scheduler", {"type": kind, "params": params}, "scheduler")
    return choices, base, facts


_NAMED = re.compile(r"`([^`]+)`")


def _keys(node: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of a JSON-like dict, and every key name on its own."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            found |= {dotted, str(key)} | _keys(value, dotted)
    return found


def _no_auto_left(node: Any) -> bool:
    if isinstance(node, dict):
        return all(_no_auto_left(v) for v in node.values())
    if isinstance(node, list):
        return all(_no_auto_left(v) for v in node)
    return node != "auto"


def _build(choices: dict[str, Any], base: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """What a user does: build the choices, then the DeepSpeed config from them and the base."""
    try:
        config = EngineConfig(**choices)
    except ConfigError as exc:  # the base was never looked at: only the choices are named
        event("refused by EngineConfig")
        _check_error(exc, choices, {}, {})
        raise _Reported from None
    try:
        out = build_ds_config(config, base=base, **facts)
    except ConfigError as exc:
        event("refused by build_ds_config")
        _check_error(exc, choices, base, facts)
        raise _Reported from None
    event("built")
    return out


class _Reported(Exception):
    """A ConfigError that passed `_check_error`."""


def _check_error(
    exc: ConfigError, choices: dict[str, Any], base: dict[str, Any], facts: dict[str, Any]
) -> None:
    text = str(exc)
    assert exc.problems and all("HINT:" in p and _NAMED.search(p) for p in exc.problems), text
    given_names = _keys(choices) | _keys(base) | {k for k, v in facts.items() if v is not None}
    # the builder's own outputs count as named keys too: they are what a missing fact leaves
    known = given_names | {"train_micro_batch_size_per_gpu", "train_batch_size"}
    named = {n for p in exc.problems for n in _NAMED.findall(p)}
    # a missing key is named by its path: its parent block is what the input gave
    parts = {".".join(n.split(".")[:i]) for n in named for i in range(1, n.count(".") + 2)}
    assert parts & known or {n.split(".")[-1] for n in named} & known, (named, text)
    for misspelt in MISSPELT & given_names:
        assert f"{misspelt}`" in text, (misspelt, text)  # unknown keys are first-class
    if any(" is not a known " in p for p in exc.problems):
        assert " is not a known " in exc.problems[0], text  # ... and come first


def _check_config(out: dict[str, Any], facts: dict[str, Any]) -> None:
    assert json.loads(json.dumps(out)) == out
    assert _no_auto_left(out), out
    micro, ga = out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]
    assert out["train_batch_size"] == micro * ga * facts["world_size"]
    assert validate_ds_config(out, world_size=facts["world_size"]) == []


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(choices=CHOICES, base=BASE, facts=FACTS)
def test_builder_either_names_a_key_or_builds_a_complete_config(
    choices: dict[str, Any], base: dict[str, Any], facts: dict[str, Any]
) -> None:
    try:
        out = _build(choices, base, facts)
    except _Reported:
        return
    _check_config(out, facts)
    assert not (MISSPELT & (_keys(choices) | _keys(base))), "a misspelt key was accepted"


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(choices=CHOICES, base=BASE, world_size=POS)
def test_engine_arguments_report_choice_and_json_problems_together(
    choices: dict[str, Any], base: dict[str, Any], world_size: int
) -> None:
    try:
        resolved = resolve_config(base, choices, world_size=world_size)  # what `Engine(base, **choices)` does
    except ConfigError as exc:
        _check_error(exc, choices, base, {"world_size": world_size})
        return
    assert resolved.base == base and resolved.user.explicit_fields == set(choices)
    assert not (MISSPELT & (_keys(choices) | _keys(base))), "a misspelt key was accepted"


class _DataParallel:
    """The one thing DeepSpeedConfig asks an mpu: the data-parallel world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def _deepspeed_accepts(out: dict[str, Any], world_size: int) -> None:
    """DeepSpeed's own config object (batch triangle included) and its optimizer/scheduler."""
    import deepspeed.runtime.config as ds_config_module
    from deepspeed.runtime import lr_schedules

    with mock.patch.object(ds_config_module.dist, "get_rank", return_value=0):  # no process group
        parsed = ds_config_module.DeepSpeedConfig(out, mpu=_DataParallel(world_size))
    assert parsed.world_size == world_size and parsed.train_batch_size == out["train_batch_size"]
    model = torch.nn.Linear(2, 2)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    block = out.get("optimizer")
    if block is not None:  # DeepSpeed's adam/adamw fall back to torch's on CPU
        kind = block["type"]
        params = dict(block.get("params") or {})
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(kind.lower()) or getattr(
            torch.optim, kind
        )
        optimizer = cls(model.parameters(), **params)
    sched = out.get("scheduler")
    if sched is not None:
        kind = sched["type"]
        cls = (
            getattr(lr_schedules, kind)
            if kind in DEEPSPEED_SCHEDULERS
            else getattr(torch.optim.lr_scheduler, kind)
        )
        cls(optimizer, **sched["params"])


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(inputs=valid_inputs())
def test_valid_inputs_always_build_a_complete_config(
    inputs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    choices, base, facts = inputs
    out = build_ds_config(EngineConfig(**choices), base=base, **facts)  # no ConfigError: all allowed
    _check_config(out, facts)


@pytest.mark.deepspeed
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(inputs=valid_inputs())
def test_every_built_config_is_accepted_by_deepspeed_itself(
    inputs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    choices, base, facts = inputs
    out = build_ds_config(EngineConfig(**choices), base=base, **facts)
    _check_config(out, facts)
    _deepspeed_accepts(out, facts["world_size"])
