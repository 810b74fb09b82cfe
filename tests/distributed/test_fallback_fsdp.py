"""The fallback's FSDP2 mapping end to end: resume, world-size changes, consolidation, reload.

accelerate offers FSDP only on GPU-type setups; these CPU ranks pretend that platform
(`--pretend-fsdp`, see `workers/_common.pretend_fsdp_platform`) and everything after it is
real: accelerate's FSDP2 preparation, torch's `fully_shard` on gloo, ds_engine's checkpoints.
Weights parity and reductions per step live in `test_parity.py`.

Three launches: (1) 2 ranks write the uninterrupted references and the FSDP checkpoints;
(2) 1 rank (no FSDP: one process has nothing to shard) resumes the 2-rank FSDP checkpoint
and writes its own; (3) 2 ranks (FSDP) resume both.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.launcher import run_workers
from tests.distributed.test_resume import _check_resumed, three_launches

pytestmark = [pytest.mark.distributed]

NOISE = {"stochastic": True}
SAME_WORLD = {
    "fsdp3": {"backend": "accelerate", "zero_stage": 3, **NOISE},
    "fsdp2": {"backend": "accelerate", "zero_stage": 2, **NOISE},
}
RESIZE = {"fsdp3_det": {"backend": "accelerate", "zero_stage": 3, "stochastic": False}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return three_launches(tmp_path_factory, "fsdp", SAME_WORLD, RESIZE, "--pretend-fsdp", timeout=600)


def _optimizer_format(folder) -> str:
    (tag,) = [p for p in (folder / "ckpt").iterdir() if p.is_dir()]
    return torch.load(tag / "optimizer_states.pt", weights_only=True)["optimizer_format"]


@pytest.mark.parametrize("name", list(SAME_WORLD))
def test_fsdp_resume_equals_uninterrupted_run_exactly(runs, name):
    reference = runs["reference"][0][f"reference:{name}"]
    resumed = runs["double"][0][f"resume:{name}"]
    assert reference["fsdp"] and resumed["fsdp"]
    _check_resumed(reference, resumed)
    assert resumed["bitwise_equal"], resumed["max_abs_diff"]
    assert resumed["warnings"] == []
    # sharded optimizer states were gathered and keyed by parameter name
    assert _optimizer_format(runs["ref_dir"] / name) == "fqn"


def test_fsdp_checkpoint_resumes_in_one_process(runs):
    reference = runs["reference"][0]["reference:fsdp3_det"]
    (resumed,) = (r["resume:fsdp3_det"] for r in runs["single"])
    assert not resumed["fsdp"]  # one process: plain model, full tensors
    _check_resumed(reference, resumed)
    assert resumed["max_abs_diff"] < 1e-5  # same samples per step; only the summation order differs


def test_single_process_checkpoint_resumes_under_fsdp(runs):
    """torch's own optimizer format (parameters numbered) is placed into FSDP shards by name."""
    reference = runs["reference"][0]["reference:fsdp3_det"]
    assert _optimizer_format(runs["one_dir"] / "fsdp3_det") == "index"
    rank0, rank1 = (r["resume:fsdp3_det"] for r in runs["double"])
    assert rank0["fsdp"] and rank1["fsdp"]
    assert rank0["loaded_counters"] == [4, 16]
    assert rank0["lrs"] == reference["lrs"][4:]
    assert rank0["max_abs_diff"] < 1e-5


@pytest.fixture(scope="module")
def saved_out(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp_save")


@pytest.fixture(scope="module")
def saved(saved_out):
    out = saved_out
    runs = [[3, "fp32"], [0, "fp32"], [2, "fp32"], [3, "bf16"]]
    return run_workers("fallback_fsdp_save.py", "--runs", json.dumps(runs), out_dir=out)


def test_fsdp_grad_norm_and_clipping_equal_ddp(saved):
    fsdp3, ddp, fsdp2 = (saved[0][name] for name in ("zero3_fp32", "zero0_fp32", "zero2_fp32"))
    assert fsdp3["fsdp"] and fsdp2["fsdp"] and not ddp["fsdp"]
    assert fsdp3["steps"] == ddp["steps"] == 3
    assert max(ddp["norms"]) > 0.5  # clipping at 0.5 really acted
    for got in (fsdp3["norms"], fsdp2["norms"]):
        assert got == pytest.approx(ddp["norms"], rel=1e-5)  # the global norm, not a shard's


@pytest.mark.parametrize("name", ["zero3_fp32", "zero2_fp32", "zero3_bf16", "zero0_fp32"])
def test_fsdp_save_pretrained_reloads_with_plain_from_pretrained(saved, name):
    rank0, rank1 = saved[0][name], saved[1][name]
    assert rank1["state_is_none"]  # the full state dict lives on rank 0 only
    assert rank0["state_keys_match"] and rank0["tied"]
    assert rank0["state_max_diff"] == 0.0
    assert rank0["logits_max_diff"] < (1e-5 if name.endswith("fp32") else 5e-2)


@pytest.mark.parametrize("name", ["zero3_fp32", "zero2_fp32", "zero3_bf16", "zero0_fp32"])
def test_fsdp_streamed_shards_equal_safetensors_bytes(saved, saved_out, name):
    """With tiny shards every sharded tensor is streamed a rank's rows at a time; the files are
    still byte for byte what safetensors writes for the full tensors."""
    import safetensors.torch

    folder = saved_out / f"{name}_pieces"
    assert folder.is_dir()
    whole = {}
    for path in sorted((folder.parent / name).glob("*.safetensors")):
        whole.update(safetensors.torch.load_file(path))
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) > 3
    seen = set()
    for path in files:
        keys = safetensors.torch.load_file(path).keys()
        expected = safetensors.torch.save({k: whole[k] for k in keys}, metadata={"format": "pt"})
        assert path.read_bytes() == expected, path.name
        seen.update(keys)
    assert seen == set(whole)
