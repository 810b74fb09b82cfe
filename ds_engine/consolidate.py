"""Offline consolidation: a DeepSpeed ZeRO checkpoint folder to a `from_pretrained` folder.

`consolidate_checkpoint` needs no process group (`ds-engine consolidate` runs it). It reads
the fp32 master weights with DeepSpeed's own `zero_to_fp32` reader in lazy mode (its files
memory-mapped), one tensor at a time, and writes each tensor into its safetensors shard as
soon as it is read: memory stays about two tensors, not a copy of the model (DeepSpeed's
`zero_to_fp32` builds the whole state dict).

How the model config travels with a checkpoint: `consolidate_checkpoint` looks for an HF
`config.json` in the tag folder, then in the checkpoint folder, then in its parent (the
Engine writes `config.json` next to its checkpoints); `config_from=` overrides the search.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ds_engine._io import listing, publish, tmp_sibling, write_json
from ds_engine._values import parse_size
from ds_engine.safety import confined_tag, deepspeed_safe_globals, restricted_load, restricted_torch_load
from ds_engine.weights import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    Entry,
    check_not_empty,
    one_at_a_time,
    preflight,
    split_shards,
    stream_shards,
    write_weights,
)

__all__ = ["consolidate_checkpoint", "consolidate_hint"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidate_hint(tag_dir: Path) -> str:
    """The start of a HINT that turns a tag folder into weights another run can start from."""
    return (
        f"HINT: turn it into weights with `ds-engine consolidate {tag_dir.parent} OUT --tag {tag_dir.name}`, "
        "load them with `from_pretrained(OUT)` before `prepare` (the optimizer starts fresh), "
    )


def _resolve_tag(checkpoint_dir: Path, tag: str | None) -> tuple[str, Path]:
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(checkpoint_dir)!r} does not exist (or is not a folder). "
            "HINT: pass the folder given to `save_checkpoint` (the one holding `latest`)."
        )
    if tag is None and not os.path.lexists(checkpoint_dir / "latest"):
        raise FileNotFoundError(
            f"{str(checkpoint_dir)!r} has no `latest` file, so no tag to consolidate; found: "
            f"{listing(checkpoint_dir)}. HINT: pass `--tag TAG` (a sub-folder name) or the "
            "folder given to `save_checkpoint`."
        )
    # a plain name of a real sub-folder: neither `latest` nor `--tag` reaches another folder
    tag, tag_dir = confined_tag(
        checkpoint_dir,
        tag,
        option="--tag ",
        tags=lambda: str(
            sorted(p.name for p in checkpoint_dir.iterdir() if p.is_dir() and not p.is_symlink()) or "none"
        ),
    )
    if not list(tag_dir.glob("*model_states.pt")):
        raise ValueError(
            f"{str(tag_dir)!r} is not a DeepSpeed checkpoint (no `*model_states.pt`); found: "
            f"{listing(tag_dir)}. HINT: point at a folder written by `engine.save_checkpoint`."
        )
    return tag, tag_dir


def _find_config(
    checkpoint_dir: Path, tag_dir: Path, config_from: str | os.PathLike[str] | None
) -> Path | None:
    if config_from is not None:
        path = Path(config_from)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"`config_from`={str(config_from)!r} holds no `config.json`. "
                "HINT: pass the folder of the original model (the one given to from_pretrained)."
            )
        return path
    for folder in (tag_dir, checkpoint_dir, checkpoint_dir.parent):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def _load_zero0_module(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full module state dict a ZeRO-0 checkpoint stores in its model-states file."""
    path = sorted(tag_dir.glob("*model_states.pt"))[0]
    state = restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
    module = state.get("module") if isinstance(state, dict) else None
    if not isinstance(module, dict):
        raise ValueError(f"{str(path)!r} holds no `module` state dict. HINT: is this a DeepSpeed checkpoint?")
    return module


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "5GB",
    config_from: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True,
) -> Path:
    """Turn a DeepSpeed ZeRO checkpoint into a `from_pretrained` folder, offline.

    No process group is needed. The fp32 master weights are read with DeepSpeed's own
    `zero_to_fp32` reader in lazy mode and materialised one tensor at a time, each written
    into its safetensors shard while the next is read, so memory stays about two tensors
    (a shard with `safe_serialization=False`). ZeRO-0 checkpoints (no partitions) are read from their
    model-states file. The HF `config.json` (and `generation_config.json`) is taken from
    `config_from`, else from the tag folder, the checkpoint folder, or its parent, in that
    order; without one only the weights are written.

    Args:
        checkpoint_dir: The folder given to `save_checkpoint` (holds `latest` and tag folders).
        output_dir: Target folder; created, or replaced atomically.
        tag: Tag folder to read; default: the one named in `latest`.
        dtype: Output dtype of floating-point tensors: a torch dtype or "fp32", "bf16", "fp16".
        max_shard_size: Largest shard, e.g. "5GB".
        config_from: A folder (or file) holding the model's `config.json`.
        safe_serialization: safetensors (True) or `pytorch_model.bin` (False).

    Returns:
        The output folder.

    Raises:
        FileNotFoundError: Missing checkpoint folder, `latest` file, tag or config.
        UnsafeCheckpointError: A checkpoint file asks the unpickler for something outside the
            allowlist (`ds_engine.safety`); names the file. Nothing of the file's choosing ran.
        ValueError: A folder that is not a DeepSpeed checkpoint, a truncated or corrupt file
            (named), or a bad dtype / shard size.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(
                f"`dtype`={dtype!r} is not allowed; allowed: {sorted(_DTYPES)}. HINT: use 'fp32'."
            )
        dtype = _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"`dtype`={dtype} is not allowed; allowed: torch.float32, bfloat16, float16.")
    max_bytes = parse_size(max_shard_size, name="max_shard_size")
    checkpoint = Path(checkpoint_dir).absolute()
    target = Path(output_dir).absolute()
    tag, tag_dir = _resolve_tag(checkpoint, tag)
    config_path = _find_config(checkpoint, tag_dir, config_from)
    problem = preflight(target, None, None)
    if problem:
        raise ValueError(problem)

    if list(tag_dir.glob("*optim_states.pt")) and _zero_stage(tag_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with restricted_torch_load(deepspeed_safe_globals()):  # it asks for weights_only=False
            lazy: dict[str, Any] = get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint), tag=tag, lazy_mode=True
            )
    else:
        lazy = _load_zero0_module(tag_dir)

    entries = []
    seen: set[int] = set()
    for key, value in lazy.items():
        if id(value) in seen:  # tied weights: DeepSpeed lists the alias after its source
            continue
        seen.add(id(value))
        out_dtype = dtype if value.dtype.is_floating_point else value.dtype
        entries.append(Entry(key, value, 0, True, torch.Size(value.shape), out_dtype))
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    shards = split_shards(entries, max_bytes, weights_name)

    tmp = tmp_sibling(target, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if safe_serialization:
            # a tensor at a time: read (DeepSpeed's lazy fragments, memory-mapped) while the
            # previous one is written, so memory stays about two tensors, never a shard
            failed = stream_shards(shards, tmp, one_at_a_time, write=True)
            if failed is not None:
                raise failed
        for shard in shards if not safe_serialization else []:
            tensors = {}
            for entry in shard.entries:
                tensors[entry.key] = entry.tensor.contiguous().to(dtype=entry.out_dtype)
                check_not_empty(entry, tensors[entry.key])
            write_weights(tensors, tmp / shard.filename, safe_serialization)
            del tensors
        if len(shards) > 1:
            index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
            weight_map = {e.key: s.filename for s in shards for e in s.entries}
            total = sum(e.nbytes for s in shards for e in s.entries)
            write_json(tmp / index_name, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if config_path is not None:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["dtype"] = str(dtype).split(".")[-1]
            config.pop("torch_dtype", None)
            write_json(tmp / "config.json", config)
            generation = config_path.parent / "generation_config.json"
            if generation.is_file():
                shutil.copyfile(generation, tmp / generation.name)
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _zero_stage(tag_dir: Path) -> int:
    """The ZeRO stage the first optimizer-states file records (0 when it records none).

    Raises:
        UnsafeCheckpointError: The file asks for something outside the allowlist.
        ValueError: The file is truncated, corrupt, or holds no optimizer state: never taken
            for ZeRO-0, whose model-states file would then be read as the whole model.
    """
    path = sorted(tag_dir.glob("*optim_states.pt"))[0]
    state = restricted_load(path, safe_globals=deepspeed_safe_globals(), mmap=True)
    optim = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(optim, dict):
        raise ValueError(
            f"checkpoint file {str(path)!r} holds no `optimizer_state_dict` (found "
            f"{sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__}), so its ZeRO "
            "stage is unknown. HINT: point at a folder written by DeepSpeed's `save_checkpoint`, or "
            "remove the stray file."
        )
    return int(optim.get("zero_stage", 0))
