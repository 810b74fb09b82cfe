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

Both open regular files only (never a symbolic link, a FIFO or a device: `check_regular_file`)
and bound what a file may inflate to before unpickling it: the pickled structure of a zip
archive (its `data.pkl`, and any compressed entry) by the sizes its zip directory declares, a
legacy (non-zip) file by its size, against `max_pickle_bytes()` (256 MiB unless
`DS_ENGINE_MAX_PICKLE_SIZE` says otherwise). Tensor data is not counted: it is mapped or read
as stored, never inflated.

A checkpoint folder is read the same way: `confined_tag` turns a tag (given, or read from the
bounded, regular `latest` file) into a plain name of a real sub-folder, never a path elsewhere;
`read_json_bounded` reads a small JSON file whose size and nesting are bounded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import pickle
import pickletools
import re
import stat
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ds_engine._values import file_kind, open_regular, read_regular

# The objects DeepSpeed 0.19 pickles into its checkpoints beyond tensors and containers, as
# `torch.serialization.get_unsafe_globals_in_checkpoint` lists them for real ZeRO-0/1/2/3
# checkpoints (fp32, bf16, fp16; CPU optimizer offload, and parameter offload on ZeRO-3) saved
# through `Engine.save_checkpoint`, and for the universal checkpoints `ds_to_universal` writes
# from them (ZeRO-0 files hold none). `scripts/benchmarks/bench_safe_load.py --allowlist` lists them again;
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


# --------------------------------------------------------------------------- regular files, bounds
MAX_PICKLE_ENV = "DS_ENGINE_MAX_PICKLE_SIZE"
#: The default bound on a checkpoint file's pickled structure (tensor data is not counted).
DEFAULT_MAX_PICKLE_BYTES = 256 * 1024**2
#: A tag name: letters, digits and _ . + = -, not starting with '.' or '-' (no '/', no '..').
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")
_LATEST_MAX_BYTES = 4096
_JSON_MAX_BYTES = 1024**2
_ZIP_MAGIC = b"PK\x03\x04"


def _link_refusal(name: str, what: str = "checkpoint files") -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to read `{name}`: it is a symbolic link; {what} are read only as regular files "
        "inside their folder, so that no link makes a load read a file elsewhere. HINT: if you trust "
        "the file it points to, replace the link by a copy of it (`cp -L`)."
    )


def _open_regular(path: str | os.PathLike[str], what: str = "checkpoint files") -> tuple[int, os.stat_result]:
    """An open descriptor of `path` and its stat, refusing links and anything but a regular file.

    Opened without following a final symbolic link and without blocking (a FIFO opens at once
    and is then refused), so neither a link nor a special file is ever read from.
    """
    return open_regular(path, follow_links=False, refuse=_not_regular(os.fspath(path), what))


def _not_regular(name: str, what: str) -> Callable[[str], UnsafeCheckpointError]:
    """The refusal of `name` by its kind (`open_regular`'s `refuse`)."""

    def refuse(kind: str) -> UnsafeCheckpointError:
        if kind == "a symbolic link":
            return _link_refusal(name, what)
        return UnsafeCheckpointError(
            f"refusing to read `{name}`: it is {kind}, not a regular file; {what} are read only as "
            "regular files (reading a FIFO or a device can block forever or never end). HINT: "
            "remove it, or put the real file in its place."
        )

    return refuse


def check_regular_file(path: str | os.PathLike[str], what: str = "checkpoint files") -> os.stat_result:
    """The stat of `path` when it is a regular file, not a symbolic link; refuses anything else.

    Raises:
        UnsafeCheckpointError: `path` is a symbolic link, a FIFO, a socket or a device (named).
        IsADirectoryError, FileNotFoundError, PermissionError: as `open` would.
    """
    fd, info = _open_regular(path, what)
    os.close(fd)
    return info


