"""LoRA (peft) under DeepSpeed ZeRO 0-3 on 2 CPU ranks: training equals LoRA on one
process, only the adapter is gathered and saved, the merged export reloads with plain
`from_pretrained`, and a checkpoint resumes exactly.

The accelerate fallback (DDP) runs the MiniLM scenario too, in both environments.

Models: the pretrained MiniLM classifier (LoRA r=8 on query/value, task SEQ_CLS so the
classifier head is in `modules_to_save`) and a tiny GPT2 causal LM built from a config (LoRA on
the fused `c_attn` Conv1D, fan_in_fan_out). One torchrun launch runs every scenario; one fresh
process that never imports DeepSpeed reloads every saved folder.
"""

from __future__ import annotations

import json
import sys

import pytest

from ds_engine._imports import is_deepspeed_available
from tests.distributed.launcher import WORKERS, run_command, run_workers, worker_env

# The DeepSpeed scenarios' tests are marked `deepspeed` one by one; the fallback's run in both
# environments (without DeepSpeed only the fallback's scenarios are launched).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ALL_SCENARIOS = {
    "gpt2_zero0": {"model": "gpt2", "zero_stage": 0, "inside": True},
    "gpt2_zero1": {"model": "gpt2", "zero_stage": 1, "inside": True},
    "gpt2_zero2": {"model": "gpt2", "zero_stage": 2, "inside": False},
    "gpt2_zero3": {"model": "gpt2", "zero_stage": 3, "inside": True},
    "minilm_zero2": {"model": "minilm", "zero_stage": 2, "inside": False},
    "minilm_zero3": {"model": "minilm", "zero_stage": 3, "inside": True},
    # base model and LoRA built outside init_context: DeepSpeed partitions them in `prepare`
    "minilm_zero3_outside": {"model": "minilm", "zero_stage": 3, "inside": False},
    # bf16: adapters and the classifier copy in one dtype (ZeRO-3 flattens trainable parameters)
    "minilm_zero3_bf16": {"model": "minilm", "zero_stage": 3, "inside": True, "precision": "bf16"},
    # the accelerate fallback (DDP on CPU ranks)
    "minilm_fallback": {"model": "minilm", "backend": "accelerate", "zero_stage": 0, "inside": True},
}
SCENARIOS = {
    name: spec
    for name, spec in ALL_SCENARIOS.items()
    if is_deepspeed_available() or spec.get("backend") == "accelerate"
}


def _bf16(name: str) -> bool:
    return ALL_SCENARIOS[name].get("precision") == "bf16"


def _params() -> list:
    """Every scenario, those of DeepSpeed marked `deepspeed` (deselected without it)."""
    return [
        pytest.param(name, marks=() if spec.get("backend") == "accelerate" else pytest.mark.deepspeed)
        for name, spec in ALL_SCENARIOS.items()
    ]


STEPS = 4  # as in workers/peft_lora.py
SAVE_AT = 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft")
    scenarios = [{"name": name, **spec} for name, spec in SCENARIOS.items()]
    results = run_workers("peft_lora.py", "--scenarios", json.dumps(scenarios), timeout=900, out_dir=out)
    return out, results


