"""Reading a model's shapes for the memory estimate: a module, a transformers config, or a
model folder's config.json, counted on the meta device with bounded work.

A config is untrusted input: its JSON is read with bounds (a regular file of limited size, no
link out of its folder, no duplicate keys), only transformers' own config and model classes
are built (never custom code, nothing downloaded), and the build runs on the meta device
under registration hooks that stop it past the `Limits` it is given. `ds_engine.memory` owns
those limits (its `MAX_*` constants) and passes them in at each call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_engine._memory_peak import (
    LoraShape,
    TransformerShape,
    lora_params,
    shape_from_config,
    shape_from_count,
)
from ds_engine._values import no_duplicate_keys, words

if TYPE_CHECKING:
    import torch

__all__ = [
    "ASSUMED_HIDDEN_PER_LAYER",
    "ASSUMED_VOCAB",
    "Limits",
    "count_params",
    "estimate_largest_layer",
    "meta_model",
    "model_and_shape",
    "peak_model",
    "resolve_num_params",
    "resolve_trainable_params",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Bounds on the work of counting a model from its config (`ds_engine.memory.MAX_*`)."""

    config_bytes: int
    """Largest config JSON read (bytes)."""
    layers: int
    """Largest layer or expert count a config may ask for."""
    modules: int
    """Most modules built on the meta device."""
    params: int
    """Most parameters built."""
    real_bytes: int
    """Most bytes a model's constructor may allocate off the meta device."""


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters (shared ones once) and the largest module's direct parameters.

    Works on meta-device modules: nothing is read from the tensors but their shapes.
    """
    unique = {id(p): p.numel() for p in model.parameters()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return sum(unique.values()), largest


#: Config keys that multiply the modules built (layers, experts), checked before anything is built.
_REPEAT_KEYS = words(
    "num_hidden_layers n_layer n_layers num_layers encoder_layers decoder_layers num_encoder_layers "
    "num_decoder_layers num_local_experts num_experts n_routed_experts moe_num_experts "
    "num_attention_heads n_head num_key_value_heads"
)
_TOO_BIG_HINT = "HINT: pass the parameter count instead (`--params` / an int), e.g. 7B"


class _BudgetExceeded(Exception):
    """Building the model went past one of its `Limits` (raised from a registration hook)."""


#: Shapes `estimate_largest_layer` assumes: a 128k-token vocabulary (Llama 3's 128,256; Gemma's
#: 256k is larger, GPT-2's 50k and Llama 2's 32k smaller), P ~ 12 * layers * hidden^2 and
#: hidden ~ 128 * layers (Llama 2 7B/13B: 4096/32, 5120/40).
ASSUMED_VOCAB = 128_000
ASSUMED_HIDDEN_PER_LAYER = 128


def estimate_largest_layer(num_params: int) -> int:
    """Parameters of the largest single module of a usual decoder transformer with `num_params`.

    Used when only a count is known. The hidden size h follows from P = 12 * L * h^2 with
    h = 128 * L, so h = (128 * P / 12) ** (1/3); the largest module is then the larger of the
    token embedding (`ASSUMED_VOCAB` x h) and an MLP matrix (4h x h), at most a third of the
    model (small models' embeddings are a large share of them, never all of it). Examples:
    7B -> h ~ 4200, 539M (the real Llama 2 7B: 131M, Llama 3 8B: 525M); 124M -> 41M (GPT-2: 39M).
    """
    hidden = (ASSUMED_HIDDEN_PER_LAYER * num_params / 12) ** (1 / 3)
    largest = max(ASSUMED_VOCAB * hidden, 4 * hidden * hidden)
    return max(1, min(round(largest), num_params // 3 or num_params))


# --------------------------------------------------------------------------- resolving
def resolve_num_params(
    model_or_num_params: Any, largest_layer_params: int | None, limits: Limits
) -> tuple[int, int]:
    """Turn an int, `nn.Module`, HF config or model path into (num_params, largest_layer_params).

    Args:
        model_or_num_params: a parameter count, an `nn.Module`, a transformers
            `PretrainedConfig`, or a path to an HF model folder / config JSON file.
        largest_layer_params: overrides the derived largest layer. With an int count and no
            value given, it is `estimate_largest_layer(count)` (usual transformer shapes).

    Raises:
        ValueError: a count that is not a positive integer, or an unsupported type.
        FileNotFoundError: a path that does not exist.
    """
    if isinstance(model_or_num_params, bool):
        raise ValueError(
            f"`model_or_num_params` must be a positive int, an nn.Module, a PretrainedConfig or a path; "
            f"got {model_or_num_params!r}. HINT: pass the parameter count, e.g. 1_300_000_000"
        )
    if isinstance(model_or_num_params, int):
        num_params = model_or_num_params
        largest = estimate_largest_layer(num_params) if num_params > 0 else num_params
    elif isinstance(model_or_num_params, (str, os.PathLike)):
        path = Path(model_or_num_params)
        if not path.exists():
            raise FileNotFoundError(
                f"`model` path {str(path)!r} does not exist. HINT: pass a local Hugging Face model folder "
                "or config JSON file (nothing is downloaded), or a parameter count"
            )
        num_params, largest = count_params(meta_model(path, limits))
    else:
        import torch

        if isinstance(model_or_num_params, torch.nn.Module):
            num_params, largest = count_params(model_or_num_params)
        elif hasattr(model_or_num_params, "to_dict") and hasattr(model_or_num_params, "model_type"):
            num_params, largest = count_params(meta_model(model_or_num_params, limits))
        else:
            raise ValueError(
                f"`model_or_num_params` has unsupported type {type(model_or_num_params).__name__}; allowed: "
                "int, torch.nn.Module, transformers.PretrainedConfig, or a path to a model folder. "
                "HINT: pass the parameter count"
            )
    if not 0 < num_params <= limits.params:
        raise ValueError(
            f"`model_or_num_params` must be a positive parameter count of at most {limits.params:.0e}, "
            f"got {num_params}. HINT: pass the number of parameters, e.g. 1_300_000_000"
        )
    if largest_layer_params is not None:
        if isinstance(largest_layer_params, bool) or not isinstance(largest_layer_params, int):
            raise ValueError(
                f"`largest_layer_params` must be an int, got {largest_layer_params!r}. "
                "HINT: pass the parameter count of the largest layer, or leave it out"
            )
        if not 0 < largest_layer_params <= num_params:
            raise ValueError(
                f"`largest_layer_params`={largest_layer_params} must be in 1..{num_params} (the total). "
                "HINT: pass the largest single layer's parameter count, or leave it out"
            )
        largest = largest_layer_params
    return num_params, largest


def resolve_trainable_params(model_or_num_params: Any, num_params: int, trainable_params: int | None) -> int:
    """`trainable_params` checked, or counted from an `nn.Module` (its `requires_grad`
    parameters, shared ones once), or all `num_params` for a count, config or path."""
    if trainable_params is None:
        import torch

        if isinstance(model_or_num_params, torch.nn.Module):
            unique = {id(p): p.numel() for p in model_or_num_params.parameters() if p.requires_grad}
            return sum(unique.values())
        return num_params
    if isinstance(trainable_params, bool) or not isinstance(trainable_params, int):
        raise ValueError(
            f"`trainable_params` must be an int, got {trainable_params!r}. HINT: pass the number of "
            "parameters with requires_grad (e.g. a LoRA adapter's), or leave it out"
        )
    if not 0 <= trainable_params <= num_params:
        raise ValueError(
            f"`trainable_params`={trainable_params} must be in 0..{num_params} (the total). HINT: pass "
            "the number of parameters with requires_grad, or leave it out"
        )
    return trainable_params


def model_and_shape(model: Any, limits: Limits) -> tuple[Any, TransformerShape | None, bool]:
    """(what to count, its transformer shape or None, whether it is a causal LM)."""
    source: Any = model
    if isinstance(model, (str, os.PathLike)) and not isinstance(model, bool):
        path = Path(model)
        if not path.exists():
            resolve_num_params(model, None, limits)  # raises the usual FileNotFoundError
        source = meta_model(path, limits)
    config = getattr(source, "config", None)
    if config is None and hasattr(source, "model_type") and hasattr(source, "to_dict"):
        config = source
    shape = shape_from_config(config) if config is not None else None
    names = [type(source).__name__, *(getattr(config, "architectures", None) or [])]
    base = getattr(getattr(source, "base_model", None), "model", None)
    names.append(type(base).__name__)
    causal = any(str(n).endswith(("ForCausalLM", "LMHeadModel")) for n in names)
    return source, shape, causal or config is None


def peak_model(
    model: Any, lora: LoraShape | None, largest_layer_params: int | None, limits: Limits
) -> tuple[int, int, int, int, TransformerShape, LoraShape | None, bool]:
    """What `estimate_peak` needs of a model: (parameters, largest layer, trainable, adapter
    parameters, transformer shape, LoRA shape, causal LM). A `lora` given adds adapters to a
    config or count (they are then the trainable parameters); a peft model is read as it is."""
    source, shape, causal = model_and_shape(model, limits)
    num_params, largest = resolve_num_params(source, largest_layer_params, limits)
    if shape is None:
        shape = shape_from_count(num_params, hidden_per_layer=ASSUMED_HIDDEN_PER_LAYER, vocab=ASSUMED_VOCAB)
    if lora is None:
        peft = getattr(model, "peft_config", None)
        if isinstance(peft, dict) and peft:
            first = next(iter(peft.values()))
            targets = getattr(first, "target_modules", None) or ()
            lora = LoraShape(rank=int(getattr(first, "r", 8)), targets=tuple(sorted(targets)))
        trainable = resolve_trainable_params(source, num_params, None)
        return num_params, largest, trainable, trainable if lora else 0, shape, lora, causal
    if not isinstance(lora, LoraShape) or isinstance(lora.rank, bool) or lora.rank < 1:
        raise ValueError(
            f"`lora` must be a LoraShape with a rank >= 1, got {lora!r}. HINT: LoraShape(rank=16)"
        )
    adapter = lora_params(shape, lora)
    return num_params + adapter, largest, adapter, adapter, shape, lora, causal


def _check_repeats(data: Any, where: str, max_layers: int, depth: int = 0) -> None:
    """Every layer/expert count in `data` (sub-configs included) is an int in 0..`max_layers`."""
    if depth > 8 or not isinstance(data, dict):
        return
    for key, value in data.items():
        if isinstance(value, dict):
            _check_repeats(value, where, max_layers, depth + 1)
        elif key in _REPEAT_KEYS and value is not None and not _is_int_in(value, 0, max_layers):
            raise ValueError(
                f"{where}: `{key}` = {value!r} is not a layer/expert count this estimate builds; "
                f"allowed: an int from 0 to {max_layers} (ds_engine.memory.MAX_LAYERS). {_TOO_BIG_HINT}"
            )


def _is_int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _model_classes(model_type: str) -> set[str]:
    """The class names transformers' auto-model mappings list for `model_type` (no import)."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            value = mapping.get(model_type)
            names.update([value] if isinstance(value, str) else value if isinstance(value, tuple) else [])
    return names


def _model_class(config: Any, where: str) -> Any:
    """The model class `config.architectures` names: only a transformers model class for this config.

    The name must be one transformers' auto-model mappings list for the config's `model_type`
    and a subclass of `PreTrainedModel` whose `config_class` the config is; anything else
    (another top-level transformers name, a custom-code class) is refused, never called.
    None when `architectures` is empty (then the base model of the type is counted).
    """
    import transformers

    names = getattr(config, "architectures", None) or []
    if not isinstance(names, (list, tuple)):
        raise ValueError(
            f"{where}: `architectures` = {names!r} is not a list of class names. "
            'HINT: write e.g. "architectures": ["GPT2LMHeadModel"], or remove the key'
        )
    model_type = str(getattr(config, "model_type", ""))
    known = _model_classes(model_type)
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) and name in known else None
        config_class = getattr(cls, "config_class", None)
        if (
            isinstance(cls, type)
            and issubclass(cls, transformers.PreTrainedModel)
            and isinstance(config_class, type)
            and isinstance(config, config_class)
        ):
            return cls
        allowed = ", ".join(sorted(known)[:8]) + (", ..." if len(known) > 8 else "")
        raise ValueError(
            f"{where}: `architectures` names {name!r}, which is not a transformers model class for "
            f"model_type {model_type!r} (allowed: {allowed or 'none known'}); nothing else is built. "
            "HINT: fix `architectures`, or remove it to count the base model"
        )
    return None


