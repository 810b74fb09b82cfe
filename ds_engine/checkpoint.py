"""Training checkpoints: `Engine.save_checkpoint` / `Engine.load_checkpoint`, resumable exactly.

A training checkpoint is a folder `directory/` holding one sub-folder per tag and a `latest`
file naming the newest tag:

  directory/latest                      the newest tag (written last, atomically)
  directory/<tag>/ds_engine_meta.json   backend, ZeRO stage, world size, precision, versions
  directory/<tag>/engine_state.pt       counters, scheduler, dataloader positions, client_state
  directory/<tag>/rng_state_rank<R>.pt  python / numpy / torch RNG of rank R
  directory/<tag>/config.json           the model's HF config (so `ds-engine consolidate` finds it)
  directory/<tag>/...                   the backend's own state files (`Backend.save_states`):
                                        DeepSpeed's `mp_rank_00_model_states.pt` and
                                        `*zero_pp_rank_*_optim_states.pt`, or on the fallback
                                        `model_states.pt` + `optimizer_states.pt` (full states)

A tag is written into `directory/.<tag>.tmp/<tag>` by every rank, then rank 0 renames it into
place after a barrier, so a crash never leaves a tag folder that looks complete. This assumes
the ranks share a filesystem (as DeepSpeed's own `latest` file does). Every file is read by
torch's weights-only unpickler with an explicit allowlist (`ds_engine.safety`): ds_engine's
own files directly, the backend's with the allowlist its class names.

The checkpointer is handed what it saves: the `Backend` (its hooks write and read the model
and optimizer states, say what the metadata records and whether a tag can be loaded), the
user's module, and the Engine as a `TrainingState` (its public step facts and its
`state_dict()` / `load_state_dict()`); it reads no private field of either.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ds_engine._async_save import BackgroundSave, deferred_writes, side_group, wait_for_pending
from ds_engine._checkpoint_state import (
    CHECKPOINT_FORMAT,
    _check_engine_state,
    _is_int,
    _short,
    capture_rng_state,
    restore_rng_state,
    rng_state_name,
)
from ds_engine._io import (
    broadcast_from_rank0,
    current_rank,
    fsync_dir,
    fsync_file,
    gather_failures,
    listing,
    load_safe,
    publish,
    raise_problem,
    remove_tree,
    save_safe,
    world_size,
    write_json,
)
from ds_engine._values import parse_size  # re-exported: the one size parser
from ds_engine.consolidate import consolidate_hint
from ds_engine.manifest import write_manifest
from ds_engine.safety import (
    TAG_RE,
    check_regular_file,
    confined_tag,
    read_json_bounded,
    restricted_load,
)
from ds_engine.weights import is_hf_model, save_hf_config

if TYPE_CHECKING:
    from ds_engine.backends.base import Backend

__all__ = [
    "CHECKPOINT_META_NAME",
    "ENGINE_STATE_NAME",
    "LATEST_NAME",
    "TrainingState",
    "capture_rng_state",
    "load_training_checkpoint",
    "parse_size",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_training_checkpoint",
    "wait_for_checkpoint",
]

CHECKPOINT_META_NAME = "ds_engine_meta.json"
ENGINE_STATE_NAME = "engine_state.pt"
LATEST_NAME = "latest"
_TAG_RE = TAG_RE  # one definition of a tag name, shared with the readers


class TrainingState(Protocol):
    """What the checkpointer needs of the Engine: public step facts and its `state_dict` pair."""

    @property
    def sync_gradients(self) -> bool: ...
    @property
    def has_unapplied_gradients(self) -> bool: ...
    @property
    def num_micro_steps(self) -> int: ...
    @property
    def num_optimizer_steps(self) -> int: ...
    @property
    def num_skipped_steps(self) -> int: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# --------------------------------------------------------------------------- metadata
def _engine_state(state: TrainingState, client_state: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"format": CHECKPOINT_FORMAT, **state.state_dict(), "client_state": dict(client_state or {})}


def _checkpoint_meta(backend: Backend, state: TrainingState, tag: str) -> dict[str, Any]:
    import time

    from ds_engine._version import __version__

    meta: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "tag": tag,
        "zero_stage": None,  # these two are filled in by the backends that have them
        "deepspeed_version": None,
        "world_size": world_size(),
        "gradient_accumulation_steps": int(state.gradient_accumulation_steps),
        "num_optimizer_steps": int(state.num_optimizer_steps),
        "ds_engine_version": __version__,
        "torch_version": torch.__version__,
        "saved_at": time.time(),
    }
    meta.update(backend.checkpoint_metadata())  # backend, precision, ...
    return meta


def _check_tag_name(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST_NAME or tag.endswith(".tmp"):
        raise ValueError(
            f"`tag`={tag!r} is not a usable tag; allowed: letters, digits and _ . + = - (not starting "
            f"with '.' or '-', not {LATEST_NAME!r}, no '/'). HINT: use tag='step_100'."
        )


def _tags(directory: Path) -> list[str]:
    """The complete ds_engine checkpoint tags in `directory`, oldest first (by `saved_at`).

    A complete tag is a real sub-folder (not a link) with a plain tag name, whose metadata
    reads as a ds_engine tag's (`_read_meta`) and which holds its engine state as a regular
    file. Anything else beside them (junk, a link, a half-copied folder) is no tag: it never
    fails this listing, is never "the newest", and is never removed by rotation.
    """
    found = []
    try:
        subs = list(directory.iterdir()) if directory.is_dir() else []
    except OSError:
        subs = []
    for sub in subs:
        if not _is_tag_name(sub.name) or sub.is_symlink() or not sub.is_dir():
            continue
        try:
            meta = _read_meta(sub)
            check_regular_file(sub / ENGINE_STATE_NAME)
        except (OSError, ValueError):
            continue
        found.append((float(meta["saved_at"]), sub.name))
    return [name for _, name in sorted(found)]


def _is_tag_name(name: str) -> bool:
    return bool(_TAG_RE.match(name)) and name != LATEST_NAME and not name.endswith(".tmp")


# --------------------------------------------------------------------------- save
def save_training_checkpoint(
    directory: str | os.PathLike[str],
    *,
    backend: Backend,
    model: nn.Module | None,
    state: TrainingState,
    tag: str | None = None,
    client_state: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    blocking: bool = True,
) -> Path:
    """Write a resumable checkpoint (collective: every rank calls it).

    See `Engine.save_checkpoint` for the contract; this is its implementation. A background
    save still in flight is waited for first (and its error raised).

    Args:
        directory: Checkpoint folder (holds tags and `latest`).
        backend: The backend that trains `model`; it writes the model and optimizer states.
        model: The user's (unwrapped) module; None before `prepare`.
        state: The Engine: its counters and `state_dict()` are saved.
        tag, client_state, keep_last: As in `Engine.save_checkpoint`.
        blocking: False copies the state to host memory now and writes the files, publishes
            the tag and rotates on a background thread (`ds_engine._async_save`); the next
            save, `load_training_checkpoint` and `wait_for_checkpoint` wait for it and raise
            its error on every rank.

    Returns:
        The tag folder, ``directory/<tag>`` (published once the save is complete).
    """
    wait_for_checkpoint()
    if model is None:
        raise RuntimeError(
            "`save_checkpoint` before `prepare`: there is no model to save. HINT: call "
            "`engine.prepare(model, optimizer, ...)` first."
        )
    if not state.sync_gradients or state.has_unapplied_gradients:
        raise RuntimeError(
            f"`save_checkpoint` in the middle of an accumulation window (micro-step "
            f"{state.num_micro_steps}, GA={state.gradient_accumulation_steps}): the gradients "
            "accumulated so far are not saved. HINT: save right after `optimizer.step()` at a boundary, "
            "i.e. when `engine.sync_gradients` is True."
        )
    if tag is None:
        tag = f"step_{state.num_optimizer_steps + state.num_skipped_steps}"
    _check_tag_name(tag)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"`keep_last`={keep_last!r} must be a positive int or None (keep all). HINT: keep_last=3."
        )
    if not isinstance(blocking, bool):
        raise ValueError(f"`blocking`={blocking!r} must be True or False. HINT: blocking=False.")
    target_root = Path(directory).absolute()
    rank = current_rank()
    problem = None
    if rank == 0 and target_root.exists() and not target_root.is_dir():
        problem = (
            "ValueError",
            f"`directory`={str(target_root)!r} is a file, not a folder. HINT: pass a folder path "
            "(created if missing).",
        )
    raise_problem(broadcast_from_rank0(problem))
    save = _TagSave(target_root, tag, rank, keep_last, backend)
    save.stage()  # the ranks meet here
    group = None if blocking else side_group()
    with contextlib.ExitStack() as stack:
        writes = None if blocking else stack.enter_context(deferred_writes())
        try:
            save.write(backend, model, state, client_state)
        except BaseException as exc:  # every rank must still reach the agreement
            save.error = exc
    if writes is None:
        save.finish(save.error)
    else:
        BackgroundSave(writes, lambda error: save.finish(error, group), save.error).start()
    return target_root / tag


def wait_for_checkpoint() -> None:
    """Wait for the background checkpoint save in flight, if any (`blocking=False`), and raise
    its error: the same on every rank, as a blocking save's failures are (collective in effect:
    call it on every rank at the same point, e.g. at the end of training)."""
    wait_for_pending()


class _TagSave:
    """One tag's save: staged by every rank in `directory/.<tag>.tmp/<tag>`, published by rank 0."""

    def __init__(self, target_root: Path, tag: str, rank: int, keep_last: int | None, backend: Backend):
        self.target_root, self.tag, self.rank, self.keep_last = target_root, tag, rank, keep_last
        self.backend = backend
        self.staging_root = target_root / f".{tag}.tmp"
        self.staging = self.staging_root / tag
        self.error: BaseException | None = None
        self.made_root = False  # rank 0: this save made `directory` (removed again, empty, if it fails)

    def stage(self) -> None:
        """Rank 0 makes the staging folder; every rank raises its failure (collective)."""
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(self.staging_root, ignore_errors=True)
                self.made_root = not self.target_root.exists()
                self.staging.mkdir(parents=True)
            except OSError as exc:
                error = _staging_failure(exc, self.target_root, self.staging_root)
        _raise_save_failure(error, gather_failures(error), self.target_root, self.tag)

    def write(
        self, backend: Backend, model: nn.Module, state: TrainingState, client_state: Mapping[str, Any] | None
    ) -> None:
        """Every rank's files into the staging folder (the backend's states, the RNG; rank 0's own)."""
        staging, staging_root = self.staging, self.staging_root
        backend.save_states(staging_root, self.tag)
        save_safe(capture_rng_state(), staging / rng_state_name(self.rank), "the RNG state")
        if self.rank == 0:
            save_safe(_engine_state(state, client_state), staging / ENGINE_STATE_NAME, "`client_state`")
            if is_hf_model(model):
                save_hf_config(model, staging, None)
            write_json(staging / CHECKPOINT_META_NAME, _checkpoint_meta(backend, state, self.tag))
            # `latest`'s new content is written now, so publishing needs renames only (no space)
            (staging_root / LATEST_NAME).write_text(self.tag, encoding="utf-8")
            fsync_file(staging_root / LATEST_NAME)

    def finish(self, error: BaseException | None, group: Any = None) -> None:
        """Agree on the ranks' write errors (collective over `group`), then publish, `latest`,
        rotate; raise on every rank when any rank failed."""
        target_root, staging_root = self.target_root, self.staging_root
        failures = gather_failures(error, group)
        if not failures:
            if self.rank == 0:
                try:
                    write_manifest(self.staging)  # every rank's files are written: record the tag
                    publish(self.staging, target_root / self.tag)
                    os.replace(staging_root / LATEST_NAME, target_root / LATEST_NAME)
                    fsync_dir(target_root)
                except BaseException as exc:
                    error = exc
                else:  # published: the older tags may go now (a problem there is a warning only)
                    shutil.rmtree(staging_root, ignore_errors=True)
                    if self.keep_last is not None:
                        _rotate(target_root, self.tag, self.keep_last, self.backend)
            failures = gather_failures(error, group)  # every rank returns after the rotation
        if failures:
            if self.rank == 0:
                shutil.rmtree(staging_root, ignore_errors=True)
                if self.made_root:
                    with contextlib.suppress(OSError):
                        target_root.rmdir()  # only while empty: nothing but this save's is removed
            _raise_save_failure(error, failures, target_root, self.tag)


