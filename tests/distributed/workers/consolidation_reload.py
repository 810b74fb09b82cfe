"""Reload save_pretrained / consolidate output with plain transformers, in a process that never
imports DeepSpeed, and compare every tensor with what consolidated_state_dict returned.

Usage: python consolidation_reload.py OUT_JSON FOLDER:REFERENCE.pt[:DTYPE] ...
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import GPT2LMHeadModel

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def check(folder: str, reference: str, dtype: str) -> dict:
    ref = torch.load(reference, weights_only=True)
    want = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in ref.items()}
    model, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True, dtype=DTYPES[dtype])
    state = model.state_dict()
    return {
        "loading_info": {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"},
        "missing_in_model": sorted(set(want) - set(state)),
        "differs": [k for k in want if k in state and not torch.equal(state[k], want[k])],
        "empty": [k for k, v in state.items() if v.numel() == 0],
        "tied": model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(),
    }


def main() -> None:
    results = {}
    for spec in sys.argv[2:]:
        folder, reference, dtype = spec.split(":")
        results[folder] = check(folder, reference, dtype)
    results["deepspeed_imported"] = "deepspeed" in sys.modules
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