def meta_model(source: Path | Any, limits: Limits) -> torch.nn.Module:
    """Build the model a config (or a model folder / config JSON at a `Path`) describes, on the meta device.

    A path is read by `_load_config`. Only transformers model classes are built (see
    `_model_class`), under `torch.device("meta")` (no memory, no download), and registration
    hooks stop the build past `limits`: modules, parameters, bytes allocated off the meta device.

    Raises:
        ValueError: the config is refused, or building it fails or goes past a limit (the
            message names the config and what went wrong).
    """
    config, where = _load_config(source, limits) if isinstance(source, Path) else (source, "the config")
    return _model_from_config(config, where, limits)


def _model_from_config(config: Any, where: str, limits: Limits) -> torch.nn.Module:
    """`meta_model` for a config object; `where` names it in errors."""
    import torch
    import transformers
    from torch.nn.modules import module as nn_module

    to_dict = getattr(config, "to_dict", None)
    _check_repeats(to_dict() if callable(to_dict) else {}, where, limits.layers)
    model_cls = _model_class(config, where)
    counts = {"modules": 0, "params": 0, "real": 0}

    def on_module(module: Any, name: str, sub: Any) -> None:
        counts["modules"] += 1
        if counts["modules"] > limits.modules:
            raise _BudgetExceeded(f"more than {limits.modules} modules (ds_engine.memory.MAX_MODULES)")

    def on_tensor(module: Any, name: str, tensor: Any) -> None:
        if tensor is None:
            return
        counts["params"] += tensor.numel()
        if tensor.device.type != "meta":
            counts["real"] += tensor.numel() * tensor.element_size()
        if counts["params"] > limits.params:
            raise _BudgetExceeded(f"more than {limits.params:.0e} parameters")
        if counts["real"] > limits.real_bytes:
            raise _BudgetExceeded(
                f"more than {limits.real_bytes} bytes allocated off the meta device "
                "(ds_engine.memory.MAX_REAL_BYTES)"
            )

    hooks = [
        nn_module.register_module_module_registration_hook(on_module),
        nn_module.register_module_parameter_registration_hook(on_tensor),
        nn_module.register_module_buffer_registration_hook(on_tensor),
    ]
    label = model_cls.__name__ if model_cls is not None else "the base model"
    try:
        with torch.device("meta"):
            if model_cls is not None:
                return model_cls(config)
            return transformers.AutoModel.from_config(config)
    except _BudgetExceeded as exc:
        raise ValueError(
            f"{where}: building {label} to count it went past a limit: {exc}. {_TOO_BIG_HINT}"
        ) from None
    except Exception as exc:  # the config is user input: whatever its values break is reported as such
        raise ValueError(
            f"{where}: {label} cannot be built from this config ({type(exc).__name__}: {exc}). "
            "HINT: check the config's values, or pass the parameter count instead (`--params`)"
        ) from None
    finally:
        for hook in hooks:
            hook.remove()