def max_pickle_bytes() -> int:
    """The bound on a checkpoint file's pickled structure: `DS_ENGINE_MAX_PICKLE_SIZE`, else 256 MiB.

    Raises:
        ValueError: The environment variable holds no size (named, with an example).
    """
    value = os.environ.get(MAX_PICKLE_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_PICKLE_BYTES
    from ds_engine._values import parse_size

    try:
        return parse_size(value, name=MAX_PICKLE_ENV)
    except (TypeError, ValueError):
        raise ValueError(
            f"{MAX_PICKLE_ENV}={value!r} is not a size; allowed: a positive number of bytes with an "
            f"optional unit (KB, MB, GB, KiB, MiB, GiB). HINT: {MAX_PICKLE_ENV}=1GB."
        ) from None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _too_big(name: str, what: str, declared: int, limit: int) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to load `{name}`: {what} {_size(declared)} ({declared} bytes), over the "
        f"{_size(limit)} limit on what a checkpoint's pickled structure may inflate to (tensor data is "
        f"not counted). HINT: if you trust the file, raise the limit, e.g. {MAX_PICKLE_ENV}="
        f"{max(2 * declared, limit) // 1024**2 + 1}MiB."
    )


def _check_bounds(fd: int, info: os.stat_result, name: str, limit: int) -> bool:
    """Refuse a file whose pickle would inflate past `limit`, before anything is unpickled.

    Returns:
        True for a zip archive (torch maps those), False for a legacy file.
    """
    head = os.pread(fd, 4, 0)
    if head != _ZIP_MAGIC:  # legacy: the pickles are read straight from the file
        if info.st_size > limit:
            what = "it is a legacy (non-zip) torch file, unpickled whole, of"
            raise _too_big(name, what, info.st_size, limit)
        return False
    try:
        with os.fdopen(os.dup(fd), "rb") as handle, zipfile.ZipFile(handle) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return True  # torch names the corrupt file itself
    inflating = 0
    for entry in entries:
        compressed = entry.compress_type != zipfile.ZIP_STORED
        storage = "/data/" in entry.filename and not entry.filename.endswith(".pkl")
        if storage and not compressed and entry.file_size == entry.compress_size:
            continue  # tensor data, stored as is: mapped or read, bounded by the file itself
        if entry.file_size > limit:
            ratio = entry.file_size // max(entry.compress_size, 1)
            shown = (
                f"is {_size(entry.compress_size)} compressed ({ratio}:1) and declares"
                if compressed
                else "declares"
            )
            raise _too_big(name, f"its entry `{entry.filename}` {shown}", entry.file_size, limit)
        inflating += entry.file_size
    if inflating > limit:
        raise _too_big(name, "its pickled and compressed entries declare", inflating, limit)
    return True


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
    file: Any,
    map_location: Any,
    mmap: bool,
    allowed: Sequence[Any],
    hint: str,
    load: Callable[..., Any],
    limit: int | None = None,
) -> Any:
    name = _name_of(file)
    if isinstance(file, (str, os.PathLike)):
        fd, info = _open_regular(file)  # never a link, a FIFO or a device
        try:
            is_zip = _check_bounds(fd, info, name, max_pickle_bytes() if limit is None else limit)
        finally:
            os.close(fd)
        mmap = mmap and is_zip  # torch maps only zip archives; a legacy file is read whole
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
    max_pickle_size: int | None = None,
) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU, allowing `safe_globals` besides torch's own.

    Args:
        path: A `torch.save` file (zip archive or legacy format).
        safe_globals: Classes the file may hold besides tensors and containers, e.g.
            `deepspeed_safe_globals()`.
        mmap: Map a zip archive's tensor data instead of reading it (only the pickle is read).
        hint: The fix suggested when the file is truncated or corrupt.
        max_pickle_size: Bound in bytes on what the file's pickled structure may inflate to;
            default `max_pickle_bytes()`.

    Returns:
        The unpickled object.

    Raises:
        UnsafeCheckpointError: The file asks for something outside the allowlist, is a symbolic
            link or not a regular file, or its pickle would inflate past the bound; names the
            file and what was refused. Nothing of the file's choosing ran.
        ValueError: The file is truncated, corrupt, or not a `torch.save` file; names the file.
        OSError: The file cannot be opened.
    """
    return _torch_load_restricted(
        path, "cpu", mmap, safe_globals, hint, torch.serialization.load, max_pickle_size
    )


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


# --------------------------------------------------------------------------- checkpoint folders
def _read_small(path: Path, limit: int, what: str) -> bytes:
    def too_large(size: int) -> ValueError:
        return ValueError(
            f"{str(path)!r} is {_size(size)}, more than the {_size(limit)} {what} may hold. HINT: "
            "the file is not the one ds_engine or DeepSpeed wrote; restore it, or load another tag."
        )

    try:
        return read_regular(
            path, limit, refuse=_not_regular(str(path), "checkpoint files"), too_large=too_large
        )
    except IsADirectoryError:
        raise ValueError(
            f"{str(path)!r} is a folder; allowed: {what} (a small regular file). HINT: the folder is "
            "not the one ds_engine or DeepSpeed wrote; restore it, or load another tag."
        ) from None


def read_json_bounded(path: Path, hint: str) -> Any:
    """A small JSON file (at most 1 MiB, a regular file, not a link), parsed.

    Raises:
        ValueError: Too big, not valid JSON, or nested deeper than Python parses (names the file).
        UnsafeCheckpointError: A symbolic link or a special file.
    """
    data = _read_small(path, _JSON_MAX_BYTES, "a checkpoint's metadata file")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        reason = "it nests deeper than can be parsed"
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        reason = str(exc).split(": line")[0] if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
    raise ValueError(f"checkpoint file {str(path)!r} is not valid JSON ({reason}). HINT: {hint}") from None


def is_tag_name(tag: object) -> bool:
    """True for a plain tag name (`TAG_RE`), which names a sub-folder and nothing else."""
    return isinstance(tag, str) and bool(TAG_RE.match(tag)) and not tag.endswith(".tmp")


def confined_tag(
    root: Path, tag: str | None, *, option: str, tags: Callable[[], str], latest: str = "latest"
) -> tuple[str, Path]:
    """A tag of the checkpoint folder `root` and its sub-folder, confined to `root`.

    The tag is `tag`, else the content of `root/<latest>`, which must be a small regular file
    (not a link). Either way it must be a plain name (`is_tag_name`: no '/', no '..', not
    absolute) of a real sub-folder of `root` (not a link), so no content of a checkpoint folder
    makes a load read another folder. A `latest` that holds no tag name is refused without
    echoing what it holds.

    Args:
        root: The checkpoint folder (it may itself be a link; what is inside it may not).
        tag: The tag asked for, or None for the one `latest` names.
        option: How the caller passes a tag (e.g. "tag=", "--tag "), for the messages.
        tags: The tags found in `root`, as the messages show them.
        latest: The name of the file naming the newest tag.

    Raises:
        FileNotFoundError: No such tag folder (the tags found are listed).
        ValueError: The tag, or what `latest` holds, is not a plain name (UnsafeCheckpointError
            for a link or a special file).
    """
    flag = f"`{option.strip()}`"
    named = ""
    if tag is None:
        path = root / latest
        data = _read_small(path, _LATEST_MAX_BYTES, f"a `{latest}` file")
        text = data.decode("utf-8", errors="replace").strip()
        if not is_tag_name(text) or text == latest:
            raise ValueError(
                f"{str(path)!r} does not hold a tag name (a sub-folder's plain name: letters, digits and "
                f"_ . + = -, no '/' or '..'); tags found: {tags()}. HINT: pass one of them with {flag}, "
                f"or write its name into `{latest}`."
            )
        tag, named = text, f" (named by its `{latest}` file)"
    elif not is_tag_name(tag) or tag == latest:
        raise ValueError(
            f"`{option}{tag!r}` is not a tag name; allowed: a sub-folder's plain name (letters, digits and "
            f"_ . + = -, not starting with '.' or '-', no '/' or '..'). HINT: pass one of "
            f"the tags found ({tags()})."
        )
    folder = root / tag
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(
            f"tag {tag!r} not found in {str(root)!r}{named}; tags found: "
            f"{tags()}. HINT: pass one of them with {flag}."
        ) from None
    if stat.S_ISLNK(mode):
        raise UnsafeCheckpointError(
            f"refusing to read tag {tag!r}: {str(folder)!r} is a symbolic link; a tag is a real "
            f"sub-folder of its checkpoint folder, so that no link makes a load read another checkpoint. "
            f"HINT: pass the folder the link points to as the checkpoint folder, if you trust it."
        )
    if not stat.S_ISDIR(mode):
        raise FileNotFoundError(
            f"tag {tag!r}{named}: {str(folder)!r} is {'a file' if stat.S_ISREG(mode) else file_kind(mode)}, "
            f"not a tag folder; tags found: {tags()}. HINT: pass one of them "
            f"with {flag}."
        )
    return tag, folder
