"""Token-weighted accumulation: `engine.windows(loader)` + `backward(loss_sum, num_items=...)`
applies the window's token mean at every boundary, for every window length, on every backend.

The data gives each sequence its own number of label tokens, so the token mean and the mean of
per-batch means differ (the worker reports by how much; the test requires a clear gap, so a
divisor that fell back to the window length would fail). Windows ``[GA, r]`` for GA in 1..4 and
every r in 1..GA (see workers/token_weighted.py).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GAS = [1, 2, 3, 4]
WHOLE_GRADIENT_RTOL = 1e-4
PER_TENSOR_RTOL = 2e-2


def _check(results: list[dict]) -> None:
    for r in results:
        label = f"{r['backend']} zero{r['zero_stage']} coalesce={r.get('coalesce', False)}"
        assert r["mean_of_means_gap"] > 100 * WHOLE_GRADIENT_RTOL, "the data does not tell the means apart"
        expected_windows = [(ga, last) for ga in r["gas"] for last in range(1, ga + 1)]
        assert [(w["ga"], w["last"]) for w in r["windows"]] == expected_windows, label
        for w in r["windows"]:
            ga, last = w["ga"], w["last"]
            assert w["sizes"] == [ga, last], (label, w)
            assert w["boundaries"] == [False] * (ga - 1) + [True] + [False] * (last - 1) + [True], (label, w)
        assert r["num_boundaries"] == r["num_reference_windows"] == 2 * len(expected_windows), label
        windows = [(ga, last, which) for ga, last in expected_windows for which in ("first", "last")]
        for (ga, last, which), err, tensor_err, tensor in zip(
            windows, r["errors"], r["tensor_errors"], r["worst_tensor"]
        ):
            where = f"{label} GA={ga} last window={last} ({which} window)"
            assert err < WHOLE_GRADIENT_RTOL, f"{where}: applied gradient off by {err:.2e} (relative)"
            assert tensor_err < PER_TENSOR_RTOL, f"{where}: `{tensor}` off by {tensor_err:.2e} (relative)"


def _scenarios(backend: str, settings: list[tuple[int, bool]]) -> str:
    return json.dumps(
        [
            {"backend": backend, "zero_stage": stage, "coalesce": coalesce, "gas": GAS}
            for stage, coalesce in settings
        ]
    )


@pytest.mark.deepspeed
def test_deepspeed_applies_the_window_token_mean_for_every_window_length():
    scenarios = _scenarios(
        "deepspeed", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
    )
    _check(run_workers("token_weighted.py", "--scenarios", scenarios, timeout=900)[0]["results"])


def test_the_fallback_applies_the_window_token_mean_for_every_window_length():
    _check(
        run_workers("token_weighted.py", "--scenarios", _scenarios("accelerate", [(0, False)]))[0]["results"]
    )
