"""ZeRO-3 on 2 ranks: `save_pretrained` into a run folder keeps the run's checkpoint and files.

The run folder holds a real training checkpoint (`checkpoint-1/`, saved by the same run),
`metrics.jsonl` and notes; two saves into it (single file, then sharded after a step) leave
all of that as it was, replace the single file by the shards and index, and the folder
reloads with plain `from_pretrained` with the trained weights; the checkpoint still loads. A
save that cannot proceed (a folder where `config.json` goes) fails on both ranks alike.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed]


def test_zero3_save_pretrained_into_a_run_folder_keeps_its_checkpoint(tmp_path):
    results = run_workers("save_into_existing.py", timeout=600, out_dir=tmp_path)
    run = tmp_path / "run"
    checkpoint_files = sorted(str(p.relative_to(run)) for p in (run / "checkpoint-1").rglob("*"))
    assert any(name.endswith("model_states.pt") for name in checkpoint_files), checkpoint_files
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (run / "notes.md").read_text() == "kept\n"
    names = sorted(p.name for p in run.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors" not in names, names
    assert not [n for n in names if n.startswith(".")], names
    assert set(names) == {
        "checkpoint-1",
        "metrics.jsonl",
        "notes.md",
        "config.json",
        "generation_config.json",
    } | {
        "model.safetensors.index.json",
        *shards,
    }

    from transformers import GPT2LMHeadModel

    reloaded = GPT2LMHeadModel.from_pretrained(run)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, state[key]), key

    from ds_engine.checkpoint import resolve_checkpoint

    resolve_checkpoint(run / "checkpoint-1")  # the run's checkpoint is complete, as saved

    for result in results:  # the refused save fails on every rank, naming the folder
        assert "config.json' is a folder where the save writes a file" in result["conflict"], result
