"""A universal checkpoint is a cache keyed to the exact tag it was converted from.

Tag `state` is saved on 2 ranks and resumed on 1 (converted to a universal checkpoint cached
beside it; a link planted inside the cache makes it convert again, never followed), then
saved again under the same name with other data and more steps, and resumed on 1 rank again:
the resume gets the new weights with the new step counter, never the old conversion's
weights (what a stale cache gave). Five launches, ZeRO-2, fp32.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]


def _weights(result: dict) -> torch.Tensor:
    return torch.cat([torch.tensor(v) for _, v in sorted(result["weights"].items())])


def test_a_tag_saved_again_is_converted_again(tmp_path):
    ckpt = tmp_path / "ckpt"

    def launch(phase: str, nproc: int, name: str, *args: str) -> dict:
        out = tmp_path / name
        return run_workers(
            "stale_universal.py", "--phase", phase, "--ckpt", str(ckpt), *args, nproc=nproc, out_dir=out
        )[0]

    first = launch("save", 2, "save1", "--seed", "1", "--steps", "2")
    resumed_first = launch("resume", 1, "resume1")
    assert (ckpt / "state.universal").is_dir()
    # a link inside the cache (to a copy of its own file) is never followed: converted again
    inside = sorted((ckpt / "state.universal").rglob("*.pt"))[-1]
    moved = tmp_path / "elsewhere.pt"
    inside.rename(moved)
    inside.symlink_to(moved)
    resumed_link = launch("resume", 1, "resume_link")
    assert not inside.is_symlink() and inside.is_file()
    assert torch.allclose(_weights(resumed_link), _weights(first), atol=1e-6)
    second = launch("save", 2, "save2", "--seed", "2", "--steps", "5")
    resumed_second = launch("resume", 1, "resume2")

    assert (first["num_optimizer_steps"], second["num_optimizer_steps"]) == (2, 5)
    assert first["optimizer"] == "torch.optim.adamw.AdamW"  # the class the tag records
    assert (_weights(first) - _weights(second)).abs().max() > 1e-2  # the two saves differ
    assert torch.allclose(_weights(resumed_first), _weights(first), atol=1e-6)
    assert resumed_second["num_optimizer_steps"] == 5
    assert torch.allclose(_weights(resumed_second), _weights(second), atol=1e-6), "the stale conversion"
    assert any("universal checkpoint" in w for w in resumed_second["warnings"])
