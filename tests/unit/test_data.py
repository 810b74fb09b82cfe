"""The scripts' sentiment data (`scripts/examples/sentiment_data.py`): where the real UCI sentences are
found (flag > environment > project folder > cache / one-time download > generated), the
download (checksum, atomic), the generated demo set, loading TSV/JSONL files through `datasets`,
and the length-grouped batch order of `scripts/examples/_recipe.py`. No network: every download here reads
a zip built by the test, from a `file://` URL or a local HTTP server.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import http.server
import io
import json
import random
import re
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: the project root (the folder holding pyproject.toml); the shared sentences lie beside it
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
REAL = ROOT.parent / "shared" / "data" / "sentiment"
# the scripts run as files with scripts/examples/ on sys.path; import their modules the same way
sys.path.insert(0, str(ROOT / "scripts" / "examples"))

import sentiment_data as sd  # noqa: E402
from sentiment_data import (  # noqa: E402
    ensure_sentiment_data,
    generate_sentiment_examples,
    load_sentiment_files,
    make_sentence,
    write_sentiment_data,
)


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


# ---------------------------------------------------------------------------------- the lookup
def _lines(source: str, n: int = 10) -> str:
    return "".join(
        f"{source} sentence number {i} was {'great' if i % 2 else 'bad'}.\t{i % 2}\n" for i in range(n)
    )


def uci_folder(folder: Path) -> Path:
    """A folder holding three small files under the UCI names (each a different marker)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in sd.UCI_FILES:
        (folder / name).write_text(_lines(f"{folder.name}-{name.split('_')[0]}"))
    return folder


