"""ZeRO 0-3 consolidation on 2 real CPU ranks (raw deepspeed.initialize), reload without DeepSpeed,
and offline consolidation of a ZeRO-3 checkpoint.

One torchrun launch runs all eight scenarios (ZeRO 0-3 x bf16/fp32); one fresh subprocess that
never imports DeepSpeed reloads every written folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.distributed.launcher import WORKERS, run_command, run_workers, worker_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

SCENARIOS = [f"zero{stage}_{precision}" for stage in (0, 1, 2, 3) for precision in ("bf16", "fp32")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("consolidation")
    results = run_workers("consolidation.py", timeout=900, out_dir=out)
    return out, results


@pytest.fixture(scope="module")
def offline(launched):
    """consolidate_checkpoint (and the CLI) on both ZeRO-3 checkpoints, with no process group."""
    from ds_engine.cli import main as cli_main
    from ds_engine.consolidate import consolidate_checkpoint

    out, _ = launched
    folders = {}
    for name in ("zero3_bf16", "zero3_fp32"):
        scenario = out / name
        target = scenario / "offline"
        if name == "zero3_bf16":
            assert (
                cli_main(
                    [
                        "consolidate",
                        str(scenario / "ckpt"),
                        str(target),
                        "--max-shard-size",
                        "30KB",
                        "--config-from",
                        str(scenario / "hf"),
                    ]
                )
                == 0
            )
        else:
            consolidate_checkpoint(scenario / "ckpt", target, config_from=scenario / "hf")
        folders[name] = target
    return folders


@pytest.fixture(scope="module")
def reloaded(launched, offline):
    out, _ = launched
    specs = []
    for name in SCENARIOS:
        precision = name.split("_")[1]
        specs.append(f"{out / name / 'hf'}:{out / name / 'ref16.pt'}:{precision}")
        specs.append(f"{out / name / 'hf32'}:{out / name / 'ref32.pt'}:fp32")
    for name, folder in offline.items():
        specs.append(f"{folder}:{out / name / 'ref32.pt'}:fp32")
    result_file = out / "reload.json"
    cmd = [sys.executable, str(WORKERS / "consolidation_reload.py"), str(result_file), *specs]
    proc = run_command(cmd, timeout=300, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(result_file.read_text())


@pytest.mark.parametrize("name", SCENARIOS)
def test_consolidated_state_dict_matches_deepspeed(launched, name):
    _, (rank0, rank1) = launched
    r0, r1 = rank0[name], rank1[name]
    assert r1["is_none_off_rank0"] == [True, True, True]  # rank 1 gets None
    assert r0["is_none_off_rank0"] == [False, False, False]
    assert r0["keys_match_state_dict"]
    assert r0["vs_deepspeed_16bit"] == []  # equals DeepSpeed's own consolidation, key by key
    assert r0["dtype16"] == [r0["want_dtype16"]]  # the training dtype by default
    assert r0["empty_tensors"] == []
    assert r0["exclude_frozen_dropped"] == ["transformer.wpe.weight"]
    assert r0["master_rounds_to_16bit"] == []
    # bf16: the fp32 masters carry bits the bf16 weights lost; fp32 training: they are the weights
    assert r0["master_differs_from_16bit"] is name.endswith("bf16")
    if not name.startswith("zero0"):
        assert r0["vs_zero_to_fp32"] == []
        assert r0["frozen_vs_zero_to_fp32"] == []


@pytest.mark.parametrize("name", ["zero3_bf16", "zero3_fp32"])
def test_zero3_empty_state_dict_is_refused_on_every_rank(launched, name):
    _, (rank0, rank1) = launched
    assert rank0[name]["empty_refused"].startswith("`state_dict['transformer.wte.weight']` has 0 elements")
    assert "HINT: leave `state_dict=None`" in rank0[name]["empty_refused"]
    assert rank1[name]["empty_refused"].startswith("rank 0 failed to write")
    assert rank0[name]["empty_dir_exists"] is False


def test_save_pretrained_reloads_without_deepspeed(launched, reloaded):
    out, _ = launched
    assert reloaded.pop("deepspeed_imported") is False
    assert len(reloaded) == 2 * len(SCENARIOS) + 2
    for folder, check in reloaded.items():
        assert check["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, (
            folder
        )
        assert check["missing_in_model"] == [] and check["differs"] == [], folder
        assert check["empty"] == [] and check["tied"], folder
    # the 16-bit folders were sharded (max_shard_size="40KB") with an index
    index = json.loads((out / "zero3_bf16" / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]


def test_offline_consolidate_equals_fp32_masters(launched, offline):
    out, _ = launched
    for name, folder in offline.items():
        ref32 = torch.load(out / name / "ref32.pt", weights_only=True)
        index_file = folder / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
            if index_file.exists()
            else ["model.safetensors"]
        )
        written: dict[str, torch.Tensor] = {}
        for file in files:
            written.update(safetensors.torch.load_file(folder / file))
        assert set(written) == set(ref32) - {"lm_head.weight"}, name  # tied alias written once
        for key, value in written.items():
            assert value.dtype == torch.float32 and torch.equal(value, ref32[key]), (name, key)
        config = json.loads((folder / "config.json").read_text())
        assert config["dtype"] == "float32" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (offline["zero3_bf16"] / "model.safetensors.index.json").exists()  # --max-shard-size 30KB
    assert not [p for p in Path(out / "zero3_bf16").iterdir() if p.name.startswith(".")]
