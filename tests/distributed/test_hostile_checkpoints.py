"""Hostile checkpoint files through a real 2-rank DeepSpeed run (ZeRO-2, bf16): one launch.

Every file of `tests/hostile_corpus.py` (each shown to run its payload when unpickled without
restrictions, in `tests/unit/test_untrusted_files.py`) replaces one file of a real ds_engine
DeepSpeed checkpoint and is tried through `Engine.load_checkpoint`, DeepSpeed's own loader in
ds_engine's restricted scope, universal conversion (fresh and cached) and `ds-engine
consolidate`. Each is refused on every rank with an error naming the file, and no payload
leaves a trace; the untouched checkpoint still loads, converts and consolidates.
"""

from __future__ import annotations

import re

import pytest

from ds_engine.safety import DEEPSPEED_GLOBALS
from tests.distributed.launcher import run_workers
from tests.hostile_corpus import CASES

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]

REFUSED = "UnsafeCheckpointError: refusing to load `{path}`: unpickling it needs .+ HINT: .+"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    return run_workers("hostile_checkpoints.py", out_dir=out, timeout=600)


def _refused(error: str | None, path: str) -> bool:
    return (
        error is not None
        and re.fullmatch(REFUSED.format(path=f".*/{re.escape(path)}"), error, re.S) is not None
    )


def test_no_payload_ran_on_any_rank(ranks) -> None:
    assert [r["traces"] for r in ranks] == [[], []]


def test_engine_load_checkpoint_refuses_every_file_on_every_rank(ranks) -> None:
    assert {r["files"][i % len(r["files"])] for r in ranks for i in range(len(CASES))} == set(
        ranks[0]["files"]
    )
    for result in ranks:
        for index, case in enumerate(CASES):
            victim, error = result["engine"][case.name]
            assert _refused(error, f"h{index}/{victim}"), (case.name, error)


def test_deepspeeds_own_loader_is_restricted(ranks) -> None:
    for result in ranks:
        for index, case in enumerate(CASES):
            victim, error = result["deepspeed"][case.name]
            assert _refused(error, f"d{index}/{victim}"), (case.name, error)


def test_a_cached_universal_checkpoint_is_read_restricted_and_every_rank_gets_the_error(ranks) -> None:
    for case, (victim, error) in ranks[0]["cached_universal"].items():
        assert victim.endswith("fp32.pt") and _refused(error, victim), (case, error)
        assert ranks[1]["cached_universal"][case][1] == error  # the same error on rank 1


def test_universal_conversion_refuses_every_file(ranks) -> None:
    for index, case in enumerate(CASES):
        victim, error, leftover = ranks[0]["universal"][case.name]
        assert _refused(error, f"u{index}/{victim}"), (case.name, error)
        assert not leftover


def test_ds_engine_consolidate_refuses_every_file(ranks) -> None:
    for index, case in enumerate(CASES):
        victim, code, stderr = ranks[0]["consolidate"][case.name]
        errors = [line for line in stderr.splitlines() if line.startswith("ds-engine: error:")]
        assert code == 2 and len(errors) == 1, (case.name, stderr)  # above it: zero_to_fp32's progress bar
        assert re.fullmatch(
            rf"ds-engine: error: refusing to load `.*/c{index}/{re.escape(victim)}`: .+ HINT: .+", errors[0]
        ), (case.name, errors[0])


def test_the_real_checkpoint_still_loads_converts_and_consolidates(ranks) -> None:
    for result in ranks:
        assert result["good_load"] is None and result["good_universal_load"] is None, result
    assert ranks[0]["good_consolidate"] == 0


def test_the_allowlist_covers_what_the_real_checkpoint_holds(ranks) -> None:
    found = set(ranks[0]["globals"])
    assert found and found <= set(DEEPSPEED_GLOBALS), found
