"""Token-weighted accumulation on one process: `windows` hands out each window's batches and the
micro-steps train them in the window's places; `num_items` scales a summed loss to the window's
token mean; misuse stops with an error naming the supported way."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.guards import window_scale


def _engine(ga: int):
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        engine = Engine(
            backend="accelerate", gradient_accumulation_steps=ga, precision="fp32", gradient_clipping=0.0
        )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.randn(7, 3), torch.randn(7, 1))
    return (engine, *engine.prepare(model, optimizer, DataLoader(data, batch_size=1)))


@pytest.mark.parametrize("ga", [1, 2, 3, 4, 7, 8])
def test_windows_are_those_of_a_plain_loop_and_train_in_their_places(ga: int) -> None:
    engine, model, optimizer, loader = _engine(ga)
    x_all = loader.dataset.tensors[0]
    sizes, boundaries = [], []
    weights = [model.weight.detach().clone()]
    start = 0
    for window in engine.windows(loader):
        sizes.append(len(window))
        total = float(len(window))  # one item per batch: the token mean is the window mean
        for x, y in window:
            with engine.accumulate(model):
                engine.backward(((model(x) - y) ** 2).sum(), num_items=total)
                optimizer.step()
                optimizer.zero_grad()
            boundaries.append(engine.sync_gradients)
        # SGD with lr 1: the step is minus the window's mean gradient
        xs, ys = (
            loader.dataset.tensors[0][start : start + len(window)],
            loader.dataset.tensors[1][start : start + len(window)],
        )
        w = weights[-1].clone().requires_grad_(True)
        (((xs @ w.T) - ys) ** 2).mean().backward()
        assert torch.allclose(model.weight.detach(), weights[-1] - w.grad, atol=1e-6), (ga, start)
        weights.append(model.weight.detach().clone())
        start += len(window)
    assert start == len(x_all)
    expected = [ga] * (7 // ga) + ([7 % ga] if 7 % ga else [])
    assert sizes == expected
    assert boundaries == [i + 1 == n for n in expected for i in range(n)]
    assert engine.num_optimizer_steps == len(expected)


def test_a_window_left_with_untrained_batches_is_refused() -> None:
    engine, model, optimizer, loader = _engine(3)
    with pytest.raises(
        RuntimeError, match=r"window of batches 0\.\.2 was left with 2 batch\(es\) not trained"
    ):
        for window in engine.windows(loader):
            x, y = window[0]
            with engine.accumulate(model):
                engine.backward(((model(x) - y) ** 2).sum(), num_items=3)
                optimizer.step()
                optimizer.zero_grad()


def test_drawing_a_window_ahead_without_windows_names_the_supported_way() -> None:
    engine, model, optimizer, loader = _engine(2)
    iterator = iter(loader)
    window = [next(iterator), next(iterator)]  # accelerate's autoregressive example draws ahead
    with pytest.raises(RuntimeError, match=r"second micro-step on batch 1 .*engine\.windows\(loader\)"):
        for x, y in window:
            engine.backward(((model(x) - y) ** 2).sum())
            optimizer.step()
            optimizer.zero_grad()


def test_windows_needs_a_prepared_loader() -> None:
    engine, *_ = _engine(2)
    with pytest.raises(TypeError, match=r"engine\.windows\(\.\.\.\)` got a DataLoader.*engine\.prepare"):
        next(iter(engine.windows(DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=1))))


def test_num_items_scales_by_ranks_over_items() -> None:
    assert window_scale(None, 4, lambda: 2, "engine") == 0.25
    assert window_scale(10, 4, lambda: 2, "engine") == 0.2
    assert window_scale(torch.tensor(8.0), 1, lambda: 4, "engine") == 0.5
    for bad in (0, -3, float("nan"), float("inf"), True, "12", torch.tensor([1.0, 2.0])):
        with pytest.raises(
            ValueError, match=r"`engine\.backward\(loss, num_items=.*must be one positive number.*HINT"
        ):
            window_scale(bad, 2, lambda: 2, "engine")
