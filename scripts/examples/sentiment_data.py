"""The scripts' sentiment data: the real UCI sentences found (or fetched), the generated demo set, the loader.

Not part of the engine: `ds_engine` trains on whatever data a script hands it. The scripts in
this folder import this module as `sentiment_data` (they run as files, so `scripts/examples/`
is on `sys.path`).

**The real data** is the UCI "Sentiment Labelled Sentences" set (Kotzias et al., KDD 2015,
CC BY 4.0): 3,000 review sentences, 500 positive and 500 negative in each of
`amazon_cells_labelled.txt`, `imdb_labelled.txt` and `yelp_labelled.txt` (sentence TAB label).
`find_sentiment_data` looks for the folder holding them, in this order:

1. `--data-dir DIR` (the scripts' flag; `--train-file` files bypass the lookup altogether);
2. the environment variable `DS_ENGINE_SENTIMENT_DIR`;
3. `../shared/data/sentiment` next to the project root (the folder holding `pyproject.toml`,
   found from this file), present on the project's machines and in CI;
4. the user's cache, `$XDG_CACHE_HOME/ds_engine/sentiment` (default `~/.cache/...`), filled
   once by downloading the public UCI archive (`DS_ENGINE_SENTIMENT_URL`, checked against
   `DS_ENGINE_SENTIMENT_SHA256`; both default to the official archive) when the machine is
   online: the zip is verified before anything is unpacked, and the folder appears under its
   final name only complete (temporary sibling + rename);
5. otherwise the generated sentences below, and the caller warns that the data is synthetic.

A folder named explicitly (1, 2) that lacks the files is an error; 3 and 4 are simply skipped.

**The generated demo set** (`generate_sentiment_examples`): short review sentences labelled 1
(positive) or 0 (negative) from five domains (restaurants, films, phones, hotels, books). The
label follows the meaning of the whole sentence, so no single word decides it:

* negation flips a clause ("the food was not good" is negative, "the plot was never boring"
  is positive), and negated and plain clauses use the same adjectives;
* contrast follows the concessive structure ("X, but Y" and "although X, Y" follow Y;
  "Y, even though X" follows Y, which now comes first), so the other clause's adjective
  points the wrong way;
* intensifiers ("very", "extremely", ...) and domain words are spread evenly over both labels.

Every word's presence alone predicts the label with well under 80 % accuracy
(`tests/unit/test_data.py` checks it). A rule of about 15 lines decides every sentence, so a
score on it shows that a pipeline runs, not that a fine-tune is good.

**Files** are TSV (`sentence<TAB>label`, no header: the UCI format, so one loader reads both)
or JSONL (`{"sentence": ..., "label": ...}`), read by `load_sentiment_files`. Write the
generated set with `python scripts/tools/make_sentiment_data.py --out DIR`.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import shutil
import tempfile
import urllib.request
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from datasets import DatasetDict

LABEL_NAMES = ("negative", "positive")

_DOMAINS: dict[str, list[str]] = {
    "restaurant": ["food", "service", "pasta", "dessert", "staff", "atmosphere", "menu", "coffee"],
    "film": ["plot", "acting", "soundtrack", "ending", "dialogue", "cast", "script", "camera work"],
    "phone": ["battery", "screen", "camera", "charger", "speaker", "case", "keyboard", "buttons"],
    "hotel": ["room", "bed", "location", "breakfast", "front desk", "pool", "view", "shower"],
    "book": ["story", "characters", "writing", "pacing", "cover", "translation", "chapters", "prose"],
}
_POSITIVE = ["good", "great", "excellent", "wonderful", "pleasant", "impressive", "lovely", "solid"]
_NEGATIVE = ["bad", "terrible", "awful", "poor", "disappointing", "boring", "mediocre", "weak"]
_INTENSIFIERS = ["", "", "very ", "really ", "extremely ", "quite ", "truly ", "incredibly "]
_OPENERS = ["", "", "", "honestly, ", "overall, ", "i have to say ", "to be fair, ", "in my opinion "]
_NEGATION_RATE = 0.4


def _clause(rng: random.Random, aspect: str, polarity: int) -> str:
    """A clause about `aspect` whose meaning has `polarity` (+1 / -1)."""
    negated = rng.random() < _NEGATION_RATE
    word_polarity = -polarity if negated else polarity
    adj = rng.choice(_POSITIVE if word_polarity > 0 else _NEGATIVE)
    verb = rng.choice(["was", "is", "seemed", "felt"])
    if aspect.endswith("s"):  # "the characters were", not "was"
        verb = {"was": "were", "is": "are"}.get(verb, verb)
    intens = rng.choice(_INTENSIFIERS)
    if not negated:
        return rng.choice(
            [
                f"the {aspect} {verb} {intens}{adj}",
                f"i found the {aspect} {intens}{adj}",
                f"the {aspect} turned out {intens}{adj}",
            ]
        )
    if verb in ("was", "is", "were", "are"):
        return rng.choice(
            [
                f"the {aspect} {verb} not {intens}{adj}",
                f"the {aspect} {verb}n't {intens}{adj}",
                f"the {aspect} {verb} never {adj}",
                f"the {aspect} {verb} not {adj} at all",
            ]
        )
    return rng.choice(
        [
            f"the {aspect} never {verb} {adj}",
            f"i did not find the {aspect} {intens}{adj}",
            f"the {aspect} did not seem {adj} at all",
        ]
    )


def make_sentence(rng: random.Random, label: int) -> str:
    """One review sentence whose overall sentiment is `label` (1 positive, 0 negative)."""
    polarity = 1 if label == 1 else -1
    aspects = _DOMAINS[rng.choice(sorted(_DOMAINS))]
    first, second = rng.sample(aspects, 2)
    form = rng.random()
    if form < 0.35:  # one clause
        body = _clause(rng, first, polarity)
    elif form < 0.55:  # two agreeing clauses
        body = f"{_clause(rng, first, polarity)} and {_clause(rng, second, polarity)}"
    elif form < 0.75:  # X, but Y: Y decides
        body = f"{_clause(rng, first, -polarity)}, but {_clause(rng, second, polarity)}"
    elif form < 0.88:  # although X, Y: Y decides
        body = f"although {_clause(rng, first, -polarity)}, {_clause(rng, second, polarity)}"
    else:  # Y, even though X: Y decides and comes first
        body = f"{_clause(rng, second, polarity)}, even though {_clause(rng, first, -polarity)}"
    text = rng.choice(_OPENERS) + body + rng.choice([".", ".", "!"])
    return text[0].upper() + text[1:]


def generate_sentiment_examples(num_examples: int = 3000, seed: int = 0) -> list[tuple[str, int]]:
    """Distinct labelled sentences, half positive and half negative, in a seeded random order.

    Args:
        num_examples: how many (sentence, label) pairs; even numbers give exact balance.
        seed: the same seed always gives the same list.

    Returns:
        A list of `(sentence, label)` with label 1 = positive, 0 = negative.
    """
    if num_examples < 2:
        raise ValueError(f"`num_examples` {num_examples} is too small; need at least 2. HINT: use 3000")
    rng = random.Random(seed)
    seen: set[str] = set()
    examples: list[tuple[str, int]] = []
    for i in range(num_examples):
        label = i % 2
        for _ in range(1000):
            sentence = make_sentence(rng, label)
            if sentence.lower() not in seen:
                break
        else:  # pragma: no cover - the grammar has millions of sentences
            raise RuntimeError("could not generate enough distinct sentences")
        seen.add(sentence.lower())
        examples.append((sentence, label))
    rng.shuffle(examples)
    return examples


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_sentiment_data(
    out_dir: str | os.PathLike[str],
    *,
    num_examples: int = 3000,
    validation_fraction: float = 0.2,
    seed: int = 0,
    fmt: Literal["tsv", "jsonl"] = "tsv",
) -> dict[str, Path]:
    """Write the generated data set as `train.<fmt>` and `validation.<fmt>` in `out_dir`.

    Writing is atomic (temporary file + rename), so several processes may call this at once.

    Args:
        out_dir: folder to write into (created if needed).
        num_examples: total number of sentences.
        validation_fraction: share of sentences in the validation split (no sentence is in both).
        seed: generator seed.
        fmt: `tsv` (sentence TAB label, no header) or `jsonl`.

    Returns:
        `{"train": path, "validation": path}`.
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(
            f"`validation_fraction` {validation_fraction} must lie strictly between 0 and 1. HINT: use 0.2"
        )
    if fmt not in ("tsv", "jsonl"):
        raise ValueError(f"`fmt` {fmt!r} is not allowed; use 'tsv' or 'jsonl'. HINT: fmt='tsv'")
    examples = generate_sentiment_examples(num_examples, seed)
    num_val = max(1, round(num_examples * validation_fraction))
    splits = {"train": examples[num_val:], "validation": examples[:num_val]}
    paths = {}
    for split, rows in splits.items():
        if fmt == "tsv":
            text = "".join(f"{s}\t{y}\n" for s, y in rows)
        else:
            text = "".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in rows)
        paths[split] = Path(out_dir) / f"{split}.{fmt}"
        _atomic_write(paths[split], text)
    return paths


