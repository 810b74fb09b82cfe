"""PEFT (LoRA) models: adapter-only gather and save, and the merged full-model export.

A `peft.PeftModel` trained under ZeRO-3 holds every parameter partitioned; saving its adapter
must neither write empty tensors (what `model.state_dict()` gives there) nor gather the whole
base model to keep a few MB. Here:

* `adapter_entries` -- which entries of `model.state_dict()` peft's own `save_pretrained`
  reads, for every adapter: LoRA matrices, `modules_to_save` copies (e.g. a classifier head),
  embeddings where peft saves them. Found by running peft's `get_peft_model_state_dict` on
  shape-only (meta) stand-ins, so peft decides, and nothing is gathered to decide it.
* `adapter_state_dict` -- collective; gathers only those entries (layer by layer); rank 0
  gets them with their full values, under `model.state_dict()`'s keys (what
  `PeftModel.save_pretrained(dir, state_dict=...)` takes), other ranks None.
* `save_adapter` -- collective; rank 0 writes peft's own folder (`adapter_config.json`,
  `adapter_model.safetensors`, README) through `PeftModel.save_pretrained` from the gathered
  entries, into a staging folder first; a new folder is renamed into place, an existing one
  gets only the files written (`ds_engine._folders`: nothing else in it is removed).
  `PeftModel.from_pretrained(base, dir)` reloads it in a process without DeepSpeed.
* `merged_entries` -- the base model's state dict with every LoRA layer's weight merged
  (W + scaling * B @ A, computed inside each layer's gather): the plan that
  `weights.save_pretrained` streams shard by shard, so the merged export never holds more
  than one shard plus one layer on rank 0 either. The folder reloads with plain
  `from_pretrained` of the base model's class.

`peft` is optional: nothing here imports it unless the model is a `PeftModel` (which means it
is imported already).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ds_engine import weights
from ds_engine._folders import ADAPTER_WEIGHTS, Staging, read_regular
from ds_engine._io import broadcast_from_rank0, current_rank, raise_rank0_failure
from ds_engine.weights import Entry, WeightGather

__all__ = [
    "adapter_entries",
    "adapter_state_dict",
    "is_peft_model",
    "merged_entries",
    "merged_state_dict",
    "save_adapter",
    "save_merged",
    "tuner_layers_outside_zero_init",
]


def is_peft_model(module: nn.Module) -> bool:
    """True for a `peft.PeftModel` (peft not imported means no PeftModel exists: False)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


# --------------------------------------------------------------------------- adapter only
def adapter_entries(
    model: nn.Module,
    gather: WeightGather,
    *,
    dtype: torch.dtype | None = None,
    save_embedding_layers: bool | Literal["auto"] = "auto",
) -> list[Entry]:
    """The entries of `model.state_dict()` that peft saves for its adapters (all of them).

    peft's `get_peft_model_state_dict` is run, per adapter, on meta tensors of the full shapes
    standing in for the live ones; the stand-ins it returns name the entries it needs.
    """
    from peft.utils import get_peft_model_state_dict

    everything = weights.plan(model, gather, dtype=dtype, exclude_frozen=False)
    stand_ins = {e.key: torch.empty(e.shape, dtype=e.tensor.dtype, device="meta") for e in everything}
    key_of = {id(t): key for key, t in stand_ins.items()}
    needed: set[str] = set()
    for name in _peft_config(model):
        chosen = get_peft_model_state_dict(
            model, state_dict=stand_ins, adapter_name=name, save_embedding_layers=save_embedding_layers
        )
        for out_key, value in chosen.items():
            if id(value) not in key_of:
                raise RuntimeError(
                    f"peft's adapter state dict for adapter {name!r} holds `{out_key}`, which is not an "
                    "entry of `model.state_dict()` (this PEFT method computes what it saves); ds_engine "
                    "cannot gather it under ZeRO-3. HINT: report the PEFT method and peft version."
                )
            needed.add(key_of[id(value)])
    return [e for e in everything if e.key in needed]


def _peft_config(model: nn.Module) -> dict[str, Any]:
    config: dict[str, Any] = getattr(model, "peft_config", {})
    return config


