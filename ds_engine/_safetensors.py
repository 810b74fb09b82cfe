"""Safetensors files written a tensor at a time, and a one-job-ahead background writer.

`safetensors.torch.save_file(tensors, path)` needs every tensor of the file in memory at once and
then copies each of them into a `bytes` object before writing, so saving a shard costs about
twice the shard. A safetensors file is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range, padded with spaces to a multiple of 8) and the
tensors' raw bytes. The header depends only on names, dtypes and shapes, so `SafetensorsFile`
writes it first and then each tensor's bytes at its own offset (`os.pwrite`) as soon as the
tensor exists, in any order; the tensor can be freed right after. The file is byte for byte the
one `save_file` writes for the same tensors and metadata: the order of tensors in the file (by
dtype, then name) is read from safetensors itself, and the test suite compares the bytes.

`BackgroundWriter` runs file work on one thread, at most one job in flight: the caller gathers
the next tensors while the previous ones are written, and calls `idle()` before allocating new
copies so no more than two batches are alive at once.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["BackgroundWriter", "SafetensorsFile", "save_file"]


@functools.cache
def _dtype_layout(dtypes: frozenset[torch.dtype]) -> dict[torch.dtype, tuple[str, int]]:
    """dtype -> (safetensors' name for it, its place in the file: lower comes first).

    safetensors orders a file's tensors by dtype (its own enum order, descending), then by name;
    both the names and the order are asked of safetensors itself, with one 1-element tensor
    per dtype, so a new safetensors release cannot silently change the bytes we write.
    """
    from safetensors.torch import save

    ordered = sorted(dtypes, key=str)
    blob = save({str(i): torch.zeros(1, dtype=dtype) for i, dtype in enumerate(ordered)})
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    return {ordered[int(name)]: (info["dtype"], place) for place, (name, info) in enumerate(header.items())}


class SafetensorsFile:
    """One safetensors file, laid out up front from (name, dtype, shape) and filled tensor by tensor.

    Args:
        path: The file to create (truncated if it exists).
        layout: Every tensor the file will hold: (name, dtype, shape).
        metadata: The header's `__metadata__` strings (transformers writes {"format": "pt"}).

    `write(name, tensor)` once per name, then `close()` (fsyncs); `close()` refuses a file with a
    tensor never written. `abort()` closes the descriptor without any check.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian
            raise RuntimeError("streamed safetensors writing needs a little-endian machine")
        entries = list(layout)
        names = [name for name, _, _ in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in a safetensors layout: {sorted(names)}")
        info = _dtype_layout(frozenset(dtype for _, dtype, _ in entries))
        entries.sort(key=lambda e: (info[e[1]][1], e[0]))
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {key: str(metadata[key]) for key in sorted(metadata)}
        #: The names in the order of their bytes in the file: writing in this order is sequential.
        self.order = [name for name, _, _ in entries]
        self._slots: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        self._filled: dict[str, int] = {}  # bytes written so far by `write_part`
        offset = 0
        for name, dtype, shape in entries:
            numel = 1
            for dim in shape:
                numel *= int(dim)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": info[dtype][0],
                "shape": [int(d) for d in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self._slots[name] = (offset, offset + nbytes, dtype, tuple(int(d) for d in shape))
            offset += nbytes
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((8 - len(raw) % 8) % 8)
        self.path = Path(path)
        self.nbytes = 8 + len(raw) + offset
        self._base = 8 + len(raw)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(self._fd, self.nbytes)
        except BaseException:
            self.abort()
            raise

    def _pwrite(self, data: Any, position: int) -> None:
        assert self._fd is not None
        view = memoryview(data).cast("B")
        while view:
            try:
                written = os.pwrite(self._fd, view, position)
            except OSError as exc:  # say which file (a full disk names none)
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            view = view[written:]
            position += written

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes at `name`'s place; its dtype and shape must match the layout."""
        if self._fd is None:
            raise RuntimeError(f"{str(self.path)!r} is closed")
        if name not in self._slots or self._filled.get(name):
            raise KeyError(f"{name!r} is not in the layout of {str(self.path)!r}, or was written already")
        start, end, dtype, shape = self._slots[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name!r}: got {tensor.dtype} {tuple(tensor.shape)}, the layout says {dtype} {shape}"
            )
        del self._slots[name]
        if end > start:
            self._put(tensor, self._base + start)

    def write_part(self, name: str, part: torch.Tensor, byte_offset: int) -> None:
        """Write the consecutive elements `part` (any shape, `name`'s dtype) `byte_offset` bytes
        into `name`'s data; `name` counts as written once its parts add up to its size."""
        if self._fd is None:
            raise RuntimeError(f"{str(self.path)!r} is closed")
        if name not in self._slots:
            raise KeyError(f"{name!r} is not in the layout of {str(self.path)!r}, or was written already")
        start, end, dtype, _ = self._slots[name]
        nbytes = part.numel() * part.element_size()
        if part.dtype != dtype or byte_offset < 0 or start + byte_offset + nbytes > end:
            raise ValueError(
                f"{name!r}: a {part.dtype} part of {nbytes} bytes at {byte_offset} does not fit its "
                f"{dtype} data of {end - start} bytes"
            )
        self._put(part, self._base + start + byte_offset)
        filled = self._filled.get(name, 0) + nbytes
        if filled == end - start:
            del self._slots[name]
            self._filled.pop(name, None)
        else:
            self._filled[name] = filled

    def _put(self, tensor: torch.Tensor, position: int) -> None:
        if tensor.numel():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._pwrite(flat.numpy(), position)

    def close(self, *, sync: bool = True) -> None:
        """fsync (unless `sync=False`: the caller fsyncs the file later) and close; raises when a
        tensor of the layout was never written."""
        if self._fd is None:
            return
        if self._slots:
            missing = sorted(self._slots)
            self.abort()
            raise RuntimeError(f"{str(self.path)!r}: tensors never written: {missing[:5]}")
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close the descriptor (no checks, no fsync); the caller removes the file."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def save_file(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: Mapping[str, str] | None
) -> None:
    """`safetensors.torch.save_file` (same bytes, fsynced) without a second copy of the tensors."""
    out = SafetensorsFile(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata)
    try:
        for key in out.order:
            out.write(key, tensors[key])
        out.close()
    finally:
        out.abort()


class BackgroundWriter:
    """Runs jobs on one thread, at most one in flight; the first error stops later jobs.

    `submit(fn, *args)` waits for the job in flight, then starts `fn(*args)`. `idle()` waits for
    it (call it before allocating the next batch). `close()` waits, stops the thread and returns
    the first error (None when every job succeeded); jobs submitted after an error are skipped.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds-engine-writer")
        self._pending: Future[None] | None = None
        self.error: BaseException | None = None

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # handed to the caller by close()
            self.error = exc

    def idle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.idle()
        if self.error is None:
            self._pending = self._pool.submit(self._run, fn, args)

    def close(self) -> BaseException | None:
        try:
            self.idle()
        finally:
            self._pool.shutdown(wait=True)
        return self.error
