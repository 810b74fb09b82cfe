"""Untrusted pickles are read with a bound on what they may inflate to, checked before unpickling.

A 2 MiB state file whose deflated `data.pkl` inflates to a 2 GiB string (`deflate_bomb`) is
refused by every entry point that reads checkpoint files, from the sizes the zip directory
declares, before a byte is inflated: the subprocess that tries them all stays small (peak
RSS measured, and an address-space limit makes a regression fail fast instead of eating the
machine). The error says what the limit is and how to raise it; raising it lets a trusted file
load. A legacy (non-zip) file is bounded by its size. A stray `*.pt` that no load needs is
never opened, bomb or not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_engine.safety import MAX_PICKLE_ENV, UnsafeCheckpointError, restricted_load
from tests.hostile_corpus import deflate_bomb

_BOMB_RUN = r"""
import json, resource, sys, warnings
from pathlib import Path

resource.setrlimit(resource.RLIMIT_AS, (3 * 1024**3, 3 * 1024**3))  # a regression fails, small
warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine
from ds_engine.cli import main
from ds_engine.safety import deepspeed_safe_globals, restricted_load, restricted_torch_load
from tests.hostile_corpus import deflate_bomb

folder = Path(sys.argv[1])
bomb = deflate_bomb(folder / "bomb.pt")
errors = {}
try:  # what consolidation imports, so that the baseline below holds the libraries themselves
    import deepspeed  # noqa: F401
except ImportError:
    pass


def attempt(name, call):
    try:
        call()
        errors[name] = None
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors[name] = f"{type(exc).__name__}: {exc}"


def prepared():
    engine = Engine(backend="accelerate")
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    return engine, *engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)


warm, *_ = prepared()
warm.save_checkpoint(folder / "warm", tag="t0")
warm.load_checkpoint(folder / "warm")
warm.end_training()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

attempt("restricted_load", lambda: restricted_load(bomb, mmap=True))
attempt("restricted_load_no_mmap", lambda: restricted_load(bomb))


def scoped():
    with restricted_torch_load(deepspeed_safe_globals()):
        torch.load(bomb, weights_only=False)


attempt("scope", scoped)

engine, model, optimizer, loader = prepared()
engine.save_checkpoint(folder / "ckpt", tag="t1")
(folder / "ckpt" / "t1" / "stray_notes.pt").write_bytes(bomb.read_bytes())  # nothing reads it
attempt("load_with_a_stray_bomb", lambda: engine.load_checkpoint(folder / "ckpt"))
(folder / "ckpt" / "t1" / "model_states.pt").write_bytes(bomb.read_bytes())
attempt("load_checkpoint", lambda: engine.load_checkpoint(folder / "ckpt"))

ds = folder / "ds" / "global_step1"
ds.mkdir(parents=True)
(ds.parent / "latest").write_text("global_step1")
(ds / "mp_rank_00_model_states.pt").write_bytes(bomb.read_bytes())
attempt("consolidate", lambda: sys.exit(main(["consolidate", str(ds.parent), str(folder / "out")])))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps({"errors": errors, "peak_rss_mib": peak, "before_mib": before}))
"""


def test_a_deflate_bomb_is_refused_everywhere_before_it_inflates(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    environ = {k: v for k, v in os.environ.items() if k not in launcher}  # a one-process run of its own
    result = subprocess.run(
        [sys.executable, "-c", _BOMB_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=environ,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    refused = (
        r"UnsafeCheckpointError: refusing to load `.*{name}`: its entry `archive/data\.pkl` is 2\.0 MiB "
        r"compressed \(\d+:1\) and declares 2\.0 GiB \(\d+ bytes\), over the 256\.0 MiB limit on what a "
        rf"checkpoint's pickled structure may inflate to .*HINT: if you trust the file, raise the limit, "
        rf"e\.g\. {MAX_PICKLE_ENV}=\d+MiB\."
    )
    errors = report["errors"]
    for name in ("restricted_load", "restricted_load_no_mmap", "scope"):
        assert re.fullmatch(refused.format(name="bomb.pt"), errors[name]), errors[name]
    assert re.fullmatch(refused.format(name="t1/model_states.pt"), errors["load_checkpoint"])
    assert errors["load_with_a_stray_bomb"] is None  # never opened
    assert errors["consolidate"] == "SystemExit: 2"
    # the libraries themselves are in `before` (ru_maxrss after a save and load without a bomb);
    # an inflated 2 GiB string would add its size
    assert report["peak_rss_mib"] - report["before_mib"] < 400, report


def _pickled(tmp_path: Path, obj: object, *, zip_format: bool = True) -> Path:
    path = tmp_path / ("zip.pt" if zip_format else "legacy.pt")
    torch.save(obj, path, _use_new_zipfile_serialization=zip_format)
    return path


def test_the_limit_is_named_and_can_be_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _pickled(tmp_path, {"notes": "n" * 50_000, "weight": torch.zeros(1000)})
    monkeypatch.setenv(MAX_PICKLE_ENV, "16KiB")
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"zip\.pt`: its entry `zip/data\.pkl` declares 49\.0 KiB \(\d+ bytes\), over the 16\.0 KiB "
        rf"limit .*\(tensor data is not counted\)\. HINT: .*{MAX_PICKLE_ENV}=1MiB\.",
    ):
        restricted_load(path)
    monkeypatch.setenv(MAX_PICKLE_ENV, "1MiB")
    assert len(restricted_load(path)["notes"]) == 50_000  # the tensor's 4 KB do not count
    assert len(restricted_load(path, max_pickle_size=64 * 1024)["notes"]) == 50_000


def test_a_legacy_file_is_bounded_by_its_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _pickled(tmp_path, {"notes": "n" * 50_000}, zip_format=False)
    monkeypatch.setenv(MAX_PICKLE_ENV, "16KiB")
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"legacy\.pt`: it is a legacy \(non-zip\) torch file, unpickled whole, of 49\.0 KiB .*over "
        rf"the 16\.0 KiB limit.*HINT: .*{MAX_PICKLE_ENV}=",
    ):
        restricted_load(path)
    monkeypatch.delenv(MAX_PICKLE_ENV)
    assert restricted_load(path)["notes"] == "n" * 50_000


def test_a_bad_limit_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_PICKLE_ENV, "lots")
    with pytest.raises(
        ValueError, match=rf"{MAX_PICKLE_ENV}='lots' is not a size; .*HINT: {MAX_PICKLE_ENV}=1GB"
    ):
        restricted_load(_pickled(tmp_path, {}))


def test_a_small_bomb_inflates_when_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the bomb is a real torch file that loads, inflated, when the limit allows it."""
    path = deflate_bomb(tmp_path / "bomb.pt", inflated=4 * 1024**2)
    assert path.stat().st_size < 64 * 1024
    monkeypatch.setenv(MAX_PICKLE_ENV, "1MiB")
    with pytest.raises(UnsafeCheckpointError, match=r"compressed \(\d+:1\) and declares 4\.0 MiB"):
        restricted_load(path)
    monkeypatch.setenv(MAX_PICKLE_ENV, "8MiB")
    assert restricted_load(path) == "a" * 4 * 1024**2
