"""`ds_engine.Accelerator`: accelerate's constructor and names over the Engine (one process)."""

from __future__ import annotations

import datetime
import logging
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch

import ds_engine
import ds_engine.accelerator as accelerator_module
from ds_engine.accelerator import COMPAT, DIFFERS, NOT_APPLICABLE, SUPPORTED
from tests.helpers import micro_step, regression_loader

ROOT = Path(__file__).resolve().parents[2]

#: What accelerate's examples import on the lines a port changes (`from accelerate import ...`,
#: `from accelerate.utils import ...`).
PORTED_NAMES = [
    "Accelerator",
    "DistributedType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
    "DummyOptim",
    "DummyScheduler",
    "set_seed",
    "find_executable_batch_size",
    "skip_first_batches",
    "LoggerType",
    "InitProcessGroupKwargs",
    "GradScalerKwargs",
    "DistributedDataParallelKwargs",
    "AutocastKwargs",
    "PartialState",
]


def _acc(**kwargs):
    return ds_engine.Accelerator(backend="accelerate", **kwargs)


def _train(acc, steps_dir: Path | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=4)
    return acc.prepare(model, opt, regression_loader(), sched)


# ---------------------------------------------------------------- the compatibility table
def test_every_public_accelerate_name_is_classified():
    public = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
    unclassified = sorted(public - set(COMPAT))
    assert not unclassified, (
        f"classify these new accelerate names in ds_engine.accelerator.COMPAT: {unclassified}"
    )
    assert {status for status, _ in COMPAT.values()} <= {SUPPORTED, DIFFERS, NOT_APPLICABLE}
    assert all(how for status, how in COMPAT.values() if status != SUPPORTED), "say how it differs"


def test_every_name_listed_as_working_exists_on_ds_engine_accelerator():
    missing = sorted(
        n
        for n, (status, _) in COMPAT.items()
        if status != NOT_APPLICABLE and not hasattr(ds_engine.Accelerator, n)
    )
    assert not missing, f"listed as supported/differs but missing on ds_engine.Accelerator: {missing}"


def test_the_generated_table_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tools" / "compat_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_name_a_port_imports_comes_from_ds_engine():
    for name in PORTED_NAMES:
        assert name in ds_engine.__all__, name
        assert getattr(ds_engine, name) is not None, name
    # accelerate's own classes where the meaning is the same
    assert ds_engine.DistributedType is accelerate.utils.DistributedType
    assert ds_engine.ProjectConfiguration is accelerate.utils.ProjectConfiguration
    assert ds_engine.DataLoaderConfiguration is accelerate.DataLoaderConfiguration
    assert ds_engine.set_seed is accelerate.utils.set_seed
    assert issubclass(ds_engine.Accelerator, ds_engine.Engine)


# ---------------------------------------------------------------- constructor mapping
def test_constructor_maps_accelerate_arguments_onto_engine_choices():
    acc = _acc(
        mixed_precision="bf16",
        gradient_accumulation_steps=4,
        cpu=True,
        kwargs_handlers=[accelerate.utils.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=77))],
    )
    assert acc.config.precision == "bf16" and acc.mixed_precision == "bf16"
    assert acc.gradient_accumulation_steps == 4 and acc.config.dist_timeout_s == 77
    plugin = ds_engine.GradientAccumulationPlugin(num_steps=3)
    assert _acc(gradient_accumulation_plugin=plugin).gradient_accumulation_steps == 3
    assert _acc(mixed_precision="no").config.precision == "fp32"


def test_mixed_precision_from_accelerate_launch_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert _acc().mixed_precision == "bf16"


