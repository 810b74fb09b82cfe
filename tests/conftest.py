"""Shared test set-up: offline Hugging Face, markers checked against the environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ds_engine._imports import is_deepspeed_available

try:  # a dev dependency; the property tests import it themselves and fail loudly without it
    from hypothesis import settings
except ImportError:  # pragma: no cover
    pass
else:
    # "ci" (the default): a bounded, reproducible search that adds well under a minute;
    # HYPOTHESIS_PROFILE=thorough searches longer (and randomly) when working on the builder.
    settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, print_blob=True)
    settings.register_profile("thorough", max_examples=3000, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The quick tier (`pytest -m quick`, about 3 minutes on 2 cores): every unit test not marked
# `slow`, and these real 2-rank launches, which check the core semantics end to end (the
# window mean for every window length, parity with a one-process reference, every loop shape,
# the schedule and overflow rules, hand-written accumulation, exact resume, the quick start).
QUICK_DISTRIBUTED = (
    "tests/distributed/test_window_exact.py::test_deepspeed_zero_0_and_1_",
    "tests/distributed/test_window_exact.py::test_fallback_ddp_and_fsdp2_",
    "tests/distributed/test_parity.py::test_deepspeed_zero_0_to_3_match_the_big_batch_reference",
    "tests/distributed/test_parity.py::test_accelerate_fallback_matches_the_reference_and_reduces_once",
    "tests/distributed/test_loop_shapes.py::",
    "tests/distributed/test_schedule_convention.py::",
    "tests/distributed/test_overflow.py::test_deepspeed_fp16_and_bf16_",
    "tests/distributed/test_overflow.py::test_fallback_skips_non_finite_steps",
    "tests/distributed/test_hand_accumulation.py::",
    "tests/distributed/test_resume.py::test_resume_equals_uninterrupted_run_exactly",
    "tests/distributed/test_examples.py::test_quickstart_",
)


def _is_quick(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow"):
        return False
    if item.nodeid.startswith("tests/unit/"):
        return True
    return item.nodeid.startswith(QUICK_DISTRIBUTED)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
    # A test marked `deepspeed` must never be silently skipped: in the DeepSpeed-free
    # environment scripts/test.sh deselects them with -m "not deepspeed"; anywhere else a
    # missing DeepSpeed is a failure, not a skip.
    for item in items:
        if item.get_closest_marker("nodeepspeed") and is_deepspeed_available():
            item.add_marker(pytest.mark.skip(reason="runs only where DeepSpeed is not installed"))
