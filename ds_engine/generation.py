"""Generation on a prepared model (`Engine.generate`): never hangs, and is fast when it can be.

Hugging Face `generate` runs one forward per new token. Under DeepSpeed ZeRO-3 every forward
all-gathers every layer's parameters, so every rank must run the same number of forwards:
a rank whose sequences stop early (EOS, a shorter `max_new_tokens`) and leaves the loop makes
the others wait forever in their next gather (transformers#20130). transformers only
synchronises the ranks (`synced_gpus`) when its global ZeRO-3 flag is set, which ds_engine
clears after `init_context` so that a later plain `from_pretrained` stays plain. Gathering
every layer for every token is also what makes naive ZeRO-3 generation crawl
(DeepSpeedExamples#718). Two paths:

- **gathered** (fast): all parameters are gathered once (`deepspeed.zero.GatheredParameters`,
  no modifier rank), DeepSpeed's per-module fetch/release hooks and its start-of-forward trace
  check (itself a collective until the fetch trace is recorded) are taken off for the duration,
  plain `generate` runs with no collective per token (each rank stops on its own,
  `synced_gpus=False`), then the hooks are put back and the parameters re-partitioned;
- **synced** (for models that do not fit): parameters stay partitioned and `generate` runs with
  `synced_gpus=True` when there is more than one rank, so a finished rank keeps stepping
  (dummy forwards) until every rank is done.

`gather=None` (default) picks the gathered path when the model's full parameters, in the dtype
they are held in, take at most `GATHER_MEMORY_FRACTION` of the accelerator memory available
now (host memory on CPU ranks) on every rank; the ranks agree through one all-reduce.

Models that are not partitioned (ZeRO 0-2, the DDP fallback) run plain `generate`. FSDP2 shards
(the fallback's ZeRO-2/3 on GPUs) run synced. In every case the model runs under
`torch.no_grad()` in eval mode and each submodule's train/eval mode is restored afterwards.

`gathered(wrapper, module)` (`Engine.gathered`) holds the gathered state for a whole block, e.g.
an evaluation loop: one gather on entry, one re-partition on exit, and in between every
`generate` takes the gathered path without a gather (or any other collective) of its own and
plain forwards run on the whole parameters with no per-layer gather. Training in the block is
refused (`Engine.backward` / the optimizer step raise, see `is_gathered`): the parameters in use
are copies that an optimizer step would not update.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GATHER_MEMORY_FRACTION",
    "full_parameter_bytes",
    "gathered",
    "generate",
    "is_gathered",
    "partitioning",
]

#: `gather=None` gathers when the full parameters take at most this share of the memory available
#: on every rank; the rest is left for activations and the KV cache.
GATHER_MEMORY_FRACTION = 0.5

#: The user's modules whose ZeRO-3 parameters `_gathered` holds whole now (hooks off).
_GATHERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def partitioning(module: torch.nn.Module) -> str | None:
    """ "zero3" (DeepSpeed ZeRO-3 parameters), "fsdp" (FSDP2 DTensor shards) or None (whole)."""
    for param in module.parameters():
        if hasattr(param, "ds_id"):
            return "zero3"
        if hasattr(param, "full_tensor"):
            return "fsdp"
    return None


def is_gathered(module: torch.nn.Module) -> bool:
    """True while `module`'s ZeRO-3 parameters are held whole by `gathered` (or by `generate`'s
    gathered path): DeepSpeed's fetch/release hooks are off, so it must not train."""
    return module in _GATHERED


def any_gathered() -> bool:
    """True while any module is held whole (a cheap check for the per-step training guard; it may
    say True for a module being collected, never False while one is held)."""
    return bool(_GATHERED.data)  # type: ignore[attr-defined]  # the WeakSet's own set


