"""Guards on what `prepare` is given and on a prepared model's outputs.

`sort_prepare_arguments` sorts and checks what `prepare` got; `check_optimizer_parameters` refuses
an optimizer over tensors the model does not own; `refuse_backward` and the clip checks name
what is wrong with a `backward` / `clip_grad_norm_` call.
`guard_direct_backward` hooks the user's module so that a backward pass reaching its outputs
outside `engine.backward` (or from another Engine's backward through a model that trains) stops
with an error before anything is reduced or scaled.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from ds_engine import process_group
from ds_engine.collectives import iter_tensors
from ds_engine.config import ConfigError
from ds_engine.dataloader import check_dataloader
from ds_engine.scheduler import is_scheduler

__all__ = [
    "check_clip_arguments",
    "check_clipped_parameters",
    "check_optimizer_parameters",
    "check_scheduler_alone",
    "guard_direct_backward",
    "refuse_backward",
    "refuse_creation_in_main_process_first",
    "sort_prepare_arguments",
]


def guard_direct_backward(
    engine: Any,
    module: torch.nn.Module,
    wrapper_hooks: Callable[[Callable[[], None]], Callable[[], bool] | None] | None = None,
) -> None:
    """Make `loss.backward()` on the prepared model's outputs stop with an error.

    A direct backward bypasses the Engine: no window scaling, no boundary, and DeepSpeed
    would divide by the configured GA (or refuse, on ZeRO-0) on its own. The forward hook
    sits on the user's module, inside DeepSpeed's / DDP's wrapper, so its gradient hooks
    run before the wrapper's own and nothing is reduced or scaled before the error. Where
    the wrapper hooks every output of its forward itself (DeepSpeed's engine), the check
    runs first in the wrapper's hooks instead, and the module's hook only serves forwards
    that bypass the wrapper (the unwrapped module called directly).

    Args:
        engine: The Engine that prepared `module` (held weakly); its `in_backward` and
            `optimizer` say whether a gradient reaching the output is its own.
        module: The user's module inside the prepared wrapper.
        wrapper_hooks: Installs a check in the wrapper's own output hooks and returns
            whether a forward through the wrapper is running now, or returns None where the
            wrapper hooks nothing (`Backend.check_in_output_hooks`).
    """

    # The hook holds the Engine weakly: DeepSpeed's engine keeps the module alive through
    # reference cycles the collector cannot see (tensor hooks), and a dropped Engine must
    # not stay alive through it (it would count as a user of the process group).
    engine_ref = weakref.ref(engine)

    def check(grad: torch.Tensor | None) -> None:
        self = engine_ref()
        if self is None or self.in_backward:
            return
        other = any(user.in_backward for user in process_group.users() if user is not self)
        trainable = any(p.requires_grad for p in module.parameters())
        if other and not trainable:
            # another Engine's backward passes through this frozen model to the one it trains
            # (a GAN's generator loss through its discriminator): no gradient lands here
            return
        if self.optimizer is None and trainable:
            raise RuntimeError(
                "a backward pass reached the output of a model prepared without an optimizer "
                "(inference only, e.g. a frozen teacher) whose parameters require gradients; it "
                "has no optimizer to apply them. HINT: run it under `torch.no_grad()`, `.detach()` "
                "its outputs, or freeze it (`model.requires_grad_(False)`), and call `backward` on "
                "the Engine of the model you train."
            )
        if other:
            raise RuntimeError(
                "another Engine's `backward` reached the output of this Engine's model, whose "
                "parameters require gradients: they would get gradients outside this Engine's "
                "accumulation. HINT: freeze it for the other model's step (`requires_grad_(False)` "
                "before that forward, `requires_grad_(True)` after, the GAN idiom) or `.detach()` "
                "its output."
            )
        if not self.in_backward:
            raise RuntimeError(
                "`loss.backward()` was called on the output of a model prepared by ds_engine; it "
                "would bypass gradient accumulation (window scaling, the boundary, the reduction "
                "across ranks). HINT: call `engine.backward(loss)` instead."
            )

    def check_here() -> None:
        check(None)

    inside_wrapper = None if wrapper_hooks is None else wrapper_hooks(check_here)

    # Which outputs needed a hook of their own, per output signature (each output's autograd
    # node type and index): their walk in `_uncovered` goes the whole depth and costs more than
    # the hook it would save, so they are hooked again without one (an extra hook is always
    # safe). An output found covered is walked again at every forward (the walk stops where it
    # meets the other output, a few nodes up), so it goes without a hook only when the graph at
    # hand shows it is covered.
    needs_hook: dict[tuple[tuple[type, int], ...], tuple[int, ...]] = {}

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or (inside_wrapper is not None and inside_wrapper()):
            return  # no graph, or the wrapper's own output hooks run `check`
        tensors = [t for t in iter_tensors(output) if t.requires_grad]
        if len(tensors) > 1:
            signature = tuple((type(t.grad_fn), t.output_nr) for t in tensors)
            keep = _uncovered(tensors, hooked=needs_hook.get(signature, ()))
            if signature in needs_hook or len(needs_hook) < 32:
                needs_hook[signature] = keep
            tensors = [tensors[i] for i in keep]
        for tensor in tensors:
            tensor.register_hook(check)

    module.register_forward_hook(hook)


def _uncovered(tensors: list[torch.Tensor], depth: int = 12, hooked: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The indices of the outputs whose backward would not pass another output's hook before
    any parameter's, `hooked` (outputs to hook without a walk) among them.

    A Hugging Face model returns its loss computed from its logits: a backward from the loss
    passes the logits before it reaches any parameter, so the logits' hook stops it just as
    early and the loss needs none (each hook is a Python call in every backward; the two cost
    about 1.5 % of a small model's step). An output counts as covered when a short walk up its
    graph (`depth` nodes, through nodes that use no parameter) meets another output's place in
    the graph (node and output index); every other output keeps its own hook.
    """
    places = {(t.grad_fn, t.output_nr): i for i, t in enumerate(tensors) if t.grad_fn is not None}
    keep: list[int] = []
    for i, tensor in enumerate(tensors):
        if i in hooked:
            keep.append(i)
            continue
        covered = False
        frontier = [tensor.grad_fn] if tensor.grad_fn is not None else []
        seen = 0
        while frontier and not covered and seen < depth:
            node = frontier.pop()
            seen += 1
            parents = [(p, n) for p, n in node.next_functions if p is not None]
            if any(type(p).__name__ == "AccumulateGrad" for p, _ in parents):
                continue  # this node computes a parameter's gradient: a hook past it is too late
            for parent, index in parents:
                other = places.get((parent, index))
                if other is not None and other != i:
                    covered = True
                    break
                frontier.append(parent)
        if not covered:
            keep.append(i)
    return tuple(keep)


def check_optimizer_parameters(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, caller: str
) -> None:
    """Refuse an optimizer that holds tensors which are not the model's parameters.

    The Engine reduces, clips, partitions and saves the prepared model's parameters only:
    an optimizer built over another model (or over this one before it was re-created)
    would step parameters that never get a gradient, and DeepSpeed's ZeRO-2/3 fail on them
    deep inside. Holding only some of the model's parameters (a frozen part) is fine.
    Checked before any process group work, on every rank alike.
    """
    owned = {id(p) for p in model.parameters()}
    foreign: list[tuple[int, int, torch.Tensor]] = []
    total = 0
    for g, group in enumerate(optimizer.param_groups):
        params = group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, param in enumerate(params):
            total += 1
            if id(param) not in owned:
                foreign.append((g, i, param))
    if not foreign:
        return
    g, i, first = foreign[0]
    shape = tuple(getattr(first, "ds_shape", None) or first.shape)
    which = (
        f"none of its {total} parameters is a parameter of the model"
        if len(foreign) == total
        else f"{len(foreign)} of its {total} parameters are not parameters of the model"
    )
    raise ValueError(
        f"`{caller}.prepare(model, optimizer)`: the optimizer ({type(optimizer).__name__}) "
        f"steps tensors the model ({type(model).__name__}) does not own: {which} (the first: "
        f"param_groups[{g}]['params'][{i}], shape {shape}). They would never get a gradient from "
        "this model (a run that counts steps and trains nothing). HINT: create the optimizer from "
        "the model you prepare, after creating it (after `init_context()` / `get_peft_model`): "
        "`torch.optim.AdamW(model.parameters(), ...)`; a tensor of your own that must train "
        "(e.g. a temperature) goes on the model: `model.temperature = torch.nn.Parameter(...)`."
    )


def sort_prepare_arguments(
    objects: tuple[Any, ...], prepared_model: str | None
) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer], list[DataLoader], list[Any]]:
    """`prepare`'s arguments sorted into (models, optimizers, dataloaders, schedulers), checked.

    Args:
        objects: What `prepare` got.
        prepared_model: The class name of the model the Engine prepared already, or None.

    Raises:
        TypeError: An object that is not a model, optimizer, DataLoader or LR scheduler.
        ValueError: Two of a kind, a second model, an optimizer / scheduler without a model, or a
            DataLoader whose data is split per rank already (`check_dataloader`).
    """
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    loaders = [o for o in objects if isinstance(o, DataLoader)]
    schedulers = [o for o in objects if is_scheduler(o) and not isinstance(o, torch.optim.Optimizer)]
    known = {id(o) for o in (*models, *optimizers, *loaders, *schedulers)}
    for obj in objects:
        if id(obj) not in known:
            raise TypeError(
                f"`prepare` got a {type(obj).__name__}, which is not a model, optimizer, "
                "DataLoader or LR scheduler. HINT: pass only those."
            )
    for kind, found in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers)):
        if len(found) > 1:
            raise ValueError(
                f"`prepare` got {len(found)} {kind}s; ds_engine trains one model with one "
                f"optimizer and one scheduler per Engine. HINT: use one Engine per model."
            )
    if models and prepared_model is not None:
        raise ValueError(
            f"`prepare` got a model ({type(models[0]).__name__}), but this Engine already prepared "
            f"one ({prepared_model}); an Engine holds one model, and a "
            "second would replace the first. HINT: create one Engine per model, each with its own "
            "choices (they share the process group), e.g. teacher_engine = Engine(zero_stage=3); "
            "teacher = teacher_engine.prepare(teacher)."
        )
    if (optimizers or schedulers) and not models and prepared_model is None:
        raise ValueError(
            "`prepare` got an optimizer/scheduler but no model. HINT: pass the model in the "
            "same call: engine.prepare(model, optimizer, ...)."
        )
    if optimizers and not models:
        raise ValueError(
            "`prepare` got an optimizer without its model; this Engine's model was prepared in an "
            "earlier call without one (inference only). HINT: pass them in one call: "
            "engine.prepare(model, optimizer, ...)."
        )
    for loader in loaders:  # before any process group work
        check_dataloader(loader)
    return models, optimizers, loaders, schedulers


