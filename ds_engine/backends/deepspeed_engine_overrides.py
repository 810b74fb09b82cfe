"""DeepSpeed's engine adjusted per instance, and the fp32 ZeRO-0 checks it does not make.

Installed by the DeepSpeed backend into the engine instance's `__dict__` (the class is
DeepSpeed's); the output-hook check and the kept norm only where the DeepSpeed in use has the
methods they replace in the shape known:

* `mode_calls_return_the_model` -- `train()` / `eval()` return the model, as torch's do.
* `hooks_every_output` / `check_in_deepspeed_output_hooks` -- the direct-backward check runs inside
  DeepSpeed's own hooks on its forward's outputs (nothing of ours per forward).
* `clip_norm_kept` -- fp32 ZeRO-0 clipping keeps the global norm DeepSpeed computes, and a step
  whose norm is not finite is skipped inside DeepSpeed's `step()` (DeepSpeed has no overflow
  check there).

Called by the backend at each fp32 ZeRO-0 step without clipping:

* `local_grad_norm` -- the global norm of the gradients (the step is skipped when not finite).

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

#: What DeepSpeed's `_take_model_step` does after clipping fp32 gradients, in this order: step the
#: optimizer, then read its `overflow` flag to decide whether the step counted (as for fp16).
TAKE_MODEL_STEP = (
    "self.clip_fp32_gradients()",
    "self.optimizer.step()",
    'if hasattr(self.optimizer, "overflow"):',
    "overflow = self.optimizer.overflow",
    "self._step_applied = not overflow",
)


def _source_lines(function: Any) -> list[str]:
    import inspect

    try:
        return [line.strip() for line in inspect.getsource(function).splitlines()[1:] if line.strip()]
    except (OSError, TypeError):  # no source to compare with
        return []


def _in_order(lines: list[str], wanted: tuple[str, ...]) -> bool:
    position = 0
    for line in lines:
        if position < len(wanted) and line == wanted[position]:
            position += 1
    return position == len(wanted)


class KeptClipNorm:
    """The global norm DeepSpeed computes to clip fp32 ZeRO-0 gradients, kept, and the step
    skipped where that norm is not finite (see `clip_norm_kept`)."""

    def __init__(self, skip_nonfinite: bool) -> None:
        self.skip_nonfinite = skip_nonfinite
        self._norm: float | None = None
        self._armed: tuple[Any, dict[str, Any]] | None = None  # (optimizer, its entries replaced)
        self._skipped = False

    def clipped(self, norm: Any, optimizer: Any) -> None:
        """DeepSpeed clipped by `norm`; where it is not finite (a gradient is inf or NaN, or their
        norm overflows), the optimizer step DeepSpeed takes next does nothing and reports an
        overflow, which DeepSpeed counts as a skipped step (no LR scheduler step, as for fp16)."""
        self._norm = value = float(norm)
        if math.isfinite(value) or not self.skip_nonfinite:
            return
        saved = {name: optimizer.__dict__[name] for name in ("step", "overflow") if name in vars(optimizer)}

        def skipped_step(*_args: Any, **_kwargs: Any) -> None:
            self._skipped = True

        self._armed = (optimizer, saved)
        optimizer.__dict__["step"] = skipped_step
        optimizer.__dict__["overflow"] = True

    def finish(self) -> tuple[bool, float | None]:
        """After DeepSpeed's `step()` (also when it raised): put the optimizer back; returns
        (whether the step was skipped here, the norm clipped by, None where none was computed)."""
        if self._armed is not None:
            optimizer, saved = self._armed
            for name in ("step", "overflow"):
                if name in saved:
                    optimizer.__dict__[name] = saved[name]
                else:
                    optimizer.__dict__.pop(name, None)
        skipped, norm = self._skipped, self._norm
        self._armed, self._skipped, self._norm = None, False, None
        return skipped, norm


def clip_norm_kept(engine: Any, *, skip_nonfinite: bool) -> KeptClipNorm | None:
    """Where `engine` clips fp32 gradients in `step()` (ZeRO-0, `gradient_clipping` > 0), keep the
    global norm DeepSpeed computes for it (its `clip_fp32_gradients`, per instance, as the same
    call that returns the norm) and, with `skip_nonfinite`, skip the step inside DeepSpeed's
    `step()` when that norm is not finite: one check on a norm already computed, where a check
    of every gradient before the step would cost a pass over them per step.

    None where DeepSpeed does not clip here, or where its methods are not the ones known (the
    caller then computes the norm and checks it before the step itself).
    """
    if not engine.gradient_clipping() > 0.0:
        return None
    found: KeptClipNorm | None = engine.__dict__.get("_ds_engine_clip_norm")
    if found is not None:
        found.skip_nonfinite = skip_nonfinite
        return found
    import types

    from deepspeed.runtime import engine as engine_module

    kind = type(engine)
    if (
        _source_lines(kind.clip_fp32_gradients) != [DEEPSPEED_CLIP]
        or not _in_order(_source_lines(kind._take_model_step), TAKE_MODEL_STEP)
        or not callable(getattr(engine_module, "clip_grad_norm_", None))
        or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
    ):
        return None
    kept = KeptClipNorm(skip_nonfinite)

    def clip_fp32_gradients(self: Any) -> None:
        norm = engine_module.clip_grad_norm_(
            parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu
        )
        kept.clipped(norm, self.optimizer)

    engine.__dict__["clip_fp32_gradients"] = types.MethodType(clip_fp32_gradients, engine)
    engine.__dict__["_ds_engine_clip_norm"] = kept
    return kept


def local_grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    """The 2-norm of every gradient of `parameters` (fp32 ZeRO-0: all-reduced, so the global norm)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # one fused kernel per dtype/device group, as torch.nn.utils.clip_grad_norm_ does
    with torch.no_grad():
        norms = torch._foreach_norm(grads, 2.0)
        return float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).item())
