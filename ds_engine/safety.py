"""Refuse checkpoint files that would run code when unpickled.

ds_engine loads its own files with `torch.load(weights_only=True)`. DeepSpeed's checkpoint
files, however, hold a few DeepSpeed objects (its loss scaler, ZeRO stage enum, fragment
addresses), so DeepSpeed's loader (and `zero_to_fp32`) unpickles them with
`weights_only=False`, which executes whatever a crafted file asks for. Before any such file
is handed to DeepSpeed, `check_pickle_file` reads its pickle opcodes (without executing
them) and refuses every global that is not on a short allowlist: tensor rebuilding, plain
containers, numpy arrays, and DeepSpeed *classes* from its runtime/utils/checkpoint packages.
"""

from __future__ import annotations

import importlib
import io
import pickletools
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_ALLOWED_EXACT = frozenset(
    {
        "collections.OrderedDict",
        "collections.defaultdict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.dict",
        "builtins.list",
        "builtins.tuple",
        "builtins.slice",
        "builtins.complex",
        "builtins.int",
        "builtins.float",
        "builtins.bool",
        "builtins.str",
        "builtins.bytes",
        "builtins.bytearray",
        "_codecs.encode",
        "torch.nn.parameter.Parameter",
        "torch._tensor._rebuild_from_type_v2",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.ndarray",
        "numpy.dtype",
        "argparse.Namespace",
    }
)
_DEEPSPEED_PACKAGES = ("deepspeed.runtime.", "deepspeed.utils.", "deepspeed.checkpoint.")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks the unpickler for something that could execute code."""


def _is_allowed(name: str) -> bool:
    if name.startswith("__builtin__."):  # protocol <= 2 spells builtins the Python 2 way
        name = "builtins." + name[len("__builtin__.") :]
    if name in _ALLOWED_EXACT:
        return True
    module, _, attr = name.rpartition(".")
    if module == "torch._utils":
        return attr.startswith("_rebuild")
    if module in ("torch", "torch.storage") or module.startswith("numpy.dtypes"):
        return _resolves_to_type(module, attr)  # torch.FloatStorage, torch.Size, torch.float16 ...
    if name.startswith(_DEEPSPEED_PACKAGES):
        return _resolves_to_type(module, attr)  # classes only, never functions
    return False


def _resolves_to_type(module: str, attr: str) -> bool:
    import torch

    try:
        value = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return False
    return isinstance(value, (type, torch.dtype))


def _pickle_globals(data: bytes) -> Iterator[str]:
    """Every global a pickle stream names (GLOBAL / STACK_GLOBAL), read without executing it."""
    strings: list[str | None] = []
    memo: dict[int, str | None] = {}
    for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = opcode.name
        if name in ("GLOBAL", "INST"):
            yield str(arg).replace(" ", ".")
        elif name in (
            "SHORT_BINUNICODE",
            "BINUNICODE",
            "UNICODE",
            "BINUNICODE8",
            "STRING",
            "SHORT_BINSTRING",
            "BINSTRING",
        ):
            strings.append(str(arg))
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg or 0)] = strings[-1] if strings else None
        elif name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(int(arg or 0)))
        elif name == "STACK_GLOBAL":
            module, attr = (strings[-2], strings[-1]) if len(strings) >= 2 else (None, None)
            yield f"{module}.{attr}" if module and attr else "<unresolvable STACK_GLOBAL>"


def _pickles_in(path: Path) -> Iterable[bytes]:
    if zipfile.is_zipfile(path):  # torch.save's zip format: one data.pkl inside
        with zipfile.ZipFile(path) as archive:
            return [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
    return [path.read_bytes()]  # legacy torch.save / plain pickle


def check_pickle_file(path: str | Path) -> None:
    """Raise `UnsafeCheckpointError` if unpickling `path` could run code ds_engine does not allow.

    Raises:
        UnsafeCheckpointError: naming the file and the refused globals.
        ValueError: the file is truncated or not a pickle at all.
    """
    path = Path(path)
    try:
        refused = sorted(
            {g for data in _pickles_in(path) for g in _pickle_globals(data) if not _is_allowed(g)}
        )
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise ValueError(
            f"`{path}` is not a readable checkpoint file ({exc}). HINT: it is truncated or not a torch.save "
            "file; resume from an earlier checkpoint tag."
        ) from None
    if refused:
        raise UnsafeCheckpointError(
            f"refusing to load `{path}`: unpickling it would call {', '.join(refused)}, which could execute "
            "code. HINT: only load checkpoints you trust; ds_engine allows tensors, containers, numpy arrays "
            "and DeepSpeed's own classes."
        )


def check_checkpoint_folder(folder: str | Path, *, recursive: bool = False) -> None:
    """`check_pickle_file` on every `*.pt` / `*.bin` / `*.pkl` file in `folder`."""
    paths = Path(folder).rglob("*") if recursive else Path(folder).iterdir()
    for path in sorted(paths):
        if path.is_file() and path.suffix in (".pt", ".bin", ".pkl"):
            check_pickle_file(path)
