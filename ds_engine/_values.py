"""Plain value helpers shared by every layer: integer/number tests and byte sizes.

The bottom of the package: imports nothing from ds_engine, so any module may use it.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

__all__ = [
    "AUTO",
    "env_int",
    "file_kind",
    "no_duplicate_keys",
    "open_regular",
    "parse_count",
    "parse_size",
    "read_regular",
    "read_regular_file",
    "words",
]

#: DeepSpeed's word for "fill this value in from the facts" (and ds_engine's, for the same).
AUTO = "auto"


def words(text: str) -> frozenset[str]:
    """The whitespace-separated words of `text` (how the key tables are written)."""
    return frozenset(text.split())


def _is_int(v: Any) -> TypeGuard[int]:
    """True for an int that is not a bool (JSON integers; `True` is no batch size)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> TypeGuard[int | float]:
    """True for a finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: The largest size `parse_size` accepts (1 EiB): anything above is a typo, not a machine.
MAX_SIZE = 2**60

#: Byte units, case-insensitive: decimal (KB = 1000, and the short K/M/G/T) and binary (KiB = 1024).
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_ALLOWED = (
    "a positive int (bytes) or a number with an optional unit "
    "(B, KB, MB, GB, TB, K, M, G, T, KiB, MiB, GiB, TiB; any case)"
)


def parse_size(size: int | str, *, name: str | None = None) -> int:
    """Bytes from a size such as ``"5GB"``, ``"5G"``, ``"500MiB"``, ``"1.5e9"`` or an int.

    Decimal units (KB, MB, GB, TB and the short K, M, G, T) are powers of 1000, binary units
    (KiB, MiB, GiB, TiB) powers of 1024, as in transformers' `max_shard_size`; no unit means bytes.

    Args:
        size: A positive int (bytes) or a string of digits followed by an optional unit.
        name: The argument the size was given as (e.g. "max_shard_size"), named in the error.

    Returns:
        The size in bytes.

    Raises:
        ValueError: `size` is not a positive size in a known unit (the message names it).
    """
    shown = f"`{name}`={size!r}" if name else f"size {size!r}"
    hint = "HINT: e.g. 5GB, 500MB or 512GiB"
    if _is_int(size):
        value: float = size
    else:
        match = _SIZE.match(size) if isinstance(size, str) else None
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{shown} is not understood; allowed: {_ALLOWED}. {hint}")
        value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or round(value) <= 0:
        raise ValueError(f"{shown} must be positive; allowed: {_ALLOWED}. {hint}")
    if value > MAX_SIZE:
        raise ValueError(f"{shown} is more than 1 EiB (2**60 bytes), the largest size accepted. {hint}")
    return round(value)


#: The largest count `parse_count` accepts: more parameters than any model has, so a typo.
MAX_COUNT = 10**15

#: Count units, case-insensitive: thousands, millions, billions (B or G) and trillions.
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A count from ``"1.5e9"``, ``"7B"``, ``"350M"`` or ``"125000"`` (units: K, M, B or G, T).

    Written like a size (`parse_size`'s number pattern), in powers of 1000.

    Raises:
        ValueError: `text` is not a positive count in a known unit, or is over `MAX_COUNT`
            (the message quotes it as "count ...").
    """
    example = "HINT: e.g. 1.5e9 or 7B"
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _COUNT_UNITS:
        allowed = ", ".join(u for u in _COUNT_UNITS if u)
        raise ValueError(
            f"count {text!r} is not understood; allowed: a number with an optional unit ({allowed}). "
            + example
        )
    value = float(match.group(1)) * _COUNT_UNITS[unit]
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"count {text!r} must be positive. {example}")
    if value > MAX_COUNT:
        raise ValueError(f"count {text!r} is more than {MAX_COUNT:.0e}, the most accepted. {example}")
    return round(value)