def _staging_failure(exc: OSError, target_root: Path, staging_root: Path) -> OSError:
    """The error for a checkpoint folder in which the staging folder cannot be made."""
    where = exc.filename or staging_root
    code = exc.errno or errno.EIO
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"make {str(target_root)!r} writable (or mount it read-write), or pass another `directory`"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        hint = f"free space on the filesystem of {str(target_root)!r}, or pass another `directory`"
    else:
        hint = "pass another `directory`"
    return OSError(
        code,
        f"{os.strerror(code)}: cannot create {str(where)!r}, the staging folder of a checkpoint in "
        f"{str(target_root)!r}. HINT: {hint}.",
    )


def _raise_save_failure(
    error: BaseException | None, failures: list[tuple[int, str, int | None]], target_root: Path, tag: str
) -> None:
    """Raise on every rank when any rank failed (`failures`, from `gather_failures`).

    A rank's own error that is no OSError (a bad `client_state`, ...) is raised as it is; every
    other rank raises an error naming the failing rank(s), the file and the cause, as an
    OSError of the first failure's errno where it has one (else RuntimeError).
    """
    if not failures:
        return
    if error is not None and not isinstance(error, OSError):
        raise error
    try:
        newest = _tags(target_root)
    except Exception:
        newest = []
    kept = f"{newest[-1]!r} is still the newest complete one" if newest else "there is no complete one"
    what = "; ".join(f"rank {rank} failed: {message.rstrip('.')}" for rank, message, _ in failures)
    message = (
        f"checkpoint {str(target_root / tag)!r} was not saved, nothing was published (of the "
        f"checkpoints in {str(target_root)!r}, {kept}): {what}."
    )
    code = error.errno if isinstance(error, OSError) else failures[0][2]
    if isinstance(code, int):
        raise OSError(code, message) from error
    raise (OSError if error is not None else RuntimeError)(message) from error


