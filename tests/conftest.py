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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test marked `deepspeed` must never be silently skipped: in the DeepSpeed-free
    # environment scripts/test.sh deselects them with -m "not deepspeed"; anywhere else a
    # missing DeepSpeed is a failure, not a skip.
    for item in items:
        if item.get_closest_marker("nodeepspeed") and is_deepspeed_available():
            item.add_marker(pytest.mark.skip(reason="runs only where DeepSpeed is not installed"))
