"""The Engine's per-micro-step path, written out: `accumulate`'s context and `backward`'s call.

Both run on every micro-step, where a generator-based context manager, a context object per
call and a few more frames cost a measurable share of a small model's step; they do what
``with engine.accumulate(model):`` and ``with context, <watchdog mark>: backend.backward(...)``
would, as plain classes and nested ``try`` blocks.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

__all__ = ["MicroStep", "run_backward"]


class MicroStep:
    """`Engine.accumulate`'s context: begins a micro-step, enters the backend's context for it.

    Args:
        engine: The Engine.
        model: The model named in `accumulate(model)`; None: the Engine's prepared model.
    """

    __slots__ = ("context", "model", "owner")

    def __init__(self, engine: Any, model: torch.nn.Module | None) -> None:
        self.owner, self.model = engine, model
        self.context: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        engine = self.owner
        if engine.step.ended:
            engine._refuse_if_ended("accumulate(model)")
        engine._begin_micro_step()
        model = self.model if self.model is not None else engine._model
        engine._in_accumulate = True
        if model is None:
            return
        try:
            step = engine.step
            context = engine._backend.micro_step_context(
                model, boundary=step.boundary, window_start=step.window_start
            )
            context.__enter__()
        except BaseException:
            engine._in_accumulate = False
            raise
        self.context = context

    def __exit__(self, *exc: Any) -> bool | None:
        context, self.context = self.context, None
        try:
            return context.__exit__(*exc) if context is not None else None
        finally:
            self.owner._in_accumulate = False


def run_backward(
    engine: Any,
    loss: torch.Tensor,
    scale: float,
    context: contextlib.AbstractContextManager[None] | None,
    dog: Any,
) -> None:
    """The backend's backward of `loss * scale` with `engine.in_backward` set, marked for the
    hang watchdog `dog` (None: none), inside the already entered `context` (None: none), which
    is exited here as a ``with`` block would (an exception it suppresses ends the call)."""
    engine.in_backward = True
    try:
        try:
            if dog is not None:
                dog.enter("backward", engine.step.num_optimizer_steps)
            try:
                engine._backend.backward(loss, scale=scale, boundary=engine.step.boundary)
            finally:
                if dog is not None:
                    dog.exit()
        except BaseException:
            if context is None or not context.__exit__(*sys.exc_info()):
                raise
        else:
            if context is not None:
                context.__exit__(None, None, None)
    finally:
        engine.in_backward = False