def _rotate(target_root: Path, tag: str, keep_last: int, backend: Backend) -> None:
    """Remove the oldest complete tags beyond `keep_last`, never `tag` (just published) and never
    anything that is not one of ours; a problem is a warning naming the folder, not an error."""
    import warnings

    try:
        old_tags = [old for old in _tags(target_root)[:-keep_last] if old != tag]
    except Exception as exc:  # the save itself succeeded
        warnings.warn(
            f"ds_engine: saved {str(target_root / tag)!r}, but could not list the older checkpoints "
            f"to keep only {keep_last} ({type(exc).__name__}: {exc}); nothing was removed.",
            stacklevel=4,
        )
        return
    for old in old_tags:
        for name in (old, *backend.checkpoint_companions(old)):
            path = target_root / name
            if path.is_symlink() or not path.is_dir():
                continue  # a link or a file is none of ours (and a missing companion is fine)
            problems = remove_tree(path)
            if problems:
                warnings.warn(
                    f"ds_engine: saved {str(target_root / tag)!r}, but could not fully remove the older "
                    f"checkpoint {str(path)!r} (keep_last={keep_last}): {problems[0]}. HINT: remove it "
                    "by hand.",
                    stacklevel=4,
                )


def has_complete_tag(directory: str | os.PathLike[str], tag: str) -> bool:
    """Whether `directory` holds `tag` as a complete, published checkpoint tag (no error ever)."""
    try:
        return tag in _tags(Path(directory))
    except Exception:
        return False