def ensure_sentiment_data(out_dir: str | os.PathLike[str], *, seed: int = 0) -> dict[str, Path]:
    """The generated TSV files in `out_dir`, written first if they are not there yet."""
    paths = {s: Path(out_dir) / f"{s}.tsv" for s in ("train", "validation")}
    if not all(p.is_file() for p in paths.values()):
        paths = write_sentiment_data(out_dir, seed=seed)
    return paths


def _as_list(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    return [os.fspath(f) for f in files]


def _file_kind(path: str, option: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".tsv", ".txt"):
        return "tsv"
    if suffix in (".jsonl", ".json"):
        return "json"
    raise ValueError(
        f"`{option}` {path!r} has suffix {suffix!r}; allowed: .tsv/.txt (sentence TAB label, no header) "
        "or .jsonl/.json ({'sentence': ..., 'label': 0|1}). HINT: rename the file or convert it"
    )


def load_sentiment_files(
    train_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    validation_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    *,
    validation_fraction: float = 0.2,
    seed: int = 0,
    cache_dir: str | None = None,
) -> DatasetDict:
    """Load labelled sentence files with `datasets` into `train` and `validation` splits.

    TSV/TXT files are read with the `csv` builder (`delimiter="\\t"`, `header=None`,
    `quoting=3` so quote marks inside sentences stay text); JSONL files with the `json` builder.
    Without validation files, `validation_fraction` of the training rows is held out (seeded).

    Args:
        train_files: one or more training files (all TSV or all JSONL).
        validation_files: one or more validation files, or None to split the training files.
        validation_fraction: held-out share when `validation_files` is None.
        seed: seed of that split.
        cache_dir: `datasets` cache folder (default: its own).

    Returns:
        A `DatasetDict` with columns `sentence` (str) and `label` (ClassLabel negative/positive).

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: an unknown suffix, mixed formats, or a label other than 0/1.
    """
    from datasets import ClassLabel, DatasetDict, Features, Value, load_dataset

    groups = {"train": ("--train-file", _as_list(train_files))}
    if validation_files is not None:
        groups["validation"] = ("--validation-file", _as_list(validation_files))
    kinds = set()
    for option, files in groups.values():
        if not files:
            raise ValueError(f"`{option}` is empty. HINT: give at least one file")
        for f in files:
            if not Path(f).is_file():
                raise FileNotFoundError(f"`{option}` {f!r}: no such file. HINT: check the path")
            kinds.add(_file_kind(f, option))
    if len(kinds) > 1:
        raise ValueError(
            f"data files mix TSV and JSONL ({', '.join(f for _, fs in groups.values() for f in fs)}). "
            "HINT: use one format for all files"
        )
    data_files = {split: files for split, (_, files) in groups.items()}
    raw_features = Features({"sentence": Value("string"), "label": Value("int64")})
    if kinds == {"tsv"}:
        raw = load_dataset(
            "csv",
            data_files=data_files,
            delimiter="\t",
            header=None,
            quoting=3,
            column_names=["sentence", "label"],
            features=raw_features,
            cache_dir=cache_dir,
        )
    else:
        raw = load_dataset("json", data_files=data_files, features=raw_features, cache_dir=cache_dir)
    for split, ds in raw.items():
        bad = sorted({y for y in ds["label"] if y not in (0, 1)}, key=str)
        if bad:
            raise ValueError(
                f"`{groups[split][0]}` files {groups[split][1]} hold labels {bad[:5]}; "
                "allowed: 0 (negative), 1 (positive). HINT: map the labels to 0/1"
            )
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=list(LABEL_NAMES))})
    data = DatasetDict({split: ds.cast(features) for split, ds in raw.items()})
    data = data.map(lambda row: {"sentence": row["sentence"].strip()})
    if "validation" not in data:
        split = data["train"].train_test_split(
            test_size=validation_fraction, seed=seed, stratify_by_column="label"
        )
        data = DatasetDict({"train": split["train"], "validation": split["test"]})
    return data