def test_deepspeed_plugin_config_is_used():
    plugin = ds_engine.DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2)
    acc = _acc(deepspeed_plugin=plugin)
    assert acc.config.zero_stage == 2 and acc.gradient_accumulation_steps == 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dataloader_config": accelerate.DataLoaderConfiguration(split_batches=True)}, "split_batches"),
        ({"split_batches": True}, "split_batches"),
        ({"dataloader_config": accelerate.DataLoaderConfiguration(even_batches=False)}, "even_batches"),
        (
            {"dataloader_config": accelerate.DataLoaderConfiguration(dispatch_batches=True)},
            "dispatch_batches",
        ),
        ({"dataloader_config": accelerate.DataLoaderConfiguration(data_seed=3)}, "data_seed"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"device_placement": False}, "device_placement"),
        ({"fsdp_plugin": accelerate.FullyShardedDataParallelPlugin()}, "fsdp_plugin"),
        ({"dynamo_backend": "inductor"}, "dynamo_backend"),
        (
            {
                "gradient_accumulation_plugin": accelerate.utils.GradientAccumulationPlugin(
                    sync_with_dataloader=False
                )
            },
            "sync_with_dataloader",
        ),
        ({"kwargs_handlers": [object()]}, "kwargs_handlers"),
    ],
)
def test_unsupported_arguments_say_which_and_what_to_do(kwargs, named):
    with pytest.raises(ValueError, match=named) as info:
        _acc(**kwargs)
    assert "HINT" in str(info.value)


def test_both_accumulation_arguments_is_an_error():
    with pytest.raises(ValueError, match="not both"):
        _acc(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=ds_engine.GradientAccumulationPlugin(num_steps=2),
        )


# ---------------------------------------------------------------- names and behaviour
def test_facts_on_the_fallback():
    acc = _acc()
    assert acc.distributed_type == ds_engine.DistributedType.NO
    assert acc.state.distributed_type == ds_engine.DistributedType.NO
    assert acc.state.deepspeed_plugin is None and acc.deepspeed_plugin is None
    assert not acc.use_distributed and acc.is_last_process and acc.is_main_process
    assert acc.state.num_processes == 1 and acc.state.is_main_process  # from accelerate's PartialState
    assert not acc.split_batches and acc.even_batches and acc.project_dir is None
    accelerate.logging.get_logger(__name__).info("works", main_process_only=True)


def test_training_loop_decorators_and_collectives():
    acc = _acc()
    model, opt, loader, sched = _train(acc)
    seen = []
    for batch in acc.skip_first_batches(loader, 1):
        micro_step(acc, model, opt, batch, sched)
        seen.append(acc.gather_for_metrics(["sample"]))
    assert len(seen) == 3 and sched.get_last_lr() == pytest.approx([0.025])
    assert len(list(loader)) == 4  # the skip applied to one iteration only
    assert not acc.optimizer_step_was_skipped
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_last_process(lambda: calls.append("last"))()
    acc.on_process(process_index=0)(lambda: calls.append("p0"))()
    acc.on_process(lambda: calls.append("p1"), process_index=1)()
    acc.on_local_main_process(lambda: calls.append("local"))()
    assert calls == ["main", "last", "p0", "p1", "local"]  # one process: accelerate runs every on_process
    with acc.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    with acc.main_process_first(), acc.local_main_process_first():
        pass
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(acc.reduce(t, "sum", scale=1.0), t)
    assert torch.equal(acc.pad_across_processes(t), t)
    assert torch.equal(acc.gather_for_metrics(t, use_gather_object=True), t)
    with acc.no_sync(model), acc.autocast():
        pass
    assert acc.unwrap_model(model, keep_fp32_wrapper=False) is acc.unwrap_model(model)
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()
    assert not acc.verify_device_map(model)


def test_save_state_load_state_automatic_naming_rotation_and_registered_objects(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    pc = ds_engine.ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    acc = _acc(project_config=pc)
    model, opt, loader, sched = _train(acc)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    with pytest.raises(ValueError, match="state_dict"):
        acc.register_for_checkpointing(object())
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
    weights = [p.detach().clone() for p in model.parameters()]
    counter.n = 0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state()
    assert counter.n == 4 and acc.save_iteration == 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    folder = acc.save_state()
    assert folder.endswith("checkpoint_4")
    plain = _acc()
    _train(plain)
    with pytest.raises(ValueError, match="output_dir"):
        plain.save_state()
    out = plain.save_state(tmp_path / "explicit")
    plain.load_state(out)
    with pytest.raises(ValueError, match="does not exist"):
        plain.load_state(tmp_path / "missing")


def test_trackers_log_through_accelerates_tensorboard_tracker(tmp_path):
    acc = _acc(log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("run", config={"lr": 0.1, "name": "x"})
    tracker = acc.get_tracker("tensorboard")
    assert isinstance(tracker, accelerate.tracking.TensorBoardTracker)
    acc.log({"loss": 1.5}, step=0)
    acc.end_training()
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match="wandb"):
        acc.get_tracker("wandb")


def test_save_model_writes_a_reloadable_folder(tmp_path):
    acc = _acc()
    model, *_ = _train(acc)
    acc.save_model(model, tmp_path / "m", safe_serialization=True)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert set(state) == {"weight", "bias"}


def test_dummies_need_deepspeed_and_a_config_block():
    acc = _acc()
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="DummyOptim / DummyScheduler"):
        acc.prepare(model, ds_engine.DummyOptim(model.parameters()))


