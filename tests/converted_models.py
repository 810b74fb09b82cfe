"""Models whose weight names transformers converts on load and back on save, and the check
that a save equals transformers' own, shared by tests/unit/test_checkpoint_io.py and the
ZeRO-3 worker tests/distributed/workers/streaming_save.py.

* `write_legacy_bert(folder)`: a tiny BERT checkpoint with the legacy names old BERT checkpoints
  have (`LayerNorm.gamma`/`beta`); transformers renames them on load and back on save.
* `tiny_mixtral_config()`: transformers fuses Mixtral's experts on load and splits them on save
  (a `WeightConverter`, which needs the whole state dict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch


def write_legacy_bert(folder: Path) -> Path:
    """Save a tiny `BertForMaskedLM` (seed 3) into `folder` under the legacy LayerNorm names."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    BertForMaskedLM(config).save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in tensors.items()
    }
    assert legacy != tensors
    safetensors.torch.save_file(legacy, path, metadata={"format": "pt"})
    return folder


def tiny_mixtral_config() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip


def assert_same_weight_files(ours: Path, theirs: Path) -> None:
    """The same safetensors files, byte for byte, and (sharded) the same weight map."""
    files = sorted(p.name for p in theirs.glob("*.safetensors"))
    assert files and sorted(p.name for p in ours.glob("*.safetensors")) == files
    for name in files:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    if len(files) > 1:
        index = "model.safetensors.index.json"
        theirs_map = json.loads((theirs / index).read_text())["weight_map"]
        assert json.loads((ours / index).read_text())["weight_map"] == theirs_map
