"""Load checkpoint files through a restricted unpickler that can only build what an allowlist names.

Never predict what a pickle will do from its opcodes: a pickle can compute the names it asks
for at load time. Every checkpoint file ds_engine or DeepSpeed unpickles is instead read by
torch's `weights_only=True` unpickler, which builds tensors and plain containers, and beyond
those only the objects named in `torch.serialization.safe_globals(...)`: here the DeepSpeed
classes its checkpoints really hold (`DEEPSPEED_GLOBALS`). Anything else is refused at the
point the unpickler would build it, with `UnsafeCheckpointError` naming the file.

* `restricted_load` -- one file (ds_engine's own reads).
* `restricted_torch_load` -- a scope in which every `torch.load` of this process, and of the
  processes it starts, is restricted the same way, whatever `weights_only` the caller passes
  (DeepSpeed's loader, `zero_to_fp32` and `ds_to_universal` pass `weights_only=False`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import pickletools
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# The objects DeepSpeed 0.19 pickles into its checkpoints beyond tensors and containers, as
# `torch.serialization.get_unsafe_globals_in_checkpoint` lists them for real ZeRO-0/1/2/3
# checkpoints (fp32, bf16, fp16; CPU optimizer offload, and parameter offload on ZeRO-3) saved
# through `Engine.save_checkpoint`, and for the universal checkpoints `ds_to_universal` writes
# from them (ZeRO-0 files hold none). `scripts/bench_safe_load.py --allowlist` lists them again;
# `tests/distributed/test_hostile_checkpoints.py` checks a real checkpoint holds no others.
# DeepSpeed 0.19 stores no `argparse.Namespace` (older Megatron-style checkpoints did).
# Each is a class whose construction only stores values and that has no `__setstate__`: the
# unpickler may call an allowlisted class with arguments the file chooses, so never add a
# function here.
DEEPSPEED_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # optimizer_state_dict["zero_stage"]
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # ZeRO's scaler under bf16 / fp32 (scale 1)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # ZeRO's scaler under fp16
    "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2 param_slice_mappings
)

_FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_NO_FORCE_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_ALLOWED = (
    "allowed are tensors, plain containers, numbers, strings and the DeepSpeed classes in "
    "`ds_engine.safety.DEEPSPEED_GLOBALS`, since anything else could execute code. HINT: load "
    "checkpoints only from a source you trust (if DeepSpeed itself wrote this, report the class so "
    "it can be allowlisted)."
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks the unpickler for something outside the allowlist."""


@functools.cache
def deepspeed_safe_globals() -> tuple[Any, ...]:
    """The objects `DEEPSPEED_GLOBALS` names, imported (names this DeepSpeed lacks are left out).

    Returns:
        A tuple for `torch.serialization.safe_globals`; empty without DeepSpeed.
    """
    found = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except Exception:  # absent, or a DeepSpeed that fails to import: fewer allowed, never more
            continue
    return tuple(found)


def _name_of(file: Any) -> str:
    if isinstance(file, (str, os.PathLike)):
        return os.fspath(file)
    return str(getattr(file, "name", None) or repr(file))


def _refused(message: str) -> str | None:
    """What the weights-only unpickler refused, from its error message (None: not a pickle)."""
    patterns = (
        (r"GLOBAL (\S+) was not an allowed global", "the global `{}`"),
        (r"unsupported GLOBAL (\S+) whose module", "the global `{}`"),
        (r"call reduce for unrecognized function (.+?)(?: which belongs|$)", "a call of `{}`"),
        (
            r"create new object for nn\.Parameter or classes allowlisted.* but got (.+)$",
            "an instance of `{}`",
        ),
        (r"Can only build .* but got (.+)$", "to set the state of `{}`"),
        (r"(persistent_load) (?:id must be|of storage)", "a `{}` of something other than a tensor storage"),
    )
    for pattern, shape in patterns:
        found = re.search(pattern, message, re.M)
        if found:
            name = found.group(1).strip()
            if shape.startswith("the global") and "." not in name:
                name = f"builtins.{name}"  # torch's message drops the `builtins.` it read
            return shape.format(name)
    opcode = re.search(r"Unsupported operand (\d+)", message)
    if opcode:
        code = chr(int(opcode.group(1)))
        name = next((op.name for op in pickletools.opcodes if op.code == code), None)
        return f"the pickle opcode {name}" if name else None
    return f"`{message.strip().splitlines()[-1]}`"


