"""What a save names: the weight files, tied duplicates dropped, transformers' renames, the shards.

* `split_shards` / `split_given` -- entries into weights files as transformers names and
  fills them (`model-0000i-of-0000N.safetensors` past `max_shard_size`).
* `drop_tied` / `saved_names` -- the keys transformers' own `save_pretrained` writes: tied
  duplicates dropped, the conversions applied on load reverted (renames stream; fused
  weights need the whole dict).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ds_engine._gather import Entry

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "Shard",
    "any_model",
    "drop_aliases",
    "drop_tied",
    "is_hf_model",
    "saved_names",
    "split_given",
    "split_shards",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"


# --------------------------------------------------------------------------- tied weights
def any_model(module: nn.Module) -> Any:
    """`module` typed as Any, for transformers helpers annotated with `PreTrainedModel`."""
    return module


def is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "save_pretrained") and hasattr(config, "to_dict")


def drop_tied(module: nn.Module, entries: list[Entry]) -> list[Entry]:
    """Drop tied duplicates the way transformers' own `save_pretrained` does.

    For HF models transformers' `remove_tied_weights_from_state_dict` decides which alias to
    keep (it needs the `_tied_weights_keys` patterns); it is fed one small proxy tensor per
    live tensor, so aliases share storage exactly as the real weights do. Plain modules keep
    the first key of each alias group (safetensors cannot store aliases).
    """
    if not is_hf_model(module):
        seen: set[int] = set()
        kept = []
        for entry in entries:
            if id(entry.tensor) not in seen:
                seen.add(id(entry.tensor))
                kept.append(entry)
        return kept
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    proxies: dict[int, torch.Tensor] = {}
    proxy_sd = {e.key: proxies.setdefault(id(e.tensor), torch.empty(1)) for e in entries}
    for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
        proxy_sd.pop(key, None)
    kept_keys = set(remove_tied_weights_from_state_dict(proxy_sd, any_model(module)))
    return [e for e in entries if e.key in kept_keys]


def _save_conversions(module: nn.Module) -> list[Any]:
    """The weight conversions transformers reverts on save (renames, fused experts), or []."""
    if not is_hf_model(module):
        return []
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return []
        conversions = get_model_conversion_mapping(any_model(module), add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    return list(conversions or ())


def saved_names(module: nn.Module, entries: list[Entry]) -> list[Entry] | None:
    """`entries` under the names and in the order transformers' `save_pretrained` writes them.

    transformers reverts the conversions it applied on load (`revert_weight_conversion`): a
    legacy checkpoint's `LayerNorm.gamma` goes back to `gamma`, a removed prefix comes back.
    When every conversion is a renaming, a key's saved name does not depend on any tensor, so
    transformers' own function is run on a dict of empty stand-ins and each entry takes the
    name its stand-in comes back under: the weights can then stream shard by shard. Returns None
    when a conversion computes tensors from several (a `WeightConverter`, e.g. fused MoE
    experts) or the renaming is not one-to-one: those need the whole dict at once.
    """
    conversions = _save_conversions(module)
    if not conversions:
        return entries
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    if any(isinstance(c, WeightConverter) for c in conversions):
        return None
    stand_ins = [torch.empty(0) for _ in entries]
    owner = {id(t): e for t, e in zip(stand_ins, entries, strict=True)}
    reverted = revert_weight_conversion(
        any_model(module), {e.key: t for e, t in zip(entries, stand_ins, strict=True)}
    )
    renamed = [(key, owner.get(id(value))) for key, value in reverted.items()]
    named = [(key, e) for key, e in renamed if e is not None]
    if not len(named) == len(renamed) == len(entries) == len({id(e) for _, e in named}):
        return None  # a stand-in came back changed, under two keys, or two keys became one
    return [replace(e, key=key) for key, e in named]


# --------------------------------------------------------------------------- sharding
@dataclass
class Shard:
    """One weights file of a save: its name and the entries it holds, in order."""

    filename: str
    entries: list[Entry]


def split_shards(entries: list[Entry], max_bytes: int, weights_name: str) -> list[Shard]:
    """Split as huggingface_hub's `split_torch_state_dict_into_shards`: in order, a new shard when
    the next tensor would overflow the open one; a tensor larger than `max_bytes` gets a shard of
    its own where it comes (the open shard stays open), so the files match transformers'."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        nbytes = entry.nbytes
        if nbytes > max_bytes:
            shards.append([entry])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current = []
            size = 0
        current.append(entry)
        size += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return [Shard(weights_name, shards[0])]
    stem, ext = weights_name.rsplit(".", 1)
    total = len(shards)
    return [Shard(f"{stem}-{i + 1:05d}-of-{total:05d}.{ext}", s) for i, s in enumerate(shards)]


def split_given(entries: list[Entry], max_bytes: int, weights_name: str) -> list[Shard]:
    """Shards of a dict of real tensors. Written as they are, huggingface_hub's own split decides
    (it sizes a tensor by its storage and keeps views of one storage in one shard, which is what
    transformers writes for e.g. experts split from a fused tensor); cast, `split_shards`."""
    if not entries or any(e.out_dtype != e.tensor.dtype for e in entries):
        return split_shards(entries, max_bytes, weights_name)
    from huggingface_hub import split_torch_state_dict_into_shards

    stem, ext = weights_name.rsplit(".", 1)
    tensors = {e.key: e.tensor for e in entries}
    pattern = f"{stem}{{suffix}}.{ext}"
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=pattern, max_shard_size=max_bytes)
    by_key = {e.key: e for e in entries}
    return [Shard(name, [by_key[k] for k in keys]) for name, keys in split.filename_to_tensors.items()]


def drop_aliases(entries: list[Entry]) -> list[Entry]:
    """Keep the first key of each group of tensors sharing storage (safetensors refuses aliases)."""
    seen: set[tuple[Any, ...]] = set()
    kept = []
    for entry in entries:
        t = entry.tensor
        ident = (
            (t.device, t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (None, id(t), 0)
        )
        if ident not in seen:
            seen.add(ident)
            kept.append(entry)
    return kept
