"""Offline consolidation: a DeepSpeed ZeRO checkpoint folder to a `from_pretrained` folder.

`consolidate_checkpoint` needs no process group (`ds-engine consolidate` runs it). It reads
the fp32 master weights with DeepSpeed's own `zero_to_fp32` reader in lazy mode (its files
memory-mapped), one tensor at a time, and writes each tensor into its safetensors shard as
soon as it is read: memory stays about two tensors, not a copy of the model (DeepSpeed's
`zero_to_fp32` builds the whole state dict).

How the model config travels with a checkpoint: `consolidate_checkpoint` looks for an HF
`config.json` in the tag folder, then in the checkpoint folder, then in its parent (the
Engine writes `config.json` next to its checkpoints); `config_from=` overrides the search.
The model's config files are read only as regular files (a symbolic link or FIFO is refused,
naming it), so the output never holds a file from elsewhere; the output folder must lie apart
from the checkpoint folder it is made from.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch

from ds_engine._folders import MODEL_WEIGHTS, Staging, read_regular
from ds_engine._io import listing, write_json
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


def _check_apart(checkpoint: Path, target: Path) -> None:
    """Refuse an output folder that is, contains or lies inside the checkpoint folder (links
    resolved): writing there would replace or mix with the files being read."""
    real_checkpoint, real_target = checkpoint.resolve(), target.resolve()
    if real_target == real_checkpoint:
        relation = "is"
    elif real_checkpoint in real_target.parents:
        relation = "lies inside"
    elif real_target in real_checkpoint.parents:
        relation = "contains"
    else:
        return
    resolved = ""
    if (real_checkpoint, real_target) != (checkpoint, target):
        resolved = f" ({str(real_target)!r} and {str(real_checkpoint)!r} once links are resolved)"
    apart = checkpoint.parent / f"{checkpoint.name}-hf"
    raise ValueError(
        f"output folder {str(target)!r} {relation} the checkpoint folder {str(checkpoint)!r} being "
        f"consolidated{resolved}; the output must lie apart from it, or writing it could replace "
        f"files the checkpoint needs. HINT: write to another folder, e.g. {str(apart)!r}."
    )


#: The most bytes a model's `config.json` or `generation_config.json` may hold.
_CONFIG_MAX_BYTES = 16 * 2**20
_CONFIG_HINT = (
    "if you trust the file, replace it by a regular copy (`cp -L`), or pass `--config-from` a "
    "folder whose config files are regular files"
)


def _is_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _find_config(
    checkpoint_dir: Path, tag_dir: Path, config_from: str | os.PathLike[str] | None
) -> Path | None:
    """The `config.json` to use; whatever is found under that name (a link, a FIFO) is taken,
    so that `_read_config` refuses it by name instead of the search passing over it."""
    if config_from is not None:
        path = Path(config_from)
        path = path / "config.json" if path.is_dir() else path
        if not os.path.lexists(path) or _is_folder(path):
            raise FileNotFoundError(
                f"`config_from`={str(config_from)!r} holds no `config.json`. "
                "HINT: pass the folder of the original model (the one given to from_pretrained)."
            )
        return path
    for folder in (tag_dir, checkpoint_dir, checkpoint_dir.parent):
        path = folder / "config.json"
        if os.path.lexists(path) and not _is_folder(path):
            return path
    return None


def _read_config(path: Path) -> tuple[dict[str, Any], bytes | None]:
    """`config.json` parsed, and the bytes of the `generation_config.json` beside it (None when
    there is none): regular files only, never read through a link or from a FIFO."""
    data = read_regular(path, _CONFIG_MAX_BYTES, "a model's config files", _CONFIG_HINT)
    try:
        config = json.loads(data.decode("utf-8"))
    except RecursionError:
        reason = "it nests deeper than can be parsed"
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        reason = str(exc).split(": line")[0] if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
    else:
        reason = "" if isinstance(config, dict) else f"a JSON {type(config).__name__}, not an object"
    if reason:
        raise ValueError(
            f"model config {str(path)!r} is not a config.json ({reason}); allowed: a JSON object of "
            "settings, as `config.save_pretrained` writes it. HINT: pass `--config-from` the folder "
            "of the original model (the one given to from_pretrained)."
        )
    generation = path.parent / "generation_config.json"
    if not os.path.lexists(generation) or _is_folder(generation):
        return config, None
    return config, read_regular(generation, _CONFIG_MAX_BYTES, "a model's config files", _CONFIG_HINT)


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
        output_dir: Target folder, apart from `checkpoint_dir` (neither inside it nor holding
            it); created, or updated: only the files written (and stale weight files of this
            naming) are replaced, everything else in it is kept, as `weights.save_pretrained`.
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
            Also a config file that is a symbolic link, FIFO or device (named, never read).
        ValueError: A folder that is not a DeepSpeed checkpoint, a truncated or corrupt file
            (named), a config.json that is not a JSON object, an output folder that is,
            contains or lies inside the checkpoint folder, or a bad dtype / shard size.
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
    _check_apart(checkpoint, target)
    tag, tag_dir = _resolve_tag(checkpoint, tag)
    config_path = _find_config(checkpoint, tag_dir, config_from)
    problem = preflight(target, None, None)
    if problem:
        raise ValueError(problem)
    config, generation = _read_config(config_path) if config_path is not None else (None, None)

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

    staging = Staging(target)
    tmp = staging.folder
    staging.start()
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
        if config is not None:
            config["dtype"] = str(dtype).split(".")[-1]
            config.pop("torch_dtype", None)
            write_json(tmp / "config.json", config)
        if generation is not None:  # the bytes read above: never a copy through a link
            (tmp / "generation_config.json").write_bytes(generation)
        staging.publish(MODEL_WEIGHTS)
    except BaseException:
        staging.discard()
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
