"""Saving into a folder that holds other things replaces only what the save writes.

The HF Trainer's layout keeps the final model beside `checkpoint-N/` folders, a `metrics.jsonl`
and notes. `Engine.save_pretrained`, `Accelerator.save_model`, the PEFT adapter save and
`ds-engine consolidate` must keep all of that byte for byte, replace the files they write,
remove stale weight files of their own naming (other shards, the single file or index of the
other layout, the other serialization's weights), and nothing else:

* every transition between single-file and sharded saves, and between serializations, ends
  with exactly the foreign files plus the new save, which `from_pretrained` loads;
* kill -9 at every rename of a save into such a folder (a real SIGKILL in a forked process,
  at the k-th rename for every k) leaves foreign files intact, no half-written file under a
  final name, and a folder that `from_pretrained` either refuses or loads with exactly the
  old or exactly the new weights -- never a mix; the previous files are always recoverable;
* a full disk (a real small tmpfs, where mounting is allowed) leaves the previous files
  byte-identical and no leftovers;
* `ds-engine consolidate` refuses an output that is, contains or lies inside the checkpoint
  (links resolved) before writing anything;
* the hostile-folder corpus (`MODEL_FOLDER_CASES`: config files that are links to a secret,
  dangling links, FIFOs, JSON that is not an object, a link in the output folder) is refused
  by name, never followed, never blocked on, nothing written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ds_engine.cli import main as cli_main
from ds_engine.weights import save_pretrained
from tests.helpers import tiny_gpt2
from tests.unit.test_save_faults import Mounts, fill

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-private-key-material"


# --------------------------------------------------------------------------- helpers
def plant_foreign(folder: Path) -> dict[str, bytes]:
    """What a run folder holds beside its final model; returns {relative path: bytes}."""
    (folder / "checkpoint-1").mkdir(parents=True, exist_ok=True)
    (folder / "checkpoint-1" / "model.safetensors").write_bytes(b"a training checkpoint's weights")
    (folder / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (folder / "notes.md").write_text("lr 2e-5 looked best\n")
    # near-names of the weight files: not of the save's naming, so never removed
    for name in ("model.safetensors.bak", "my_model-00001-of-00002.safetensors", "model-1-of-2.safetensors"):
        (folder / name).write_bytes(b"kept: " + name.encode())
    return snapshot(folder)


def snapshot(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every regular file, hidden staging folders left out."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink() and not p.relative_to(folder).parts[0].startswith(".")
    }


def assert_loads(folder: Path, model: torch.nn.Module) -> None:
    from transformers import GPT2LMHeadModel

    loaded: Any = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    reloaded, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = model.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, want[key]), key


def _engine():
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        return Engine(backend="accelerate")


# --------------------------------------------------------------------------- L: keep what is not ours
def test_engine_save_pretrained_keeps_everything_it_does_not_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    foreign = plant_foreign(run)
    engine = _engine()
    model = engine.prepare(tiny_gpt2())
    engine.save_pretrained(model, run)
    after = snapshot(run)
    assert {k: after[k] for k in foreign} == foreign  # byte for byte
    assert set(after) - set(foreign) == {"config.json", "generation_config.json", "model.safetensors"}
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no staging left
    assert_loads(run, tiny_gpt2())


def test_accelerator_save_model_keeps_everything_it_does_not_write(tmp_path: Path) -> None:
    import ds_engine

    run = tmp_path / "run"
    foreign = plant_foreign(run)
    accelerator = ds_engine.Accelerator(backend="accelerate")
    model = accelerator.prepare(tiny_gpt2())
    accelerator.save_model(model, run, max_shard_size="40KB")
    after = snapshot(run)
    assert {k: after[k] for k in foreign} == foreign
    assert "model.safetensors.index.json" in after
    assert_loads(run, tiny_gpt2())


#: (first save, second save): max_shard_size / serialization of each ("bin": pytorch_model.bin)
TRANSITIONS = {
    "single-to-sharded": ("5GB", "40KB"),
    "sharded-to-single": ("40KB", "5GB"),
    "sharded-to-other-split": ("40KB", "25KB"),
    "sharded-to-same-names": ("40KB", "40KB"),
    "bin-to-safetensors": ("bin", "40KB"),
    "safetensors-to-bin": ("40KB", "bin"),
}


def _save(model: torch.nn.Module, folder: Path, how: str) -> None:
    if how == "bin":
        save_pretrained(model, folder, safe_serialization=False)
    else:
        save_pretrained(model, folder, max_shard_size=how)


@pytest.mark.parametrize("first,second", TRANSITIONS.values(), ids=list(TRANSITIONS))
@pytest.mark.parametrize("beside", ["foreign files", "nothing else"])
def test_stale_weights_of_its_own_naming_go_the_rest_stays(
    tmp_path: Path, first: str, second: str, beside: str
) -> None:
    alone = tmp_path / "alone"
    _save(tiny_gpt2(1), alone, second)  # what the second save alone writes
    run = tmp_path / "run"
    foreign = plant_foreign(run) if beside == "foreign files" else {}
    _save(tiny_gpt2(0), run, first)
    _save(tiny_gpt2(1), run, second)
    after = snapshot(run)
    assert {k: after[k] for k in foreign} == foreign
    assert set(after) == set(foreign) | set(snapshot(alone))  # stale shards, index, file gone
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
    assert [p.name for p in tmp_path.iterdir()] == ["alone", "run"]  # no sibling left either
    assert_loads(run, tiny_gpt2(1))


def test_a_link_in_the_folder_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere.safetensors"
    victim.write_bytes(b"not yours")
    run = tmp_path / "run"
    plant_foreign(run)
    (run / "model.safetensors").symlink_to(victim)
    (run / "config.json").symlink_to(tmp_path / "nowhere.json")  # dangling
    save_pretrained(tiny_gpt2(), run)
    assert victim.read_bytes() == b"not yours"
    assert not (run / "model.safetensors").is_symlink() and not (run / "config.json").is_symlink()
    assert_loads(run, tiny_gpt2())


def test_a_folder_where_the_save_writes_a_file_is_refused_untouched(tmp_path: Path) -> None:
    run = tmp_path / "run"
    foreign = plant_foreign(run)
    (run / "config.json").mkdir()
    (run / "config.json" / "mine.txt").write_text("a user's folder")
    with pytest.raises(
        FileExistsError,
        match=r"config.json' is a folder where the save writes a file of that name; "
        r"nothing was replaced .*HINT: move it away",
    ):
        save_pretrained(tiny_gpt2(), run)
    assert snapshot(run) == {**foreign, "config.json/mine.txt": b"a user's folder"}
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- crashes and full disks
def crash_child(folder: str) -> None:
    """In a fresh process: for each transition, save the first model into `<t>/template` beside
    foreign files, then for k = 1, 2, ... copy the template to `<t>/k<k>` and, in a forked
    process, save the second model there with SIGKILL at the k-th rename, until a save
    completes (`<t>/done` holds that k)."""
    torch.set_num_threads(1)
    base = Path(folder)
    old, new = tiny_gpt2(0), tiny_gpt2(1)
    for name in CRASH_TRANSITIONS:
        first, second = TRANSITIONS[name]
        template = base / name / "template"
        plant_foreign(template)
        _save(old, template, first)
        for k in range(1, 200):
            case = base / name / f"k{k}"
            shutil.copytree(template, case, symlinks=True)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the forked process
                _die_at_rename(k)
                _save(new, case, second)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status):
                assert os.WEXITSTATUS(status) == 0
                (base / name / "done").write_text(str(k))
                break
            assert os.WTERMSIG(status) == signal.SIGKILL


CRASH_TRANSITIONS = ("sharded-to-same-names", "single-to-sharded", "sharded-to-single")


def _die_at_rename(k: int) -> None:
    """From now on this process is killed with SIGKILL at its k-th `os.rename`."""
    calls = [0]
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst, *args, **kwargs)

    os.rename = rename


def _state(folder: Path) -> dict[str, torch.Tensor] | None:
    """The weights `from_pretrained` loads from `folder`, or None when it refuses the folder."""
    from transformers import GPT2LMHeadModel

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return GPT2LMHeadModel.from_pretrained(folder).state_dict()
    except OSError as error:
        assert re.search(
            r"no file named model.safetensors|does not appear to have a file named", str(error)
        ), error
        return None


@pytest.mark.timeout(900)
def test_kill_at_every_rename_never_mixes_old_and_new_weights(tmp_path: Path) -> None:
    code = "import sys; from tests.unit.test_save_into_existing import crash_child; crash_child(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    old_state, new_state = tiny_gpt2(0).state_dict(), tiny_gpt2(1).state_dict()
    foreign = plant_foreign(tmp_path / "foreign")
    for name in CRASH_TRANSITIONS:
        alone = tmp_path / f"alone-{name}"
        _save(tiny_gpt2(1), alone, TRANSITIONS[name][1])
        template = snapshot(tmp_path / name / "template")
        last = int((tmp_path / name / "done").read_text())
        assert last > 4, (name, last)  # the kills really fell inside the save, at several points
        final = snapshot(tmp_path / name / f"k{last}")
        assert set(final) == set(foreign) | set(snapshot(alone)), name  # stale files gone
        assert not list((tmp_path / name / f"k{last}").glob(".*")), name
        seen = set()
        for k in range(1, last + 1):
            case = tmp_path / name / f"k{k}"
            files = snapshot(case)
            assert {f: files.get(f) for f in foreign} == foreign, (name, k)
            for f, data in files.items():  # no half-written file under a final name
                assert data in (template.get(f), final.get(f)), (name, k, f)
            state = _state(case)
            if state is None:
                seen.add("refused")
                assert not {"model.safetensors", "model.safetensors.index.json"} & set(files), (name, k)
            else:
                same_old = all(torch.equal(v, old_state[key]) for key, v in state.items())
                same_new = all(torch.equal(v, new_state[key]) for key, v in state.items())
                assert same_old or same_new, f"{name}: kill at rename {k} left a mix of old and new weights"
                seen.add("old" if same_old else "new")
            if k == last:
                continue  # the save completed: the previous files are replaced
            # every previous file is still on disk: in place, or set aside in the hidden folder
            kept = list(files.values()) + [p.read_bytes() for p in case.glob(".ds_engine-save-*/old/*")]
            assert all(data in kept for data in template.values()), (name, k)
        assert {"old", "new"} <= seen, (name, seen)


def _chattr(flag: str, path: Path) -> bool:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    return done.returncode == 0


def test_a_move_that_fails_part_way_puts_every_previous_file_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    plant_foreign(run)
    save_pretrained(tiny_gpt2(0), run, max_shard_size="40KB")
    before = snapshot(run)
    shards = sorted(p for p in run.iterdir() if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", p.name))
    stuck = shards[-1]  # set aside after the index and the other shards
    if shutil.which("chattr") is None or not _chattr("+i", stuck):
        pytest.skip("needs `chattr +i` (root, a filesystem with the immutable flag): the real failing rename")
    try:
        with pytest.raises(
            PermissionError,
            match=rf"Operation not permitted: could not write the saved model's files to "
            rf"'{re.escape(str(stuck))}'.*HINT: make the folder writable",
        ):
            save_pretrained(tiny_gpt2(1), run)
    finally:
        _chattr("-i", stuck)
    assert snapshot(run) == before  # every previous file back in place, byte for byte
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
    assert_loads(run, tiny_gpt2(0))


@pytest.fixture
def mounts(tmp_path: Path):
    made = Mounts(tmp_path)
    yield made
    made.unmount_all()


def test_full_disk_leaves_the_previous_files_byte_identical(mounts: Mounts) -> None:
    disk = mounts.tmpfs("disk", size="4m")
    run = disk / "run"
    plant_foreign(run)
    save_pretrained(tiny_gpt2(0), run, max_shard_size="40KB")
    before = snapshot(run)
    fill(disk).unlink()
    # room for about one shard: the save fails part way, after writing some of its files
    (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 60 * 1024))
    with pytest.raises(OSError) as raised:
        save_pretrained(tiny_gpt2(1), run, max_shard_size="40KB")
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert snapshot(run) == before
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "run"]
    assert_loads(run, tiny_gpt2(0))


# --------------------------------------------------------------------------- PEFT adapter folders
def test_adapter_save_keeps_foreign_files_and_updates_the_model_card(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
    )
    model = get_peft_model(tiny_gpt2(), config)
    run = tmp_path / "run"
    foreign = plant_foreign(run)
    (run / "README.md").write_text("# my adapter\n\nnotes by the user\n")
    (run / "adapter_model.bin").write_bytes(b"a stale adapter of the other serialization")
    engine = _engine()
    prepared = engine.prepare(model)
    engine.save_pretrained(prepared, run)
    after = snapshot(run)
    assert {k: after[k] for k in foreign} == foreign
    assert set(after) - set(foreign) == {"README.md", "adapter_config.json", "adapter_model.safetensors"}
    card = (run / "README.md").read_text()
    assert "notes by the user" in card and "library_name: peft" in card  # updated, as peft does
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), run)
    want = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    got = reloaded.state_dict()
    assert want and all(torch.equal(got[k], v) for k, v in want.items())


def test_adapter_save_never_reads_a_linked_model_card(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    secret = tmp_path / "id_rsa"
    secret.write_text(SECRET)
    run = tmp_path / "run"
    plant_foreign(run)
    (run / "README.md").symlink_to(secret)
    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    engine = _engine()
    engine.save_pretrained(engine.prepare(model), run)
    assert secret.read_text() == SECRET
    assert not (run / "README.md").is_symlink()
    assert all(SECRET.encode() not in data for data in snapshot(run).values())


# --------------------------------------------------------------------------- consolidate
TAG = "t1"


def zero0_checkpoint(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """The layout DeepSpeed writes at ZeRO-0 (what `consolidate` reads) and a config.json."""
    (folder / TAG).mkdir(parents=True)
    (folder / "latest").write_text(TAG)
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 1).state_dict()
    torch.save({"module": module}, folder / TAG / "mp_rank_00_model_states.pt")
    (folder / "config.json").write_text(json.dumps({"model_type": "demo", "hidden_size": 4}))
    (folder / "generation_config.json").write_text(json.dumps({"max_length": 7}))
    return module


#: output folder -> how it relates to the checkpoint folder `run/ckpt`
APART = {
    "the checkpoint itself": ("run/ckpt", "is"),
    "its parent": ("run", "contains"),
    "a folder inside it": ("run/ckpt/hf", "lies inside"),
    "a link to it": ("link", "is"),
    "inside a link to it": ("link/hf", "lies inside"),
}


@pytest.mark.parametrize("output,relation", APART.values(), ids=list(APART))
def test_consolidate_refuses_an_output_that_overlaps_the_checkpoint(
    tmp_path: Path, output: str, relation: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "run" / "ckpt"
    zero0_checkpoint(checkpoint)
    (tmp_path / "link").symlink_to(checkpoint)
    before = snapshot(tmp_path)
    status = cli_main(["consolidate", str(checkpoint), str(tmp_path / output)])
    error = capsys.readouterr().err
    assert status == 2, error
    assert re.fullmatch(
        rf"ds-engine: error: output folder '{re.escape(str(tmp_path / output))}' {relation} the checkpoint "
        rf"folder '{re.escape(str(checkpoint))}' being consolidated.* the output must lie apart from it.* "
        rf"HINT: write to another folder, e.g. '{re.escape(str(checkpoint))}-hf'.\n",
        error,
    ), error
    assert snapshot(tmp_path) == before  # nothing read was removed, nothing written
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "config.json",
        "generation_config.json",
        "latest",
        TAG,
    ]
    assert not [p for p in tmp_path.rglob(".*")]


def test_consolidate_into_a_folder_beside_the_checkpoint_keeps_its_files(tmp_path: Path) -> None:
    from ds_engine.consolidate import consolidate_checkpoint

    checkpoint = tmp_path / "run" / "ckpt"
    weights = zero0_checkpoint(checkpoint)
    out = tmp_path / "run" / "final"
    foreign = plant_foreign(out)
    consolidate_checkpoint(checkpoint, out)
    after = snapshot(out)
    assert {k: after[k] for k in foreign} == foreign
    assert set(after) - set(foreign) == {"config.json", "generation_config.json", "model.safetensors"}
    assert torch.equal(safetensors.torch.load_file(out / "model.safetensors")["weight"], weights["weight"])
    assert json.loads((out / "generation_config.json").read_text()) == {"max_length": 7}


@dataclass(frozen=True)
class ModelFolderCase:
    """`plant(checkpoint, secret)` spoils `spoiled` (a path under the test's folder, whose
    checkpoint is `ckpt/`) and returns extra CLI arguments; `refused` is the error (a regex,
    `{file}` the spoiled file) or None: consolidate works."""

    name: str
    plant: Callable[[Path, Path], list[str]]
    spoiled: str
    refused: str | None


def _link(name: str, to_secret: bool = True) -> Callable[[Path, Path], list[str]]:
    def plant(checkpoint: Path, secret: Path) -> list[str]:
        (checkpoint / name).unlink()
        (checkpoint / name).symlink_to(secret if to_secret else checkpoint / "gone.json")
        return []

    return plant


def _fifo(name: str) -> Callable[[Path, Path], list[str]]:
    def plant(checkpoint: Path, secret: Path) -> list[str]:
        (checkpoint / name).unlink()
        os.mkfifo(checkpoint / name)
        return []

    return plant


def _content(text: str) -> Callable[[Path, Path], list[str]]:
    def plant(checkpoint: Path, secret: Path) -> list[str]:
        (checkpoint / "config.json").write_text(text)
        return []

    return plant


def _tag_config_link(checkpoint: Path, secret: Path) -> list[str]:
    (checkpoint / TAG / "config.json").symlink_to(secret)  # found first: the tag folder
    return []


def _config_from_link(checkpoint: Path, secret: Path) -> list[str]:
    model = checkpoint.parent / "model"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    return ["--config-from", str(model)]


def _generation_folder(checkpoint: Path, secret: Path) -> list[str]:
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "generation_config.json").mkdir()  # not a file: there is none to copy
    return []


_LINK = (
    r"refusing to read '{file}': it is a symbolic link, and a model's config files are read only as "
    r"regular files in their folder"
)
_FIFO = r"refusing to read '{file}': it is a FIFO \(named pipe\), and a model's config files"
_CONFIG, _GENERATION = "ckpt/config.json", "ckpt/generation_config.json"
#: Hostile or broken model-config inputs of `ds-engine consolidate`.
MODEL_FOLDER_CASES = (
    ModelFolderCase("generation-config-link-to-secret", _link("generation_config.json"), _GENERATION, _LINK),
    ModelFolderCase("config-link-to-secret", _link("config.json"), _CONFIG, _LINK),
    ModelFolderCase("config-dangling-link", _link("config.json", to_secret=False), _CONFIG, _LINK),
    ModelFolderCase("config-fifo", _fifo("config.json"), _CONFIG, _FIFO),
    ModelFolderCase("generation-config-fifo", _fifo("generation_config.json"), _GENERATION, _FIFO),
    ModelFolderCase("config-in-tag-folder-link", _tag_config_link, f"ckpt/{TAG}/config.json", _LINK),
    ModelFolderCase("config-from-link", _config_from_link, "model/config.json", _LINK),
    ModelFolderCase(
        "config-a-list",
        _content("[1, 2]"),
        _CONFIG,
        r"model config '{file}' is not a config.json \(a JSON list, not an object\); allowed: a JSON "
        r"object of settings",
    ),
    ModelFolderCase(
        "config-not-json",
        _content("{nope"),
        _CONFIG,
        r"model config '{file}' is not a config.json \(Expecting",
    ),
    ModelFolderCase("generation-config-a-folder", _generation_folder, _GENERATION, None),
)


@pytest.mark.timeout(120)  # a FIFO that is opened blocks forever: fail instead
@pytest.mark.parametrize("case", MODEL_FOLDER_CASES, ids=[c.name for c in MODEL_FOLDER_CASES])
def test_consolidate_reads_config_files_only_as_regular_files(
    tmp_path: Path, case: ModelFolderCase, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, out = tmp_path / "ckpt", tmp_path / "out"
    weights = zero0_checkpoint(checkpoint)
    secret = tmp_path / "id_rsa"
    secret.write_text(json.dumps({"key": SECRET}))
    extra = case.plant(checkpoint, secret)
    status = cli_main(["consolidate", str(checkpoint), str(out), *extra])
    error = capsys.readouterr().err
    assert SECRET not in error
    if case.refused is None:
        assert status == 0, error
        assert torch.equal(
            safetensors.torch.load_file(out / "model.safetensors")["weight"], weights["weight"]
        )
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        return
    assert status == 2, error
    pattern = case.refused.format(file=re.escape(str(tmp_path / case.spoiled)))
    assert re.fullmatch(rf"ds-engine: error: {pattern}.*HINT: .*\n", error), error
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    assert secret.read_text() == json.dumps({"key": SECRET})


def test_consolidate_api_names_the_linked_file(tmp_path: Path) -> None:
    from ds_engine.consolidate import consolidate_checkpoint
    from ds_engine.safety import UnsafeCheckpointError

    checkpoint = tmp_path / "ckpt"
    zero0_checkpoint(checkpoint)
    secret = tmp_path / "id_rsa"
    secret.write_text(SECRET)
    _link("generation_config.json")(checkpoint, secret)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"generation_config.json': it is a symbolic link.*HINT: if you trust the file, replace it by a "
        r"regular copy \(`cp -L`\)",
    ):
        consolidate_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