def refuse_backward(
    loss: Any,
    kwargs: dict[str, Any],
    caller: str,
    model: Any,
    optimizer: Any,
    refuse_while_gathered: Callable[[str], None],
) -> None:
    """Raise the error for an `engine.backward(loss, **kwargs)` call that cannot run, in the order
    the checks apply (called only when one of them fails, off the per-micro-step path).

    Args:
        loss: What `backward` got.
        kwargs: The extra keyword arguments it got.
        caller: What the script calls the Engine ("engine" or "accelerator").
        model: The Engine's prepared model (None before `prepare`).
        optimizer: Its prepared optimizer (None: none prepared, or inference only).
        refuse_while_gathered: Raises while a gathered ZeRO-3 model is in use (the call named).
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"`{caller}.backward(loss)` got a {type(loss).__name__} ({loss!r:.60}); it needs the "
            "loss tensor the forward computed (with its graph). HINT: pass the tensor itself, e.g. "
            "`outputs.loss`, not `loss.item()` or a float."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"`{caller}.backward(loss)` got a loss of shape {tuple(loss.shape)} ({loss.numel()} "
            "values); backward needs a single number (a 0-dim tensor). HINT: reduce it first, e.g. "
            f"`{caller}.backward(loss.mean())` (per-sample or per-token losses), or pass "
            "`reduction='mean'` to the loss function."
        )
    if optimizer is None:
        if model is not None:
            raise RuntimeError(
                "`engine.backward` on an Engine whose model was prepared without an optimizer: it is "
                "inference only (no gradients, no optimizer state), e.g. a frozen teacher. HINT: call "
                "`backward` on the Engine of the model you train; to train this one, prepare it with "
                "its optimizer: engine.prepare(model, optimizer, ...)."
            )
        raise RuntimeError(
            "`engine.backward` before an optimizer was prepared. HINT: "
            "engine.prepare(model, optimizer, ...) first."
        )
    if kwargs:
        raise TypeError(
            f"`engine.backward` got unexpected arguments {sorted(kwargs)}. HINT: call "
            "`engine.backward(loss)`; the Engine scales the loss for accumulation itself (for a "
            "loss summed over tokens: `engine.backward(loss_sum, num_items=tokens_in_window)`)."
        )
    refuse_while_gathered("engine.backward(loss)")
    if not loss.requires_grad:
        raise ValueError(
            f"`{caller}.backward(loss)` got a loss ({float(loss.detach()):.6g}) that does not "
            "require gradients: nothing connects it to a trained parameter (computed under "
            "`torch.no_grad()`, from `.detach()`ed outputs, or with every parameter frozen). HINT: "
            "compute the loss from the prepared model's forward with gradients enabled."
        )


def check_clip_arguments(max_norm: float, norm_type: float, configured: float) -> None:
    """`clip_grad_norm_(max_norm, norm_type)`: refuse a norm other than the config's
    `gradient_clipping` (`configured`), or another norm than the 2-norm."""
    if float(max_norm) != float(configured):
        raise ConfigError(
            f"`clip_grad_norm_(max_norm={max_norm})` differs from `gradient_clipping={configured}`; "
            "DeepSpeed clips with the config's value inside its step. HINT: "
            f"Engine(gradient_clipping={max_norm}, ...) and keep the two equal."
        )
    if float(norm_type) != 2.0:
        raise ConfigError(
            f"`clip_grad_norm_(norm_type={norm_type})`: only the 2-norm is supported "
            "(DeepSpeed clips by the global 2-norm). HINT: drop `norm_type`."
        )


def check_clipped_parameters(parameters: Any, module: torch.nn.Module | None) -> None:
    """Refuse a parameter set other than the model's (`module`, None before `prepare`): clipping
    is global to every backend."""
    if module is None:
        raise RuntimeError(
            "`clip_grad_norm_` before `prepare`. HINT: engine.prepare(model, optimizer, ...) first."
        )
    given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    every = {id(p) for p in module.parameters()}
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    ids = {id(p) for p in given}
    if not trained <= ids or not ids <= every:
        raise ConfigError(
            f"`clip_grad_norm_` got {len(ids & trained)} of the model's {len(trained)} trained "
            f"parameters{' and tensors that are not its parameters' if not ids <= every else ''}; "
            "DeepSpeed clips the global norm of every trained parameter inside its step, so a "
            "subset cannot be clipped on its own. HINT: pass `model.parameters()`."
        )


def check_scheduler_alone(has_optimizer: bool, has_scheduler: bool, *, caller: str) -> None:
    """`prepare(scheduler)` in a call of its own: refused without a prepared optimizer, or when a
    scheduler is prepared already."""
    if not has_optimizer:
        raise ValueError(
            f"`{caller}.prepare(scheduler)`: the model was prepared without an optimizer "
            "(inference only), so there is nothing for an LR scheduler to drive. HINT: prepare "
            "the model with its optimizer first: prepare(model, optimizer), then prepare(scheduler)."
        )
    if has_scheduler:
        raise ValueError(
            f"`{caller}.prepare(scheduler)`: a scheduler is prepared already; ds_engine trains "
            "one scheduler per Engine. HINT: prepare one scheduler only."
        )


def refuse_creation_in_main_process_first(caller: str) -> None:
    """Raise: a ZeRO-3 model created inside `main_process_first()` would hang the run."""
    raise RuntimeError(
        f"`{caller}.init_context()` inside `main_process_first()` under ZeRO-3: creating (or "
        "loading) a model there partitions its weights across every rank, a collective, while the "
        "other ranks wait for the main process: the run would hang. HINT: create the model on every "
        "rank at once, outside `main_process_first()` (download or cache files inside it, then load "
        "after it)."
    )


def window_scale(num_items: Any, window_len: int, world: Callable[[], int], caller: str) -> float:
    """What `backward` multiplies the loss by: ``1 / window_len`` (the window mean of mean
    losses), or ``world() / num_items`` for a loss summed over items when `num_items` counts the
    items of the whole window on all ranks (the reduction averages over ranks). `world` is
    asked only then: the common case does no process-group work per micro-step.

    Raises:
        ValueError: `num_items` is not one positive finite number.
    """
    if num_items is None:
        return 1.0 / window_len
    value = num_items
    if isinstance(num_items, torch.Tensor) and num_items.numel() == 1:
        value = num_items.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        shown = f"{num_items!r:.80}"
        raise ValueError(
            f"`{caller}.backward(loss, num_items={shown})`: `num_items` must be one positive number, "
            "the count of items (e.g. label tokens) in the whole accumulation window on all ranks "
            "together. HINT: count the window's items on each rank and sum them across ranks, e.g. "
            f"`num_items = {caller}.reduce(torch.tensor(tokens_in_window), 'sum')`; skip a window "
            "without items (its token mean is undefined)."
        )
    return world() / float(value)


_CALLER_NAMES: dict[type, str] = {}


def caller_name(cls: type) -> str:
    """What a user's script calls an object of `cls` in messages: the lower-cased name of the first
    ds_engine class in its MRO ("engine", "accelerator"; a user's subclass of Engine is still
    "engine"). Looked up once per class: `backward` asks on every micro-step."""
    name = _CALLER_NAMES.get(cls)
    if name is None:
        found = (base.__name__.lower() for base in cls.__mro__ if base.__module__.startswith("ds_engine."))
        name = _CALLER_NAMES[cls] = next(found, "engine")
    return name
