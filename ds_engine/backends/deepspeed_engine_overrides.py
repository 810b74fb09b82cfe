"""DeepSpeed's engine adjusted per instance, and the fp32 ZeRO-0 checks it does not make.

Installed by the DeepSpeed backend into the engine instance's `__dict__` (the class is
DeepSpeed's); the output-hook check and the kept norm only where the DeepSpeed in use has the
methods they replace in the shape known:

* `mode_calls_return_the_model` -- `train()` / `eval()` return the model, as torch's do.
* `hooks_every_output` / `check_in_deepspeed_output_hooks` -- the direct-backward check runs inside
  DeepSpeed's own hooks on its forward's outputs (nothing of ours per forward).
* `clip_norm_kept` -- fp32 ZeRO-0 clipping keeps the global norm DeepSpeed computes.

Called by the backend at each fp32 ZeRO-0 step, where DeepSpeed has no overflow check:

* `all_finite` / `local_grad_norm` -- whether every gradient is finite, and their global norm.

DeepSpeed is imported lazily, inside functions, so this module imports without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def mode_calls_return_the_model(engine: Any) -> None:
    """Make the prepared model's `train()` / `eval()` return it, as every torch module's do.

    DeepSpeed's engine overrides both to return None (and leaves its own `training` flag
    behind), so `teacher = engine.prepare(teacher).eval()` would bind None. Per instance: the
    class is DeepSpeed's.
    """
    import types

    set_mode = type(engine).train

    def train(self: Any, mode: bool = True) -> Any:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
        set_mode(self, mode)
        self.training = mode
        return self

    def to_eval(self: Any) -> Any:
        return train(self, False)

    engine.__dict__["train"] = types.MethodType(train, engine)
    engine.__dict__["eval"] = types.MethodType(to_eval, engine)


def hooks_every_output(engine: Any) -> bool:
    """Whether this DeepSpeed hooks every output of its engine's forward and calls
    `_backward_prologue` (once) and `_backward_prologue_per_tensor` (per output) from those
    hooks, before any gradient leaves the outputs (`register_output_backward_hooks`)."""
    from deepspeed.runtime import utils

    kind = type(engine)
    return (
        callable(getattr(utils, "register_output_backward_hooks", None))
        and callable(getattr(kind, "_backward_prologue", None))
        and callable(getattr(kind, "_backward_prologue_per_tensor", None))
        and not {"forward", "_backward_prologue", "_backward_prologue_per_tensor"} & engine.__dict__.keys()
    )


def check_in_deepspeed_output_hooks(engine: Any, check: Callable[[], None]) -> Callable[[], bool]:
    """Run `check()` first in DeepSpeed's hooks on `engine`'s outputs (per instance, as
    `mode_calls_return_the_model`), and count the forwards running through `engine`.

    DeepSpeed's engine hooks every output of each forward already; checking there costs one
    call per output gradient and nothing per forward, where hooks of our own on the outputs
    cost a module hook, a walk and a tensor hook per forward (about 2 % of a small model's
    step). The returned function says whether a forward through `engine` is running now.
    """
    import types

    kind = type(engine)
    once, per_tensor, forward = kind._backward_prologue, kind._backward_prologue_per_tensor, kind.forward
    running = [0]

    def backward_prologue(self: Any) -> Any:
        check()  # before DeepSpeed's own refusal of a direct backward on ZeRO-0
        return once(self)

    def backward_prologue_per_tensor(self: Any, grad: Any) -> Any:
        check()  # every output's gradient, every backward (the once-hook runs per forward)
        return per_tensor(self, grad)

    def counted_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        running[0] += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            running[0] -= 1

    for name, function in (
        ("_backward_prologue", backward_prologue),
        ("_backward_prologue_per_tensor", backward_prologue_per_tensor),
        ("forward", counted_forward),
    ):
        engine.__dict__[name] = types.MethodType(function, engine)
    return lambda: running[0] > 0


#: DeepSpeed's `clip_fp32_gradients` (fp32 ZeRO-0 clipping inside `step()`), which drops the
#: global norm it computes; `clip_norm_kept` keeps it where the method is exactly this call.
DEEPSPEED_CLIP = (
    "clip_grad_norm_(parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu)"
)


def clip_norm_kept(engine: Any) -> Callable[[], float | None] | None:
    """Where `engine` clips fp32 gradients in `step()` (ZeRO-0, `gradient_clipping` > 0), keep the
    global norm DeepSpeed computes for it (its `clip_fp32_gradients`, per instance, as the same
    call that returns the norm) and return a function that gives the norm of the last step;
    None where DeepSpeed does not clip here or its method is not the one known."""
    if not engine.gradient_clipping() > 0.0:
        return None
    kept = engine.__dict__.get("_ds_engine_clip_norm")
    if kept is not None:
        return kept
    import inspect
    import types

    from deepspeed.runtime import engine as engine_module

    method = type(engine).clip_fp32_gradients
    try:
        body = [line.strip() for line in inspect.getsource(method).splitlines()[1:] if line.strip()]
    except (OSError, TypeError):  # no source to compare with: compute the norm ourselves
        body = []
    if body != [DEEPSPEED_CLIP] or not callable(getattr(engine_module, "clip_grad_norm_", None)):
        return None
    last: list[Any] = [None]

    def clip_fp32_gradients(self: Any) -> None:
        last[0] = engine_module.clip_grad_norm_(
            parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu
        )

    def norm() -> float | None:
        value, last[0] = last[0], None
        return None if value is None else float(value)

    engine.__dict__["clip_fp32_gradients"] = types.MethodType(clip_fp32_gradients, engine)
    engine.__dict__["_ds_engine_clip_norm"] = norm
    return norm


def all_finite(parameters: list[torch.nn.Parameter]) -> bool:
    """Whether every gradient of `parameters` is finite: one fused kernel per dtype/device group
    (torch's own non-finite check for AMP; multiplying by exactly 1 leaves every value as it was)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return True
    found = torch.zeros(1, device=grads[0].device)
    try:
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(1, device=found.device))
    except RuntimeError:  # gradients of several devices or dtypes the kernel does not take
        return math.isfinite(local_grad_norm(parameters))
    return not bool(found.item())


def local_grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    """The 2-norm of every gradient of `parameters` (fp32 ZeRO-0: all-reduced, so the global norm)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # one fused kernel per dtype/device group, as torch.nn.utils.clip_grad_norm_ does
    with torch.no_grad():
        norms = torch._foreach_norm(grads, 2.0)
        return float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).item())
