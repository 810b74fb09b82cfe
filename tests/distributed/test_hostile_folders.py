"""Hostile checkpoint folders through a real 2-rank DeepSpeed run (ZeRO-2): one launch.

Every case of `tests/hostile_corpus.py`'s `FOLDER_CASES` (a `latest` naming `..` or an absolute
path, a link to another checkpoint or a system file, a FIFO in place of a state file ...)
is planted into a copy of a real checkpoint and loaded with `Engine.load_checkpoint` on both
ranks: each rank stops at once with the same error, naming the file (a FIFO never blocks a
rank until the collective timeout), and a stray file no load needs leaves the load alone.
"""

from __future__ import annotations

import re

import pytest

from tests.distributed.launcher import run_workers
from tests.hostile_corpus import FOLDER_CASES, SECRET_LINE

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile_folders")
    return run_workers("hostile_folders.py", out_dir=out, timeout=600)


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[c.name for c in FOLDER_CASES])
def test_every_rank_gets_the_same_error_at_once(ranks, case) -> None:
    errors = [r["errors"][case.name] for r in ranks]
    assert errors[0] == errors[1], errors
    if case.refused is None:
        assert errors[0] is None
        return
    assert errors[0] is not None and re.search(case.refused.format(victim=ranks[0]["victim"]), errors[0]), (
        errors
    )
    assert SECRET_LINE not in errors[0]
