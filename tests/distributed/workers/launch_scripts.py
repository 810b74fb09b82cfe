"""Run the fine-tuning scripts' `main()` for several scenarios in one process group.

`--scenarios cls:2,clm:3,cls:accelerate` runs each script in turn on this rank (ZeRO stage or
the accelerate fallback) and writes every scenario's summary, so one launch (one start-up cost)
covers several configurations. The scripts are imported from `scripts/` as they ship.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from _common import parse_args, rank, write_result

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = {"cls": "finetune_classification", "clm": "finetune_clm"}
COMMON = ["--max-steps", "12", "--epochs", "3", "--batch-size", "16", "--eval-batch-size", "24",
          "--max-length", "32", "--num-examples", "405", "--log-every", "1", "--seed", "0"]  # fmt: skip
EXTRA = {"cls": ["--lr", "3e-4", "--warmup-ratio", "0"], "clm": ["--lr", "3e-3", "--warmup-ratio", "0"]}


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


args = parse_args([("--scenarios", {"required": True})])
results = {}
for scenario in args.scenarios.split(","):
    script, setting = scenario.split(":")
    engine_args = ["--backend", "accelerate"] if setting == "accelerate" else ["--zero-stage", setting]
    out = Path(args.out) / scenario.replace(":", "_")
    summary = load(SCRIPTS[script]).main([*COMMON, *EXTRA[script], *engine_args, "--output-dir", str(out)])
    if rank() == 0:
        summary["metrics"] = [
            json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()
        ]
        summary["model_files"] = sorted(p.name for p in Path(summary["model_dir"]).iterdir())
    results[scenario] = summary
write_result(args.out, results)
