"""One rank of test_auto_stage.py: `Engine(zero_stage="auto")` with a memory budget, trained for a few
steps; reports the stage the Engine chose, the DeepSpeed config it ran, the lines it logged and the
peak resident memory over this process's baseline (taken after the imports, as the memory-peak
benchmark does: `scripts/benchmarks/_bench_memory_peak_worker.py`)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "benchmarks"))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", required=True)
    parser.add_argument("--live", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--budget-rank1", default=None, help="another budget on rank 1 (a GPU of another size)"
    )
    args = parser.parse_args()

    import deepspeed  # noqa: F401  (imported before the baseline: part of it)
    import transformers  # noqa: F401
    from bench_memory_peak import MICRO, SEQ, model_config
    from transformers import LlamaForCausalLM

    from ds_engine import Engine
    from ds_engine.config import ConfigError

    lines = _Lines()
    logging.getLogger("ds_engine").addHandler(lines)
    gc.collect()
    with contextlib.suppress(OSError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from here

    rank1 = os.environ.get("RANK") == "1"
    engine = Engine(
        zero_stage="auto",
        seq_len=SEQ,
        memory_budget=args.budget_rank1 if rank1 and args.budget_rank1 else args.budget,
        precision="bf16",
        micro_batch_size=MICRO,
        gradient_clipping=1.0,
        stage3_max_live_parameters=args.live,
    )
    torch.manual_seed(0)
    with engine.init_context():  # a no-op under "auto": the stage is decided at prepare
        model = LlamaForCausalLM(model_config("decoder"))
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    try:
        model, optimizer = engine.prepare(model, optimizer)
    except ConfigError as exc:  # the ranks decided differently: every rank says so
        (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps({"error": str(exc)}))
        return
    g = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(1, vocab, (MICRO, SEQ), generator=g).to(engine.device)
        with engine.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
        del loss
    result = {
        "peak": _status("VmHWM") - baseline,
        "baseline": baseline,
        "zero_stage": engine.config.zero_stage,
        "offload_optimizer": engine.config.offload_optimizer,
        "ds_zero": engine.ds_config["zero_optimization"],
        "lines": lines.lines,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
    }
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    engine.end_training()


if __name__ == "__main__":
    main()
