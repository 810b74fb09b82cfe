"""accelerate's constructor arguments -> Engine choices: `map_arguments` on its own (no Engine).

Every argument of `accelerate.Accelerator.__init__` is classified in `ARGUMENTS` (mapped,
ignored or refused); each refused one raises naming itself, each ignored one leaves the setup
as it was, each mapped one lands where the table says. The function reads only its arguments
and changes none of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math

import accelerate
import pytest
from accelerate.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)

import ds_engine
from ds_engine.accelerate_compat.constructor import (
    ARGUMENTS,
    IGNORED,
    MAPPED,
    REFUSED,
    EngineSetup,
    map_arguments,
)

#: A value other than accelerate's default for every refused argument.
REFUSED_VALUES = {
    "device_placement": False,
    "split_batches": True,
    "fsdp_plugin": accelerate.FullyShardedDataParallelPlugin(),
    "torch_tp_plugin": object(),
    "megatron_lm_plugin": object(),
    "dynamo_backend": "inductor",
    "dynamo_plugin": object(),
    "parallelism_config": object(),
}

#: A value other than accelerate's default for every ignored argument.
IGNORED_VALUES = {"rng_types": ["torch", "generator"]}

#: The arguments that are the Accelerator's own settings (trackers, state folders): they leave
#: the Engine's setup alone (`tests/unit/test_accelerator_surface.py` covers what they do).
OWN_SETTINGS = {
    "log_with": "tensorboard",
    "project_dir": "out/run",
    "project_config": ProjectConfiguration(project_dir="out/run", automatic_checkpoint_naming=True),
}


def _accelerate_arguments() -> dict[str, inspect.Parameter]:
    params = inspect.signature(accelerate.Accelerator.__init__).parameters
    return {name: p for name, p in params.items() if name != "self"}


def test_every_accelerate_constructor_argument_is_classified():
    names = list(_accelerate_arguments())
    assert sorted(set(names) - set(ARGUMENTS)) == [], "classify them in constructor.ARGUMENTS"
    assert sorted(set(ARGUMENTS) - set(names)) == [], "accelerate no longer has these"
    assert {status for status, _ in ARGUMENTS.values()} <= {MAPPED, IGNORED, REFUSED}
    assert all(how for _, how in ARGUMENTS.values()), "say what happens"
    refused = {n for n, (status, _) in ARGUMENTS.items() if status == REFUSED}
    ignored = {n for n, (status, _) in ARGUMENTS.items() if status == IGNORED}
    assert refused == set(REFUSED_VALUES) and ignored == set(IGNORED_VALUES)


def test_the_function_and_the_class_take_accelerates_arguments_with_its_defaults():
    mapping = inspect.signature(map_arguments).parameters
    accelerator = inspect.signature(ds_engine.Accelerator.__init__).parameters
    for name, param in _accelerate_arguments().items():
        assert name in mapping and name in accelerator, name
        if name != "split_batches":  # accelerate's "not given" marker is its own object
            assert mapping[name].default == param.default, name
            assert accelerator[name].default == param.default, name


def test_the_defaults_map_onto_nothing():
    setup = map_arguments()
    assert setup == EngineSetup(config=None, choices={})
    assert setup.dataloader_config == DataLoaderConfiguration() and setup.step_scheduler_with_optimizer


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_argument_is_named_with_the_fix(name):
    with pytest.raises(ValueError, match=rf"`{name}=.*` is not supported\. HINT: ") as info:
        map_arguments(**{name: REFUSED_VALUES[name]})
    assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(IGNORED_VALUES) + sorted(OWN_SETTINGS))
def test_an_ignored_argument_or_the_accelerators_own_setting_leaves_the_setup_alone(name):
    value = {**IGNORED_VALUES, **OWN_SETTINGS}[name]
    assert map_arguments(**{name: value}) == map_arguments()


def test_precision():
    assert map_arguments(mixed_precision="bf16").choices == {"precision": "bf16"}
    assert map_arguments(mixed_precision="no").choices == {"precision": "fp32"}
    assert map_arguments(mixed_precision=accelerate.utils.PrecisionType.FP16).choices == {"precision": "fp16"}
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    assert map_arguments(environ=env).choices == {"precision": "bf16"}
    assert map_arguments(mixed_precision="fp16", environ=env).choices == {"precision": "fp16"}
    assert map_arguments().choices == {}, "the process environment is not read"
    with pytest.raises(ValueError, match=r"`mixed_precision='fp8'` is not supported\. HINT: use 'no'"):
        map_arguments(mixed_precision="fp8")


def test_the_callers_engine_choices_win():
    setup = map_arguments(
        mixed_precision="bf16", gradient_accumulation_steps=4, choices={"precision": "fp16"}
    )
    assert setup.choices == {"precision": "fp16", "gradient_accumulation_steps": 4}


def test_accumulation_steps_and_the_plugin():
    assert map_arguments(gradient_accumulation_steps=4).choices == {"gradient_accumulation_steps": 4}
    plugin = GradientAccumulationPlugin(num_steps=3)
    assert map_arguments(gradient_accumulation_plugin=plugin).choices == {"gradient_accumulation_steps": 3}
    with pytest.raises(ValueError, match="not both"):
        map_arguments(gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin)
    with pytest.raises(ValueError, match=r"`GradientAccumulationPlugin\.sync_with_dataloader=False`.*HINT"):
        map_arguments(gradient_accumulation_plugin=GradientAccumulationPlugin(sync_with_dataloader=False))


def test_cpu_is_refused_only_where_cuda_is_visible():
    assert map_arguments(cpu=True, cuda_available=False) == map_arguments()
    with pytest.raises(ValueError, match=r"`cpu=True` is not supported\. HINT: .*CUDA_VISIBLE_DEVICES"):
        map_arguments(cpu=True, cuda_available=True)


@pytest.mark.parametrize(
    ("loaders", "named"),
    [
        (DataLoaderConfiguration(split_batches=True), "split_batches"),
        (DataLoaderConfiguration(dispatch_batches=True), "dispatch_batches"),
        (DataLoaderConfiguration(even_batches=False), "even_batches"),
        (DataLoaderConfiguration(data_seed=3), "data_seed"),
    ],
)
def test_loader_settings_it_cannot_honour_are_named(loaders, named):
    with pytest.raises(ValueError, match=rf"`{named}=.*` is not supported\. HINT: "):
        map_arguments(dataloader_config=loaders)


def test_the_loader_settings_are_kept_and_never_changed_in_place():
    loaders = DataLoaderConfiguration(non_blocking=True)
    assert map_arguments(dataloader_config=loaders).dataloader_config is loaders
    split = DataLoaderConfiguration(split_batches=True)
    setup = map_arguments(dataloader_config=split, split_batches=False)
    assert not setup.dataloader_config.split_batches and split.split_batches
    with pytest.raises(ValueError, match="split_batches"):
        map_arguments(dataloader_config=DataLoaderConfiguration(), split_batches=True)


def test_a_deepspeed_plugin_is_the_engines_config():
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2)
    config = map_arguments(deepspeed_plugin=plugin).config
    assert config["zero_optimization"]["stage"] == 2 and config["gradient_accumulation_steps"] == 2
    expected = dict(plugin.deepspeed_config)
    steps = expected.get("steps_per_print")
    if isinstance(steps, float) and not math.isfinite(steps):
        del expected["steps_per_print"]  # accelerate's "never print" is ds_engine's default
    assert config == expected
    assert map_arguments(deepspeed_plugins={"only": plugin}).config == config
    with pytest.raises(
        ValueError, match=r"`deepspeed_plugins=\"\{'a', 'b'\}\"` is not supported\. HINT: pass one"
    ):
        map_arguments(deepspeed_plugins={"a": plugin, "b": plugin})
    with pytest.raises(ValueError, match="`deepspeed_plugin` and `config` both give a DeepSpeed config"):
        map_arguments(deepspeed_plugin=plugin, config="zero2")
    assert map_arguments(config="zero2").config == "zero2"


def test_kwargs_handlers():
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=77))
    scaler = GradScalerKwargs(init_scale=2.0**10, growth_interval=500)
    quiet = [DistributedDataParallelKwargs(find_unused_parameters=True), ProfileKwargs(), AutocastKwargs()]
    setup = map_arguments(kwargs_handlers=[timeout, scaler, *quiet])
    assert setup.choices == {"dist_timeout_s": 77, "initial_scale_power": 10, "loss_scale_window": 500}
    later = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5))
    assert map_arguments(kwargs_handlers=[timeout, later]).choices == {"dist_timeout_s": 77}
    for bad, named in (
        (GradScalerKwargs(init_scale=3.0), "GradScalerKwargs.init_scale"),
        (AutocastKwargs(enabled=False), "AutocastKwargs.enabled"),
        (object(), "kwargs_handlers"),
    ):
        with pytest.raises(ValueError, match=rf"`{named}=.*` is not supported\. HINT: "):
            map_arguments(kwargs_handlers=[bad])


def test_step_scheduler_with_optimizer():
    assert not map_arguments(step_scheduler_with_optimizer=False).step_scheduler_with_optimizer


def test_nothing_given_is_changed():
    choices = {"zero_stage": 2}
    loaders = DataLoaderConfiguration()
    before = dataclasses.asdict(loaders)
    map_arguments(
        mixed_precision="bf16", gradient_accumulation_steps=2, dataloader_config=loaders, choices=choices
    )
    assert choices == {"zero_stage": 2} and dataclasses.asdict(loaders) == before