def adapter_state_dict(
    model: nn.Module,
    *,
    gather: WeightGather | None = None,
    dtype: torch.dtype | None = None,
    save_embedding_layers: bool | Literal["auto"] = "auto",
) -> dict[str, torch.Tensor] | None:
    """The adapter's entries of `model.state_dict()` with full values on rank 0, None elsewhere.

    Collective: every rank calls it. Only the adapter's parameters (and `modules_to_save`
    copies) are gathered, never the base model. The keys are `model.state_dict()`'s (adapter
    name included), so the dict is what `PeftModel.save_pretrained(dir, state_dict=...)` and
    `peft.get_peft_model_state_dict(model, state_dict=...)` take.
    """
    gather = gather or WeightGather()
    entries = adapter_entries(model, gather, dtype=dtype, save_embedding_layers=save_embedding_layers)
    return weights.consolidated_state_dict(model, dtype=dtype, gather=gather, entries=entries)


def save_adapter(
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    gather: WeightGather | None = None,
    tokenizer: Any = None,
    safe_serialization: bool = True,
    dtype: torch.dtype | None = None,
    save_embedding_layers: bool | Literal["auto"] = "auto",
) -> None:
    """Write the adapter folder peft's `save_pretrained` writes (collective; rank 0 writes).

    Only the adapter's entries are gathered. Rank 0 writes into a hidden staging folder
    (peft's `save_pretrained` with the gathered dict, then the tokenizer) and fsyncs it; a new
    `save_directory` is renamed into place whole, an existing one gets the files written, the
    adapter weights last, and keeps everything else (as peft's own save, which also updates an
    existing README.md rather than replacing it). A crash never leaves a folder that loads
    another adapter's weights, nor a half-written file under its final name.
    """
    gather = gather or WeightGather()
    target = Path(save_directory).absolute()
    rank = current_rank()
    problem = broadcast_from_rank0(weights.preflight(target, None, tokenizer) if rank == 0 else None)
    if problem:
        raise ValueError(problem)
    state = adapter_state_dict(model, gather=gather, dtype=dtype, save_embedding_layers=save_embedding_layers)

    def write(tmp: Path) -> None:
        assert state is not None  # rank 0
        _seed_model_card(target, tmp)
        peft_class: Any = type(model)  # the class's save: not the prepared model's rank guard
        peft_class.save_pretrained(
            model,
            str(tmp),
            state_dict=state,
            safe_serialization=safe_serialization,
            save_embedding_layers=save_embedding_layers,
            is_main_process=True,
        )
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    _write_on_rank0(target, write)


#: The model card peft's `save_pretrained` updates in place (it keeps an existing one's text).
_MODEL_CARD = "README.md"
_MODEL_CARD_MAX_BYTES = 16 * 2**20


def _seed_model_card(target: Path, tmp: Path) -> None:
    """Copy `target`'s README.md into `tmp`, so peft updates it as it does saving in place (a
    link or special file there is not read: peft then writes a fresh card, which replaces it)."""
    card = target / _MODEL_CARD
    if not os.path.isfile(card) or os.path.islink(card):
        return
    hint = "replace it by a regular file, or remove it (peft then writes a fresh model card)"
    (tmp / _MODEL_CARD).write_bytes(read_regular(card, _MODEL_CARD_MAX_BYTES, "model cards", hint))


def _write_on_rank0(target: Path, write: Callable[[Path], None]) -> None:
    """Rank 0 runs `write(tmp)` into a staging folder and publishes it into `target`
    (`ds_engine._folders.Staging`); its error is raised on every rank."""
    error: BaseException | None = None
    if current_rank() == 0:
        staging = Staging(target)
        try:
            staging.start()
            write(staging.folder)
            staging.publish(ADAPTER_WEIGHTS)
        except BaseException as exc:  # re-raised below on every rank
            error = exc
            staging.discard()
    raise_rank0_failure(error, target)


