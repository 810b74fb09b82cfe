"""The project's generated sentiment data, and loading TSV/JSONL files through `datasets`."""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import pytest

from ds_engine.data import (
    ensure_sentiment_data,
    generate_sentiment_examples,
    load_sentiment_files,
    make_sentence,
    write_sentiment_data,
)

#: the project root (the folder holding pyproject.toml); the shared sentences lie beside it
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
REAL = ROOT.parent / "shared" / "data" / "sentiment"


def _tokens(sentence: str) -> set[str]:
    return set(re.findall(r"[a-z']+", sentence.lower()))


def best_single_token_accuracy(examples: list[tuple[str, int]]) -> tuple[float, str]:
    """The best accuracy any rule "label = a if token present else b" reaches, and its token."""
    n = len(examples)
    num_pos = sum(y for _, y in examples)
    present: collections.Counter[str] = collections.Counter()
    present_pos: collections.Counter[str] = collections.Counter()
    for sentence, label in examples:
        for tok in _tokens(sentence):
            present[tok] += 1
            present_pos[tok] += label
    best = (max(num_pos, n - num_pos) / n, "<majority>")
    for tok, c in present.items():
        p = present_pos[tok]
        absent_pos = num_pos - p
        absent_neg = (n - c) - absent_pos
        # present -> 1, absent -> 0;  present -> 0, absent -> 1
        for correct in (p + absent_neg, (c - p) + absent_pos):
            best = max(best, (correct / n, tok))
    return best


def test_single_token_scorer_finds_a_planted_separator() -> None:
    # the measure itself must be able to fail: plant a token that decides the label
    rng = random.Random(1)
    planted = [(f"{s} {'zzgood' if y else ''}", y) for s, y in generate_sentiment_examples(400, seed=3)]
    rng.shuffle(planted)
    acc, tok = best_single_token_accuracy(planted)
    assert (acc, tok) == (1.0, "zzgood")


def test_no_single_token_separates_the_classes() -> None:
    examples = generate_sentiment_examples(3000, seed=0)
    acc, tok = best_single_token_accuracy(examples)
    assert acc < 0.8, f"token {tok!r} alone predicts the label with accuracy {acc:.3f}"


def test_sentiment_words_and_negation_are_spread_over_both_labels() -> None:
    examples = generate_sentiment_examples(3000, seed=0)
    for word in ("not", "good", "bad", "great", "terrible", "but", "although", "very"):
        labels = [y for s, y in examples if word in _tokens(s)]
        assert len(labels) > 100, word
        assert 0.3 < sum(labels) / len(labels) < 0.7, (word, sum(labels) / len(labels))


def test_generator_is_deterministic_balanced_and_distinct() -> None:
    a = generate_sentiment_examples(1000, seed=5)
    assert a == generate_sentiment_examples(1000, seed=5)
    assert a != generate_sentiment_examples(1000, seed=6)
    assert sum(y for _, y in a) == 500
    assert len({s.lower() for s, _ in a}) == 1000
    assert all("\t" not in s and "\n" not in s for s, _ in a)


@pytest.mark.parametrize(
    ("label", "clue"),
    [
        (
            0,
            re.compile(
                r"(\bnot|n't|\bnever) .*\b(good|great|excellent|wonderful|pleasant|impressive|lovely|solid)\b"
            ),
        ),
        (
            1,
            re.compile(
                r"(\bnot|n't|\bnever) .*\b(bad|terrible|awful|poor|disappointing|boring|mediocre|weak)\b"
            ),
        ),
    ],
)
def test_negation_flips_a_single_clause(label: int, clue: re.Pattern[str]) -> None:
    # one-clause sentences with a negated adjective: "not good" is negative, "not bad" positive
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        y = rng.randint(0, 1)
        s = make_sentence(rng, y).lower()
        if any(w in s for w in (" and ", " but ", "although", "even though")):
            continue
        if clue.search(s):
            found += 1
            assert y == label, s
    assert found > 50


