"""Benchmark ZeRO-3 consolidation, save_pretrained and offline consolidation at two model sizes.

Run (from the repository root; started without torchrun it re-launches itself under torchrun
with 2 ranks, OMP_NUM_THREADS=1 and GLOO_SOCKET_IFNAME=lo unless set):

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .venv/bin/torchrun \
        --nproc-per-node=2 scripts/benchmarks/bench_consolidate.py [--layers 12,24] [--out DIR]

For each size, a GPT-2 shaped model (width 768, vocabulary 8192, 512 positions; 12 and 24
layers by default: about 98M and 183M parameters) is built under zero.Init and wrapped by raw
`deepspeed.initialize` (ZeRO-3, bf16, torch AdamW, lr 0). Rank 0 prints one table, a column
per size so growth is visible, each figure beside its baseline and its target (a figure that
misses its target is marked `MISS`):

* gather time: ds_engine `consolidated_state_dict` vs DeepSpeed's
  `engine._zero3_consolidated_16bit_state_dict`; target ratio <= 1.0;
* get-state-dict peak: rank-0 peak RSS rise of each of those two calls, as a multiple of one
  16-bit copy of the weights; target (ds_engine) <= 1.1x;
* save_pretrained peak: rank-0 peak RSS rise of `save_pretrained(module, dir, gather=DeepSpeedGather(engine),
  max_shard_size=one 16-bit copy / 8)` against the bound "largest shard + largest layer" (the
  largest shard file written, plus the largest submodule's own 16-bit parameters); target
  rise <= bound;
* write speed: the write itself, `save_pretrained(state_dict=...)` of the gathered 16-bit dict
  already in rank 0's memory (safetensors + fsync + rename, config.json), vs a plain write of
  the same tensors' bytes from the same memory, a file per shard (one `write` per tensor) +
  fsync each, into the same folder, in the same run, interleaved; target >= 0.8x. Beside it,
  the whole `save_pretrained` (gather + write) against the gather alone plus the write alone:
  the gather overlaps the write when the whole takes less than the sum (it cannot take less
  than the larger of the two). Every timed write starts after `os.sync()`, so no run pays for
  the previous one's dirty pages;
* offline consolidation of the same model's ZeRO-3 checkpoint (`engine.save_checkpoint` after
  one optimizer step on zero gradients, lr 0, so it holds fp32 masters + Adam states: about 3
  fp32 copies on disk, printed): `ds_engine.consolidate.
  consolidate_checkpoint(ckpt, out, max_shard_size=one fp32 copy / 8)` vs DeepSpeed's
  `convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=..., safe_serialization=True)`,
  each run by rank 0 in a fresh process (`_bench_consolidate_offline.py`) while rank 1 waits at
  a barrier. Time is the call alone (imports excluded); DeepSpeed's writer neither fsyncs nor
  renames, so its time includes an fsync of the files it wrote (ds_engine's writer fsyncs and
  renames). Memory, as multiples of one fp32 copy, above the child's level after its imports:
  its peak RSS (VmHWM read by the child itself) and its peak anonymous memory (RssAnon of
  /proc/<pid>/status sampled by the parent every --sample-ms ms): the checkpoint is read
  through mmap, and mapped pages count in RSS though they are reclaimable page cache. No
  target is set for these; ds_engine's docstring claims about one fp32 copy.

The embeddings are untied (`tie_word_embeddings=False`): DeepSpeed 0.19's safetensors writer
refuses GPT-2's tied `lm_head.weight` / `wte.weight` ("Some tensors share memory"); `--tied`
keeps them tied, and DeepSpeed's cell then says it failed.

Measurement hygiene: barriers around every measured call; memory is measured with glibc
serving allocations of 64 KiB and up from mmap from the start of each rank's process
(`MALLOC_MMAP_THRESHOLD_=65536`; each rank re-executes itself with it: set later through
mallopt, after the heap has grown, blocks freed into the heap stay resident), so freed memory
leaves RSS and RSS tracks live memory (`malloc_trim` before each call). With glibc's defaults
a process keeps freed blocks in its heap, and its RSS rises by more than its live memory; that
is the allocator's, not the program's, and differs between allocators. Memory is the rise of
the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) above its RSS just before
the call, the max over --memory-repeats runs; times are measured afterwards with the same
setting (for both tools alike), best of --repeats, ours and the baseline interleaved. Offline
runs: --offline-memory-runs per tool with the mmap setting (max), then --offline-repeats per
tool without it (best time), interleaved. Other jobs may share the 2 cores, so the load
average (os.getloadavg, which counts this run's own ranks) is printed with
the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _bench_consolidate_offline import (
    TOOLS,
    malloc_trim,
    peak_bytes,
    pin_malloc_to_mmap,
    reset_peak,
    rss_bytes,
    status_bytes,
)
from safetensors import safe_open

HELPER = Path(__file__).with_name("_bench_consolidate_offline.py")
MB = 1e6
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


#: Every rank runs with glibc serving blocks of 64 KiB and up from mmap from its start
#: (MALLOC_MMAP_THRESHOLD_), so freed memory leaves RSS and the memory rows show live memory.
MMAP_THRESHOLD = 1 << 16


def relaunch_under_torchrun() -> None:
    """Started without torchrun: replace this process by torchrun running this script on 2 ranks."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    os.execve(sys.executable, command, env)


def measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak RSS rise in bytes) of `fn()` on this rank (collective); the result is dropped."""
    gc.collect()
    malloc_trim()
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


def largest_layer_bytes(module: torch.nn.Module) -> int:
    """The largest submodule's own parameters and persistent buffers, at their full size."""
    seen: set[int] = set()
    best = 0
    for sub in module.modules():
        total = 0
        tensors = [*sub._parameters.items(), *sub._buffers.items()]
        for name, tensor in tensors:
            if tensor is None or id(tensor) in seen or name in sub._non_persistent_buffers_set:
                continue
            seen.add(id(tensor))
            numel = int(getattr(tensor, "ds_numel", tensor.numel()))
            total += numel * tensor.element_size()
        best = max(best, total)
    return best


def shard_sizes(folder: Path) -> list[int]:
    return sorted((p.stat().st_size for p in folder.glob("*.safetensors")), reverse=True)


def settle() -> None:
    """Flush every dirty page to disk (collective), so a timed write does not pay for earlier ones."""
    os.sync()
    torch.distributed.barrier()


def shard_layout(folder: Path) -> list[list[str]]:
    """The keys of each safetensors file `save_pretrained` wrote into `folder`, file by file."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return [list(f.keys())]
    files: dict[str, list[str]] = {}
    for key, name in json.loads(index.read_text())["weight_map"].items():
        files.setdefault(name, []).append(key)
    return [files[name] for name in sorted(files)]


def plain_write(folder: Path, layout: list[list[str]], state: dict[str, torch.Tensor]) -> float:
    """Seconds to write the same tensors' bytes from memory into `folder`, a file per shard (one
    write per tensor, as the tensors lie in memory), each file fsynced."""
    folder.mkdir(parents=True)
    start = time.perf_counter()
    for i, keys in enumerate(layout):
        with open(folder / f"plain{i}.bin", "wb") as f:
            for key in keys:
                f.write(state[key].contiguous().view(torch.uint8).reshape(-1).numpy().data)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


# --------------------------------------------------------------------------- offline (rank 0)
@dataclass
class OfflineRuns:
    seconds: list[float] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)  # DeepSpeed's call without the fsync
    peak_rss: list[int] = field(default_factory=list)
    peak_anon: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    written: int = 0


def fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def run_offline(
    tool: str, checkpoint: Path, out: Path, max_shard_bytes: int, *, pin: bool, sample_s: float
) -> dict[str, Any]:
    """One consolidation in a fresh process; its result, with the sampled peak RssAnon added."""
    result_path = out.with_name(out.name + ".json")
    log_path = out.with_name(out.name + ".log")
    command = [sys.executable, str(HELPER), tool, str(checkpoint), str(out), str(max_shard_bytes)]
    command += [str(result_path), *(["--pin-malloc"] if pin else [])]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    peak_anon = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            try:
                peak_anon = max(peak_anon, status_bytes("RssAnon", proc.pid))
            except (OSError, RuntimeError):  # exiting: a zombie has no RssAnon
                pass
            time.sleep(sample_s)
    if result_path.is_file():
        result: dict[str, Any] = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        result = {"error": f"exit status {proc.returncode}: {tail[0]}"}
    result["peak_anon"] = peak_anon
    result["fsync_seconds"] = 0.0
    if not result.get("error") and tool == "deepspeed":
        start = time.perf_counter()
        fsync_tree(out)
        result["fsync_seconds"] = time.perf_counter() - start
    result["written"] = sum(p.stat().st_size for p in out.glob("*.safetensors")) if out.is_dir() else 0
    return result


def bench_offline(
    checkpoint: Path, out: Path, max_shard_bytes: int, args: argparse.Namespace
) -> dict[str, OfflineRuns]:
    runs = {tool: OfflineRuns() for tool in TOOLS}
    plan = [True] * args.offline_memory_runs + [False] * args.offline_repeats
    for i, pin in enumerate(plan):
        for tool in TOOLS:
            target = out / f"offline-{tool}-{i}"
            r = run_offline(tool, checkpoint, target, max_shard_bytes, pin=pin, sample_s=args.sample_ms / 1e3)
            runs[tool].written = max(runs[tool].written, r["written"])
            if r.get("error"):
                runs[tool].errors.append(r["error"])
            elif pin:
                runs[tool].peak_rss.append(r["peak_rss"] - r["base_rss"])
                runs[tool].peak_anon.append(max(0, r["peak_anon"] - r["base_anon"]))
            else:
                runs[tool].seconds.append(r["seconds"] + r["fsync_seconds"])
                runs[tool].call_seconds.append(r["seconds"])
            shutil.rmtree(target, ignore_errors=True)
            for suffix in (".json", ".log"):
                if not r.get("error"):
                    target.with_name(target.name + suffix).unlink(missing_ok=True)
    return runs


# --------------------------------------------------------------------------- one size
def create_optimizer_states(engine: Any) -> None:
    """Give the optimizer its Adam states, which DeepSpeed 0.19 creates at the first step only.

    One optimizer step per ZeRO-3 sub-group on zero gradients, as DeepSpeed's own step runs it
    (lr is 0: the weights do not move), instead of a forward and backward pass, which takes
    tens of seconds here; a real step where DeepSpeed's internals differ.
    """
    zero = engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if flats is None or not hasattr(zero, "_optimizer_step"):
        ids = torch.zeros((1, 8), dtype=torch.long)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        return
    for i, flat in enumerate(flats):
        flat.grad = torch.zeros_like(flat)
        zero._optimizer_step(i)
        flat.grad = None


@dataclass
class SizeResult:
    layers: int
    num_params: int
    t_ours: list[float]
    t_theirs: list[float]
    m_ours: list[int]
    m_theirs: list[int]
    shard_limit: int
    shards: list[int]
    largest_layer: int
    m_save: list[int]
    t_save: list[float]
    t_write: list[float]
    t_plain: list[float]
    checkpoint_bytes: int
    checkpoint_seconds: float
    offline: dict[str, OfflineRuns]

    @property
    def one16(self) -> int:
        return self.num_params * 2

    @property
    def one32(self) -> int:
        return self.num_params * 4


def bench_size(layers: int, args: argparse.Namespace, out: Path) -> SizeResult | None:
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_engine.backends.deepspeed_states import DeepSpeedGather
    from ds_engine.weights import consolidated_state_dict, save_pretrained

    rank = torch.distributed.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    config = GPT2Config(
        n_layer=layers,
        n_embd=args.width,
        n_head=args.width // 64,
        vocab_size=8192,
        n_positions=512,
        tie_word_embeddings=args.tied,
        bos_token_id=0,  # inside the small vocabulary (GPT-2's 50256 is not), so no warning
        eos_token_id=0,
    )
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    module = engine.module
    num_params = sum(p.ds_numel for p in module.parameters())  # shared parameters once
    shard_limit = max(1, num_params * 2 // args.shard_fraction)
    largest_layer = largest_layer_bytes(module)
    folder = out / f"layers{layers}"
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    ours = lambda: consolidated_state_dict(module, gather=DeepSpeedGather(None))  # noqa: E731
    theirs = lambda: engine._zero3_consolidated_16bit_state_dict()  # noqa: E731

    def save(name: str) -> Callable[[], None]:
        return lambda: save_pretrained(
            module, folder / name, gather=DeepSpeedGather(engine), max_shard_size=shard_limit
        )

    def write_given(name: str, state: dict[str, torch.Tensor] | None) -> Callable[[], None]:
        # rank 0 writes the dict it holds; the other ranks only take part in the preflight
        given = state if rank == 0 else {}
        return lambda: save_pretrained(
            module,
            folder / name,
            gather=DeepSpeedGather(engine),
            max_shard_size=shard_limit,
            state_dict=given,
        )

    def cleanup(name: str) -> None:
        if rank == 0:
            shutil.rmtree(folder / name, ignore_errors=True)
        torch.distributed.barrier()

    # memory first: large blocks from mmap so RSS tracks live memory (slower allocations) ...
    m_ours: list[int] = []
    m_theirs: list[int] = []
    m_save: list[int] = []
    shards: list[int] = []
    layout: list[list[str]] = []
    pin_malloc_to_mmap()
    for i in range(args.memory_repeats):
        m_ours.append(measure(ours)[1])
        m_theirs.append(measure(theirs)[1])
        m_save.append(measure(save(f"mem{i}"))[1])
        if rank == 0:
            shards = shard_sizes(folder / f"mem{i}")
            layout = shard_layout(folder / f"mem{i}")
        cleanup(f"mem{i}")
    # ... then times (same allocator setting: switching it at run time leaves freed blocks resident)
    t_ours: list[float] = []
    t_theirs: list[float] = []
    t_save: list[float] = []
    t_write: list[float] = []
    t_plain: list[float] = []
    for _ in range(args.repeats):
        t_ours.append(measure(ours)[0])
        t_theirs.append(measure(theirs)[0])
    state = ours()  # rank 0's gathered dict, for the write alone
    for i in range(args.repeats):
        settle()
        t_save.append(measure(save(f"model{i}"))[0])
        cleanup(f"model{i}")
        settle()
        t_write.append(measure(write_given(f"given{i}", state))[0])
        cleanup(f"given{i}")
        settle()
        if state is not None:  # rank 0
            t_plain.append(plain_write(folder / f"plain{i}", layout, state))
        cleanup(f"plain{i}")
    del state

    # a real ZeRO-3 checkpoint: fp32 masters + Adam states
    create_optimizer_states(engine)
    checkpoint = folder / "checkpoint"
    torch.distributed.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(str(checkpoint))
    torch.distributed.barrier()
    checkpoint_seconds = time.perf_counter() - start
    result = None
    if rank == 0:
        checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.rglob("*.pt"))
        offline = bench_offline(checkpoint, folder, max(1, num_params * 4 // args.shard_fraction), args)
        result = SizeResult(
            layers, num_params, t_ours, t_theirs, m_ours, m_theirs, shard_limit, shards, largest_layer,
            m_save, t_save, t_write, t_plain, checkpoint_bytes, checkpoint_seconds, offline,
        )  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
    torch.distributed.barrier()  # rank 1 waits here while rank 0 runs the offline children
    engine.destroy()
    return result


# --------------------------------------------------------------------------- report
def verdict(value: float, ok: bool) -> str:
    return f"{value:.2f}" + ("" if ok else " MISS")


def mb(nbytes: float) -> str:
    return f"{nbytes / MB:.0f} MB"


def multiple(nbytes: float, unit: int, target: float | None = None) -> str:
    text = f"{nbytes / MB:.0f} MB = {nbytes / unit:.2f}x"
    return text + (" MISS" if target is not None and nbytes / unit > target else "")


def offline_cell(r: SizeResult, tool: str, what: str) -> str:
    runs = r.offline[tool]
    if runs.errors:
        return "failed"
    if what == "time":
        return f"{min(runs.seconds):.2f} s"
    return multiple(max(runs.peak_rss if what == "rss" else runs.peak_anon), r.one32)


def offline_ratio(r: SizeResult) -> str:
    ours, theirs = r.offline["ds_engine"], r.offline["deepspeed"]
    if ours.errors or theirs.errors:
        return "n/a"
    return f"{min(ours.seconds) / min(theirs.seconds):.2f}"


def column(r: SizeResult, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, this size's figure, target) for every row of the table; '' figure: a heading."""
    t_ours, t_theirs, t_save, t_plain = min(r.t_ours), min(r.t_theirs), min(r.t_save), min(r.t_plain)
    t_write = min(r.t_write)
    largest_shard = max(r.shards)
    bound = largest_shard + r.largest_layer
    written = sum(r.shards)
    fraction = args.shard_fraction
    return [
        ("model (GPT-2, width 768, vocab 8192)", f"{r.layers} layers, {r.num_params / 1e6:.1f}M", ""),
        ("one 16-bit / one fp32 copy", f"{r.one16 / MB:.0f} / {r.one32 / MB:.0f} MB", ""),
        (f"gather time (best of {args.repeats})", "", ""),
        ("  ds_engine consolidated_state_dict", f"{t_ours:.3f} s", ""),
        ("  DeepSpeed _zero3_consolidated_16bit_sd", f"{t_theirs:.3f} s", "baseline"),
        ("  ratio", verdict(t_ours / t_theirs, t_ours <= t_theirs), "<= 1.0"),
        (f"get-state-dict rank-0 peak RSS rise (max of {args.memory_repeats})", "", ""),
        ("  ds_engine (x one 16-bit copy)", multiple(max(r.m_ours), r.one16, 1.1), "<= 1.1x"),
        ("  DeepSpeed (x one 16-bit copy)", multiple(max(r.m_theirs), r.one16), "baseline"),
        (f"save_pretrained rank-0 peak RSS rise (max of {args.memory_repeats})", "", ""),
        (
            f"  max_shard_size (one 16-bit copy / {fraction})",
            f"{mb(r.shard_limit)}, {len(r.shards)} shards",
            "",
        ),
        (
            "  bound: largest shard + largest layer",
            f"{mb(bound)} ({largest_shard / MB:.0f} + {r.largest_layer / MB:.0f})",
            "",
        ),
        ("  ds_engine save_pretrained", mb(max(r.m_save)), ""),
        ("  rise / bound", verdict(max(r.m_save) / bound, max(r.m_save) <= bound), "<= 1.0"),
        (f"write speed (best of {args.repeats}, after os.sync)", "", ""),
        ("  write alone (given dict: write+fsync+mv)", f"{written / t_write / MB:.0f} MB/s", ""),
        ("  plain write + fsync, same bytes", f"{written / t_plain / MB:.0f} MB/s", "baseline"),
        ("  ratio", verdict(t_plain / t_write, t_plain / t_write >= 0.8), ">= 0.8"),
        ("  save_pretrained (gather + write)", f"{t_save:.3f} s = {written / t_save / MB:.0f} MB/s", ""),
        ("  gather alone + write alone", f"{t_ours + t_write:.3f} s (max {max(t_ours, t_write):.3f})", ""),
        ("  overlap: whole / (gather + write)", f"{t_save / (t_ours + t_write):.2f}", "< 1: overlapped"),
        ("offline consolidation (fresh process, fp32)", "", ""),
        (
            "  ZeRO-3 checkpoint on disk",
            f"{r.checkpoint_bytes / MB:.0f} MB = {r.checkpoint_bytes / r.one32:.2f}x fp32",
            "",
        ),
        (f"  max_shard_size (one fp32 copy / {fraction})", mb(max(1, r.one32 // fraction)), ""),
        (f"  time, ds_engine (best of {args.offline_repeats})", offline_cell(r, "ds_engine", "time"), ""),
        ("  time, DeepSpeed zero_to_fp32 + fsync", offline_cell(r, "deepspeed", "time"), "baseline"),
        ("  ratio", offline_ratio(r), "none set"),
        ("  peak RSS rise, ds_engine (x fp32)", offline_cell(r, "ds_engine", "rss"), ""),
        ("  peak RSS rise, DeepSpeed (x fp32)", offline_cell(r, "deepspeed", "rss"), "baseline"),
        ("  peak anon rise, ds_engine (x fp32)", offline_cell(r, "ds_engine", "anon"), "~1x (docstring)"),
        ("  peak anon rise, DeepSpeed (x fp32)", offline_cell(r, "deepspeed", "anon"), "baseline"),
    ]


def print_table(
    results: list[SizeResult], args: argparse.Namespace, load: list[tuple[float, float, float]], wall: float
) -> None:
    columns = [column(r, args) for r in results]
    width = max(24, *(len(figure) + 2 for col in columns for _, figure, _ in col))
    tied = "tied" if args.tied else "untied"
    print(f"\nZeRO-3 bf16, 2 ranks, {tied} embeddings; MISS = misses its target\n")
    for i, (label, _, target) in enumerate(columns[0]):
        print(f"{label:<50}" + "".join(f"{col[i][1]:<{width}}" for col in columns) + target)
    start, end = load
    print(
        f"\nload average (1/5/15 min, counts this run's ranks): at start {start[0]:.2f} {start[1]:.2f} "
        f"{start[2]:.2f}, at end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}; run took {wall:.0f} s"
    )
    for r in results:
        print(f"\n{r.layers} layers, all times (s):")
        for label, times in (
            ("ds_engine gather", r.t_ours),
            ("DeepSpeed gather", r.t_theirs),
            ("save_pretrained", r.t_save),
            ("write alone (given)", r.t_write),
            ("plain write", r.t_plain),
            ("offline ds_engine", r.offline["ds_engine"].seconds),
            ("offline DeepSpeed+fsync", r.offline["deepspeed"].seconds),
            ("offline DeepSpeed alone", r.offline["deepspeed"].call_seconds),
            ("save_checkpoint", [r.checkpoint_seconds]),
        ):
            print(f"  {label:<24}" + " ".join(f"{t:.3f}" for t in times))
        print(
            f"  written: save_pretrained {mb(sum(r.shards))}, offline ds_engine "
            f"{mb(r.offline['ds_engine'].written)}, DeepSpeed {mb(r.offline['deepspeed'].written)}"
        )
        for tool in TOOLS:
            errors = r.offline[tool].errors
            if errors:
                print(f"  offline {tool} failed in {len(errors)} runs, first: {errors[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench_consolidate")
    parser.add_argument("--layers", default="12,24", help="comma-separated layer counts, one column each")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tied", action="store_true", help="tie lm_head to wte (DeepSpeed's writer fails)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best of)")
    parser.add_argument("--memory-repeats", type=int, default=2, help="memory runs (max of)")
    parser.add_argument("--shard-fraction", type=int, default=8, help="max_shard_size = one copy / this")
    parser.add_argument("--offline-repeats", type=int, default=2, help="timed offline runs per tool")
    parser.add_argument("--offline-memory-runs", type=int, default=1, help="offline memory runs per tool")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="RssAnon sampling interval")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
        # glibc reads this at process start only; set later (mallopt) after the heap has grown,
        # freed blocks below it stay in the heap and RSS stops tracking live memory
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    wall = time.perf_counter()
    load = [os.getloadavg()]

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = Path(args.out)
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    torch.distributed.barrier()
    results = []
    for layers in (int(n) for n in args.layers.split(",")):
        result = bench_size(layers, args, out)
        gc.collect()  # the engine of this size goes with bench_size's frame
        malloc_trim()
        if result is not None:
            results.append(result)
    load.append(os.getloadavg())
    if rank == 0:
        print_table(results, args, load, time.perf_counter() - wall)
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