# --------------------------------------------------------------------------- load
def _read_meta(tag_dir: Path) -> dict[str, Any]:
    """A tag's `ds_engine_meta.json`: bounded (size, nesting), a dict of the keys loading reads.

    Raises:
        ValueError: The file is not valid JSON, of another format, or a key is missing or of
            the wrong type (named, with a HINT). UnsafeCheckpointError for a link or special file.
    """
    path = tag_dir / CHECKPOINT_META_NAME
    meta = read_json_bounded(path, "the file is truncated or corrupt; load an older tag with `tag=...`.")
    if not isinstance(meta, dict):
        raise ValueError(
            f"{str(path)!r} holds a JSON {type(meta).__name__}; allowed: a JSON object (the metadata "
            "ds_engine writes). HINT: the file was changed after ds_engine wrote it; restore it, or load "
            "an older tag with `tag=...`."
        )
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{str(path)!r} has format {_short(meta.get('format'))}; this ds_engine reads format "
            f"{CHECKPOINT_FORMAT}. HINT: load it with the ds_engine version that wrote it."
        )
    for key, (check, allowed) in _META_KEYS.items():
        if key in meta and check(meta[key]):
            continue
        found = f"is {_short(meta[key])}" if key in meta else "is missing"
        raise ValueError(
            f"checkpoint file {str(path)!r}: `{key}` {found}; allowed: {allowed}. HINT: the file was "
            "changed after ds_engine wrote it; restore it, or load an older tag with `tag=...`."
        )
    return meta