def _torch_load_restricted(
    file: Any, map_location: Any, mmap: bool, allowed: Sequence[Any], hint: str, load: Callable[..., Any]
) -> Any:
    name = _name_of(file)
    if mmap and isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as handle:  # torch maps only zip archives; a legacy file is read whole
            mmap = handle.read(4) == b"PK\x03\x04"
    present = torch.serialization.get_safe_globals()  # leave those alone: the scope's, the user's
    try:
        with torch.serialization.safe_globals([g for g in allowed if g not in present]):
            return load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        detail = str(exc).split("WeightsUnpickler error:")[-1].split("\n\nCheck the documentation")[0]
        refused = _refused(detail)
        if refused is None:
            raise ValueError(_unreadable(name, "not a pickle stream", hint)) from None
        raise UnsafeCheckpointError(
            f"refusing to load `{name}`: unpickling it needs {refused}; {_ALLOWED}"
        ) from None
    except RuntimeError as exc:
        if "TorchScript" in str(exc):
            raise UnsafeCheckpointError(
                f"refusing to load `{name}`: it is a TorchScript archive; {_ALLOWED}"
            ) from None
        raise ValueError(_unreadable(name, exc, hint)) from None
    except (FileNotFoundError, IsADirectoryError, PermissionError):  # these name the file
        raise
    except Exception as exc:  # truncated or corrupt: EOFError, zip and struct errors, bad memo keys
        raise ValueError(_unreadable(name, exc, hint)) from None


def _unreadable(name: str, exc: BaseException | str, hint: str) -> str:
    reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0] or type(exc).__name__
    return f"checkpoint file {name!r} is truncated or corrupt ({reason}). HINT: {hint}"


def restricted_load(
    path: str | os.PathLike[str],
    *,
    safe_globals: Sequence[Any] = (),
    mmap: bool = False,
    hint: str = "load an earlier checkpoint, or write this one again",
) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU, allowing `safe_globals` besides torch's own.

    Args:
        path: A `torch.save` file (zip archive or legacy format).
        safe_globals: Classes the file may hold besides tensors and containers, e.g.
            `deepspeed_safe_globals()`.
        mmap: Map a zip archive's tensor data instead of reading it (only the pickle is read).
        hint: The fix suggested when the file is truncated or corrupt.

    Returns:
        The unpickled object.

    Raises:
        UnsafeCheckpointError: The file asks for something outside the allowlist; names the
            file and what was refused. Nothing of the file's choosing ran.
        ValueError: The file is truncated, corrupt, or not a `torch.save` file; names the file.
        OSError: The file cannot be opened.
    """
    return _torch_load_restricted(path, "cpu", mmap, safe_globals, hint, torch.serialization.load)


_scope_lock = threading.Lock()
_scope_depth = 0
_saved: dict[str, Any] = {}


@contextlib.contextmanager
def restricted_torch_load(safe_globals: Sequence[Any] = ()) -> Iterator[None]:
    """Within this scope every `torch.load` is `restricted_load`'s, whatever its caller asks.

    Used around calls into DeepSpeed's checkpoint loading, `zero_to_fp32` and
    `ds_to_universal`. Two layers, each enough on its own for the loads DeepSpeed 0.19 makes:

    * `torch.load` is replaced by a wrapper that drops `weights_only=False` (and a custom
      `pickle_module`), loads inside `torch.serialization.safe_globals(safe_globals)` and turns
      a refusal into `UnsafeCheckpointError` naming the file. DeepSpeed calls `torch.load`
      through the module attribute everywhere (its checkpoint engine, ZeRO's universal loader,
      `zero_to_fp32`, `ds_to_universal`, `DeepSpeedCheckpoint`), so this one place covers them all;
      replacing only `engine.checkpoint_engine` would leave the universal, `zero_to_fp32` and
      `ds_to_universal` loads unrestricted.
    * `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` is set in the environment, which torch's own `load`
      reads on every call: a load that reaches torch some other way (`torch.serialization.load`,
      `from torch import load`) is restricted too, and so are processes started inside the
      scope (e.g. `ds_to_universal`'s worker pool), which inherit the environment. A forked
      worker inherits the allowlist as well; a spawned one has none and refuses DeepSpeed's
      classes, which fails closed.

    The scope is process-wide while it lasts (other threads' loads are restricted too) and
    re-entrant (the outermost scope's allowlist applies); it restores `torch.load`, the
    environment and torch's list of safe globals on exit.

    Args:
        safe_globals: As for `restricted_load`.
    """
    global _scope_depth
    with _scope_lock:
        if _scope_depth == 0:
            original = torch.load
            _saved.update(load=original, env={k: os.environ.get(k) for k in (_FORCE_ENV, _NO_FORCE_ENV)})
            allowed = list(safe_globals)

            def load(
                f: Any, map_location: Any = None, pickle_module: Any = None, *, mmap: Any = None, **_: Any
            ) -> Any:
                return _torch_load_restricted(
                    f, map_location, bool(mmap), allowed, "load an earlier checkpoint", original
                )

            torch.load = load
            os.environ[_FORCE_ENV] = "1"
            os.environ.pop(_NO_FORCE_ENV, None)  # both set is an error in torch
            present = torch.serialization.get_safe_globals()  # the user's stay after the scope
            _saved["globals"] = torch.serialization.safe_globals([g for g in allowed if g not in present])
            _saved["globals"].__enter__()
        _scope_depth += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                _saved.pop("globals").__exit__(None, None, None)
                torch.load = _saved.pop("load")
                for key, value in _saved.pop("env").items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