# --------------------------------------------------------------------------- merged export
def _check_mergeable(model: nn.Module) -> None:
    from peft.utils import PeftType

    for name, config in _peft_config(model).items():
        peft_type = getattr(config, "peft_type", None)
        if peft_type != PeftType.LORA:
            raise ValueError(
                f"`merged=True` with adapter {name!r} of peft_type={peft_type}: only LoRA adapters can be "
                "merged into the base weights here. HINT: save the adapter alone (`merged=False`)."
            )
        for option in ("use_dora", "lora_bias"):
            if getattr(config, option, False):
                raise ValueError(
                    f"`merged=True` with adapter {name!r} that sets `{option}=True`: ds_engine merges plain "
                    "LoRA only. HINT: save the adapter alone (`merged=False`) and merge it after "
                    "reloading with `PeftModel.from_pretrained(base, dir).merge_and_unload()`."
                )


def _merged_weight(layer: Any, base_weight: torch.Tensor, adapters: list[str]) -> Callable[[], torch.Tensor]:
    def compute() -> torch.Tensor:
        value = base_weight.detach().clone()
        for adapter in adapters:
            value += layer.get_delta_weight(adapter).to(value.dtype)
        return value

    return compute


def merged_entries(
    model: nn.Module, gather: WeightGather, *, dtype: torch.dtype | None = None
) -> list[Entry]:
    """The plan of the base model's state dict with the active LoRA adapters merged in.

    Keys are the base model's own (as after peft's `merge_and_unload`): a LoRA layer's
    `base_layer.weight` becomes `weight` and is computed, inside its gather, as W plus every
    active, not yet merged adapter's delta; LoRA matrices are left out; a `modules_to_save`
    wrapper contributes its active adapter's copy (or the original module when none is active).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    _check_mergeable(model)
    base = _base_model(model)
    modules = dict(base.named_modules())
    out: list[Entry] = []
    for entry in weights.plan(base, gather, dtype=dtype, exclude_frozen=False):
        parts = entry.key.split(".")
        for i in range(len(parts) - 1):
            owner: Any = modules.get(".".join(parts[:i])) if i else base
            rest = parts[i:]
            if isinstance(owner, LoraLayer):
                if rest[0] != "base_layer":
                    break  # LoRA matrices and their scalars: merged, not saved
                key = ".".join(parts[:i] + rest[1:])
                layer: Any = owner
                adapters = [] if layer.disable_adapters else _unmerged_adapters(layer)
                if rest[1:] == ["weight"] and adapters:
                    extra = tuple(p for p in layer.parameters() if p is not entry.tensor)
                    compute = _merged_weight(layer, layer.get_base_layer().weight, adapters)
                    out.append(_renamed(entry, key, compute=compute, extra=extra))
                else:
                    out.append(_renamed(entry, key))
                break
            if isinstance(owner, ModulesToSaveWrapper):
                active = [a for a in owner.active_adapters if a in owner.modules_to_save]
                if owner.disable_adapters or not active:
                    if rest[0] == "original_module":
                        out.append(_renamed(entry, ".".join(parts[:i] + rest[1:])))
                elif rest[:2] == ["modules_to_save", active[0]]:
                    out.append(_renamed(entry, ".".join(parts[:i] + rest[2:])))
                break
        else:
            out.append(entry)
    return out


def _base_model(model: nn.Module) -> nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    assert isinstance(base, nn.Module)
    return base


def _unmerged_adapters(layer: Any) -> list[str]:
    merged = set(getattr(layer, "merged_adapters", []))
    return [
        a
        for a in layer.active_adapters
        if a not in merged and (a in layer.lora_A or a in layer.lora_embedding_A)
    ]


def _renamed(
    entry: Entry,
    key: str,
    *,
    compute: Callable[[], torch.Tensor] | None = None,
    extra: tuple[torch.Tensor, ...] = (),
) -> Entry:
    return Entry(key, entry.tensor, entry.owner, entry.is_param, entry.shape, entry.out_dtype, compute, extra)


def merged_state_dict(
    model: nn.Module, *, gather: WeightGather | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """The merged base model's full state dict on rank 0, None elsewhere (collective)."""
    gather = gather or WeightGather()
    entries = merged_entries(model, gather, dtype=dtype)
    return weights.consolidated_state_dict(_base_model(model), dtype=dtype, gather=gather, entries=entries)


