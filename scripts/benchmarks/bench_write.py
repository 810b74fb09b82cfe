"""Write speed of `save_pretrained` against a plain write of the same bytes, pair by pair.

Run (from the repository root, one process, no process group):

    .venv/bin/python scripts/benchmarks/bench_write.py [--layers 12,24] [--pairs 10] [--out DIR]

For each size, a GPT-2 shaped model (width 768, vocabulary 8192, untied embeddings, bf16; 12
and 24 layers by default: about 98M and 183M parameters) is held in memory as a state dict,
and two writers take turns (ABBA order), each after `os.sync()` so neither pays for the other's
dirty pages:

* ds_engine: `weights.save_pretrained(model, dir, state_dict=..., max_shard_size=one copy / 8)`
  -- the write itself (no gather): safetensors shards laid out up front and filled tensor by
  tensor on the writer thread, each fsynced, config.json, generation_config.json, the index,
  the directory fsynced, the rename;
* plain: the same tensors' bytes from the same memory, a file per shard (same grouping), one
  `write` per tensor, each file fsynced (`bench_consolidate.plain_write`, the baseline that
  benchmark uses too).

It prints the median and best time of each, the median over the pairs of (plain / ours) with
its range, and the target (>= 0.8). A last row prices the save's fixed cost: a tiny model
written as 6 shards, against 6 plain files of the same sizes.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_consolidate import plain_write, shard_layout


def gpt2_state(layers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=768,
        n_head=12,
        vocab_size=8192,
        n_positions=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    return model, {k: v.contiguous() for k, v in model.state_dict().items()}


def timed(fn: Callable[[], None]) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pairs(
    ours: Callable[[int], None], plain: Callable[[int], None], n: int, clean: Callable[[int], None]
) -> tuple[list[float], list[float]]:
    """(our times, plain times), ABBA order."""
    t_ours: list[float] = []
    t_plain: list[float] = []
    for i in range(n):
        first, second = (plain, ours) if i % 2 else (ours, plain)
        a = timed(functools.partial(first, i))
        b = timed(functools.partial(second, i))
        t_plain.append(a if i % 2 else b)
        t_ours.append(b if i % 2 else a)
        clean(i)
    return t_ours, t_plain


def row(label: str, t_ours: list[float], t_plain: list[float], nbytes: int) -> str:
    ratios = [p / o for p, o in zip(t_plain, t_ours, strict=True)]
    median = statistics.median(ratios)
    verdict = "" if median >= 0.8 else " MISS"
    ours, plain = statistics.median(t_ours), statistics.median(t_plain)
    mib = nbytes / 2**20
    return (
        f"{label:<34} {ours:8.3f} {min(t_ours):8.3f} {plain:8.3f} {min(t_plain):8.3f} "
        f"{mib / ours:9.0f} {mib / plain:8.0f}   {median:.2f}{verdict} ({min(ratios):.2f}-{max(ratios):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24", help="comma-separated layer counts")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--out", default="/tmp/bench_write")
    args = parser.parse_args()
    from ds_engine.weights import save_pretrained

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(
        f"{'':<34} {'ours s':>8} {'best':>8} {'plain s':>8} {'best':>8} {'ours MB/s':>9} {'plain':>8}   "
        "plain/ours per pair: median (range); target >= 0.8"
    )

    def measure(label: str, model: torch.nn.Module, state: dict[str, torch.Tensor], limit: int) -> None:
        save_pretrained(model, out / "warm", state_dict=state, max_shard_size=limit)
        layout = shard_layout(out / "warm")
        shutil.rmtree(out / "warm")
        nbytes = sum(state[k].numel() * state[k].element_size() for keys in layout for k in keys)

        def clean(i: int) -> None:
            shutil.rmtree(out / f"ours{i}")
            shutil.rmtree(out / f"plain{i}")

        t_ours, t_plain = pairs(
            lambda i: save_pretrained(model, out / f"ours{i}", state_dict=state, max_shard_size=limit),
            lambda i: plain_write(out / f"plain{i}", layout, state),
            args.pairs,
            clean,
        )
        print(row(f"{label}, {len(layout)} shards", t_ours, t_plain, nbytes), flush=True)

    for layers in (int(n) for n in args.layers.split(",")):
        model, state = gpt2_state(layers)
        total = sum(v.numel() * v.element_size() for v in state.values())
        measure(f"{layers} layers {total / 1e6:.0f} MB", model, state, total // 8)
        del model, state
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
        )
    )
    tiny_state = {k: v.contiguous() for k, v in tiny.state_dict().items()}
    measure("fixed cost: tiny model", tiny, tiny_state, 20_000)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
