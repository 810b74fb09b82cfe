"""Generation speed under ZeRO-3: naive `generate`, ds_engine's synced and gathered paths, ZeRO-0.

    python scripts/benchmarks/bench_generate.py     # launches itself on 2 CPU ranks (torchrun, gloo)
    torchrun --nproc-per-node=2 scripts/benchmarks/bench_generate.py   # or under any launcher

A small GPT-2 built from a config (nothing downloads), the same prompts on every path: each rank
runs a loop of `--calls` generate calls (an evaluation loop), each generating `--new-tokens`
greedy tokens for `--batch` prompts of `--prompt-len` tokens. Paths:

- ZeRO-0: the whole model on every rank, `engine.generate` (plain `generate`);
- naive ZeRO-3: `model.generate(..., synced_gpus=True)` on the partitioned model (every layer
  gathered for every token);
- ds_engine synced: `engine.generate(model, gather=False)`;
- ds_engine gathered: `engine.generate(model, gather=True)` (one gather per call);
- ds_engine gathered block: the loop inside `with engine.gathered(model):` (one gather for the
  whole loop; `engine.generate` gathers nothing inside).

tokens/s counts the new tokens of all ranks and calls over the slowest rank's wall time for the
loop, best of `--repeats` after one warm-up; "x ZeRO-0" is the time relative to ZeRO-0 (lower
is better). Rank 0 prints one table.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks when launching itself (default 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4, help="generate calls per loop (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def launch_self(args: argparse.Namespace) -> int:
    """Not under a launcher: run this script on `--nproc` local CPU ranks with torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        __file__,
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_head=4,
        n_embd=args.hidden,
        vocab_size=args.vocab,
        n_positions=args.prompt_len + args.new_tokens,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.3,
    )
    return GPT2LMHeadModel(config)


def timed(paths: dict[str, Any], repeats: int) -> dict[str, tuple[float, Any]]:
    """Per path: the best wall time of `repeats` runs (the slowest rank's) and its output. One
    warm-up each; the repeats take turns across paths, so load from elsewhere hits all alike."""
    import torch.distributed as dist

    outputs = {name: fn() for name, fn in paths.items()}
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fn in paths.items():
            dist.barrier()
            start = time.perf_counter()
            outputs[name] = fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best[name] = min(best[name], float(elapsed))
    return {name: (best[name], outputs[name]) for name in paths}


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ:
        return launch_self(args)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from ds_engine import Engine

    rank = int(os.environ["RANK"])
    calls = []  # the evaluation loop: one prompt batch per call, different on each rank
    for call in range(args.calls):
        prompts = torch.randint(
            1,
            args.vocab,
            (args.batch, args.prompt_len),
            generator=torch.Generator().manual_seed(1000 * rank + call),
        )
        calls.append(
            {
                "input_ids": prompts,
                "attention_mask": torch.ones_like(prompts),
                "max_new_tokens": args.new_tokens,
                "min_new_tokens": args.new_tokens,
                "do_sample": False,
                "pad_token_id": 0,
            }
        )
    engine0 = Engine(backend="deepspeed", zero_stage=0, micro_batch_size=1)
    created = build(args)
    model0, _ = engine0.prepare(created, torch.optim.SGD(created.parameters(), lr=0.0))
    engine3 = Engine(backend="deepspeed", zero_stage=3, micro_batch_size=1)
    with engine3.init_context():
        created = build(args)
    model3, _ = engine3.prepare(created, torch.optim.SGD(created.parameters(), lr=0.0))
    module3 = engine3.unwrap_model(model3)
    module3.eval()
    naive_generate: Any = module3.generate  # nn.Module's __getattr__ types it as a Tensor

    def block() -> list[torch.Tensor]:
        with engine3.gathered(model3):  # one gather for the whole loop
            return [engine3.generate(model3, **kwargs) for kwargs in calls]

    paths = {
        "ZeRO-0": lambda: [engine0.generate(model0, **kwargs) for kwargs in calls],
        "naive ZeRO-3 generate": lambda: [naive_generate(synced_gpus=True, **kwargs) for kwargs in calls],
        "ds_engine synced": lambda: [engine3.generate(model3, gather=False, **kwargs) for kwargs in calls],
        "ds_engine gathered": lambda: [engine3.generate(model3, gather=True, **kwargs) for kwargs in calls],
        "ds_engine gathered block (`engine.gathered`)": block,
    }
    results = timed(paths, args.repeats)

    world = dist.get_world_size()
    tokens = world * args.calls * args.batch * args.new_tokens
    base_ids = results["ZeRO-0"][1]
    same = all(
        len(out) == len(base_ids) and all(torch.equal(a, b) for a, b in zip(out, base_ids, strict=True))
        for _, out in results.values()
    )
    if rank == 0:
        params = sum(int(getattr(p, "ds_numel", p.numel())) for p in module3.parameters())
        print(
            f"\nGPT-2 {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M parameters (fp32); "
            f"{world} CPU ranks (gloo); per rank a loop of {args.calls} calls x {args.batch} prompts x "
            f"{args.prompt_len} tokens, {args.new_tokens} new tokens; best of {args.repeats}"
        )
        base = results["ZeRO-0"][0]
        print("| path | seconds | tokens/s | x ZeRO-0 |\n|---|---:|---:|---:|")
        for name, (seconds, _) in results.items():
            print(f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {seconds / base:.2f} |")
        print(f"rank 0's generated ids identical on every path: {same}")
    engine3.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