def uci_zip(path: Path) -> str:
    """A zip laid out like the UCI archive (its folder, a readme, macOS junk, CRLF lines); its SHA-256."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name in sd.UCI_FILES:
            text = _lines(f"zipped-{name.split('_')[0]}").replace("\n", "\r\n")
            z.writestr(f"{sd.UCI_ARCHIVE_FOLDER}/{name}", text)
            z.writestr(f"__MACOSX/{sd.UCI_ARCHIVE_FOLDER}/._{name}", b"\x00\x05junk")
        z.writestr(f"{sd.UCI_ARCHIVE_FOLDER}/readme.txt", "format: sentence \\t score \\n")
    path.write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """A fake project root (with no shared folder yet), a cache home and an archive, all under tmp."""
    root = tmp_path / "checkout" / "project"
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    archive = tmp_path / "server" / "sentiment.zip"
    archive.parent.mkdir()
    return {
        "root": root,
        "shared": root.parent / "shared" / "data" / "sentiment",
        "cache_home": tmp_path / "cache_home",
        "cache": tmp_path / "cache_home" / "ds_engine" / "sentiment",
        "archive": archive,
        "flag": tmp_path / "flag",
        "env": tmp_path / "env",
    }


def _env(places: dict[str, Path], **extra: str) -> dict[str, str]:
    # never the real URL: a download, if tried, reads the local archive (or fails on a missing one)
    return {"XDG_CACHE_HOME": str(places["cache_home"]), sd.ENV_URL: places["archive"].as_uri(), **extra}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_the_project_root_is_found_from_the_module_file() -> None:
    assert sd.PROJECT_ROOT == ROOT
    assert sd.project_data_dir() == ROOT.parent / "shared" / "data" / "sentiment"


def test_lookup_order_flag_env_project_cache_download_synthetic(places: dict[str, Path]) -> None:
    sha = uci_zip(places["archive"])
    flag, env_dir = uci_folder(places["flag"]), uci_folder(places["env"])
    uci_folder(places["shared"])
    env = _env(places, **{sd.ENV_DIR: str(env_dir), sd.ENV_SHA256: sha})
    find = functools.partial(sd.find_sentiment_data, project_root=places["root"])

    # every place holds the files: the flag wins, then the environment, then the project folder
    got = find(flag, env=env)
    assert (got.kind, got.origin, got.folder) == ("real", "--data-dir", flag)
    got = find(env=env)
    assert (got.kind, got.origin, got.folder) == ("real", sd.ENV_DIR, env_dir)
    del env[sd.ENV_DIR]
    got = find(env=env)
    assert (got.kind, got.origin, got.folder) == ("real", "project", places["shared"])
    assert got.files == tuple(places["shared"] / n for n in sd.UCI_FILES)

    # no project folder: the cache is empty, so the archive is downloaded into it once ...
    for f in places["shared"].iterdir():
        f.unlink()
    got = find(env=env)
    assert (got.kind, got.origin, got.folder) == ("real", "download", places["cache"])
    assert _leftovers(places["cache"]) == sorted(sd.UCI_FILES)  # no zip, readme or temporary left
    assert _leftovers(places["cache"].parent) == ["sentiment"]
    # ... and found there afterwards, without downloading again (the archive is gone)
    places["archive"].unlink()
    got = find(env=env)
    assert (got.kind, got.origin) == ("real", "cache")

    # nothing anywhere and the download fails: the generated set, with the reasons
    for f in places["cache"].iterdir():
        f.unlink()
    got = find(env=env)
    assert (got.kind, got.origin, got.files) == ("synthetic", "fallback", ())
    assert "download from file://" in got.notes[-1] and "failed" in got.notes[-1]
    assert str(places["cache"]) in got.notes[0]
    assert _leftovers(places["cache"].parent) == ["sentiment"]  # the emptied folder, no temporaries


def test_downloaded_files_load_as_3_sources(places: dict[str, Path]) -> None:
    sha = uci_zip(places["archive"])
    got = sd.find_sentiment_data(env=_env(places, **{sd.ENV_SHA256: sha}), project_root=places["root"])
    assert got.origin == "download"
    data = load_sentiment_files(
        got.files, validation_fraction=0.2, cache_dir=str(places["cache_home"] / "hf")
    )
    assert data["train"].num_rows + data["validation"].num_rows == 30
    assert all(not s.endswith("\r") and s.startswith("zipped-") for s in data["train"]["sentence"])
    assert sorted(collections.Counter(data["validation"]["label"]).values()) == [3, 3]  # stratified


def test_a_wrong_checksum_is_refused_and_leaves_nothing(places: dict[str, Path]) -> None:
    uci_zip(places["archive"])
    with pytest.raises(ValueError, match=r"has SHA-256 [0-9a-f]{64}, expected 0{64}; refused"):
        sd.download_uci_archive(places["cache"], url=places["archive"].as_uri(), sha256="0" * 64)
    assert _leftovers(places["cache"].parent) == []  # neither the folder nor a temporary
    # through the lookup: the generated set, saying why; still nothing in the cache
    got = sd.find_sentiment_data(env=_env(places, **{sd.ENV_SHA256: "0" * 64}), project_root=places["root"])
    assert got.kind == "synthetic" and "expected " + "0" * 64 in got.notes[-1]
    assert _leftovers(places["cache"].parent) == []


def test_the_default_checksum_is_the_pinned_one(places: dict[str, Path]) -> None:
    # without DS_ENGINE_SENTIMENT_SHA256 the archive must match the official archive's pinned hash
    uci_zip(places["archive"])
    assert re.fullmatch(r"[0-9a-f]{64}", sd.UCI_SHA256)
    got = sd.find_sentiment_data(env=_env(places), project_root=places["root"])
    assert got.kind == "synthetic" and f"expected {sd.UCI_SHA256}" in got.notes[-1]


def test_an_archive_without_the_files_is_refused(places: dict[str, Path]) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("amazon_cells_labelled.txt", "top level, not in the UCI folder\t1\n")
    places["archive"].write_bytes(buffer.getvalue())
    sha = hashlib.sha256(buffer.getvalue()).hexdigest()
    with pytest.raises(ValueError, match="is not the UCI archive"):
        sd.download_uci_archive(places["cache"], url=places["archive"].as_uri(), sha256=sha)
    assert _leftovers(places["cache"].parent) == []


@pytest.fixture
def http_server(places: dict[str, Path]) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(places["archive"].parent))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_download_over_http(places: dict[str, Path], http_server: str) -> None:
    sha = uci_zip(places["archive"])
    env = _env(places, **{sd.ENV_URL: f"{http_server}/sentiment.zip", sd.ENV_SHA256: sha})
    got = sd.find_sentiment_data(env=env, project_root=places["root"])
    assert (got.kind, got.origin, got.folder) == ("real", "download", places["cache"])
    assert (places["cache"] / "yelp_labelled.txt").read_text().startswith("zipped-yelp")
    # a 404 is a failed download like being offline: the generated set, nothing cached
    for f in places["cache"].iterdir():
        f.unlink()
    places["cache"].rmdir()
    env[sd.ENV_URL] = f"{http_server}/missing.zip"
    got = sd.find_sentiment_data(env=env, project_root=places["root"])
    assert got.kind == "synthetic" and "404" in got.notes[-1]
    assert _leftovers(places["cache"].parent) == []


def test_no_download_when_disabled_or_not_the_main_process(places: dict[str, Path]) -> None:
    sha = uci_zip(places["archive"])
    for url in ("", "none"):
        got = sd.find_sentiment_data(env=_env(places, **{sd.ENV_URL: url}), project_root=places["root"])
        assert got.kind == "synthetic" and "download disabled" in got.notes[-1]
    got = sd.find_sentiment_data(
        env=_env(places, **{sd.ENV_SHA256: sha}), project_root=places["root"], download=False
    )
    assert got.kind == "synthetic" and "no download tried" in got.notes[-1]
    assert not places["cache"].exists()


def test_a_named_folder_without_the_files_is_an_error(places: dict[str, Path]) -> None:
    uci_folder(places["shared"])  # would be found, but a named folder must not be skipped silently
    (places["flag"]).mkdir()
    (places["flag"] / "yelp_labelled.txt").write_text("x\t1\n")
    with pytest.raises(
        FileNotFoundError, match=r"`--data-dir` '.*flag' lacks amazon_cells_labelled.txt, imdb"
    ):
        sd.find_sentiment_data(places["flag"], env=_env(places), project_root=places["root"])
    env = _env(places, **{sd.ENV_DIR: str(places["env"])})
    with pytest.raises(FileNotFoundError, match=r"\$DS_ENGINE_SENTIMENT_DIR '.*env' lacks .*HINT"):
        sd.find_sentiment_data(env=env, project_root=places["root"])


def test_cache_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert sd.cache_data_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "ds_engine" / "sentiment"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert sd.cache_data_dir({}) == tmp_path / "home" / ".cache" / "ds_engine" / "sentiment"


# ---------------------------------------------------------------------------------- the scripts' data
class _OneProcess:
    """What `_recipe.find_data` / `load_data` ask of the Engine, for one process."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def _args(**kw: object) -> argparse.Namespace:
    base = {"train_file": None, "validation_file": None, "data_dir": None, "synthetic": False,
            "validation_fraction": 0.2, "num_examples": 100, "seed": 3}  # fmt: skip
    return argparse.Namespace(**(base | kw))


