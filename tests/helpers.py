"""What many unit tests build alike: a backend on its own, a tiny GPT-2, a small regression
loader, and the standard training-loop body.

Test helpers, not the package's API: `ds_engine` builds its backends only from the Engine's one
resolution, so a test that wants a backend alone resolves here, as the Engine would.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.backends.base import Backend
from ds_engine.config import EngineConfig, resolve_config

B = TypeVar("B", bound=Backend)


def backend_alone(cls: type[B], config: EngineConfig, base: dict[str, Any] | None = None) -> B:
    """A backend of class `cls` for `config` (and its DeepSpeed JSON `base`), resolved once as the
    Engine resolves (no world size yet), without an Engine."""
    return cls(resolve_config(config, base=base, world_size=None))


def tiny_gpt2(seed: int = 0, *, train: bool = False, **config: Any) -> Any:
    """A 2-layer GPT-2 (hidden 32, vocabulary 128, 32 positions) built with torch seed `seed`;
    `config` overrides `GPT2Config` fields. In eval mode unless `train`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    options = {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 2,
        "vocab_size": 128,
        "n_positions": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **config,
    }
    model = GPT2LMHeadModel(GPT2Config(**options))
    return model if train else model.eval()


def regression_loader(n: int = 8, batch: int = 2, *, seed: int = 0) -> DataLoader:
    """`n` samples (x: 4 features, y: 1 target) from a generator seeded `seed`, `batch` at a time."""
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch
    )


def quiet_fallback(**choices: Any) -> Any:
    """`Engine(backend="accelerate", **choices)`, its warning about choices the fallback cannot
    honour silenced."""
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(backend="accelerate", **choices)


def prepared_linear(
    engine: Any,
    *,
    seed: int = 0,
    n: int = 8,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> tuple[Any, ...]:
    """`engine` and what its `prepare` returns for a `Linear(4, 1)` built under torch seed `seed`,
    its optimizer (`optimizer(parameters)`; SGD with lr 0.1 by default) and `n` samples drawn from
    the global generator right after, in batches of 2: (engine, model, optimizer, loader)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    made = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=2)
    return engine, *engine.prepare(model, made, loader)


def micro_step(engine: Any, model: Any, optimizer: Any, batch: Any, scheduler: Any = None) -> torch.Tensor:
    """The standard loop body on one `(x, y)` batch: mean-squared error, `engine.backward`, then
    the optimizer's (and `scheduler`'s) step and `zero_grad` inside `engine.accumulate(model)`
    (an Engine or an Accelerator). Returns the loss."""
    x, y = batch
    with engine.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        engine.backward(loss)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return loss


def train(
    engine: Any, model: Any, optimizer: Any, loader: Iterable[Any], scheduler: Any = None
) -> list[bool]:
    """`micro_step` on every batch of `loader`; returns `engine.sync_gradients` after each."""
    boundaries = []
    for batch in loader:
        micro_step(engine, model, optimizer, batch, scheduler)
        boundaries.append(engine.sync_gradients)
    return boundaries
