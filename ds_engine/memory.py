"""ZeRO-aware memory estimate for model states, and the cheapest stage/offload that fits.

`estimate_memory` returns numbers (bytes per accelerator and per host) for the *model states*
of data-parallel training: parameters, gradients and optimizer states (fp32 master weights,
fp32 gradients handed to the optimizer, and the optimizer's own state). Activations, the
CUDA context, communication buckets and fragmentation are not included; keep headroom for
them (`recommend_config` does).

Formulas
========
P = number of parameters, L = parameters of the largest single module (its direct
parameters: the layer ZeRO-3 gathers at once; from a bare count it is estimated by
`estimate_largest_layer`), N = num_gpus_per_node * num_nodes,
G = num_gpus_per_node, K = optimizer state bytes per parameter (Adam/AdamW 8: two fp32
moments; Lion, Adagrad and SGD with momentum 4; plain SGD 0). T = trainable parameters
(`requires_grad`): all of P unless given, or read from a model with frozen parameters (LoRA /
PEFT adapters): gradients, fp32 masters, fp32 gradients and optimizer state exist for these
only, so every "grad" and optimizer term below is times T, not P.

Bytes per parameter, by precision:

============  ======  =====  ===========  ==================
precision     weight  grad   fp32 master  fp32 grad for step
============  ======  =====  ===========  ==================
bf16 / fp16   2       2      4            4
fp32          4       4      4 (ZeRO>=1)  4 (ZeRO>=1)
============  ======  =====  ===========  ==================

Per accelerator, no offload:

* ZeRO-0: weight*P + grad*P + (master + fp32 grad + K)*P   (fp32 ZeRO-0: 4P + 4P + K*P)
* ZeRO-1: weight*P + grad*P + (master + fp32 grad + K)*P/N
* ZeRO-2: weight*P + grad*P/N + (master + fp32 grad + K)*P/N
* ZeRO-3: (weight + grad + master + fp32 grad + K)*P/N, plus (weight + grad)*L working memory
  for the gathered largest layer and its gradient.

Offload (ZeRO-1/2/3, `offload_optimizer="cpu"`): master weights, fp32 gradients and optimizer
state move to host memory; gradients leave the accelerator as they are reduced, so the
accelerator keeps the weights only (plus the ZeRO-3 working layer). `offload_params="cpu"`
(ZeRO-3 only) also moves the weight partitions (weight*P/N) to the host. Host memory is per
node: the sum over its G ranks, e.g. `(4 + 4 + K)*P/N * G` for the offloaded optimizer.

Host memory also has a loading peak, before optimizer states exist: every rank materialises
the full model in fp32 (4*P*G per node), except under ZeRO-3 with `zero_init` (zero.Init),
where only the largest layer is whole at a time (4*L*G). The host total is the larger of
the loading peak and the offloaded model states.

Where this differs from DeepSpeed's estimators, and why
-------------------------------------------------------
The base is DeepSpeed's `estimate_zero2_model_states_mem_needs` (accelerator:
2P + 18P/N; offload: 2P on the accelerator, 16P on the host) and
`estimate_zero3_model_states_mem_needs` (4L + 18P/N; offload optimizer: 4L + 2P/N on the
accelerator, 16P/nodes on the host; offload both: 4L, 18P/nodes), which this module
reproduces for bf16/fp16 Adam except:

* ZeRO-3 without optimizer offload is 20P/N here, not 18P/N: DeepSpeed 0.19's stage-3
  optimizer holds the 16-bit gradient partition *and* the fp32 gradient partition at the
  optimizer step (measured: `tests/distributed/test_memory_real.py`).
* DeepSpeed only covers 16-bit mixed precision with Adam and stages 2/3. This adds ZeRO-0
  and ZeRO-1, fp32 training, and other optimizers. fp32 under ZeRO-1/2/3 still counts a
  separate fp32 master partition and fp32 gradient partition: DeepSpeed's ZeRO optimizers
  clone the partition even when the model is already fp32 (measured); plain fp32 ZeRO-0
  uses the torch optimizer directly and has no copy.
* DeepSpeed multiplies host memory by `additional_buffer_factor=1.5`; here the numbers are
  the model states themselves and the margin is explicit (`recommend_config(headroom=...)`).
* DeepSpeed's ZeRO-2 host figure ignores the number of nodes; here host memory is per node.
* The estimate is an upper bound at the optimizer step: it counts the 16-bit gradient
  partition and the fp32 gradient copy made from it as alive together, as DeepSpeed does
  (they coexist while the copy is made; just before and after it, only one of them does).
* ZeRO-1 counts full 16-bit gradients on every rank: with gradient accumulation ZeRO-1
  keeps them until the boundary. With gradient_accumulation_steps=1 DeepSpeed reduces them
  during backward and holds only a 2P/N partition, so the ZeRO-1 figure is then high by
  2P - 2P/N.

Measured against DeepSpeed 0.19.8 (2 CPU ranks, bf16, AdamW, 51M-parameter GPT-2, tensor
storages reachable from the engine; `scripts/bench_memory.py`), bytes per parameter per
rank, measured / estimated: ZeRO-0 20.0 / 20 (1.00), ZeRO-2 10.0 / 11 (0.91, the coexisting
gradient copies above), ZeRO-3 10.08 / 10 (1.01, the extra is communication buffers).

NVMe offload is not modelled (what stays in host memory then depends on the swap buffers).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, get_args

from ds_engine._values import parse_size, words

if TYPE_CHECKING:
    import torch

Precision = Literal["bf16", "fp16", "fp32"]
OffloadDevice = Literal["none", "cpu"]
OptimizerName = Literal["adamw", "adam", "lion", "adagrad", "sgd_momentum", "sgd"]

#: fp32 optimizer state bytes per parameter.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,
    "adam": 8,
    "lion": 4,
    "adagrad": 4,
    "sgd_momentum": 4,
    "sgd": 0,
}

#: Every stage/offload combination worth running, cheapest (least offload, lowest stage) first.
CHOICES: tuple[tuple[int, OffloadDevice, OffloadDevice], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (1, "cpu", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
)

#: What "cheapest" means in `recommend_config` (said in its reason).
CHEAPEST = (
    "Cheapest means the fastest step expected, not the least memory: least offload first (offload "
    "moves optimizer work to the CPU and slows every step), then the lowest ZeRO stage (each stage up "
    "adds communication)."
)

ModelLike = Union[int, "torch.nn.Module", Any, str, os.PathLike]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes of model states on one device kind (one accelerator, or one node's host memory)."""

    params: int
    """Model weights (16-bit under mixed precision) held here."""
    gradients: int
    """Gradients held here (16-bit on the accelerator, fp32 on the host when offloaded)."""
    optimizer_states: int
    """fp32 master weights + fp32 gradients for the step + the optimizer's own state."""
    working: int
    """Accelerator: the gathered ZeRO-3 layer and its gradient. Host: the model-loading peak."""
    total: int
    """What must fit: the sum on the accelerator; on the host the larger of states and loading."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states (without the working term)."""
        return self.params + self.gradients + self.optimizer_states


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Model-state memory of one training set-up; see the module docstring for the formulas."""

    num_params: int
    trainable_params: int
    """Parameters with `requires_grad` (gradients and optimizer states are sized by these)."""
    largest_layer_params: int
    num_gpus_per_node: int
    num_nodes: int
    zero_stage: int
    offload_optimizer: OffloadDevice
    offload_params: OffloadDevice
    precision: Precision
    optimizer: OptimizerName
    zero_init: bool
    accelerator: MemoryBreakdown
    """Bytes on each accelerator."""
    host: MemoryBreakdown
    """Bytes of host (CPU) memory on each node."""

    @property
    def num_gpus(self) -> int:
        """Total number of accelerators (data-parallel ranks)."""
        return self.num_gpus_per_node * self.num_nodes

    @property
    def label(self) -> str:
        """Short name of the stage/offload choice, e.g. `ZeRO-3 + offload optimizer+params`."""
        offload = []
        if self.offload_optimizer != "none":
            offload.append("optimizer")
        if self.offload_params != "none":
            offload.append("params")
        suffix = f" + offload {'+'.join(offload)}" if offload else ""
        return f"ZeRO-{self.zero_stage}{suffix}"

    def describe(self) -> str:
        """A few lines of human-readable text (GB = 1e9 bytes)."""
        a, h = self.accelerator, self.host
        return "\n".join(
            [
                f"{self.label}, {self.precision}, {self.optimizer}: {format_count(self.num_params)} params "
                + (
                    f"({format_count(self.trainable_params)} trainable) "
                    if self.trainable_params != self.num_params
                    else ""
                )
                + f"(largest layer {format_count(self.largest_layer_params)}) on {self.num_nodes} node(s) x "
                f"{self.num_gpus_per_node} accelerator(s)",
                f"  per accelerator: params {format_bytes(a.params)} + grads {format_bytes(a.gradients)}"
                f" + optimizer {format_bytes(a.optimizer_states)} + working layer {format_bytes(a.working)}"
                f" = {format_bytes(a.total)}",
                f"  per host (node): params {format_bytes(h.params)} + grads {format_bytes(h.gradients)}"
                f" + optimizer {format_bytes(h.optimizer_states)}; loading peak {format_bytes(h.working)}"
                f" -> {format_bytes(h.total)}",
            ]
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, kw_only=True, slots=True)
class Recommendation:
    """The cheapest stage/offload choice that fits, why, and every choice considered."""

    estimate: MemoryEstimate
    """The chosen stage/offload and its figures."""
    reason: str
    """Why this choice, in words (what it needs, which cheaper choices did not fit)."""
    candidates: tuple[MemoryEstimate, ...]
    """Every choice in `CHOICES` order."""
    accelerator_memory_bytes: int
    host_memory_bytes: int | None
    headroom: float

    @property
    def zero_stage(self) -> int:
        """The recommended ZeRO stage."""
        return self.estimate.zero_stage

    @property
    def offload_optimizer(self) -> OffloadDevice:
        """The recommended `offload_optimizer` device."""
        return self.estimate.offload_optimizer

    @property
    def offload_params(self) -> OffloadDevice:
        """The recommended `offload_params` device."""
        return self.estimate.offload_params


# --------------------------------------------------------------------------- counting
def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters (shared ones once) and the largest module's direct parameters.

    Works on meta-device modules: nothing is read from the tensors but their shapes.
    """
    unique = {id(p): p.numel() for p in model.parameters()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return sum(unique.values()), largest


#: Bounds on the work of counting a model from its config (a config is untrusted input).
MAX_CONFIG_BYTES = 4 * 2**20
"""Largest config JSON read (bytes); real configs are a few KB (a large label map: a few hundred)."""
MAX_LAYERS = 1024
"""Largest layer or expert count a config may ask for (real models: at most a few hundred)."""
MAX_MODULES = 100_000
"""Most modules built on the meta device while counting (about 10 s of work on one core)."""
MAX_COUNTED_PARAMS = 10**15
"""Largest parameter count accepted, counted or given."""
MAX_REAL_BYTES = 256 * 2**20
"""Most bytes a model's constructor may allocate off the meta device while it is counted."""

#: Config keys that multiply the modules built (layers, experts), checked before anything is built.
_REPEAT_KEYS = words(
    "num_hidden_layers n_layer n_layers num_layers encoder_layers decoder_layers num_encoder_layers "
    "num_decoder_layers num_local_experts num_experts n_routed_experts moe_num_experts "
    "num_attention_heads n_head num_key_value_heads"
)
_TOO_BIG_HINT = "HINT: pass the parameter count instead (`--params` / an int), e.g. 7B"


class _BudgetExceeded(Exception):
    """Building the model went past one of the bounds above (raised from a registration hook)."""


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


def _check_repeats(data: Any, where: str, depth: int = 0) -> None:
    """Every layer/expert count in `data` (sub-configs included) is an int in 0..MAX_LAYERS."""
    if depth > 8 or not isinstance(data, dict):
        return
    for key, value in data.items():
        if isinstance(value, dict):
            _check_repeats(value, where, depth + 1)
        elif key in _REPEAT_KEYS and value is not None and not _is_int_in(value, 0, MAX_LAYERS):
            raise ValueError(
                f"{where}: `{key}` = {value!r} is not a layer/expert count this estimate builds; "
                f"allowed: an int from 0 to {MAX_LAYERS} (ds_engine.memory.MAX_LAYERS). {_TOO_BIG_HINT}"
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


def _model_from_config(config: Any, where: str = "the config") -> torch.nn.Module:
    """Build the model a config describes on the meta device, with bounded work.

    Only transformers model classes are built (see `_model_class`), under `torch.device("meta")`
    (no memory, no download), and registration hooks stop the build past `MAX_MODULES`
    modules, `MAX_COUNTED_PARAMS` parameters or `MAX_REAL_BYTES` allocated off the meta device.
    """
    import torch
    import transformers
    from torch.nn.modules import module as nn_module

    to_dict = getattr(config, "to_dict", None)
    _check_repeats(to_dict() if callable(to_dict) else {}, where)
    model_cls = _model_class(config, where)
    counts = {"modules": 0, "params": 0, "real": 0}

    def on_module(module: Any, name: str, sub: Any) -> None:
        counts["modules"] += 1
        if counts["modules"] > MAX_MODULES:
            raise _BudgetExceeded(f"more than {MAX_MODULES} modules (ds_engine.memory.MAX_MODULES)")

    def on_tensor(module: Any, name: str, tensor: Any) -> None:
        if tensor is None:
            return
        counts["params"] += tensor.numel()
        if tensor.device.type != "meta":
            counts["real"] += tensor.numel() * tensor.element_size()
        if counts["params"] > MAX_COUNTED_PARAMS:
            raise _BudgetExceeded(f"more than {MAX_COUNTED_PARAMS:.0e} parameters")
        if counts["real"] > MAX_REAL_BYTES:
            raise _BudgetExceeded(
                f"more than {MAX_REAL_BYTES} bytes allocated off the meta device "
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


def _read_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """The JSON object in a model folder's config.json (or a config JSON file), read with bounds.

    Only a regular file of at most `MAX_CONFIG_BYTES` is read. A symlink is followed only to a
    file inside the same folder, or (the Hugging Face cache layout) from `snapshots/<rev>/` into
    the repository's `blobs/`. Duplicate keys, a non-object top level and nesting deeper than
    Python's recursion limit are refused.
    """
    import json
    import stat

    from ds_engine._values import no_duplicate_keys

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
        if info.st_size > MAX_CONFIG_BYTES:
            raise ValueError(
                f"{where} is {info.st_size} bytes; allowed: at most {MAX_CONFIG_BYTES} "
                f"(ds_engine.memory.MAX_CONFIG_BYTES). {_TOO_BIG_HINT}"
            )
        raw = f.read(MAX_CONFIG_BYTES + 1)
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


def _load_config(path: Path) -> tuple[Any, str]:
    """The transformers config object a model folder / config file describes, and its name for errors.

    The class comes from transformers' own `CONFIG_MAPPING` by `model_type`; no custom code
    (`auto_map`) is run and nothing is downloaded.
    """
    from transformers import CONFIG_MAPPING

    data, where = _read_config_file(path)
    _check_repeats(data, where)
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


def resolve_num_params(
    model_or_num_params: ModelLike, largest_layer_params: int | None = None
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
        num_params, largest = count_params(_model_from_config(*_load_config(path)))
    else:
        import torch

        if isinstance(model_or_num_params, torch.nn.Module):
            num_params, largest = count_params(model_or_num_params)
        elif hasattr(model_or_num_params, "to_dict") and hasattr(model_or_num_params, "model_type"):
            num_params, largest = count_params(_model_from_config(model_or_num_params))
        else:
            raise ValueError(
                f"`model_or_num_params` has unsupported type {type(model_or_num_params).__name__}; allowed: "
                "int, torch.nn.Module, transformers.PretrainedConfig, or a path to a model folder. "
                "HINT: pass the parameter count"
            )
    if not 0 < num_params <= MAX_COUNTED_PARAMS:
        raise ValueError(
            f"`model_or_num_params` must be a positive parameter count of at most {MAX_COUNTED_PARAMS:.0e}, "
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


def resolve_trainable_params(
    model_or_num_params: ModelLike, num_params: int, trainable_params: int | None
) -> int:
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


# --------------------------------------------------------------------------- estimate
def _check_choice(name: str, value: Any, allowed: tuple[Any, ...], hint: str) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(
            f"`{name}`={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}. {hint}"
        )


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}. HINT: pass e.g. {name}=8")


def estimate_memory(
    model_or_num_params: ModelLike,
    *,
    largest_layer_params: int | None = None,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    zero_stage: int,
    offload_optimizer: OffloadDevice = "none",
    offload_params: OffloadDevice = "none",
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    zero_init: bool = True,
    trainable_params: int | None = None,
) -> MemoryEstimate:
    """Estimate the model-state memory of data-parallel ZeRO training (formulas: module docstring).

    Args:
        model_or_num_params: a parameter count, an `nn.Module`, a transformers
            `PretrainedConfig`, or a path to a local HF model folder / config JSON (counted on
            the meta device: nothing is allocated or downloaded).
        largest_layer_params: parameters of the largest single module; derived from a model
            when not given (for a bare count: `estimate_largest_layer`, usual transformer shapes).
        num_gpus_per_node: accelerators (ranks) per node.
        num_nodes: number of nodes.
        zero_stage: 0, 1, 2 or 3.
        offload_optimizer: "none" or "cpu" (ZeRO-1/2/3).
        offload_params: "none" or "cpu" (ZeRO-3 only).
        precision: "bf16", "fp16" or "fp32".
        optimizer: one of `OPTIMIZER_STATE_BYTES`.
        zero_init: ZeRO-3 models built under `zero.Init` (no full copy on the host at load).
        trainable_params: parameters with `requires_grad`; counted from an `nn.Module` when
            not given (a LoRA model: its adapter), else all of them.

    Returns:
        A `MemoryEstimate`: bytes per accelerator and per node's host memory.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).
    """
    _check_choice("zero_stage", zero_stage, (0, 1, 2, 3), "HINT: pick a ZeRO stage from 0 to 3")
    _check_choice(
        "offload_optimizer",
        offload_optimizer,
        get_args(OffloadDevice),
        "HINT: use 'cpu' (NVMe offload is not estimated; 'cpu' bounds its accelerator side)",
    )
    _check_choice(
        "offload_params",
        offload_params,
        get_args(OffloadDevice),
        "HINT: use 'cpu' (NVMe offload is not estimated; 'cpu' bounds its accelerator side)",
    )
    _check_choice("precision", precision, get_args(Precision), "HINT: use precision='bf16'")
    _check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES), "HINT: use optimizer='adamw'")
    _check_positive_int("num_gpus_per_node", num_gpus_per_node)
    _check_positive_int("num_nodes", num_nodes)
    if offload_optimizer != "none" and zero_stage == 0:
        raise ValueError(
            f"`offload_optimizer`={offload_optimizer!r} needs ZeRO stage 1, 2 or 3, got `zero_stage`=0. "
            "HINT: use zero_stage=2 with optimizer offload"
        )
    if offload_params != "none" and zero_stage != 3:
        raise ValueError(
            f"`offload_params`={offload_params!r} needs `zero_stage`=3, got {zero_stage} (only ZeRO-3 "
            "partitions the parameters). HINT: use zero_stage=3, or offload_params='none'"
        )
    num_params, largest = resolve_num_params(model_or_num_params, largest_layer_params)
    trainable = resolve_trainable_params(model_or_num_params, num_params, trainable_params)

    p, t, n, g = num_params, trainable, num_gpus_per_node * num_nodes, num_gpus_per_node
    weight = 4 if precision == "fp32" else 2
    grad = weight
    # Plain fp32 ZeRO-0 steps the model's own tensors; every other set-up keeps an fp32
    # master copy and hands the optimizer an fp32 gradient copy (DeepSpeed clones even for fp32).
    copies = 0 if (precision == "fp32" and zero_stage == 0) else 4 + 4
    state = OPTIMIZER_STATE_BYTES[optimizer]

    def part(bytes_per_param: int, partitioned: bool, count: int = p) -> int:
        return math.ceil(bytes_per_param * count / n) if partitioned else bytes_per_param * count

    offload_opt = offload_optimizer != "none"
    # accelerator
    acc_params = 0 if offload_params != "none" else part(weight, zero_stage == 3)
    acc_grads = 0 if offload_opt else part(grad, zero_stage >= 2, t)
    acc_opt = 0 if offload_opt else part(copies + state, zero_stage >= 1, t)
    acc_work = (weight + grad) * largest if zero_stage == 3 else 0
    accelerator = MemoryBreakdown(
        params=acc_params,
        gradients=acc_grads,
        optimizer_states=acc_opt,
        working=acc_work,
        total=acc_params + acc_grads + acc_opt + acc_work,
    )
    # host, per node (g ranks)
    host_params = part(weight, True) * g if offload_params != "none" else 0
    host_grads = part(4, True, t) * g if offload_opt else 0  # fp32 gradient partition for the CPU step
    host_opt = part(4 + state, True, t) * g if offload_opt else 0  # fp32 master + optimizer state
    host_load = 4 * (largest if zero_stage == 3 and zero_init else p) * g
    host = MemoryBreakdown(
        params=host_params,
        gradients=host_grads,
        optimizer_states=host_opt,
        working=host_load,
        total=max(host_params + host_grads + host_opt, host_load),
    )
    return MemoryEstimate(
        num_params=num_params,
        trainable_params=trainable,
        largest_layer_params=largest,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        precision=precision,
        optimizer=optimizer,
        zero_init=zero_init,
        accelerator=accelerator,
        host=host,
    )


def estimate_all(
    model_or_num_params: ModelLike,
    *,
    largest_layer_params: int | None = None,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    zero_init: bool = True,
    trainable_params: int | None = None,
) -> list[MemoryEstimate]:
    """`estimate_memory` for every choice in `CHOICES`, cheapest first (the model is counted once)."""
    num_params, largest = resolve_num_params(model_or_num_params, largest_layer_params)
    trainable = resolve_trainable_params(model_or_num_params, num_params, trainable_params)
    return [
        estimate_memory(
            num_params,
            largest_layer_params=largest,
            num_gpus_per_node=num_gpus_per_node,
            num_nodes=num_nodes,
            zero_stage=stage,
            offload_optimizer=off_opt,
            offload_params=off_params,
            precision=precision,
            optimizer=optimizer,
            zero_init=zero_init,
            trainable_params=trainable,
        )
        for stage, off_opt, off_params in CHOICES
    ]


# --------------------------------------------------------------------------- recommend
def fits(
    estimate: MemoryEstimate, accelerator_memory_bytes: int, host_memory_bytes: int | None, headroom: float
) -> bool:
    """Whether `estimate` times (1 + headroom) fits both budgets (host unchecked when None)."""
    factor = 1.0 + headroom
    if estimate.accelerator.total * factor > accelerator_memory_bytes:
        return False
    return host_memory_bytes is None or estimate.host.total * factor <= host_memory_bytes


def recommend_config(
    model_or_num_params: ModelLike,
    *,
    accelerator_memory_bytes: int,
    host_memory_bytes: int | None = None,
    headroom: float = 0.2,
    largest_layer_params: int | None = None,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    zero_init: bool = True,
    trainable_params: int | None = None,
) -> Recommendation:
    """The cheapest ZeRO stage/offload choice whose model states fit, with headroom.

    Cheapest means least offload first (offload costs step time), then the lowest stage
    (less communication). A choice fits when its estimate times `1 + headroom` is within
    `accelerator_memory_bytes` per accelerator and, when given, `host_memory_bytes` per node.
    The headroom is for what the estimate leaves out: activations, buffers, fragmentation.

    Args:
        model_or_num_params: as for `estimate_memory`.
        accelerator_memory_bytes: memory of one accelerator, in bytes.
        host_memory_bytes: host memory of one node, in bytes; None leaves the host unchecked.
        headroom: fraction kept free on top of the estimate (0.2 = 20 %).
        largest_layer_params: as for `estimate_memory`.
        num_gpus_per_node: accelerators per node.
        num_nodes: number of nodes.
        precision: "bf16", "fp16" or "fp32".
        optimizer: one of `OPTIMIZER_STATE_BYTES`.
        zero_init: as for `estimate_memory`.
        trainable_params: as for `estimate_memory`.

    Returns:
        A `Recommendation` with the chosen estimate, the reason in words and all candidates.

    Raises:
        ValueError: bad arguments, or no choice fits (the message names the budget and the
            smallest requirement).
    """
    for name, value in (
        ("accelerator_memory_bytes", accelerator_memory_bytes),
        ("host_memory_bytes", host_memory_bytes),
    ):
        if value is None and name == "host_memory_bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number of bytes, got {value!r}. HINT: e.g. 80e9")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 10:
        raise ValueError(
            f"`headroom` must be a fraction >= 0 (e.g. 0.2 for 20 %), got {headroom!r}. HINT: headroom=0.2"
        )
    candidates = estimate_all(
        model_or_num_params,
        largest_layer_params=largest_layer_params,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
        precision=precision,
        optimizer=optimizer,
        zero_init=zero_init,
        trainable_params=trainable_params,
    )
    budget = f"{format_bytes(accelerator_memory_bytes)} per accelerator" + (
        f" and {format_bytes(host_memory_bytes)} host memory per node"
        if host_memory_bytes is not None
        else ""
    )
    margin = f"{headroom:.0%} headroom"
    skipped: list[str] = []
    for est in candidates:
        if fits(est, accelerator_memory_bytes, host_memory_bytes, headroom):
            reason = (
                f"{est.label} is the cheapest choice that fits {budget} with {margin}: it needs "
                f"{format_bytes(est.accelerator.total)} per accelerator and {format_bytes(est.host.total)} "
                f"host memory per node. {CHEAPEST}"
            )
            if skipped:
                reason += " Cheaper choices need more: " + "; ".join(skipped) + "."
            return Recommendation(
                estimate=est,
                reason=reason,
                candidates=tuple(candidates),
                accelerator_memory_bytes=int(accelerator_memory_bytes),
                host_memory_bytes=None if host_memory_bytes is None else int(host_memory_bytes),
                headroom=float(headroom),
            )
        skipped.append(
            f"{est.label} {format_bytes(est.accelerator.total)}/accelerator, "
            f"{format_bytes(est.host.total)}/host"
        )

    def shortfall(est: MemoryEstimate) -> float:
        ratios = [est.accelerator.total / accelerator_memory_bytes]
        if host_memory_bytes is not None:
            ratios.append(est.host.total / host_memory_bytes)
        return max(ratios)

    best = min(candidates, key=shortfall)
    raise ValueError(
        f"no ZeRO stage/offload choice fits the budget of {budget} with {margin}: the smallest "
        f"requirement is {best.label} at {format_bytes(best.accelerator.total)} per accelerator and "
        f"{format_bytes(best.host.total)} host memory per node (before headroom). HINT: add accelerators "
        "(num_gpus_per_node / num_nodes), or train fewer parameters (e.g. LoRA adapters)"
    )


# --------------------------------------------------------------------------- units
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str, example: str) -> int:
    match = _NUMBER.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        allowed = ", ".join(u for u in units if u) or "none"
        raise ValueError(
            f"{what} {text!r} is not understood; allowed: a number with an optional unit ({allowed}). "
            f"HINT: e.g. {example}"
        )
    value = float(match.group(1)) * units[unit]
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"{what} {text!r} must be positive. HINT: e.g. {example}")
    if value > MAX_COUNTED_PARAMS:
        raise ValueError(
            f"{what} {text!r} is more than {MAX_COUNTED_PARAMS:.0e}, the most accepted. HINT: e.g. {example}"
        )
    return round(value)


def parse_count(text: str) -> int:
    """A count from `1.5e9`, `7B`, `350M`, `125000`. Raises ValueError."""
    return _parse(text, _COUNT_UNITS, "count", "1.5e9 or 7B")


def format_bytes(num_bytes: float) -> str:
    """`12.35 GB` style (decimal units: 1 GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def format_count(count: float) -> str:
    """`1.30B`, `22.7M` style."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))


__all__ = [
    "CHOICES",
    "OPTIMIZER_STATE_BYTES",
    "MemoryBreakdown",
    "MemoryEstimate",
    "Recommendation",
    "count_params",
    "estimate_all",
    "estimate_largest_layer",
    "estimate_memory",
    "fits",
    "format_bytes",
    "format_count",
    "parse_count",
    "parse_size",
    "recommend_config",
    "resolve_num_params",
]
