"""A process group the host formed before the Engine is borrowed: the Engine trains on it and
never destroys it; a group the Engine formed is still torn down (see `workers/borrowed_group.py`)."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import exit_probes, free_port, run_workers

pytestmark = [pytest.mark.distributed]

BACKENDS = [pytest.param("deepspeed", marks=pytest.mark.deepspeed), "accelerate"]


def _check(ranks: list[dict]) -> None:
    for r in ranks:
        assert "error" not in r, f"{r['error']}\n{r.get('tb')}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("env", ["keep", "strip"])
def test_a_group_the_host_formed_survives_end_training(backend, env):
    ranks = run_workers(
        "borrowed_group.py", "--backend", backend, "--group", "host", "--env", env,
        "--port", str(free_port()), timeout=600,
    )  # fmt: skip
    _check(ranks)
    for r in ranks:
        for run in ("first", "second"):
            facts = r[run]
            assert facts["owns"] is False, (run, facts)
            assert facts["place"] == [r["rank"], 2, r["rank"]], (run, facts)
            assert facts["steps"] == 2 and facts["alive_after_end"] is True, (run, facts)
        assert r["all_reduce"] == 3.0  # 1 + 2 over the host's group, after end_training
        # the same training on the borrowed group as on one the Engine forms itself
        assert r["first"]["losses"] == r["second"]["losses"]
        if env == "strip":  # the launcher's variables, taken from the group
            assert r["env_after"] == {"RANK": str(r["rank"]), "WORLD_SIZE": "2", "LOCAL_RANK": str(r["rank"])}
    assert ranks[0]["first"]["losses"] == ranks[1]["first"]["losses"]  # reduced across ranks


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_the_engine_formed_is_destroyed_by_end_training(backend, tmp_path):
    out = tmp_path / "out"
    ranks = run_workers(
        "borrowed_group.py", "--backend", backend, "--group", "engine", out_dir=out, timeout=600
    )
    _check(ranks)
    for r in ranks:
        facts = r["first"]
        assert facts["owns"] is True and facts["alive_after_end"] is False, facts
        assert facts["steps"] == 2
    assert exit_probes(out) == [False, False]