def no_duplicate_keys(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json.load(s)` `object_pairs_hook` that refuses a key written twice in one object.

    Plain `json` keeps the last of two equal keys without a word, so a config holding two
    `zero_optimization` blocks would silently drop the first. `where` (the file) is named in
    the ValueError together with the key.
    """

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(
                    f"{where} writes the key {key!r} twice in one JSON object (JSON readers keep only the "
                    f"last one). HINT: merge the two {key!r} entries into one"
                )
            out[key] = value
        return out

    return hook


def env_int(name: str, default: int, *, minimum: int = 0, environ: Mapping[str, str] | None = None) -> int:
    """The integer environment variable `name` (`default` when unset or empty), at least `minimum`.

    Raises:
        ValueError: the variable holds something else; the message names it and its value.
    """
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(
            f"environment variable {name}={text!r} is not an integer >= {minimum}. HINT: unset {name}, or "
            f"start the script with `ds-engine launch` / torchrun, which set {name} for every process"
        )
    return value


#: The words a refusal uses for what a path is, by its mode (the first test that holds).
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """What a file of `mode` is, in the words refusals use ("a FIFO (named pipe)", "a folder", ...)."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_regular(
    path: str | os.PathLike[str], *, follow_links: bool, refuse: Callable[[str], Exception]
) -> tuple[int, os.stat_result]:
    """An open read-only descriptor of `path` and its stat, when `path` is a regular file.

    Opened without blocking (a FIFO opens at once and is then refused, never read) and checked
    on the open descriptor, so nothing swapped in after a check is read. With
    `follow_links=False` a final symbolic link is refused too, also one that appears between
    the check and the open. The caller closes the descriptor.

    Raises:
        Exception: `refuse(kind)` for a symbolic link (when not followed), a FIFO, socket or
            device; `kind` is `file_kind`'s words ("a symbolic link", "a FIFO (named pipe)", ...).
        IsADirectoryError: `path` is a folder.
        FileNotFoundError, PermissionError, OSError: as `os.open` raises them.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        if os.path.islink(name):
            raise refuse("a symbolic link")
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:  # a link that appeared after the check
            raise refuse("a symbolic link") from None
        raise
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode):
        return fd, info
    os.close(fd)
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
    raise refuse(file_kind(info.st_mode))


def read_regular(
    path: str | os.PathLike[str],
    limit: int,
    *,
    follow_links: bool = False,
    refuse: Callable[[str], Exception],
    too_large: Callable[[int], Exception],
) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (opened as `open_regular` does).

    The one bounded reader of the package: at most `limit + 1` bytes are ever read, so a file
    that grows, or one whose stat lies (`/proc`), still stops at the bound.

    Raises:
        Exception: `refuse(kind)` as in `open_regular`; `too_large(size)` when the file holds
            more than `limit` bytes (`size`: its stat size, or the bytes read when larger).
        IsADirectoryError, FileNotFoundError, PermissionError, OSError: as `open_regular`.
    """
    fd, info = open_regular(path, follow_links=follow_links, refuse=refuse)
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise too_large(max(size, info.st_size))
    return b"".join(chunks)


def read_regular_file(path: str | os.PathLike[str], limit: int, what: str, hint: str) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes (links followed).

    `read_regular` with the config readers' words: a FIFO, device or folder, or a file over
    `limit` (e.g. `/dev/zero`, or a multi-GB file given by mistake) is a ValueError naming
    `what`, the limit and `hint`. FileNotFoundError propagates for the caller to word.
    """

    def not_regular(kind: str) -> ValueError:
        return ValueError(f"{what} is not a regular file (a folder, FIFO or device). HINT: {hint}")

    def too_large(size: int) -> ValueError:
        return ValueError(f"{what} is larger than {limit} bytes, the most read. HINT: {hint}")

    try:
        return read_regular(path, limit, follow_links=True, refuse=not_regular, too_large=too_large)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except IsADirectoryError:
        raise not_regular("a folder") from None
    except OSError as exc:
        raise ValueError(f"{what} cannot be opened ({exc.strerror}). HINT: {hint}") from None
