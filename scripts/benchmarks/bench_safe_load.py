"""What the restricted loader costs: loading a real ZeRO-3 checkpoint, restricted vs unrestricted.

Run (from the repository root):

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .venv/bin/torchrun \
        --nproc-per-node=2 scripts/benchmarks/bench_safe_load.py [--out /tmp/bench_safe_load]

A GPT-2 shaped model (6 layers, width 768, vocabulary 8192: about 49M parameters) trains one
step through ds_engine's Engine on ZeRO-3 bf16 and saves a checkpoint. Then, best of
`--repeats` each, interleaved:

* per file, rank 0: `restricted_load` (torch's weights-only unpickler, DeepSpeed's classes
  allowlisted) vs `torch.load(weights_only=False)`, summed over every file of the tag;
* the pre-read `Engine.load_checkpoint` adds (rank 0 reads every file's pickle through the
  restricted unpickler, tensor data mapped and never read);
* end to end, both ranks: DeepSpeed's `load_checkpoint` inside ds_engine's restricted scope vs
  DeepSpeed's `load_checkpoint` as it is (`weights_only=False`), and the whole
  `Engine.load_checkpoint` (pre-read + restricted DeepSpeed load + ds_engine's own files).

With `--allowlist` it instead saves small ZeRO-0/1/2/3 checkpoints (fp32, bf16, fp16; CPU
optimizer offload, and parameter offload on ZeRO-3) and prints every global their files hold
beyond torch's own allowlist (`torch.serialization.get_unsafe_globals_in_checkpoint`), beside
`ds_engine.safety.DEEPSPEED_GLOBALS`: how that allowlist was found. (CPUs without native fp16
get DeepSpeed's CPU accelerator told it has fp16, as the tests do.)
"""

from __future__ import annotations

import argparse
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def best(fn: Callable[[], Any], repeats: int, collective: bool = False) -> float:
    times = []
    for _ in range(repeats):
        if collective:
            torch.distributed.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timing(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_engine import Engine
    from ds_engine.checkpoint import resolve_checkpoint
    from ds_engine.safety import deepspeed_safe_globals, restricted_load, restricted_torch_load

    engine = Engine(
        backend="deepspeed", zero_stage=3, precision="bf16", micro_batch_size=2, gradient_clipping=1.0
    )
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=12, vocab_size=8192, n_positions=64)
    with engine.init_context():
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer)
    rank = torch.distributed.get_rank()
    out = Path(args.out)
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    with engine.accumulate(model):
        engine.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    engine.save_checkpoint(out, tag="t")
    ds = engine._backend.ds_engine
    num_params = sum(p.ds_numel for p in ds.module.parameters())
    files = sorted((out / "t").glob("*.pt"))
    allowed = deepspeed_safe_globals()

    def restricted_files() -> None:
        for path in files:
            restricted_load(path, safe_globals=allowed)

    def unrestricted_files() -> None:
        for path in files:
            torch.load(path, map_location="cpu", weights_only=False)

    def deepspeed_load() -> None:
        ds.load_checkpoint(str(out), tag="t", load_optimizer_states=True, load_lr_scheduler_states=True)

    def deepspeed_load_restricted() -> None:
        with restricted_torch_load(allowed):
            deepspeed_load()

    rows = []
    if rank == 0:
        t_restricted, t_plain = [], []
        for _ in range(args.repeats):  # interleaved, so the page cache treats both alike
            t_restricted.append(best(restricted_files, 1))
            t_plain.append(best(unrestricted_files, 1))
        t_preread = best(lambda: resolve_checkpoint(out, "t"), args.repeats)
        size = sum(p.stat().st_size for p in files) / 1e6
        what = (
            f"GPT-2 {num_params / 1e6:.1f}M params, ZeRO-3 bf16, 2 ranks: {len(files)} files, {size:.0f} MB"
        )
        rows += [
            ("checkpoint", what),
            ("every file, rank 0", compare(min(t_restricted), min(t_plain))),
            ("pre-read, rank 0", f"{t_preread:.3f} s"),
        ]
    t_ds_restricted, t_ds_plain = [], []
    for _ in range(args.repeats):
        t_ds_restricted.append(best(deepspeed_load_restricted, 1, collective=True))
        t_ds_plain.append(best(deepspeed_load, 1, collective=True))
    t_engine = best(lambda: engine.load_checkpoint(out, tag="t"), args.repeats, collective=True)
    if rank == 0:
        rows += [
            ("DeepSpeed load, 2 ranks", compare(min(t_ds_restricted), min(t_ds_plain))),
            (
                "Engine.load_checkpoint",
                f"{t_engine:.3f} s (pre-read + restricted DeepSpeed load + own files)",
            ),
        ]
        print()
        for label, value in rows:
            print(f"{label:<26}{value}")
        print(f"(best of {args.repeats}; files in the page cache)")
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()


def compare(restricted: float, unrestricted: float) -> str:
    ratio = restricted / unrestricted
    return f"restricted {restricted:.3f} s vs weights_only=False {unrestricted:.3f} s ({ratio:.2f}x)"


def allowlist(args: argparse.Namespace) -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from ds_engine import Engine
    from ds_engine.safety import DEEPSPEED_GLOBALS

    CPU_Accelerator.is_fp16_supported = lambda self: True  # type: ignore[method-assign]
    out = Path(args.out)
    found: dict[str, set[str]] = {}
    combos = [(stage, precision, {}) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
    combos += [(stage, "bf16", {"offload_optimizer": "cpu"}) for stage in (1, 2)]
    combos += [
        (3, precision, {"offload_optimizer": "cpu", "offload_params": "cpu"})
        for precision in ("fp32", "fp16")
    ]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for stage, precision, offload in combos:
        name = f"zero{stage}_{precision}" + ("_offload" if offload else "")
        engine = Engine(
            backend="deepspeed",
            zero_stage=stage,
            precision=precision,
            micro_batch_size=2,
            gradient_clipping=1.0,
            **offload,
        )
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        model, optimizer = engine.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        with engine.accumulate(model):
            engine.backward(model(torch.randn(2, 4).to(dtypes[precision])).float().sum())
            optimizer.step()
            optimizer.zero_grad()
        engine.save_checkpoint(out / name, tag="t")
        if torch.distributed.get_rank() == 0:
            for path in sorted((out / name / "t").glob("*.pt")):
                for global_name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
                    found.setdefault(global_name, set()).add(name)
    if torch.distributed.get_rank() == 0:
        print()
        for global_name in sorted(set(found) | set(DEEPSPEED_GLOBALS)):
            listed = "allowlisted" if global_name in DEEPSPEED_GLOBALS else "NOT ALLOWLISTED"
            print(f"{global_name:<56}{listed:<18}{', '.join(sorted(found.get(global_name, [])))}")
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench_safe_load")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--allowlist", action="store_true", help="list the globals real checkpoints hold")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    (allowlist if args.allowlist else timing)(args)


if __name__ == "__main__":
    main()