# What loading reads of a tag's metadata: key -> (check, what is allowed). Other keys are kept.
_META_KEYS: dict[str, tuple[Any, str]] = {
    "backend": (lambda v: isinstance(v, str) and bool(v), "a backend name such as 'deepspeed'"),
    "precision": (lambda v: isinstance(v, str), "a precision such as 'bf16'"),
    "world_size": (lambda v: _is_int(v, 1), "a positive int"),
    "zero_stage": (lambda v: v is None or _is_int(v, 0, 3), "null or 0, 1, 2, 3"),
    "saved_at": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"),
        "a time in seconds",
    ),
}


def resolve_checkpoint(
    directory: str | os.PathLike[str], tag: str | None = None
) -> tuple[str, Path, dict[str, Any]]:
    """Find and check a tag of a ds_engine training checkpoint (no process group needed).

    Args:
        directory: The folder given to `save_checkpoint`.
        tag: A tag in it; default: the one named in its `latest` file.

    Returns:
        (tag, tag folder, the tag's metadata).

    Raises:
        FileNotFoundError: The folder, its `latest` file, or the tag does not exist.
        ValueError: The folder is not a ds_engine checkpoint, or a file in it is truncated.
    """
    root = Path(directory).absolute()
    if not root.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(root)!r} does not exist (or is not a folder). HINT: pass the "
            "folder given to `engine.save_checkpoint`."
        )
    tags = _tags(root)
    if tag is None:
        latest = root / LATEST_NAME
        if not os.path.lexists(latest):
            if (root / CHECKPOINT_META_NAME).is_file():
                raise ValueError(
                    f"{str(root)!r} is a tag folder, not a checkpoint folder. HINT: pass its parent "
                    f"{str(root.parent)!r} with tag={root.name!r}."
                )
            raise ValueError(
                f"{str(root)!r} is not a ds_engine checkpoint: no `{LATEST_NAME}` file; found: "
                f"{listing(root)}. HINT: pass the folder given to `engine.save_checkpoint`"
                + (f", or one of its tags with `tag=` ({', '.join(tags)})." if tags else ".")
            )
    # a plain name of a real sub-folder: neither `latest` nor `tag=` reaches another folder
    tag, tag_dir = confined_tag(
        root, tag, option="tag=", tags=lambda: ", ".join(tags) or "none", latest=LATEST_NAME
    )
    if not os.path.lexists(tag_dir / CHECKPOINT_META_NAME):
        raise ValueError(
            f"{str(tag_dir)!r} is not a ds_engine checkpoint tag (no `{CHECKPOINT_META_NAME}`); found: "
            f"{listing(tag_dir)}. HINT: point at a folder written by `engine.save_checkpoint` (a raw "
            "DeepSpeed checkpoint can be turned into weights with `ds-engine consolidate`)."
        )
    meta = _read_meta(tag_dir)
    if not os.path.lexists(tag_dir / ENGINE_STATE_NAME):
        raise ValueError(
            f"{str(tag_dir)!r} lacks `{ENGINE_STATE_NAME}`; the checkpoint is incomplete. HINT: load "
            "an older tag with `tag=`."
        )
    # Every file a load reads goes through the restricted unpickler now (tensor data stays
    # mapped, unread; the pickle bounded): a truncated file, a link, a FIFO, or one asking for
    # anything off the allowlist, is refused here on rank 0 and the error reaches every rank,
    # instead of one rank failing inside DeepSpeed's collective load while the others wait.
    # DeepSpeed's own loads are restricted again later. Other files are never opened.
    safe_globals = _state_file_globals(meta.get("backend"))
    older = ", ".join(t for t in tags if t != tag) or "none other saved"
    for path in _state_files(tag_dir):
        restricted_load(
            path, safe_globals=safe_globals, mmap=True, hint=f"load an older tag with `tag=` ({older})."
        )
    return tag, tag_dir, meta