def test_script_flags_come_first(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import _recipe

    for key, value in _env(places, **{sd.ENV_DIR: str(uci_folder(places["env"]))}).items():
        monkeypatch.setenv(key, value)
    flag = uci_folder(places["flag"])
    engine = _OneProcess()
    files = [str(flag / "imdb_labelled.txt")]
    got = _recipe.find_data(_args(train_file=files, data_dir=str(flag)), engine)  # type: ignore[arg-type]
    assert (got.kind, got.origin, got.files) == ("real", "--train-file", (Path(files[0]),))
    got = _recipe.find_data(_args(data_dir=str(flag)), engine)  # type: ignore[arg-type]
    assert (got.origin, got.folder) == ("--data-dir", flag)
    got = _recipe.find_data(_args(), engine)  # type: ignore[arg-type]
    assert (got.origin, got.folder) == (sd.ENV_DIR, places["env"])
    got = _recipe.find_data(_args(synthetic=True), engine)  # type: ignore[arg-type]
    assert (got.kind, got.origin) == ("synthetic", "generated")


def test_the_real_split_is_fixed_and_stratified(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import _recipe

    monkeypatch.setenv(sd.ENV_DIR, str(uci_folder(places["env"])))
    engine = _OneProcess()
    splits = []
    for seed in (0, 1):  # the training seed does not move the held-out sentences
        data, source = _recipe.load_data(_args(seed=seed), places["root"], engine)  # type: ignore[arg-type]
        assert source.kind == "real"
        splits.append(sorted(data["validation"]["sentence"]))
        assert (data["train"].num_rows, data["validation"].num_rows) == (24, 6)
        assert sum(data["validation"]["label"]) == 3
    assert splits[0] == splits[1]


def test_falling_back_to_generated_data_warns(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import _recipe

    monkeypatch.delenv(sd.ENV_DIR, raising=False)
    for key, value in _env(places).items():  # the archive does not exist: the download fails
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sd, "PROJECT_ROOT", places["root"])
    data, source = _recipe.load_data(_args(), places["root"] / "out", _OneProcess())  # type: ignore[arg-type]
    assert (source.kind, source.origin) == ("synthetic", "fallback")
    assert (data["train"].num_rows, data["validation"].num_rows) == (80, 20)
    err = capsys.readouterr().err  # (and the progress bars of `datasets`)
    assert "\nWARNING: the UCI 'Sentiment Labelled Sentences' files were not found" in "\n" + err
    assert "GENERATED sentences" in err and "download from file://" in err and "HINT: --data-dir" in err
    # asked for explicitly: no warning
    _recipe.load_data(_args(synthetic=True), places["root"] / "out", _OneProcess())  # type: ignore[arg-type]
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.skipif(not REAL.is_dir(), reason="the shared UCI sentiment files are not on this machine")
def test_the_project_folder_holds_the_real_sentences() -> None:
    got = sd.find_sentiment_data(env={sd.ENV_URL: ""})
    assert (got.kind, got.origin, got.folder) == ("real", "project", REAL)


# ---------------------------------------------------------------------------------- batch order
def test_length_grouped_batches() -> None:
    from _recipe import LengthGroupedSampler

    rng = random.Random(0)
    lengths = [rng.randint(3, 100) for _ in range(1000)]
    sampler = LengthGroupedSampler(lengths, 16, num_replicas=2, seed=5, group_batches=50)
    order = list(sampler)
    assert sorted(order) == list(range(1000)) and len(sampler) == 1000
    assert order == list(sampler)  # the same epoch gives the same order
    sampler.set_epoch(1)
    assert list(sampler) != order
    sampler.set_epoch(0)
    batches = sampler.global_batches()
    assert [len(b) for b in batches] == [32] * 31 + [8]  # the one short batch comes last
    padded = sum(32 * max(lengths[i] for i in b) for b in batches[:-1])
    real = sum(lengths[i] for b in batches[:-1] for i in b)
    assert padded < 1.1 * real  # a random order pads to about twice the real tokens
    for b in batches[:-1]:  # members are dealt in turn: each rank gets one of the two longest
        ranked = sorted(lengths[i] for i in b)
        assert min(max(lengths[i] for i in b[:16]), max(lengths[i] for i in b[16:])) >= ranked[-2]
    assert len({tuple(sorted(lengths[i] for i in b)) for b in batches}) > 1
    # the global batches are shuffled, not in length order
    maxima = [max(lengths[i] for i in b) for b in batches[:-1]]
    assert maxima != sorted(maxima) and maxima != sorted(maxima, reverse=True)