def test_free_memory_allows_a_new_prepare():
    acc = _acc()
    model, opt, _, _ = _train(acc)
    assert acc.free_memory(model, opt) == [None, None]
    assert acc.optimizer is None and acc.lr_scheduler is None
    _train(acc)


@pytest.mark.deepspeed
def test_deepspeed_facts_plugin_view_and_dummies():
    plugin = ds_engine.DeepSpeedPlugin(
        hf_ds_config={
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 2},
            },
        }
    )
    acc = ds_engine.Accelerator(deepspeed_plugin=plugin, backend="deepspeed")
    try:
        assert acc.distributed_type == ds_engine.DistributedType.DEEPSPEED
        assert acc.state.distributed_type == ds_engine.DistributedType.DEEPSPEED
        view = acc.state.deepspeed_plugin
        assert view.zero_stage == 1 and "optimizer" in view.deepspeed_config
        assert view.hf_ds_config.get_value("zero_optimization.stage") == 1
        accelerate.logging.get_logger(__name__).info("works", main_process_only=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        model, opt, loader, sched = acc.prepare(
            model,
            ds_engine.DummyOptim(model.parameters()),
            regression_loader(),
            ds_engine.DummyScheduler(None),
        )
        assert opt is acc.optimizer and sched is acc.lr_scheduler and sched is not None
        assert acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
        for batch in loader:
            micro_step(acc, model, opt, batch, sched)
        assert acc.num_optimizer_steps == 4
        with pytest.raises(RuntimeError, match="clip_grad_norm_"):
            acc.clip_grad_value_(model.parameters(), 1.0)
    finally:
        acc.end_training()


@pytest.mark.deepspeed
def test_dummies_fill_the_config_autos_as_accelerate_does():
    """An HF-style JSON ("auto" in both blocks): DummyOptim's lr / weight decay and param groups,
    DummyScheduler's warm-up and total steps reach DeepSpeed's optimizer and scheduler."""
    plugin = ds_engine.DeepSpeedPlugin(
        hf_ds_config={
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "eps": 1e-8}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": "auto",
                    "total_num_steps": "auto",
                },
            },
        }
    )
    acc = ds_engine.Accelerator(deepspeed_plugin=plugin, backend="deepspeed")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        groups = [
            {"params": [model.weight], "weight_decay": 0.01},
            {"params": [model.bias], "weight_decay": 0.0},
        ]
        model, opt, loader, sched = acc.prepare(
            model,
            ds_engine.DummyOptim(groups, lr=0.05, weight_decay=0.01),
            regression_loader(),
            ds_engine.DummyScheduler(None, total_num_steps=8, warmup_num_steps=2),
        )
        cfg = acc.state.deepspeed_plugin.deepspeed_config
        assert cfg["optimizer"]["params"] == {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-8}
        assert cfg["scheduler"]["params"] == {
            "warmup_min_lr": 0,
            "warmup_max_lr": 0.05,
            "warmup_num_steps": 2,
            "total_num_steps": 8,  # one process: 8 / 1
        }
        decay = [g["weight_decay"] for g in opt.param_groups]
        assert decay == [0.01, 0.0], "DummyOptim's param groups are what the config optimizer trains"
        lrs = []
        for batch in loader:
            micro_step(acc, model, opt, batch, sched)
            lrs.append(sched.get_last_lr()[0])
        assert lrs[1] == pytest.approx(0.05) and lrs[0] < lrs[1], lrs  # warm-up of 2 steps to 0.05
    finally:
        acc.end_training()


def test_the_semantics_it_keeps_are_said_once_in_the_log(caplog):
    with caplog.at_level(logging.INFO, logger="ds_engine"):
        _acc(cpu=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage() == accelerator_module.SEMANTICS_NOTE]
    assert len(said) == 1 and "accumulation boundaries" in said[0]