def save_merged(
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    gather: WeightGather | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> None:
    """Write the merged model as the base model's `from_pretrained` folder (collective).

    Streams like `weights.save_pretrained`: shard by shard, each LoRA layer merged inside its
    own gather. `options` as in `weights.save_pretrained` (tokenizer, max_shard_size, ...).
    """
    gather = gather or WeightGather()
    entries = merged_entries(model, gather, dtype=dtype)
    weights.save_pretrained(
        _base_model(model), save_directory, gather=gather, dtype=dtype, entries=entries, **options
    )


# --------------------------------------------------------------------------- ZeRO-3 creation
def _subclasses(cls: type) -> list[type]:
    found = [cls]
    sub: type
    for sub in cls.__subclasses__():
        found.extend(c for c in _subclasses(sub) if c not in found)
    return found


def _settle_new_parameters(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Make the parameters peft just created under `module` plain tensors of zero.Init's dtype.

    New adapter matrices are plain already: they are cast to `dtype`, as zero.Init would have
    created them. A `modules_to_save` copy is a deep copy of partitioned parameters, made by
    peft while they were gathered: whole values, but DeepSpeed's attributes (the same `ds_id`)
    copied too. Each becomes a fresh plain parameter with those values, partitioned in `prepare`
    like the adapter matrices.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if hasattr(param, "ds_id"):
                if getattr(param, "ds_status", None) is None or param.numel() != getattr(
                    param, "ds_numel", -1
                ):
                    continue  # a live partitioned parameter (the base layer): DeepSpeed's
                if any(param is q for q in _live_zero_params(module)):
                    continue
                fresh = nn.Parameter(param.data.detach().clone(), requires_grad=param.requires_grad)
                sub._parameters[name] = fresh
                param = fresh
            if dtype is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def _live_zero_params(module: nn.Module) -> list[torch.Tensor]:
    """The partitioned parameters `module` wraps (a tuner layer's base layer, a wrapper's original)."""
    live: list[torch.Tensor] = []
    for attr in ("base_layer", "original_module"):
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module):
            live.extend(inner.parameters())
    return live


@contextlib.contextmanager
def tuner_layers_outside_zero_init() -> Iterator[None]:
    """While this lasts, peft builds its adapter layers as whole tensors, outside `zero.Init`.

    `get_peft_model` inside ZeRO-3's `zero.Init` would create each LoRA matrix partitioned
    (empty on every rank) and then initialise it in place: `zeros_(lora_B)` and peft's
    `kaiming_uniform_(lora_A)` do nothing to an empty tensor, so lora_B keeps nn.Linear's random
    init and the adapted model no longer starts as the base model. Here each tuner layer's
    `update_layer` (and each `modules_to_save` wrapper's `update`) runs with `zero.Init` paused:
    the adapter is built whole, exactly as on one process (peft itself gathers base weights it
    reads, e.g. for PiSSA or DoRA, while transformers knows the ZeRO-3 config); DeepSpeed
    partitions it in `prepare`. New adapter parameters get zero.Init's dtype (bf16 / fp16 under
    mixed precision, where peft would upcast adapters to fp32: ZeRO-3 keeps all trainable
    parameters in one dtype), and `modules_to_save` copies become plain parameters (see
    `_settle_new_parameters`). A no-op where peft is not installed.
    """
    if importlib.util.find_spec("peft") is None:
        yield
        return
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    depth = [0]

    def paused(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            context = partition_parameters.top_level_context
            if depth[0] == 1:  # nested calls (a subclass calling super()) pause once
                shutdown_init_context()
            try:
                result = method(*args, **kwargs)
                if depth[0] == 1 and isinstance(args[0], nn.Module):
                    _settle_new_parameters(args[0], getattr(context, "dtype", None))
                return result
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    restore_init_context()

        return wrapper

    patched: list[tuple[type, str, Any]] = []
    for root, name in ((BaseTunerLayer, "update_layer"), (AuxiliaryTrainingWrapper, "update")):
        for cls in _subclasses(root):
            original = cls.__dict__.get(name)
            if callable(original):
                patched.append((cls, name, original))
                setattr(cls, name, paused(original))
    cast = BaseTuner.__dict__["_cast_adapter_dtype"]

    def keep_dtype(self: Any, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        cast(self, adapter_name, autocast_adapter_dtype=False)  # no fp32 upcast: one dtype

    patched.append((BaseTuner, "_cast_adapter_dtype", cast))
    BaseTuner._cast_adapter_dtype = keep_dtype  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)