#: The state files a load reads (ds_engine's own; DeepSpeed's model, layer and ZeRO files; the
#: fallback's `model_states.pt` / `optimizer_states.pt`): DeepSpeed finds its files by these
#: shapes of name, so a file of another name in a tag folder is never read by anyone.
_STATE_FILE_PATTERNS = (ENGINE_STATE_NAME, "rng_state_rank*.pt", "*model_states.pt", "*optim*_states.pt")


def _state_files(tag_dir: Path) -> list[Path]:
    """The files of `tag_dir` a load of it reads (links and special files included: refused)."""
    names = {p.name for pattern in _STATE_FILE_PATTERNS for p in tag_dir.glob(pattern)}
    return [tag_dir / name for name in sorted(names)]


def _state_file_globals(backend_name: Any) -> tuple[Any, ...]:
    """The unpickler allowlist for the state files of the backend named in a tag's metadata."""
    from ds_engine.backends import backend_class

    try:
        return backend_class(str(backend_name)).checkpoint_safe_globals()
    except KeyError:  # not a backend this install knows: nothing beyond tensors and containers
        return ()


def _compatibility(backend: Backend, meta: Mapping[str, Any], tag_dir: Path) -> str:
    """'' when `backend` can load the tag `meta` describes, else the error message (rank 0)."""
    if meta["backend"] != backend.name:
        return (
            f"{str(tag_dir)!r} was written by the {meta['backend']!r} backend but this Engine runs "
            f"{backend.name!r}; their optimizer files differ. {consolidate_hint(tag_dir)}or resume with "
            f"Engine(backend={meta['backend']!r})."
        )
    return backend.check_checkpoint(meta, tag_dir) or _optimizer_problem(backend, meta, tag_dir)


def _unreadable(exc: OSError) -> str:
    """An OS error met reading a checkpoint (a folder in a file's place, no permission), in words."""
    where = f"checkpoint file {str(exc.filename)!r}" if exc.filename else "a checkpoint file"
    return (
        f"{where} cannot be read: {exc.strerror or exc}. HINT: a tag holds regular, readable files "
        "only; restore the file, or load an older tag with `tag=...`."
    )


