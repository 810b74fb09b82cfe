"""Training checkpoints in one process on the accelerate fallback: layout, `latest`, `keep_last`,
atomic publication, RNG round trip, and every user error (pinned messages)."""

from __future__ import annotations

import json
import random
import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.backends.accelerate_states import FALLBACK_MODEL_NAME, FALLBACK_OPTIMIZER_NAME
from ds_engine.checkpoint import (
    CHECKPOINT_META_NAME,
    ENGINE_STATE_NAME,
    capture_rng_state,
    resolve_checkpoint,
    restore_rng_state,
)
from ds_engine.consolidate import consolidate_checkpoint
from tests.helpers import micro_step


class Custom:
    """An object that only loads by running code (a pickled class)."""


def _engine(**choices):
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback reports unhonoured choices
        return Engine(backend="accelerate", **choices)


def _prepared(ga: int = 2, num_samples: int = 16, model: torch.nn.Module | None = None):
    engine = _engine(gradient_accumulation_steps=ga)
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(num_samples, 4, generator=g), torch.randn(num_samples, 1, generator=g))
    loader = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))
    return (engine, *engine.prepare(model, optimizer, loader, scheduler))


def _train(engine, model, optimizer, loader, scheduler, steps: int, save=None) -> None:
    done = 0
    for batch in loader:
        micro_step(engine, model, optimizer, batch, scheduler)
        if engine.sync_gradients:
            done += 1
            if save is not None:
                save(done)
            if done == steps:
                return


@pytest.fixture
def saved(tmp_path):
    parts = _prepared()
    _train(
        *parts,
        steps=2,
        save=lambda step: parts[0].save_checkpoint(tmp_path / "ckpt", client_state={"s": step}),
    )
    return tmp_path / "ckpt", parts


# --------------------------------------------------------------------------- layout
def test_layout_latest_and_meta(saved):
    ckpt, (engine, *_) = saved
    assert (ckpt / "latest").read_text() == "step_2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1", "step_2"]  # no temp folders
    tag = ckpt / "step_2"
    assert sorted(p.name for p in tag.iterdir()) == sorted(
        [
            CHECKPOINT_META_NAME,
            ENGINE_STATE_NAME,
            FALLBACK_MODEL_NAME,
            FALLBACK_OPTIMIZER_NAME,
            "rng_state_rank0.pt",
            "ds_engine_manifest.json",  # what the save wrote: resuming by itself checks it
        ]
    )
    meta = json.loads((tag / CHECKPOINT_META_NAME).read_text())
    assert {k: meta[k] for k in ("backend", "zero_stage", "world_size", "precision", "tag")} == {
        "backend": "accelerate",
        "zero_stage": None,
        "world_size": 1,
        "precision": engine.config.precision,
        "tag": "step_2",
    }
    # every file ds_engine reads back loads without running code
    for path in tag.glob("*.pt"):
        torch.load(path, weights_only=True)


def test_load_restores_counters_schedule_position_and_client_state(saved):
    ckpt, (engine, model, _, _, scheduler) = saved
    expected = {k: v.clone() for k, v in engine.unwrap_model(model).state_dict().items()}
    _, model2, optimizer2, loader2, scheduler2 = parts = _prepared()
    client = parts[0].load_checkpoint(ckpt, tag="step_2")
    assert client == {"s": 2}
    assert (parts[0].num_optimizer_steps, parts[0].num_micro_steps) == (2, 4)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr() == [optimizer2.param_groups[0]["lr"]]
    state = parts[0].unwrap_model(model2).state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    # not iterating yet: the restored position is what a save made now records
    assert loader2.state_dict() == {"epoch": 0, "batch_index": 4}
    assert loader2.batch_sampler.skip_batches == 4  # the next batch after the 4 consumed


def test_rng_round_trip():
    state = capture_rng_state()
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == first


def test_keep_last_prunes_old_tags_but_never_the_new_one(tmp_path):
    parts = _prepared()
    _train(*parts, steps=3, save=lambda step: parts[0].save_checkpoint(tmp_path, keep_last=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_3"]
    parts[0].save_checkpoint(tmp_path, tag="final", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "latest"]
    assert (tmp_path / "latest").read_text() == "final"


def test_offline_consolidate_reads_a_fallback_checkpoint(saved, tmp_path):
    ckpt, (engine, model, *_) = saved
    out = consolidate_checkpoint(ckpt, tmp_path / "weights")
    import safetensors.torch

    weights = safetensors.torch.load_file(out / "model.safetensors")
    state = engine.unwrap_model(model).state_dict()
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)


def test_crash_while_writing_publishes_nothing(saved, monkeypatch):
    ckpt, (engine, *_) = saved
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith(FALLBACK_OPTIMIZER_NAME):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(ckpt, tag="broken")
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1", "step_2"]
    assert (ckpt / "latest").read_text() == "step_2"


# --------------------------------------------------------------------------- load errors
def test_missing_folder(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint folder '.*nope' does not exist .*HINT: pass the folder"
    ):
        resolve_checkpoint(tmp_path / "nope")


def test_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(
        ValueError, match=r"is not a ds_engine checkpoint: no `latest` file; found: weights.bin\. HINT"
    ):
        resolve_checkpoint(tmp_path)


def test_tag_folder_given_instead_of_checkpoint_folder(saved):
    ckpt, _ = saved
    with pytest.raises(
        ValueError, match=r"is a tag folder, not a checkpoint folder\. HINT: pass its parent .* tag='step_2'"
    ):
        resolve_checkpoint(ckpt / "step_2")


def test_missing_tag_lists_the_tags(saved):
    ckpt, (engine, *_) = saved
    with pytest.raises(
        FileNotFoundError, match=r"tag 'step_9' not found in .*; tags found: step_1, step_2\. HINT"
    ):
        engine.load_checkpoint(ckpt, tag="step_9")


def test_tag_folder_without_meta(saved):
    ckpt, _ = saved
    (ckpt / "global_step3").mkdir()
    with pytest.raises(
        ValueError, match=r"global_step3' is not a ds_engine checkpoint tag .*found: an empty folder"
    ):
        resolve_checkpoint(ckpt, "global_step3")


@pytest.mark.parametrize("name", [ENGINE_STATE_NAME, FALLBACK_MODEL_NAME, "rng_state_rank0.pt"])
def test_truncated_file(saved, name):
    ckpt, (engine, *_) = saved
    path = ckpt / "step_2" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        ValueError, match=rf"{name}' is truncated or corrupt .*HINT: load an older tag with `tag=` \(step_1\)"
    ):
        engine.load_checkpoint(ckpt)