def full_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter at its full (unpartitioned) size, in the dtype it is held in."""
    total = 0
    for param in module.parameters():
        numel = int(getattr(param, "ds_numel", param.numel()))
        total += numel * param.element_size()
    return total


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _zero3_offload(wrapper: Any) -> Any:
    """DeepSpeed's `DeepSpeedZeRoOffload` (owner of the ZeRO-3 fetch/release hooks) of a prepared
    model, or None when `wrapper` is not a DeepSpeed engine (e.g. a bare partitioned module)."""
    optimizer = getattr(wrapper, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)  # ZeRO-3 optimizer, or inference-only
    if hasattr(offload, "forward_hooks") and hasattr(offload, "_register_deepspeed_module"):
        return offload
    return None


def _fits_everywhere(module: torch.nn.Module) -> bool:
    """The auto rule, agreed by all ranks: the full parameters take at most
    `GATHER_MEMORY_FRACTION` of the memory available on each rank's accelerator (host on CPU)."""
    from deepspeed.accelerator import get_accelerator

    needed = full_parameter_bytes(module)
    available = int(get_accelerator().available_memory())
    fits = torch.tensor([1 if needed <= GATHER_MEMORY_FRACTION * available else 0], dtype=torch.int32)
    if _world_size() > 1:
        device = torch.device(get_accelerator().current_device_name())
        fits = fits.to(device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every rank takes the same path
    return bool(int(fits.item()))


@contextlib.contextmanager
def _gathered(module: torch.nn.Module, offload: Any) -> Iterator[None]:
    """Every parameter whole for the block, with DeepSpeed's per-module hooks off (they would
    release the gathered parameters after each submodule); hooks and partitions restored after."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        # The root's start-of-forward hook checks the fetch trace across ranks (a collective on
        # every forward until the trace is recorded): detached too, or ranks that stop at
        # different lengths hang in it. DeepSpeed's own `unwrap_model_for_generation` keeps it.
        root_hooks = offload.module._forward_pre_hooks
        start_hook = getattr(offload, "fwd_pre_hook", None)
        start_key = None if start_hook is None else start_hook.id
        start_fn = None if start_key is None else root_hooks.pop(start_key, None)
        _GATHERED.add(module)
        try:
            yield
        finally:
            _GATHERED.discard(module)
            if start_fn is not None:
                root_hooks[start_key] = start_fn
                root_hooks.move_to_end(start_key, last=False)  # before the fetch hooks, as registered
            offload._register_deepspeed_module(offload.module)  # also invalidates the fetch trace


@contextlib.contextmanager
def gathered(wrapper: torch.nn.Module, module: torch.nn.Module) -> Iterator[None]:
    """Hold `module`'s ZeRO-3 parameters whole for the block (`Engine.gathered`).

    Collective on entry (one all-gather of the whole model: every rank enters); inside, nothing
    is collective: `generate` skips its own gather (ranks may call it different numbers of
    times, and stop at different lengths), plain forwards gather nothing. On exit (also on an
    exception, and without a collective) DeepSpeed's hooks are put back and the parameters
    re-partitioned, as after `generate`'s gathered path. Re-entrant: a block inside a block for
    the same model is a no-op. Not partitioned (ZeRO 0-2, the DDP fallback) or FSDP2-sharded
    (whose `generate` stays synced, per call): a no-op.

    Raises:
        ValueError: a ZeRO-3 module without the DeepSpeed engine that owns its hooks.
    """
    if partitioning(module) != "zero3" or module in _GATHERED:
        yield
        return
    offload = _zero3_offload(wrapper)
    if offload is None:
        raise ValueError(
            f"`engine.gathered` on a bare ZeRO-3 module ({type(module).__name__}) that ds_engine cannot "
            "match to its DeepSpeed engine (the owner of its parameter hooks). HINT: pass the model "
            "`engine.prepare` returned, to the Engine that prepared it."
        )
    with _gathered(module, offload):
        yield


@contextlib.contextmanager
def _evaluating(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the block; each submodule's own mode restored after."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for sub, training in modes:
            sub.training = training


def _call_generate(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return module.generate(*args, **kwargs)


def _synced(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    world = _world_size()
    if world > 1 and kwargs.get("synced_gpus") is False:
        raise ValueError(
            "`engine.generate(..., synced_gpus=False)` on a model whose parameters are sharded "
            f"across {world} ranks: every forward gathers parameters from all ranks, so a rank that "
            "stops early would leave the others waiting forever. HINT: drop `synced_gpus` (ds_engine "
            "sets it), or pass `gather=True` to gather the model once and let ranks stop on their own."
        )
    kwargs["synced_gpus"] = world > 1
    return _call_generate(module, args, kwargs)


def generate(
    wrapper: torch.nn.Module,
    module: torch.nn.Module,
    *args: Any,
    gather: bool | None = None,
    **generate_kwargs: Any,
) -> Any:
    """`module.generate(*args, **generate_kwargs)` that neither hangs nor crawls under ZeRO-3.

    Collective when the parameters are partitioned: every rank calls it (with its own prompts
    and lengths). See the module docstring for the paths.

    Args:
        wrapper: The prepared model (a DeepSpeed engine, DDP, ...), used to find DeepSpeed's hooks.
        module: The user's model inside it (has `generate`).
        gather: True: gather the whole model once (DeepSpeed ZeRO-3); False: synced stepping;
            None: gather when it fits (`GATHER_MEMORY_FRACTION`). No effect where parameters
            are not partitioned. Inside `gathered`, True and None run on the parameters
            already gathered (no gather, no collective).

    Raises:
        TypeError: `gather` is not a bool or None; `module` has no `generate`.
        ValueError: `gather=True` where ds_engine cannot gather (FSDP2, a ZeRO-3 module without
            its DeepSpeed engine), `gather=False` inside `gathered`, or `synced_gpus=False` on
            the synced path with several ranks.
    """
    if gather is not None and not isinstance(gather, bool):
        raise TypeError(
            f"`gather={gather!r}`: allowed values are True, False or None (decide from memory). "
            "HINT: leave `gather=None`."
        )
    if not callable(getattr(module, "generate", None)):
        raise TypeError(
            f"`engine.generate` needs a model with a `generate` method (a Hugging Face generation "
            f"model); got {type(module).__name__}. HINT: pass the prepared "
            "`AutoModelForCausalLM`/`AutoModelForSeq2SeqLM`."
        )
    kind = partitioning(module)
    with _evaluating(module):
        if kind is None:
            return _call_generate(module, args, generate_kwargs)
        if kind == "fsdp":
            if gather:
                raise ValueError(
                    "`gather=True` on an FSDP-sharded model: ds_engine gathers whole models only "
                    "under DeepSpeed ZeRO-3. HINT: leave `gather=None` (FSDP generates with synced "
                    "stepping)."
                )
            return _synced(module, args, generate_kwargs)
        if module in _GATHERED:  # inside `gathered`: already whole, hooks already off
            if gather is False:
                raise ValueError(
                    "`engine.generate(..., gather=False)` inside `engine.gathered(model)`: the model is "
                    "already gathered, synced stepping over partitioned parameters is not available "
                    "there. HINT: drop `gather=` inside the block, or generate outside it."
                )
            generate_kwargs.setdefault("synced_gpus", False)  # no collective per token: stop freely
            return _call_generate(module, args, generate_kwargs)
        offload = _zero3_offload(wrapper)
        if gather and offload is None:
            raise ValueError(
                f"`gather=True` with a bare ZeRO-3 module ({type(module).__name__}): the gathered "
                "path needs the DeepSpeed engine that owns its parameter hooks. HINT: pass the model "
                "`engine.prepare` returned."
            )
        use_gather = gather if gather is not None else offload is not None and _fits_everywhere(module)
        if not use_gather:
            return _synced(module, args, generate_kwargs)
        generate_kwargs.setdefault("synced_gpus", False)  # no collective per token: stop freely
        with _gathered(module, offload):
            return _call_generate(module, args, generate_kwargs)
