"""Benchmark ZeRO-3 consolidation and save_pretrained on 2 CPU ranks.

Run (from the repository root):

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 \
        .venv/bin/torchrun --nproc-per-node=2 scripts/bench_consolidate.py [--out /tmp/bench_consolidate]

A GPT-2 shaped model of about 92M parameters (12 layers, width 768, vocabulary 8192) is built
under zero.Init and wrapped by raw `deepspeed.initialize` (ZeRO-3, bf16). Rank 0 prints, side by
side:

* gather time: ds_engine `consolidated_state_dict` vs DeepSpeed's
  `engine._zero3_consolidated_16bit_state_dict` (best of 3 each, interleaved);
* rank-0 peak memory of each call: the rise of the process's peak resident set size (VmHWM from
  /proc/self/status, reset through /proc/self/clear_refs before each call) above the RSS just
  before it, against the size of one 16-bit copy of the weights (glibc is set to serve large
  blocks from mmap, so freed memory leaves RSS and is not silently reused);
* write speed: `save_pretrained` (gather + safetensors + fsync + rename) vs writing the same
  number of bytes from memory to a plain file in the same folder (write + fsync).

Targets: time ratio <= 1.0, peak <= 1.1x one copy, write >= 0.8x.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import time
from pathlib import Path

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def pin_malloc_to_mmap() -> None:
    """Serve large allocations from mmap (returned to the OS on free) so RSS tracks live memory.

    Without this glibc keeps freed blocks in its heap after the first round and later rounds
    reuse them, which hides part of the peak from an RSS-based measure.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB (also disables the dynamic threshold)
    libc.malloc_trim(0)


def measure(fn, is_rank0: bool):
    """(seconds, peak rise in bytes) of `fn()` on this rank; the result is dropped."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch.distributed.barrier()
    base = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    rise = peak_bytes() - base
    del result
    gc.collect()
    torch.distributed.barrier()
    return seconds, rise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench_consolidate")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_engine.backends.deepspeed_states import consolidated_state_dict, save_pretrained

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, n_positions=512)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    num_params = sum(p.ds_numel for p in engine.module.parameters())
    one_copy = num_params * 2  # bf16

    ours = lambda: consolidated_state_dict(engine.module)  # noqa: E731
    theirs = lambda: engine._zero3_consolidated_16bit_state_dict()  # noqa: E731
    # memory first: large blocks from mmap so RSS tracks live memory (slower allocations) ...
    t_ours, t_theirs, m_ours, m_theirs = [], [], [], []
    pin_malloc_to_mmap()
    for _ in range(2):
        m_ours.append(measure(ours, rank == 0)[1])
        m_theirs.append(measure(theirs, rank == 0)[1])
    # ... then times with large blocks from the heap again (M_MMAP_THRESHOLD = 256 MiB)
    ctypes.CDLL("libc.so.6").mallopt(-3, 256 << 20)
    for _ in range(args.repeats):
        t_ours.append(measure(ours, rank == 0)[0])
        t_theirs.append(measure(theirs, rank == 0)[0])

    out = Path(args.out)
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    torch.distributed.barrier()
    t_save = []
    for i in range(args.repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        save_pretrained(engine.module, out / f"model{i}", ds_engine=engine)
        t_save.append(time.perf_counter() - start)
    written = sum(p.stat().st_size for p in (out / "model0").glob("*.safetensors"))

    if rank == 0:
        payload = torch.empty(written, dtype=torch.uint8).numpy()
        payload[:] = 7
        t_plain = []
        for i in range(args.repeats):
            path = out / f"plain{i}.bin"
            start = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(payload))
                f.flush()
                os.fsync(f.fileno())
            t_plain.append(time.perf_counter() - start)
        mb = 1e6
        rows = [
            ("model", f"GPT-2 {num_params / 1e6:.1f}M params, ZeRO-3 bf16, 2 ranks", "", ""),
            ("one 16-bit copy", f"{one_copy / mb:.0f} MB", "", ""),
            ("", "ds_engine", "DeepSpeed / plain", "ratio"),
            (
                "gather time (best)",
                f"{min(t_ours):.3f} s",
                f"{min(t_theirs):.3f} s",
                f"{min(t_ours) / min(t_theirs):.2f} (target <= 1.0)",
            ),
            (
                "rank-0 peak RSS rise (max)",
                f"{max(m_ours) / mb:.0f} MB",
                f"{max(m_theirs) / mb:.0f} MB",
                f"{max(m_ours) / one_copy:.2f}x one copy (target <= 1.1); "
                f"DeepSpeed {max(m_theirs) / one_copy:.2f}x",
            ),
            (
                "write speed (best)",
                f"{written / min(t_save) / mb:.0f} MB/s",
                f"{written / min(t_plain) / mb:.0f} MB/s",
                f"{min(t_plain) / min(t_save):.2f} (target >= 0.8)",
            ),
        ]
        print()
        for row in rows:
            print(f"{row[0]:<28}{row[1]:<44}{row[2]:<20}{row[3]}")
        print(f"\nsave_pretrained includes the gather; wrote {written / mb:.0f} MB to {out}")
        for label, times in (("ours", t_ours), ("DeepSpeed", t_theirs), ("save", t_save), ("plain", t_plain)):
            print(f"{label:>10} times: " + " ".join(f"{t:.3f}" for t in times))
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()
    engine.destroy()


if __name__ == "__main__":
    main()
