"""What a checkpoint tag holds, recorded when it is saved and checked before resuming from it.

A save writes every rank's files into a staging folder; once every rank is done, rank 0 lists
that folder into `ds_engine_manifest.json` (each file's relative path and size, and a CRC-32 of
the small ones: metadata, engine state, RNG states, configs) before the tag is published. A
tag whose files no longer match (a truncated file, a rank's file missing, a small file changed)
is not complete: resuming by itself (`Engine.autosave`, `Accelerator.load_state` with automatic
naming) skips it with a warning that names it and uses the one before.

This module imports nothing from ds_engine but `safety`, so `checkpoint` can call it.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any

from ds_engine.safety import read_json_bounded

__all__ = ["MANIFEST_NAME", "check_manifest", "write_manifest"]

MANIFEST_NAME = "ds_engine_manifest.json"
MANIFEST_FORMAT = 1
CHECKSUM_LIMIT = 4 * 1024 * 1024
"""Files up to this size get a CRC-32 (cheap); larger ones (model and optimizer shards) a size."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(tag_dir: Path) -> list[Path]:
    """Every regular file under `tag_dir` except the manifest itself, sorted."""
    return sorted(
        p for p in tag_dir.rglob("*") if p.name != MANIFEST_NAME and not p.is_symlink() and p.is_file()
    )


def write_manifest(tag_dir: Path) -> None:
    """Record `tag_dir`'s files (size, CRC-32 of the small ones) in its manifest, durably.

    Called by rank 0 after every rank finished writing into the staging folder, before publishing.
    """
    files: dict[str, dict[str, Any]] = {}
    for path in _files(tag_dir):
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= CHECKSUM_LIMIT:
            entry["crc32"] = _crc32(path)
        files[path.relative_to(tag_dir).as_posix()] = entry
    target = tag_dir / MANIFEST_NAME
    with open(target, "w", encoding="utf-8") as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def check_manifest(tag_dir: Path) -> str:
    """'' when `tag_dir` holds every file its manifest lists, as the save wrote it; else what differs.

    A tag without a manifest (saved by an older ds_engine) passes here; the state files are still
    checked by loading them. Never raises for a damaged tag: the answer is the problem, in words.
    """
    path = tag_dir / MANIFEST_NAME
    if not os.path.lexists(path):
        return ""
    try:
        manifest = read_json_bounded(path, "the manifest is truncated or corrupt.")
    except (OSError, ValueError) as exc:
        return f"its manifest {MANIFEST_NAME} cannot be read ({exc})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return f"its manifest {MANIFEST_NAME} is not one ds_engine writes"
    for name, entry in sorted(files.items()):
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            return f"its manifest {MANIFEST_NAME} has a bad entry for {name!r}"
        file = tag_dir / name
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            return f"{name} is missing (the save wrote {entry['size']} bytes)"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size != entry["size"]:
            return f"{name} has {info.st_size} bytes, the save wrote {entry['size']}"
        if "crc32" in entry:
            try:
                crc = _crc32(file)
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror or exc})"
            if crc != entry["crc32"]:
                recorded = entry["crc32"]
                return (
                    f"{name} differs from what the save wrote (CRC-32 {crc:#010x}, recorded {recorded:#010x})"
                )
    return ""