@pytest.fixture(scope="module")
def reloaded(launched):
    out, _ = launched
    result_file = out / "reload.json"
    specs = [f"{out / name}:{spec['model']}" for name, spec in SCENARIOS.items()]
    cmd = [sys.executable, str(WORKERS / "peft_reload.py"), str(result_file), *specs]
    proc = run_command(cmd, timeout=300, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads(result_file.read_text())


@pytest.mark.parametrize("name", _params())
def test_lora_on_two_ranks_equals_lora_on_one_process(launched, name):
    _, (rank0, rank1) = launched
    got, want = rank0[name]["losses"], rank0[name]["reference_losses"]
    assert len(got) == len(want) == STEPS
    tolerance = 2e-2 if _bf16(name) else 2e-5  # the reference trains in fp32
    assert got == pytest.approx(want, rel=0, abs=tolerance), (got, want)
    assert rank1[name]["losses"] == got  # the mean over ranks, the same on both
    assert len(set(got)) > 1  # it trained (different batches, moving weights)


@pytest.mark.parametrize("name", _params())
def test_only_trainable_parameters_get_optimizer_state(launched, name):
    _, ranks = launched
    trainable, total = ranks[0][name]["trainable"], ranks[0][name]["total"]
    if SCENARIOS[name]["zero_stage"] == 0:  # ZeRO-0 and DDP: every rank holds the whole state
        assert [r[name]["optimizer_state_numel"] for r in ranks] == [trainable, trainable]
    else:
        state = sum(r[name]["optimizer_state_numel"] for r in ranks)  # each rank holds a partition
        assert trainable <= state <= trainable + 8  # ZeRO pads partitions by a few elements
    assert trainable < total / 10


@pytest.mark.parametrize("name", _params())
def test_get_state_dict_gathers_only_the_adapter(launched, name):
    _, (rank0, rank1) = launched
    assert rank1[name]["state_dict_none"] is True and rank0[name]["state_dict_none"] is False
    keys = rank0[name]["state_dict_keys"]
    assert rank0[name]["state_dict_empty"] == []
    assert all(
        ".lora_A.default." in k or ".lora_B.default." in k or ".modules_to_save.default." in k for k in keys
    )
    if name.startswith("minilm"):  # 6 layers x query/value x A/B, and the classifier's copy
        assert len(keys) == 6 * 2 * 2 + 2
        assert "base_model.model.classifier.modules_to_save.default.weight" in keys
    else:
        assert len(keys) == 2 * 2


@pytest.mark.parametrize("name", _params())
def test_adapter_save_gathers_only_adapter_parameters(launched, name):
    _, ranks = launched
    for result in ranks:  # every rank takes part in the same gathers
        gathered = result[name]["adapter_save_gathered"]
        assert all(".lora_" in n or ".modules_to_save." in n for n in gathered), gathered
        if ALL_SCENARIOS[name]["zero_stage"] == 3:  # ZeRO-3 gathers; other stages read as is
            assert sorted(gathered) == sorted(ranks[0][name]["state_dict_keys"])
        else:
            assert gathered == []


@pytest.mark.parametrize("name", _params())
def test_checkpoint_resumes_exactly(launched, name):
    _, (rank0, _) = launched
    assert rank0[name]["client_state"] == {"step": SAVE_AT}
    assert rank0[name]["resumed_losses"] == rank0[name]["losses"][SAVE_AT:]  # bitwise
    assert rank0[name]["resumed_state_equal"] is True


def test_adapter_and_merged_model_reload_without_deepspeed(reloaded):
    assert reloaded.pop("deepspeed_imported") is False
    assert sorted(reloaded) == sorted(SCENARIOS)
    for name, check in reloaded.items():
        assert check["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"], name
        tolerance = 3e-2 if _bf16(name) else 1e-5  # bf16 weights reloaded into fp32 models
        assert check["adapter_logits_diff"] < tolerance, (name, check)
        assert check["merged_logits_diff"] < tolerance, (name, check)
        assert check["untrained_logits_diff"] > 1e-3, (name, check)  # the comparison can fail
        assert check["merged_loading_info"] == {
            "missing_keys": [],
            "unexpected_keys": [],
            "mismatched_keys": [],
        }


def test_adapter_file_holds_no_base_model_weights(reloaded):
    for name, check in reloaded.items():
        if name == "deepspeed_imported":
            continue
        keys = check["adapter_keys"]
        lora = [k for k in keys if ".lora_A." in k or ".lora_B." in k]
        if name.startswith("minilm"):
            assert check["merged_class"] == "BertForSequenceClassification"
            assert sorted(set(keys) - set(lora)) == [
                "base_model.model.classifier.bias",
                "base_model.model.classifier.weight",
            ]
        else:
            assert check["merged_class"] == "GPT2LMHeadModel"
            assert keys == lora and len(keys) == 4
        factor = 50 if name.startswith("minilm") else 10  # the tiny GPT2 is 32k parameters in all
        assert check["adapter_bytes"] * factor < check["merged_bytes"], (name, check)