# ---------------------------------------------------------------------------------- the real data
UCI_FILES = ("amazon_cells_labelled.txt", "imdb_labelled.txt", "yelp_labelled.txt")
UCI_ARCHIVE_FOLDER = "sentiment labelled sentences"  # the three files' folder inside the zip
UCI_URL = "https://archive.ics.uci.edu/static/public/331/sentiment+labelled+sentences.zip"
# SHA-256 of the archive at UCI_URL as pinned by independent public projects (not computed here:
# these machines are offline). DS_ENGINE_SENTIMENT_SHA256 overrides it, DS_ENGINE_SENTIMENT_URL the URL.
UCI_SHA256 = "afc26626d710899948693e1a61405dce197f57ffa719fa1130d346b4cc095343"
ENV_DIR = "DS_ENGINE_SENTIMENT_DIR"
ENV_URL = "DS_ENGINE_SENTIMENT_URL"  # "" or "none": never download
ENV_SHA256 = "DS_ENGINE_SENTIMENT_SHA256"
DOWNLOAD_TIMEOUT_S = 60.0
# The project root: the folder holding pyproject.toml, found from this file (never an absolute path).
PROJECT_ROOT = next((p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()), None)


@dataclass(frozen=True)
class SentimentSource:
    """Where the sentences come from.

    Attributes:
        kind: "real" (files) or "synthetic" (the generated set).
        origin: which step of the lookup found them: "--train-file", "--data-dir", the environment
            variable's name, "project", "cache", "download", "generated" (asked for) or
            "fallback" (nothing found).
        files: the data files (empty for the generated set).
        notes: why earlier steps found nothing, for the warning (e.g. the download's error).
    """

    kind: Literal["real", "synthetic"]
    origin: str
    files: tuple[Path, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def folder(self) -> Path | None:
        return self.files[0].parent if self.files else None


def project_data_dir(project_root: Path | None = None) -> Path | None:
    """`../shared/data/sentiment` seen from `project_root` (default `PROJECT_ROOT`; None if unknown)."""
    root = PROJECT_ROOT if project_root is None else project_root
    return None if root is None else root.parent / "shared" / "data" / "sentiment"


def cache_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/ds_engine/sentiment`, by default `~/.cache/ds_engine/sentiment`."""
    env = os.environ if env is None else env
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "ds_engine" / "sentiment"


def uci_files_in(folder: str | os.PathLike[str] | None) -> tuple[Path, ...] | None:
    """The three UCI files in `folder`, or None unless all three are there."""
    if folder is None:
        return None
    files = tuple(Path(folder) / name for name in UCI_FILES)
    return files if all(f.is_file() for f in files) else None


def _named_folder(folder: str | os.PathLike[str], what: str) -> tuple[Path, ...]:
    files = uci_files_in(folder)
    if files is None:
        missing = [n for n in UCI_FILES if not (Path(folder) / n).is_file()]
        raise FileNotFoundError(
            f"{what} {os.fspath(folder)!r} lacks {', '.join(missing)} (the UCI 'Sentiment Labelled "
            f"Sentences' files). HINT: point it at the folder that holds {', '.join(UCI_FILES)}, or "
            f"unset it to use the default lookup"
        )
    return files


def download_uci_archive(
    dest: str | os.PathLike[str],
    *,
    url: str = UCI_URL,
    sha256: str = UCI_SHA256,
    timeout: float = DOWNLOAD_TIMEOUT_S,
) -> tuple[Path, ...]:
    """Download the UCI zip, check its SHA-256, unpack the three files into `dest` atomically.

    Everything is written into a hidden temporary sibling of `dest` that is renamed to `dest` only
    once it is complete, so `dest` either holds all three files or does not exist; on any error
    the temporary folder is removed. Several processes may call this at once.

    Raises:
        OSError: the download failed (offline, HTTP error, ...); also http.client.HTTPException.
        ValueError: the checksum differs, or the zip lacks a file.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.download."))
    try:
        archive = tmp / "archive.zip"
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=timeout) as response, open(archive, "wb") as f:
            while chunk := response.read(1 << 16):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != sha256.strip().lower():
            raise ValueError(
                f"the archive from {url} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                f"refused, nothing was unpacked. HINT: check {ENV_URL} / {ENV_SHA256}"
            )
        try:
            with zipfile.ZipFile(archive) as z:
                for name in UCI_FILES:  # only these members, never the archive's own paths
                    (tmp / name).write_bytes(z.read(f"{UCI_ARCHIVE_FOLDER}/{name}"))
        except (KeyError, zipfile.BadZipFile) as e:
            raise ValueError(f"the archive from {url} is not the UCI archive: {e}") from e
        archive.unlink()
        for name in UCI_FILES:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        try:
            os.rename(tmp, dest)  # atomic; fails if another process completed `dest` first
        except OSError:
            if uci_files_in(dest) is None:
                raise
        files = uci_files_in(dest)
        assert files is not None
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def find_sentiment_data(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    project_root: Path | None = None,
    download: bool = True,
) -> SentimentSource:
    """Find the UCI sentences: `data_dir`, $DS_ENGINE_SENTIMENT_DIR, the project's shared folder,
    the user's cache (downloaded into it once if `download` and online), else the generated set.

    Args:
        data_dir: a folder named by the user (`--data-dir`); it must hold the three files.
        env: the environment to read (default `os.environ`).
        project_root: the folder holding pyproject.toml (default `PROJECT_ROOT`, found from this file).
        download: try the download when nothing is found locally (off on all but one process).

    Returns:
        A `SentimentSource`; `kind == "synthetic"` means nothing was found and the caller should
        warn, with `notes` saying why.

    Raises:
        FileNotFoundError: `data_dir` or $DS_ENGINE_SENTIMENT_DIR is set but lacks the files.
    """
    env = os.environ if env is None else env
    if data_dir is not None:
        return SentimentSource("real", "--data-dir", _named_folder(data_dir, "`--data-dir`"))
    if env.get(ENV_DIR):
        return SentimentSource("real", ENV_DIR, _named_folder(env[ENV_DIR], f"${ENV_DIR}"))
    files = uci_files_in(project_data_dir(project_root))
    if files is not None:
        return SentimentSource("real", "project", files)
    cache = cache_data_dir(env)
    files = uci_files_in(cache)
    if files is not None:
        return SentimentSource("real", "cache", files)
    notes = [f"not in {project_data_dir(project_root)} nor in the cache {cache}"]
    url = env.get(ENV_URL, UCI_URL)
    if not download:
        notes.append("no download tried on this process")
    elif url.strip().lower() in ("", "none"):
        notes.append(f"download disabled (${ENV_URL} is empty)")
    else:
        try:
            files = download_uci_archive(cache, url=url, sha256=env.get(ENV_SHA256) or UCI_SHA256)
            return SentimentSource("real", "download", files)
        except (OSError, ValueError, http.client.HTTPException) as e:
            notes.append(f"download from {url} failed: {e}")
    return SentimentSource("synthetic", "fallback", notes=tuple(notes))
