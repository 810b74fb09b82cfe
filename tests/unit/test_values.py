"""The shared value helpers: one `parse_size` for every size ds_engine reads (shards, budgets)."""

from __future__ import annotations

import pytest

from ds_engine._values import _is_int, _is_number, parse_size


# Moved from test_checkpoint_io.py (checkpoint's `max_shard_size`).
@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30), ("10kb", 10_000), (123, 123), ("7", 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5XB", "GB", "", "-1GB", 0, -5, 1.5, True])
def test_parse_size_errors_name_the_value(bad):
    with pytest.raises(ValueError, match=r"`max_shard_size`=.* HINT"):
        parse_size(bad, name="max_shard_size")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5G", 5 * 10**9),  # what `ds-engine estimate --budget` took and `consolidate` refused
        ("5GB", 5 * 10**9),
        ("500MiB", 500 * 2**20),
        ("500MB", 500 * 10**6),
        ("30KB", 30_000),
        ("80gb", 80 * 10**9),
        ("512GiB", 512 * 2**30),
        ("1.5e9", 1_500_000_000),
        ("2T", 2 * 10**12),
        (" 7 B ", 7),
        (4096, 4096),
    ],
)
def test_one_parser_takes_the_union_of_units(text, expected):
    assert parse_size(text) == expected


def test_unnamed_sizes_read_as_the_memory_estimator_words_them():
    with pytest.raises(ValueError, match=r"^size '80XB' is not understood; allowed: .* HINT"):
        parse_size("80XB")
    with pytest.raises(ValueError, match=r"^size '0' must be positive"):
        parse_size("0")
    with pytest.raises(ValueError, match=r"^`max_shard_size`='lots' is not understood"):
        parse_size("lots", name="max_shard_size")


def test_int_and_number_tests_refuse_booleans():
    assert _is_int(3) and not _is_int(True) and not _is_int(3.0)
    assert _is_number(3) and _is_number(2.5) and not _is_number(False) and not _is_number(float("nan"))