def test_truncated_meta(saved):
    ckpt, (engine, *_) = saved
    path = ckpt / "step_2" / CHECKPOINT_META_NAME
    path.write_text(path.read_text()[:20])
    with pytest.raises(ValueError, match=r"ds_engine_meta.json' is not valid JSON .*truncated or corrupt"):
        engine.load_checkpoint(ckpt)


def test_checkpoint_from_another_backend(saved):
    ckpt, (engine, *_) = saved
    path = ckpt / "step_2" / CHECKPOINT_META_NAME
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "backend": "deepspeed", "zero_stage": 3}))
    with pytest.raises(
        ValueError,
        match=r"written by the 'deepspeed' backend but this Engine runs 'accelerate'.*"
        r"HINT: turn it into weights with `ds-engine consolidate .* OUT --tag step_2`.*"
        r"or resume with Engine\(backend='deepspeed'\)",
    ):
        engine.load_checkpoint(ckpt)


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"zero_stage": 2},
            r"written with zero_stage=2 but this Engine runs zero_stage=3.*or resume with zero_stage=2",
        ),
        (
            {"precision": "bf16"},
            r"written with precision='bf16' but this Engine runs precision='fp32'.*precision='bf16'",
        ),
    ],
)
def test_checkpoint_from_another_zero_stage_or_precision(tmp_path, change, message):
    from ds_engine import Engine
    from ds_engine.backends.deepspeed_states import needs_universal
    from ds_engine.checkpoint import _compatibility

    engine = Engine(backend="deepspeed", zero_stage=3, precision="fp32")  # no process group needed
    meta = {"backend": "deepspeed", "zero_stage": 3, "precision": "fp32", "world_size": 1, **change}
    problem = _compatibility(engine._backend, meta, tmp_path / "step_2")
    universal = needs_universal(meta, tmp_path / "step_2")
    assert re.search(message, problem) and "HINT: turn it into weights" in problem and not universal


def test_other_dataloaders_are_refused(saved):
    ckpt, _ = saved
    engine, *_ = _prepared(num_samples=20)
    with pytest.raises(
        ValueError,
        match=r"dataloader #0 has 20 samples but the checkpoint's had 16.*HINT: resume with the same data",
    ):
        engine.load_checkpoint(ckpt)


def test_load_before_prepare(saved):
    ckpt, _ = saved
    with pytest.raises(RuntimeError, match=r"`load_checkpoint` before `prepare`.*HINT: call `engine.prepare"):
        _engine().load_checkpoint(ckpt)


# --------------------------------------------------------------------------- save errors
def test_save_before_prepare(tmp_path):
    with pytest.raises(RuntimeError, match=r"`save_checkpoint` before `prepare`.*HINT"):
        _engine().save_checkpoint(tmp_path)


def test_save_mid_window(tmp_path):
    engine, model, _, loader, _ = _prepared(ga=2)
    x, y = next(iter(loader))
    with engine.accumulate(model):
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        with pytest.raises(
            RuntimeError,
            match=r"in the middle of an accumulation window \(micro-step 1, GA=2\).*HINT: save right after",
        ):
            engine.save_checkpoint(tmp_path)


@pytest.mark.parametrize("tag", ["latest", "../up", ".hidden", "a/b", "x.tmp", ""])
def test_bad_tag(saved, tag):
    ckpt, (engine, *_) = saved
    with pytest.raises(
        ValueError, match=r"`tag`=.* is not a usable tag; allowed: letters.*HINT: use tag='step_100'"
    ):
        engine.save_checkpoint(ckpt, tag=tag)


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5])
def test_bad_keep_last(saved, keep_last):
    ckpt, (engine, *_) = saved
    with pytest.raises(ValueError, match=r"`keep_last`=.* must be a positive int or None.*HINT: keep_last=3"):
        engine.save_checkpoint(ckpt, keep_last=keep_last)


def test_directory_that_is_a_file(saved, tmp_path):
    _, (engine, *_) = saved
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`directory`=.*file' is a file, not a folder\. HINT"):
        engine.save_checkpoint(tmp_path / "file")


def test_client_state_that_needs_code_to_load(saved):
    ckpt, (engine, *_) = saved
    with pytest.raises(
        TypeError,
        match=r"`client_state` holds an object that cannot be loaded without running code.*HINT: convert it",
    ):
        engine.save_checkpoint(ckpt, tag="custom", client_state={"obj": Custom()})
    assert not (ckpt / "custom").exists() and (ckpt / "latest").read_text() == "step_2"
