"""Why the main job trains in fp32 on CPU: one MiniLM forward+backward, fp32 vs bf16 autocast.

    .venv/bin/python scripts/benchmarks/bench_precision.py [--steps 8] [--threads 1]

Interleaves the two (fp32, bf16, fp32, bf16, ...) after warm-up and prints the median time per
step of each, and the CPU flags that decide it: without `avx512_bf16` / `amx_bf16`, bf16 matmuls
on a CPU are emulated and far slower than fp32, so bf16 only pays where those instructions exist.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the main job's `_recipe`
from _recipe import minilm_path


def cpu_flags() -> str:
    """The bf16-relevant CPU flags Linux reports (or 'unknown')."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "avx512f", "avx2"})
    return " ".join(found) or "none of avx2/avx512f/avx512_bf16/amx_bf16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per precision")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the main job: 1 per rank)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=24, help="tokens per sentence (UCI median ~15-20)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForSequenceClassification, logging

    logging.set_verbosity_error()
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    ids = torch.randint(1000, 20000, (args.batch_size, args.length))
    labels = torch.randint(0, 2, (args.batch_size,))

    def step(dtype: torch.dtype | None) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        model.zero_grad()
        return time.perf_counter() - start

    arms = {"fp32": None, "bf16 autocast": torch.bfloat16}
    for dtype in arms.values():
        step(dtype)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.steps):
        for name, dtype in arms.items():
            times[name].append(step(dtype))
    print(
        f"CPU flags: {cpu_flags()}; {args.threads} thread(s), batch {args.batch_size} x {args.length} tokens"
    )
    base = statistics.median(times["fp32"])
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"{name:<14} {med * 1000:8.0f} ms/step "
            f"(min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})  {med / base:5.2f}x fp32"
        )


if __name__ == "__main__":
    main()
