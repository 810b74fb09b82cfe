"""The Engine's and the backends' declared interfaces: `prepare(scheduler)` alone, `release`,
`model` / `current_loader`, `ensure_process_group`, `is_scheduler` and the backend capabilities."""

from __future__ import annotations

import pytest
import torch

from ds_engine import Engine
from ds_engine.backends.base import Backend
from ds_engine.scheduler import OverflowAwareScheduler, is_scheduler
from tests.helpers import micro_step, regression_loader


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _steps(
    engine: Engine, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, loader
) -> list[float]:
    lrs = []
    for batch in loader:
        micro_step(engine, model, optimizer, batch, scheduler)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_is_scheduler_is_public_and_tells_schedulers_from_optimizers():
    model, optimizer = _model_and_optimizer()
    assert is_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    assert not is_scheduler(optimizer) and not is_scheduler(model) and not is_scheduler(object())
    from ds_engine import engine as engine_module

    assert engine_module._is_scheduler is is_scheduler


@pytest.mark.parametrize("backend", ["accelerate", pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_prepare_scheduler_alone_after_model_and_optimizer_steps_like_one_call(backend):
    ga = 2
    runs = []
    for separate in (False, True):
        engine = Engine(backend=backend, gradient_accumulation_steps=ga)
        try:
            model, optimizer = _model_and_optimizer()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            if separate:
                model, optimizer, loader = engine.prepare(model, optimizer, regression_loader())
                assert engine.lr_scheduler is None
                prepared = engine.prepare(scheduler)
            else:
                model, optimizer, loader, prepared = engine.prepare(
                    model, optimizer, regression_loader(), scheduler
                )
            assert isinstance(prepared, OverflowAwareScheduler) and engine.lr_scheduler is prepared
            runs.append(_steps(engine, model, optimizer, prepared, loader))
        finally:
            engine.end_training()
    assert runs[0] == runs[1] == [0.1, 0.05, 0.05, 0.025]


def test_prepare_scheduler_alone_is_refused_with_the_reason():
    engine = Engine(backend="accelerate")
    try:
        model, optimizer = _model_and_optimizer()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        with pytest.raises(ValueError, match="but no model"):
            engine.prepare(scheduler)
        engine.prepare(model)  # inference only
        with pytest.raises(ValueError, match=r"prepare\(scheduler\).*without an optimizer"):
            engine.prepare(scheduler)
    finally:
        engine.end_training()
    engine = Engine(backend="accelerate")
    try:
        model, optimizer = _model_and_optimizer()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        engine.prepare(model, optimizer, scheduler)
        with pytest.raises(ValueError, match="a scheduler is prepared already"):
            engine.prepare(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    finally:
        engine.end_training()


@pytest.mark.parametrize("backend", ["accelerate", pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_release_drops_every_prepared_object_and_a_new_prepare_starts_afresh(backend):
    engine = Engine(backend=backend)
    try:
        assert engine.model is None and engine.current_loader is None
        model, optimizer = _model_and_optimizer()
        wrapped, prepared_opt, loader = engine.prepare(model, optimizer, regression_loader())
        assert engine.model is wrapped and engine.optimizer is prepared_opt
        seen = []
        for x, y in loader:
            seen.append(engine.current_loader)
            engine.backward(torch.nn.functional.mse_loss(wrapped(x), y))
            prepared_opt.step()
            prepared_opt.zero_grad()
        assert seen == [loader] * len(loader) and engine.current_loader is None
        native = getattr(engine._backend, "ds_engine", None)
        assert (native is not None) == (backend == "deepspeed")
        steps = engine.num_optimizer_steps

        engine.release()
        assert engine.model is None and engine.optimizer is None and engine.lr_scheduler is None
        assert engine.current_loader is None and engine.state_dict()["dataloaders"] == []
        assert getattr(engine._backend, "ds_engine", None) is None
        assert engine.num_optimizer_steps == steps  # counters stay

        # a second model can be prepared now (an Engine holds one model at a time)
        model2, optimizer2 = _model_and_optimizer()
        wrapped2, opt2, loader2 = engine.prepare(model2, optimizer2, regression_loader())
        assert engine.model is wrapped2
        for x, y in loader2:
            engine.backward(torch.nn.functional.mse_loss(wrapped2(x), y))
            opt2.step()
            opt2.zero_grad()
        assert engine.num_optimizer_steps == steps + len(loader2)
    finally:
        engine.end_training()


def test_release_inside_a_loop_forgets_the_loader_in_progress():
    engine = Engine(backend="accelerate")
    try:
        model, optimizer = _model_and_optimizer()
        _, _, loader = engine.prepare(model, optimizer, regression_loader())
        for _ in loader:
            assert engine.current_loader is loader
            engine.release()
            assert engine.current_loader is None
            break
    finally:
        engine.end_training()


def test_ensure_process_group_answers_and_is_refused_after_end_training():
    engine = Engine(backend="accelerate")
    assert engine.ensure_process_group() is False  # one process, no launcher: no group
    engine.end_training()
    with pytest.raises(RuntimeError, match=r"ensure_process_group\(\)` after `end_training"):
        engine.ensure_process_group()


def test_backend_capabilities_are_declared_on_the_base_class():
    for name in (
        "distributed_type",
        "is_fsdp2",
        "supports_clip_grad_value",
        "partitions_at_creation",
        "plans_auto_stage",
    ):
        assert isinstance(getattr(Backend, name), property), name
    for name in ("unscale_gradients", "release"):
        assert callable(getattr(Backend, name)), name


def test_fallback_capabilities():
    engine = Engine(backend="accelerate", precision="fp32")
    try:
        backend = engine.backend_capabilities
        model, optimizer = _model_and_optimizer()
        engine.prepare(model, optimizer)
        assert backend.distributed_type == "NO"  # one process, no launcher
        assert backend.is_fsdp2 is False and backend.supports_clip_grad_value is True
        assert backend.partitions_at_creation is False and backend.plans_auto_stage is False
        backend.unscale_gradients()  # no GradScaler: nothing to unscale, and no error
        backend.unscale_gradients()
    finally:
        engine.end_training()


@pytest.mark.deepspeed
def test_deepspeed_capabilities():
    engine = Engine(backend="deepspeed")
    try:
        backend = engine.backend_capabilities
        assert backend.distributed_type == "DEEPSPEED"
        assert backend.is_fsdp2 is False and backend.supports_clip_grad_value is False
        assert backend.plans_auto_stage is True and backend.partitions_at_creation is False
        backend.update_effective(zero_stage=3)  # ZeRO-3's zero.Init partitions at creation
        assert backend.partitions_at_creation is True
        backend.unscale_gradients()  # DeepSpeed unscales inside its step: a no-op
    finally:
        engine.end_training()


@pytest.fixture
def _accelerate_state_kept():
    """accelerate's view of the process group is process-wide (`PartialState`, and the fallback's
    record of it): a test that forms and ends a group of its own puts it back as it found it, so
    the tests after it on the same worker are not told of a group that is gone."""
    from accelerate.state import AcceleratorState, PartialState

    import ds_engine.backends.accelerate as fallback

    kept = (dict(PartialState._shared_state), dict(AcceleratorState._shared_state))
    base = fallback._BASE_DISTRIBUTED_TYPE
    yield
    for shared, before in zip((PartialState._shared_state, AcceleratorState._shared_state), kept):
        shared.clear()
        shared.update(before)
    fallback._BASE_DISTRIBUTED_TYPE = base


@pytest.mark.usefixtures("_accelerate_state_kept")
def test_a_group_the_host_formed_is_borrowed_and_outlives_end_training(monkeypatch, tmp_path):
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "0")  # undone at the end: the Engine and accelerate set them
        monkeypatch.delenv(name)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        engine = Engine(backend="accelerate")
        model, optimizer = _model_and_optimizer()
        model, optimizer, loader = engine.prepare(model, optimizer, regression_loader())
        for x, y in loader:
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        assert engine.owns_process_group is False
        assert (engine.process_index, engine.num_processes) == (0, 1)
        engine.end_training()
        assert dist.is_initialized()  # the host's: still there, and usable
        total = torch.ones(1)
        dist.all_reduce(total)
        assert float(total) == 1.0
        from ds_engine.backends.base import _destroy_process_group

        _destroy_process_group()  # the exit hook leaves a borrowed group alone too
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
