"""Several models in one `ds_engine.Accelerator.prepare`, in one process: the pairing rules, the
routing of `backward` / `accumulate` / `clip_grad_norm_` / `unwrap_model` / `get_state_dict`, and
every error (each names the user's objects by argument position and class, and the fix).

The 2-rank runs against accelerate's own are in
`tests/distributed/test_accelerator_several_models.py`.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ds_engine
from ds_engine.accelerate_compat.views import plan_models, reached_engines
from ds_engine.scheduler import is_scheduler


class Generator(torch.nn.Sequential):
    pass


class Discriminator(torch.nn.Sequential):
    pass


def _models(seed: int = 0) -> tuple[Generator, Discriminator]:
    torch.manual_seed(seed)
    return (
        Generator(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
        Discriminator(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
    )


def _loader(n: int = 8, batch: int = 2) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(0))), batch_size=batch
    )


@pytest.fixture
def acc():
    accelerator = ds_engine.Accelerator(backend="accelerate")
    yield accelerator
    accelerator.end_training()


def _gan(acc, *, order: str = "mixed", **opt):
    gen, disc = _models()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, 2)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 3)
    loader = _loader()
    if order == "mixed":
        disc, opt_g, gen, loader, opt_d, sched_d, sched_g = acc.prepare(
            disc, opt_g, gen, loader, opt_d, sched_d, sched_g
        )
    else:
        gen, disc, opt_g, opt_d, loader, sched_g, sched_d = acc.prepare(
            gen, disc, opt_g, opt_d, loader, sched_g, sched_d
        )
    return gen, disc, opt_g, opt_d, sched_g, sched_d, loader


# ---------------------------------------------------------------- pairing (a pure function)
def test_each_optimizer_goes_with_its_model_and_each_scheduler_with_its_optimizer_in_any_order():
    gen, disc = _models()
    teacher = torch.nn.Linear(2, 2)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=1), torch.optim.SGD(disc.parameters(), lr=1)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 1)
    loader = _loader()
    call = (teacher, sched_d, opt_d, loader, disc, opt_g, gen)
    mine, extras = plan_models(call, call, is_scheduler, has_model=False)
    # the first model with an optimizer is the Accelerator's own, with the loaders
    assert {id(o) for o in mine} == {id(o) for o in (sched_d, opt_d, loader, disc)}
    assert [tuple(map(id, e)) for e in extras] == [
        (id(teacher), id(None), id(None)),
        (id(gen), id(opt_g), id(None)),
    ]
    # a model prepared before: every model of the call goes beside it
    mine, extras = plan_models((gen, opt_g, loader), (gen, opt_g, loader), is_scheduler, has_model=True)
    assert mine == [loader] and [e[0] for e in extras] == [gen]
    # one of each: left as it is (today's one-model path)
    one = (gen, opt_g, loader)
    assert plan_models(one, one, is_scheduler, has_model=False) == (list(one), [])


# ---------------------------------------------------------------- errors, naming the objects
def test_an_optimizer_over_no_prepared_model_is_refused_naming_it(acc):
    gen, disc = _models()
    stray = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(
        ValueError,
        match=r"argument 3 \(SGD\) steps none of the parameters .*"
        r"argument 1 \(Generator\), argument 2 \(Discriminator\).*HINT: create it from the model",
    ):
        acc.prepare(gen, disc, stray)


def test_an_optimizer_over_two_models_is_refused_naming_both(acc):
    gen, disc = _models()
    both = torch.optim.SGD([*gen.parameters(), *disc.parameters()], lr=1)
    with pytest.raises(
        ValueError,
        match=r"argument 3 \(SGD\) steps the parameters of argument 1 \(Generator\) "
        r"and of argument 2 \(Discriminator\).*HINT: one optimizer per model",
    ):
        acc.prepare(gen, disc, both)


def test_two_optimizers_of_one_model_are_refused(acc):
    gen, disc = _models()
    a, b = torch.optim.SGD(gen.parameters(), lr=1), torch.optim.Adam(gen.parameters())
    with pytest.raises(
        ValueError,
        match=r"argument 3 \(SGD\) and argument 4 \(Adam\) both step "
        r"argument 1 \(Generator\).*HINT",
    ):
        acc.prepare(gen, disc, a, b)


def test_a_scheduler_of_an_unknown_optimizer_is_refused(acc):
    gen, disc = _models()
    opt_g = torch.optim.SGD(gen.parameters(), lr=1)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1), 1)
    with pytest.raises(
        ValueError,
        match=r"argument 4 \(StepLR\) drives an optimizer \(SGD\) that is neither "
        r"passed to this call nor prepared before. HINT",
    ):
        acc.prepare(gen, disc, opt_g, other)


def test_two_schedulers_of_one_optimizer_are_refused(acc):
    gen, disc = _models()
    opt_g = torch.optim.SGD(gen.parameters(), lr=1)
    s1, s2 = torch.optim.lr_scheduler.StepLR(opt_g, 1), torch.optim.lr_scheduler.StepLR(opt_g, 2)
    with pytest.raises(
        ValueError, match=r"argument 4 \(StepLR\) and argument 5 \(StepLR\) both drive .*SequentialLR"
    ):
        acc.prepare(gen, disc, opt_g, s1, s2)


def test_a_loss_reaching_two_trained_models_is_refused_naming_both(acc):
    gen, disc, *_ = _gan(acc)
    fake = gen(torch.randn(2, 3))
    with pytest.raises(
        RuntimeError,
        match=r"argument 1 to `prepare` \(Discriminator\) and the model passed as "
        r"argument 3 to `prepare` \(Generator\).*requires_grad_\(False\)",
    ):
        acc.backward(disc(fake).mean())
    assert all(p.grad is None for m in (gen, disc) for p in m.parameters())  # refused before any backward


def test_windows_that_end_inside_an_epoch_are_refused_with_two_trained_models():
    acc = ds_engine.Accelerator(backend="accelerate", gradient_accumulation_steps=3)
    try:
        gen, disc = _models()
        with pytest.raises(
            ValueError, match=r"gradient_accumulation_steps=3 .*4 batches per process.*multiple of 3"
        ):
            acc.prepare(
                gen,
                disc,
                torch.optim.SGD(gen.parameters(), lr=1),
                torch.optim.SGD(disc.parameters(), lr=1),
                _loader(8, 2),
            )
    finally:
        acc.end_training()
    acc = ds_engine.Accelerator(backend="accelerate", gradient_accumulation_steps=2)
    try:  # only the training loader (the first) counts: an evaluation loader may end anywhere
        gen, disc = _models()
        opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=1), torch.optim.SGD(disc.parameters(), lr=1)
        acc.prepare(gen, disc, opt_g, opt_d, _loader(8, 2), _loader(10, 2))
    finally:
        acc.end_training()


def test_dummy_optim_with_several_models_is_refused():
    from ds_engine.accelerate_compat.constructor import check_dummies

    with pytest.raises(ValueError, match=r"prepares 2 models. HINT: pass a torch optimizer"):
        check_dummies([object()], [], None, "deepspeed", True, 2)


# ---------------------------------------------------------------- routing
def test_a_gan_step_trains_each_model_with_its_own_optimizer_and_schedule(acc):
    gen, disc, opt_g, opt_d, sched_g, sched_d, loader = _gan(acc)
    assert acc.unwrap_model(disc) is not acc.unwrap_model(gen)
    assert type(acc.unwrap_model(disc)) is Discriminator and type(acc.unwrap_model(gen)) is Generator
    for (real,) in loader:
        with acc.accumulate(gen, disc):
            fake = gen(torch.randn(2, 3))
            d_loss = disc(real).mean() - disc(fake.detach()).mean()
            acc.backward(d_loss)  # reaches the discriminator only
            assert all(p.grad is None for p in acc.unwrap_model(gen).parameters())
            acc.clip_grad_norm_(disc.parameters(), 0.0)
            opt_d.step()
            sched_d.step()
            opt_d.zero_grad()
            disc.requires_grad_(False)
            g_loss = -acc.unwrap_model(disc)(fake).mean()
            acc.backward(g_loss)  # the frozen discriminator: the generator only
            assert all(p.grad is None for p in acc.unwrap_model(disc).parameters())
            opt_g.step()
            sched_g.step()
            opt_g.zero_grad()
            disc.requires_grad_(True)
            assert acc.sync_gradients
    steps = len(loader)
    assert sched_g.get_last_lr()[0] == pytest.approx(1e-2 * 0.1 ** (steps // 2))
    assert sched_d.get_last_lr()[0] == pytest.approx(0.1 * 0.1 ** (steps // 3))
    g_state, d_state = acc.get_state_dict(gen), acc.get_state_dict(disc)
    assert set(g_state) == {"0.weight", "0.bias", "2.weight", "2.bias"} and g_state["0.weight"].shape == (
        8,
        3,
    )
    assert d_state["0.weight"].shape == (8, 2)


def test_a_frozen_teacher_and_a_reference_model_without_optimizer_beside_the_student(acc, tmp_path):
    teacher, student = _models(1)[1], _models(2)[1]
    reference = torch.nn.Linear(2, 1)
    teacher.requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    teacher, reference, student, optimizer, loader = acc.prepare(
        teacher, reference, student, optimizer, _loader()
    )
    assert acc.optimizer is optimizer  # the student is the Accelerator's own model
    before = {k: v.clone() for k, v in acc.get_state_dict(teacher).items()}
    for (x,) in loader:
        with acc.accumulate(student):
            with torch.no_grad():
                target = teacher(x) + reference(x)
            loss = (student(x) - target).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(before[k], v) for k, v in acc.get_state_dict(teacher).items())
    acc.save_model(teacher, tmp_path / "teacher")
    assert (tmp_path / "teacher" / "model.safetensors").is_file()
    saved = acc.save_state(tmp_path / "state")  # inference-only models hold no training state
    assert not (tmp_path / "state" / "model_0").exists() and saved == str(tmp_path / "state")


def test_models_prepared_in_separate_calls_keep_their_optimizers_and_schedulers(acc):
    gen, disc = _models()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    gen, opt_g, loader = acc.prepare(gen, opt_g, _loader())
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 1, gamma=0.5)
    disc, opt_d, sched_d = acc.prepare(disc, opt_d, sched_d)  # a scheduler beside its optimizer
    teacher = acc.prepare(torch.nn.Linear(2, 1))  # a later inference model
    assert acc.lr_scheduler is None  # the discriminator's schedule is its own Engine's
    sched_g = acc.prepare(torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.1))  # late, the generator's
    assert acc.lr_scheduler is sched_g
    for (real,) in loader:
        with acc.accumulate(gen, disc):
            with torch.no_grad():
                real = real + teacher(real)
            acc.backward(disc(real).mean())
            opt_d.step()
            sched_d.step()
            opt_d.zero_grad()
    assert sched_d.get_last_lr()[0] == pytest.approx(0.1 * 0.5 ** len(loader))
    assert sched_g.get_last_lr()[0] == pytest.approx(0.1)  # the generator never stepped


@pytest.mark.deepspeed
def test_under_deepspeed_a_loss_reaching_two_trained_models_is_refused(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    acc = ds_engine.Accelerator(backend="deepspeed", zero_stage=2)
    try:
        gen, disc, opt_g, *_ = _gan(acc, order="plain")
        assert acc.distributed_type.name == "DEEPSPEED"
        fake = gen(torch.randn(2, 3))
        with pytest.raises(
            RuntimeError,
            match=r"argument 1 to `prepare` \(Generator\) and the model passed as "
            r"argument 2 to `prepare` \(Discriminator\).*under DeepSpeed, one DeepSpeed engine",
        ):
            acc.backward(disc(fake).mean())
        disc.requires_grad_(False)
        acc.backward(acc.unwrap_model(disc)(fake).mean())  # frozen: the generator's engine alone
        opt_g.step()
        disc.requires_grad_(True)
    finally:
        acc.end_training()


def test_the_graph_walk_costs_little(acc):
    """`backward` with several trained models walks the loss's graph once: measured here on a
    64-layer MLP (about 200 graph nodes)."""
    big = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(64)])
    other = torch.nn.Linear(16, 1)
    big, other, *_ = acc.prepare(
        big, other, torch.optim.SGD(big.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    )
    loss = big(torch.randn(4, 16)).pow(2).mean()
    engines = [acc, *acc._extra_engines]
    reached_engines(loss, engines)
    start = time.perf_counter()
    for _ in range(20):
        assert reached_engines(loss, engines) == [acc]
    cost = (time.perf_counter() - start) / 20
    print(f"graph walk: {cost * 1e3:.3f} ms per backward")
    assert cost < 0.05
