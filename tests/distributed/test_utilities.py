"""accelerate-named utilities on both backends, in real 2-rank CPU groups."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.distributed.launcher import exit_probes, run_workers

pytestmark = pytest.mark.distributed


def _check(ranks: list[dict], backend: str) -> None:
    r0, r1 = ranks
    assert (r0["backend"], r1["backend"]) == (backend, backend)
    assert (r0["rank"], r1["rank"], r0["world"], r1["world"]) == (0, 1, 2, 2)
    assert r0["is_main"] and not r1["is_main"]
    assert r0["is_local_main"] and not r1["is_local_main"]
    assert r0["device"] == "cpu" and r0["unwrapped_is_original"] and r1["unwrapped_is_original"]
    assert r0["ds_config_is_none"] == (backend == "accelerate")
    # distinct samples per rank, all covered, a new order next epoch
    assert not set(r0["epoch0"]) & set(r1["epoch0"])
    assert sorted(r0["epoch0"] + r1["epoch0"]) == list(range(20))
    assert sorted(r0["epoch1"] + r1["epoch1"]) == list(range(20))
    assert r0["epoch0"] != r0["epoch1"]
    assert r0["gather"] == r1["gather"] == [0.0, 10.0, 11.0]
    assert r0["gather_dict"] == [0, 1]
    assert r0["metrics_samples"] == [float(i) for i in range(7)]
    assert r0["reduce_sum"] == 3.0 and r0["reduce_mean"] == 1.5
    assert r0["printed"] == "hello from 0\n" and r1["printed"] == ""
    assert r0["order"] == ["0", "1"]
    assert r0["autocast_ok"] and r1["autocast_ok"]
    assert not r0["group_alive_after_end_training"] and not r1["group_alive_after_end_training"]
    assert "end_training() destroyed" in r0["after_end"]


def _run(backend: str) -> None:
    out = Path(tempfile.mkdtemp(prefix="ds_engine_utilities_"))
    _check(run_workers("utilities.py", "--backend", backend, out_dir=out), backend)
    assert exit_probes(out) == [False, False]


def test_utilities_on_the_accelerate_fallback():
    _run("accelerate")


@pytest.mark.deepspeed
def test_utilities_on_deepspeed():
    _run("deepspeed")