def test_contrast_follows_the_clause_after_but() -> None:
    rng = random.Random(0)
    pos = r"(good|great|excellent|wonderful|pleasant|impressive|lovely|solid)"
    checked = 0
    for _ in range(3000):
        y = rng.randint(0, 1)
        s = make_sentence(rng, y).lower()
        if ", but " not in s:
            continue
        after = s.split(", but ")[1]
        negated = re.search(r"\bnot\b|n't\b|\bnever\b", after) is not None
        positive_word = re.search(rf"\b{pos}\b", after) is not None
        assert y == int(positive_word != negated), s
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
def test_write_and_load_round_trip(tmp_path: Path, fmt: str) -> None:
    paths = write_sentiment_data(tmp_path, num_examples=200, validation_fraction=0.25, seed=2, fmt=fmt)  # type: ignore[arg-type]
    data = load_sentiment_files(paths["train"], paths["validation"], cache_dir=str(tmp_path / "cache"))
    assert (data["train"].num_rows, data["validation"].num_rows) == (150, 50)
    expected = generate_sentiment_examples(200, seed=2)
    assert list(zip(data["validation"]["sentence"], data["validation"]["label"])) == expected[:50]
    assert set(data["train"]["sentence"]).isdisjoint(data["validation"]["sentence"])
    assert data["train"].features["label"].names == ["negative", "positive"]


def test_tsv_keeps_quote_marks_and_strips_padding(tmp_path: Path) -> None:
    f = tmp_path / "reviews.txt"
    f.write_text('He said "wow" and left.  \t1\nA "bad\tfilm.\t0\n"Meh" it was.\t0\nGreat.\t1\n')
    # the second line has a tab inside: with quoting=3 the file is still read per line,
    # so it must be rejected rather than silently mis-parsed
    with pytest.raises(Exception):  # noqa: B017 - pandas/datasets raise different types per version
        load_sentiment_files(f, cache_dir=str(tmp_path / "c0"))
    f.write_text('He said "wow" and left.  \t1\n"Meh" it was.\t0\nGreat.\t1\nNo.\t0\nFine!\t1\n')
    data = load_sentiment_files(f, f, cache_dir=str(tmp_path / "c1"))
    assert data["train"]["sentence"][:2] == ['He said "wow" and left.', '"Meh" it was.']
    assert data["train"]["label"] == [1, 0, 1, 0, 1]


def test_without_validation_files_a_stratified_split_is_held_out(tmp_path: Path) -> None:
    paths = write_sentiment_data(tmp_path, num_examples=100, seed=0)
    data = load_sentiment_files(paths["train"], validation_fraction=0.25, cache_dir=str(tmp_path / "c"))
    assert (data["train"].num_rows, data["validation"].num_rows) == (60, 20)
    assert sum(data["validation"]["label"]) == 10


def test_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"`--train-file` '.*nope.tsv': no such file.*HINT"):
        load_sentiment_files(tmp_path / "nope.tsv")
    csv = tmp_path / "data.csv"
    csv.write_text("a,1\n")
    with pytest.raises(ValueError, match=r"`--train-file` '.*data.csv' has suffix '.csv'; allowed: .*HINT"):
        load_sentiment_files(csv)
    tsv = tmp_path / "t.tsv"
    tsv.write_text("fine\t1\nodd\t2\n")
    jsonl = tmp_path / "v.jsonl"
    jsonl.write_text(json.dumps({"sentence": "x", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"data files mix TSV and JSONL.*HINT"):
        load_sentiment_files(tsv, jsonl)
    with pytest.raises(ValueError, match=r"`--train-file` files .* hold labels \[2\]; allowed: 0 .*HINT"):
        load_sentiment_files(tsv, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"`validation_fraction` 1.5 must lie strictly between 0 and 1"):
        write_sentiment_data(tmp_path, validation_fraction=1.5)


def test_ensure_writes_once(tmp_path: Path) -> None:
    paths = ensure_sentiment_data(tmp_path / "d")
    stamp = paths["train"].stat().st_mtime_ns
    assert ensure_sentiment_data(tmp_path / "d") == paths
    assert paths["train"].stat().st_mtime_ns == stamp
    assert len(paths["train"].read_text().splitlines()) == 2400


@pytest.mark.skipif(not REAL.is_dir(), reason="the shared UCI sentiment files are not on this machine")
def test_real_uci_files_load(tmp_path: Path) -> None:
    files = sorted(REAL.glob("*_labelled.txt"))
    data = load_sentiment_files(files, validation_fraction=0.2, cache_dir=str(tmp_path / "c"))
    assert data["train"].num_rows + data["validation"].num_rows == 3000
    assert sum(data["validation"]["label"]) == 300  # 1500/1500 overall, stratified