def _optimizer_problem(backend: Backend, meta: Mapping[str, Any], tag_dir: Path) -> str:
    """'' unless the tag records another optimizer class than the one `backend` trains with
    (tags written before the class was recorded, or without an optimizer, are not compared)."""
    saved, current = meta.get("optimizer"), backend.checkpoint_metadata().get("optimizer")
    if saved is not None and not isinstance(saved, str):
        return (
            f"checkpoint file {str(tag_dir / CHECKPOINT_META_NAME)!r}: `optimizer` is {_short(saved)}; "
            "allowed: null or a class name such as 'torch.optim.adamw.AdamW'. HINT: the file was changed "
            "after ds_engine wrote it; restore it, or load an older tag with `tag=...`."
        )
    if saved is None or current is None or saved == current:
        return ""
    return (
        f"{str(tag_dir)!r} was written by a run whose optimizer is {saved} but this run's is {current}; "
        "the saved optimizer state (its per-parameter buffers and hyperparameters) belongs to the "
        f"former and would fail or mislead the latter. HINT: prepare the saved run's optimizer class "
        f"(`{saved.rsplit('.', 1)[-1]}`), or {consolidate_hint(tag_dir)[len('HINT: ') :]}and train on "
        "with the new optimizer."
    )


def load_training_checkpoint(
    directory: str | os.PathLike[str],
    *,
    backend: Backend,
    model: nn.Module | None,
    state: TrainingState,
    tag: str | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into `backend` and `state` (collective). See `Engine.load_checkpoint`.

    Args:
        directory: The folder given to `save_checkpoint`.
        backend: The backend that trains `model`; it reads the model and optimizer states.
        model: The prepared model; None before `prepare`.
        state: The Engine: its `load_state_dict` gets the saved counters, scheduler, positions.
        tag: The tag to load; default: the one named in `directory/latest`.

    Returns:
        The saved `client_state`.
    """
    wait_for_checkpoint()  # a background save still writing: its tag may be the one to load
    if model is None:
        raise RuntimeError(
            "`load_checkpoint` before `prepare`: there is nothing to load into. HINT: call "
            "`engine.prepare(model, optimizer, dataloader, scheduler)` with the same objects as the "
            "run that saved it, then `load_checkpoint`."
        )
    rank, world = current_rank(), world_size()
    outcome: Any = None
    if rank == 0:
        try:
            found_tag, tag_dir, meta = resolve_checkpoint(directory, tag)
            problem = _compatibility(backend, meta, tag_dir)
            if not problem:  # before anything is loaded: a bad engine state is refused whole
                _check_engine_state(load_safe(tag_dir / ENGINE_STATE_NAME), tag_dir / ENGINE_STATE_NAME)
            outcome = (("ValueError", problem) if problem else None, found_tag, meta)
        except (FileNotFoundError, ValueError) as exc:
            outcome = ((type(exc).__name__, str(exc)), None, None)
        except OSError as exc:  # a folder or an unreadable file where a file is read: every rank hears
            outcome = (("ValueError", _unreadable(exc)), None, None)
    problem, found_tag, meta = broadcast_from_rank0(outcome)
    raise_problem(problem)
    root = Path(directory).absolute()
    tag_dir = root / found_tag
    backend.load_states(root, found_tag, meta)
    saved = load_safe(tag_dir / ENGINE_STATE_NAME)
    try:
        state.load_state_dict(saved)
    except ValueError as exc:  # the positions do not fit the prepared objects: name the file
        raise ValueError(f"checkpoint file {str(tag_dir / ENGINE_STATE_NAME)!r}: {exc}") from None
    rng_path = tag_dir / rng_state_name(rank)
    if os.path.lexists(rng_path):  # a link or special file is refused by name, never skipped
        restore_rng_state(load_safe(rng_path))
    else:
        import warnings

        warnings.warn(
            f"ds_engine: the checkpoint was written by {meta['world_size']} ranks, so rank {rank} of "
            f"{world} has no saved RNG state; its RNG is left as it is.",
            stacklevel=3,
        )
    return dict(saved["client_state"])
