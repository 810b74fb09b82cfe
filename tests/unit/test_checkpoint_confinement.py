"""A checkpoint folder is read only inside itself, and only as regular files.

Every case of the hostile-folder corpus (`tests/hostile_corpus.py`: `latest` naming `..` or an
absolute path, links to another checkpoint or a system file, FIFOs, an oversized `latest`,
a `tag=` that is a path) is planted into a copy of a good checkpoint beside another good one,
`outside`, with other weights. `Engine.load_checkpoint` (fallback) and `ds-engine consolidate`
(a DeepSpeed ZeRO-0 layout) must stop with the pinned error, naming the file, never showing
what a link points to, never blocking, and never reading `outside`; a stray file no load
needs is left alone and the checkpoint loads. Junk beside the tags never fails the listing
nor counts as the newest tag; bad metadata is refused with the file and key named.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ds_engine.checkpoint import CHECKPOINT_META_NAME, _tags, resolve_checkpoint
from ds_engine.cli import main
from tests.helpers import micro_step, prepared_linear, quiet_fallback
from tests.hostile_corpus import FOLDER_CASES, SECRET_LINE, HostileFolder

TAG = "t1"


def _prepared(seed: int = 0) -> tuple[Any, ...]:
    return prepared_linear(quiet_fallback(), seed=seed)


def _fallback_checkpoint(folder: Path, seed: int) -> torch.Tensor:
    """A fallback checkpoint with tag `TAG` in `folder`; returns its saved weight."""
    engine, model, optimizer, loader = _prepared(seed)
    micro_step(engine, model, optimizer, next(iter(loader)))
    engine.save_checkpoint(folder, tag=TAG)
    return engine.unwrap_model(model).weight.detach().clone()


def _zero0_checkpoint(folder: Path, seed: int) -> torch.Tensor:
    """The layout DeepSpeed writes at ZeRO-0 (what `consolidate` reads), tag `TAG`."""
    (folder / TAG).mkdir(parents=True)
    (folder / "latest").write_text(TAG)
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 1).state_dict()
    torch.save({"module": module}, folder / TAG / "mp_rank_00_model_states.pt")
    return module["weight"]


def _ids(cases: tuple[HostileFolder, ...]) -> list[str]:
    return [c.name for c in cases]


@pytest.mark.timeout(120)  # a FIFO that is opened blocks forever: fail instead
@pytest.mark.parametrize("case", FOLDER_CASES, ids=_ids(FOLDER_CASES))
def test_engine_load_checkpoint_stays_inside_the_folder(tmp_path: Path, case: HostileFolder) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    mine = _fallback_checkpoint(root, seed=0)
    theirs = _fallback_checkpoint(outside, seed=1)
    assert not torch.equal(mine, theirs)
    tag = case.plant(root, TAG, "model_states.pt", outside)
    engine, model, *_ = _prepared(seed=2)
    if case.refused is None:
        engine.load_checkpoint(root, tag=tag)
        assert torch.equal(engine.unwrap_model(model).weight, mine)
        return
    with pytest.raises(ValueError) as raised:
        engine.load_checkpoint(root, tag=tag)
    message = str(raised.value)
    assert re.search(case.refused.format(victim="model_states.pt"), message), message
    assert SECRET_LINE not in message
    assert not torch.equal(engine.unwrap_model(model).weight, theirs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", FOLDER_CASES, ids=_ids(FOLDER_CASES))
def test_consolidate_stays_inside_the_folder(
    tmp_path: Path, case: HostileFolder, capsys: pytest.CaptureFixture[str]
) -> None:
    root, outside, out = tmp_path / "ckpt", tmp_path / "outside", tmp_path / "out"
    mine = _zero0_checkpoint(root, seed=0)
    _zero0_checkpoint(outside, seed=1)
    victim = "mp_rank_00_model_states.pt"
    tag = case.plant(root, TAG, victim, outside)
    status = main(["consolidate", str(root), str(out)] + (["--tag", tag] if tag is not None else []))
    error = capsys.readouterr().err
    if case.refused is None:
        assert status == 0, error
        assert torch.equal(load_file(out / "model.safetensors")["weight"], mine)
        return
    assert status == 2
    assert re.fullmatch(r"ds-engine: error: .*\n", error), error
    assert re.search(case.refused.format(victim=victim), error), error
    assert SECRET_LINE not in error
    assert not out.exists()


# --------------------------------------------------------------------------- junk beside the tags
def _junk(root: Path) -> None:
    """Siblings of the real tag that are no complete tag, each newer than it if it counted."""
    later = 4e9  # saved "in 2096"

    def meta_folder(name: str, meta: Any, *, state: bool = True) -> Path:
        folder = root / name
        folder.mkdir()
        text = meta if isinstance(meta, str) else json.dumps(meta)
        (folder / CHECKPOINT_META_NAME).write_text(text)
        if state:
            shutil.copy(root / TAG / "engine_state.pt", folder / "engine_state.pt")
        return folder

    good = json.loads((root / TAG / CHECKPOINT_META_NAME).read_text())
    meta_folder("meta_is_a_list", [good])
    meta_folder(
        "meta_without_backend", {k: v for k, v in {**good, "saved_at": later}.items() if k != "backend"}
    )
    meta_folder("meta_nested_deep", "[" * 100_000 + "]" * 100_000)
    meta_folder("meta_saved_at_text", {**good, "saved_at": "tomorrow"})
    meta_folder("no_engine_state", {**good, "saved_at": later}, state=False)
    (root / "linked").symlink_to(root / TAG, target_is_directory=True)
    (root / ".hidden").mkdir()
    (root / "notes.txt").write_text("x")


def test_junk_siblings_never_fail_the_listing_nor_count_as_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _fallback_checkpoint(root, seed=0)
    _junk(root)
    assert _tags(root) == [TAG]
    engine, model, optimizer, loader = _prepared()
    micro_step(engine, model, optimizer, next(iter(loader)))
    engine.save_checkpoint(root, tag="t2", keep_last=1)  # rotation removes the old tag, no junk
    assert _tags(root) == ["t2"]
    assert {p.name for p in root.iterdir()} >= {"meta_is_a_list", "no_engine_state", "linked", "notes.txt"}


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        (
            "meta_is_a_list",
            r"meta_is_a_list/ds_engine_meta\.json' holds a JSON list; allowed: a JSON object .*HINT",
        ),
        (
            "meta_without_backend",
            r"meta_without_backend/ds_engine_meta\.json': `backend` is missing; allowed: a backend "
            r"name .*HINT",
        ),
        (
            "meta_nested_deep",
            r"meta_nested_deep/ds_engine_meta\.json' is not valid JSON \(it nests deeper than can be "
            r"parsed\)\. HINT",
        ),
        (
            "meta_saved_at_text",
            r"meta_saved_at_text/ds_engine_meta\.json': `saved_at` is 'tomorrow'; allowed: a time in "
            r"seconds\. HINT",
        ),
    ],
)
def test_bad_metadata_names_the_file_and_key(tmp_path: Path, tag: str, message: str) -> None:
    root = tmp_path / "ckpt"
    _fallback_checkpoint(root, seed=0)
    _junk(root)
    with pytest.raises(ValueError, match=message):
        resolve_checkpoint(root, tag)


def test_oversized_metadata_is_refused_unread(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _fallback_checkpoint(root, seed=0)
    (root / TAG / CHECKPOINT_META_NAME).write_text(" " * (3 * 1024**2) + "{}")
    with pytest.raises(ValueError, match=r"ds_engine_meta\.json' is 3\.0 MiB, more than the 1\.0 MiB .*HINT"):
        resolve_checkpoint(root)
