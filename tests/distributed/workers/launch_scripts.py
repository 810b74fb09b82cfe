"""Run the fine-tuning scripts' `main()` for several scenarios in one process group.

`--scenarios cls:2,clm:3,cls:accelerate` runs each script in turn on this rank (ZeRO stage or
the accelerate fallback) and writes every scenario's summary, so one launch (one start-up cost)
covers several configurations. The scripts are imported from `scripts/examples/` as they ship
(with `scripts/examples/` on `sys.path`, as when they run as files, so `import _recipe` works).

`--resume-from-step N` (with `--checkpoint-every`) then runs each scenario a second time from its
own checkpoint of step N into `<scenario>_resumed/`, recorded as `<scenario>+resumed`.

The scenarios `cls:*` / `clm:*` train on the generated sentences (`--synthetic`, a small set of
known size). The scenario `main` is the main job as `scripts/main.sh` runs it: the classification
script with exactly the arguments main.sh gives it (read from main.sh) and its default data, only
stopped after `--max-steps` steps.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import parse_args, rank, write_result

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "scripts" / "examples"
sys.path.insert(0, str(EXAMPLES))
SCRIPTS = {"cls": "finetune_classification", "clm": "finetune_clm"}
COMMON = ["--epochs", "3", "--batch-size", "16", "--eval-batch-size", "24", "--max-length", "32",
          "--synthetic", "--num-examples", "405", "--log-every", "1", "--seed", "0"]  # fmt: skip
EXTRA = {"cls": ["--lr", "3e-4", "--warmup-ratio", "0"], "clm": ["--lr", "3e-3", "--warmup-ratio", "0"]}


def main_sh_arguments() -> list[str]:
    """The arguments scripts/main.sh passes to scripts/examples/finetune_classification.py (before "$@")."""
    text = (ROOT / "scripts" / "main.sh").read_text().replace("\\\n", " ")
    found = re.search(r"scripts/examples/finetune_classification\.py(.*?)\"\$@\"", text)
    assert found is not None, "scripts/main.sh no longer launches scripts/examples/finetune_classification.py"
    return shlex.split(found.group(1))


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, argv: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = load(SCRIPTS[script]).main(argv)
    if rank() == 0:
        summary["metrics"] = [
            json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()
        ]
        summary["model_files"] = sorted(p.name for p in Path(summary["model_dir"]).iterdir())
    return summary


args = parse_args(
    [
        ("--scenarios", {"required": True}),
        ("--max-steps", {"type": int, "default": 12}),
        ("--checkpoint-every", {"type": int, "default": 0}),
        ("--resume-from-step", {"type": int, "default": 0}),
    ]
)
results = {}
for scenario in args.scenarios.split(","):
    if scenario == "main":
        argv = [*main_sh_arguments(), "--max-steps", str(args.max_steps), "--output-dir", f"{args.out}/main"]
        results[scenario] = run("cls", argv) | {"argv": argv}
        continue
    script, setting = scenario.split(":")
    engine_args = ["--backend", "accelerate"] if setting == "accelerate" else ["--zero-stage", setting]
    argv = [*COMMON, *EXTRA[script], *engine_args, "--max-steps", str(args.max_steps)]
    out = Path(args.out) / scenario.replace(":", "_")
    results[scenario] = run(script, [*argv, "--checkpoint-every", str(args.checkpoint_every),
                                     "--output-dir", str(out)])  # fmt: skip
    if args.resume_from_step:
        checkpoint = out / "checkpoints" / f"step_{args.resume_from_step}"
        resumed = run(script, [*argv, "--resume-from", str(checkpoint), "--output-dir", f"{out}_resumed"])
        results[f"{scenario}+resumed"] = resumed
write_result(args.out, results)
