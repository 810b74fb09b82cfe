"""Reload what peft_lora.py saved, in a process that never imports DeepSpeed: the adapter with
`PeftModel.from_pretrained(base, dir)` and the merged model with plain `from_pretrained`; compare
their logits on the fixed probe with the trained model's (``logits.pt``).

Usage: python peft_reload.py OUT_JSON SCENARIO_DIR:KIND ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).parent))
from peft_lora import build_base, minilm_path, probe


def base_model(kind: str, folder: Path):
    if kind == "minilm":
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder / "base")


def merged_model(kind: str, folder: Path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if kind == "minilm" else AutoModelForCausalLM
    return auto.from_pretrained(folder / "merged", output_loading_info=True)


def logits_of(model, kind: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=probe(kind)).logits.float()


def check(folder: Path, kind: str) -> dict:
    from peft import PeftModel

    want = torch.load(folder / "logits.pt", weights_only=True)
    adapter = PeftModel.from_pretrained(base_model(kind, folder), folder / "adapter")
    merged, info = merged_model(kind, folder)
    keys = sorted(safetensors.torch.load_file(folder / "adapter" / "adapter_model.safetensors"))
    untrained = build_base(kind) if kind == "gpt2" else base_model(kind, folder)
    return {
        "files": sorted(p.name for p in (folder / "adapter").iterdir()),
        "adapter_keys": keys,
        "adapter_bytes": (folder / "adapter" / "adapter_model.safetensors").stat().st_size,
        "merged_bytes": sum(p.stat().st_size for p in (folder / "merged").glob("*.safetensors")),
        "adapter_logits_diff": float((logits_of(adapter, kind) - want).abs().max()),
        "merged_logits_diff": float((logits_of(merged, kind) - want).abs().max()),
        "untrained_logits_diff": float((logits_of(untrained, kind) - want).abs().max()),
        "merged_loading_info": {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"},
        "merged_class": type(merged).__name__,
    }


def main() -> None:
    results = {}
    for spec in sys.argv[2:]:
        folder, kind = spec.rsplit(":", 1)
        results[Path(folder).name] = check(Path(folder), kind)
    results["deepspeed_imported"] = "deepspeed" in sys.modules
    Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