def _read_config_file(path: Path, max_bytes: int) -> tuple[dict[str, Any], str]:
    """The JSON object in a model folder's config.json (or a config JSON file), read with bounds.

    Only a regular file of at most `max_bytes` is read. A symlink is followed only to a
    file inside the same folder, or (the Hugging Face cache layout) from `snapshots/<rev>/` into
    the repository's `blobs/`. Duplicate keys, a non-object top level and nesting deeper than
    Python's recursion limit are refused.
    """
    import json
    import stat

    file = path / "config.json" if path.is_dir() else path
    where = f"`model` config {str(file)!r}"
    if path.is_dir() and not os.path.lexists(file):
        raise FileNotFoundError(
            f"`model` folder {str(path)!r} has no config.json; expected a Hugging Face model folder or a "
            "config JSON file. HINT: pass the folder that holds config.json (or the file itself)"
        )
    if file.is_symlink():
        folder, target = file.parent.resolve(), file.resolve()
        inside = folder in target.parents or (
            folder.parent.name == "snapshots" and folder.parent.parent / "blobs" in target.parents
        )
        if not inside:
            raise ValueError(
                f"{where} is a symbolic link to {str(target)!r}, outside its folder; it is not followed. "
                "HINT: copy the real config.json into the folder"
            )
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(
            f"{where} cannot be opened ({exc.strerror}). HINT: pass a readable config.json"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError(
            f"{where} is not a regular file. HINT: pass a model folder whose config.json is a file"
        )
    with os.fdopen(fd, "rb") as f:
        if info.st_size > max_bytes:
            raise ValueError(
                f"{where} is {info.st_size} bytes; allowed: at most {max_bytes} "
                f"(ds_engine.memory.MAX_CONFIG_BYTES). {_TOO_BIG_HINT}"
            )
        raw = f.read(max_bytes + 1)
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys(where))
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where} is not UTF-8 text ({exc.reason}). HINT: pass the model's config.json"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}. "
            "HINT: fix the JSON there, or pass the parameter count instead (`--params`)"
        ) from None
    except RecursionError:
        raise ValueError(
            f"{where} nests too deeply to read. HINT: pass the model's real config.json"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{where} holds a JSON {type(data).__name__}, not an object. HINT: a model config is a JSON "
            'object such as {"model_type": "gpt2", ...}'
        )
    return data, where


def _load_config(path: Path, limits: Limits) -> tuple[Any, str]:
    """The transformers config object a model folder / config file describes, and its name for errors.

    The class comes from transformers' own `CONFIG_MAPPING` by `model_type`; no custom code
    (`auto_map`) is run and nothing is downloaded.
    """
    from transformers import CONFIG_MAPPING

    data, where = _read_config_file(path, limits.config_bytes)
    _check_repeats(data, where, limits.layers)
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{where}: `model_type` = {model_type!r} is not a model type this transformers knows. "
            "HINT: pass a transformers model's config.json, or the parameter count instead (`--params`)"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(data), where
    except Exception as exc:  # untrusted values: report what the config class refused
        raise ValueError(
            f"{where}: transformers' {model_type!r} config refuses it ({type(exc).__name__}: {exc}). "
            "HINT: check the config's values, or pass the parameter count instead (`--params`)"
        ) from None
