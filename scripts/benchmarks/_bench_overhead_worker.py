"""Worker for `bench_overhead.py`: per-step overhead and time to first step.

Both modes run inside torchrun, one process per rank.

**steps** (`--mode steps`). For each setting it builds two trainers on identically seeded
copies of the same GPT-2 and the same data, a *baseline* (raw DeepSpeed or plain accelerate,
written the way their docs show) and *ds_engine* (which one is built first alternates with the
round, `--first`), then alternates them one optimizer step at a time (ABBA...) so that load
from other processes on the machine hits both alike. Each optimizer step is timed from a
barrier to its end on every rank; the step time is the slowest rank's. One pair is the two
steps run next to each other (ds_engine's step and the baseline's). A setting runs `--steps`
pairs, or (adaptive, `--seconds`) pairs until its time slice is used (rank 0 decides, so both
ranks stop together).

Gradient reductions are counted by wrapping `torch.distributed`'s reduction functions before
DeepSpeed forms its communication backend (DeepSpeed binds `reduce_scatter_tensor` then).
Only tensors with more than one element count: scalar all-reduces are grad-norm / overflow
bookkeeping. DDP reduces in C++, so there a counting comm hook (the default all-reduce hook
plus a counter) is registered on both DDP models. A "reduction pass" is a micro-step that
issued at least one gradient reduction (a bucketed reduction is many calls, one pass).

With `--profile-steps N`, after the timed steps the ds_engine trainer runs N more optimizer
steps under cProfile (every rank), and the result gives the share of that profiled time spent
in ds_engine's own Python code (self time of the functions in the `ds_engine` package).

**ttfs** (`--mode ttfs`). Time to first step: the process that torchrun starts imports torch, transformers and
DeepSpeed (nothing else) and then forks one fresh child per sample. A child builds the model,
optimizer and data (untimed; ds_engine's child also imports ds_engine, timed apart), waits at
a file barrier for the other rank's child, and times construction + prepare + the first
optimizer step (GA micro-steps):

- ds_engine: `Engine(backend="deepspeed", zero_stage=...)`, `engine.prepare(model, optimizer,
  DataLoader(...))` and the first window of the documented loop;
- raw DeepSpeed: `deepspeed.initialize(model, optimizer, config=<the JSON ds_engine rendered>)`,
  a `DataLoader` with a `DistributedSampler`, and the first window of the canonical loop.

Each child forms its own process group (a fresh port, TCPStore on rank 0, not torchrun's agent
store), and both variants include that. Samples run in ABBA order per stage after one untimed
ds_engine warm-up sample, which writes the JSON the raw children use and warms the file cache
for both variants (every ds_engine child reports the JSON it rendered). With `--profile`, one more
ds_engine child per stage runs construction + prepare + the first step under cProfile, with
DeepSpeed's entry points timed (`DeepSpeedEntries`), so that what ds_engine adds is separated
from what raw DeepSpeed does too.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import os
import pstats
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

COUNTED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_reduce_coalesced")
SETTINGS = ("zero0", "zero2", "zero2-coalesce", "zero3", "zero3-coalesce", "accelerate")
#: Raw DeepSpeed ZeRO-0 against itself: the ratio's noise floor on this machine.
NULL_SETTING = "zero0-null"
TTFS_STAGES = ("zero0", "zero2", "zero3")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class ReductionCounter:
    """Counts gradient reductions per (trainer, micro-step) while a trainer is active."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.micro_step = 0
        self.calls: dict[str, int] = {}
        self.passes: dict[str, set[int]] = {}

    def record(self) -> None:
        if self.active is None:
            return
        self.calls[self.active] = self.calls.get(self.active, 0) + 1
        self.passes.setdefault(self.active, set()).add(self.micro_step)

    def install(self) -> None:
        """Wrap torch.distributed reductions (call before DeepSpeed initialises its backend)."""
        for name in COUNTED:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def wrapper(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                tensor = args[0] if args else next(iter(kwargs.values()))
                if isinstance(tensor, (list, tuple)):
                    tensor = tensor[0]
                if isinstance(tensor, torch.Tensor) and tensor.numel() > 1:
                    self.record()
                return __original(*args, **kwargs)

            setattr(dist, name, wrapper)


COUNTER = ReductionCounter()


def counting_comm_hook(state, bucket):  # no annotations: DDP rejects the string ones
    """DDP comm hook: the default all-reduce, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    COUNTER.record()
    return allreduce_hook(state, bucket)


# ---------------------------------------------------------------------------- model and data
def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.hidden,
        vocab_size=args.vocab,
        n_positions=args.seq,
        resid_pdrop=0.0,  # no dropout: both trainers must see the same numbers
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


_DATASETS: dict[tuple[int, int], TensorDataset] = {}


def make_dataset(args: argparse.Namespace, world: int, windows: int) -> TensorDataset:
    """Exactly `windows` full accumulation windows of data (shared by the trainers of a pair)."""
    key = (windows, world)
    if key not in _DATASETS:
        _DATASETS.clear()
        num = windows * args.ga * args.micro_batch * world
        ids = torch.randint(0, args.vocab, (num, args.seq), generator=torch.Generator().manual_seed(99))
        _DATASETS[key] = TensorDataset(ids, ids)  # labels = inputs (GPT-2 shifts them itself)
    return _DATASETS[key]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def engine_choices(args: argparse.Namespace, zero_stage: int, coalesce: bool) -> dict[str, Any]:
    """The ds_engine keyword choices of every run here (the raw runs get the JSON they render)."""
    return {
        "zero_stage": zero_stage,
        "precision": args.precision,
        "gradient_accumulation_steps": args.ga,
        "gradient_clipping": args.clip,
        "coalesce_grad_reduction": coalesce,
    }


# ---------------------------------------------------------------------------- trainers
class Trainer:
    """One training loop, advanced one optimizer step at a time."""

    name = ""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # CPU seconds of this process: blind to other load
        self.micro_step = 0
        self.ddp: torch.nn.Module | None = None

    def optimizer_step(self) -> None:
        """Run one full accumulation window (GA micro-steps and the optimizer step), timed."""
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        COUNTER.active = self.name
        try:
            self.run_window()
        finally:
            COUNTER.active = None
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - cpu_start)

    def run_window(self) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        COUNTER.micro_step = self.micro_step
        self.micro_step += 1

    def close(self) -> None:
        """Release what this trainer holds (DeepSpeed engines keep hooks and buffers)."""


def raw_window(engine: Any, loader: Iterator[Any], ga: int, coalesce: bool, tick: Callable[[], None]) -> list:
    """One window of the canonical DeepSpeed loop; returns the micro-steps' detached losses.

    Without `coalesce`: `engine.backward(loss); engine.step()` on every micro-step. With it, the
    window's backwards run inside `engine.coalesce_grad_reduction()` and `engine.step()` follows
    once, with the boundary flag set as DeepSpeed requires there.
    """
    losses = []

    def forward_backward() -> None:
        ids, labels = (t.to(engine.device) for t in next(loader))
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        losses.append(loss.detach())

    if not coalesce:
        for _ in range(ga):
            tick()
            forward_backward()
            engine.step()
        return losses
    with engine.coalesce_grad_reduction():
        for j in range(ga):
            tick()
            engine.set_gradient_accumulation_boundary(j == ga - 1)
            forward_backward()
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    return losses


def engine_window(
    engine: Any, model: Any, optimizer: Any, loader: Iterator[Any], tick: Callable[[], None]
) -> list:
    """One window of the ds_engine training loop: `accumulate` / `backward` / `optimizer.step()`."""
    losses = []
    for _ in range(engine.gradient_accumulation_steps):
        tick()
        ids, labels = next(loader)
        with engine.accumulate(model):
            loss = model(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def raw_loader(dataset: TensorDataset, micro_batch: int) -> Iterator[Any]:
    """The raw DeepSpeed user's loader: each rank reads its shard, in order."""
    return iter(
        DataLoader(dataset, batch_size=micro_batch, sampler=DistributedSampler(dataset, shuffle=False))
    )


class RawDeepSpeed(Trainer):
    """The canonical DeepSpeed loop (see `raw_window`), initialised on a given JSON."""

    def __init__(
        self, args: argparse.Namespace, ds_config: dict[str, Any], *, coalesce: bool, windows: int
    ) -> None:
        import deepspeed

        super().__init__()
        self.name = "baseline"
        self.ga = args.ga
        self.coalesce = coalesce
        model = make_model(args)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=copy.deepcopy(ds_config)
        )
        self.loader = raw_loader(make_dataset(args, dist.get_world_size(), windows), args.micro_batch)

    def run_window(self) -> None:
        self.losses += raw_window(self.engine, self.loader, self.ga, self.coalesce, self._tick)

    def close(self) -> None:
        self.engine.destroy()


class RawAccelerate(Trainer):
    """The canonical accelerate loop: `accelerator.accumulate(model)` with GA=4."""

    def __init__(self, args: argparse.Namespace, *, windows: int) -> None:
        from accelerate import Accelerator

        super().__init__()
        self.name = "baseline"
        self.ga = args.ga
        self.clip = args.clip
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.ga)
        model = make_model(args)
        loader = DataLoader(make_dataset(args, dist.get_world_size(), windows), batch_size=args.micro_batch)
        self.model, self.optimizer, loader = self.accelerator.prepare(model, make_optimizer(model), loader)
        self.loader = iter(loader)
        self.ddp = self.model

    def run_window(self) -> None:
        # accelerate keeps the accumulation count in a process-wide singleton (GradientState),
        # shared with the Accelerator inside ds_engine's fallback; put ours back first.
        self.accelerator.gradient_accumulation_steps = self.ga
        for _ in range(self.ga):
            self._tick()
            ids, labels = next(self.loader)
            with self.accelerator.accumulate(self.model):
                loss = self.model(input_ids=ids, labels=labels).loss
                self.accelerator.backward(loss)
                if self.accelerator.sync_gradients and self.clip > 0:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), self.clip)
                self.optimizer.step()
                self.optimizer.zero_grad()
            self.losses.append(loss.detach())


class DsEngine(Trainer):
    """The ds_engine loop (see `engine_window`)."""

    def __init__(
        self, args: argparse.Namespace, *, backend: str, zero_stage: int, coalesce: bool, windows: int
    ) -> None:
        from ds_engine import Engine

        super().__init__()
        self.name = "ds_engine"
        self.engine = Engine(backend=backend, **engine_choices(args, zero_stage, coalesce))
        model = make_model(args)
        loader = DataLoader(
            make_dataset(args, self.engine.num_processes, windows), batch_size=args.micro_batch
        )
        self.model, self.optimizer, loader = self.engine.prepare(model, make_optimizer(model), loader)
        self.loader = iter(loader)
        if self.engine.backend_name == "accelerate":
            self.ddp = self.model

    def run_window(self) -> None:
        backend = getattr(self.engine, "_backend", None)
        accelerator = getattr(backend, "accelerator", None)
        if accelerator is not None:  # see RawAccelerate.run_window: the shared GradientState
            accelerator.gradient_accumulation_steps = 1
        self.losses += engine_window(self.engine, self.model, self.optimizer, self.loader, self._tick)

    def close(self) -> None:
        ds = getattr(getattr(self.engine, "_backend", None), "ds_engine", None)
        if ds is not None:
            ds.destroy()


# ---------------------------------------------------------------------------- profiles
def _package_dir() -> str:
    import ds_engine

    return os.path.dirname(ds_engine.__file__) + os.sep


def profile_share(trainer: Trainer, steps: int) -> dict[str, Any]:
    """Run `steps` more optimizer steps under cProfile; ds_engine's share of the profiled time.

    "own" is the self time of the functions defined in the `ds_engine` package; "direct" adds
    the builtins (C functions, torch ops among them) that those functions call directly. Both
    are shares of the total self time under the profiler, which slows Python-heavy code such
    as ds_engine's more than torch's C++: they overstate rather than understate its cost.
    """
    package = _package_dir()
    profiler = cProfile.Profile()
    for _ in range(steps):
        dist.barrier()
        profiler.enable()
        try:
            trainer.run_window()
        finally:
            profiler.disable()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = own = direct = 0.0
    functions: dict[str, float] = {}
    for (filename, line, name), (_cc, _nc, tt, _ct, callers) in stats.items():
        total += tt
        if filename.startswith(package):
            own += tt
            functions[f"{filename[len(package) :]}:{line}({name})"] = tt
        elif filename == "~":  # a builtin: count the part of its time called from ds_engine
            direct += sum(c[2] for caller, c in callers.items() if caller[0].startswith(package))
    top = sorted(functions.items(), key=lambda kv: -kv[1])[:3]
    return {
        "steps": steps,
        "total_s": total,
        "own_s": own,
        "own_share": own / total if total else 0.0,
        "direct_share": (own + direct) / total if total else 0.0,
        "top": top,
    }


class DeepSpeedEntries:
    """Times DeepSpeed's entry points, and which ds_engine functions were on the stack at each call.

    The entries are what raw DeepSpeed runs too: `deepspeed.initialize`,
    `deepspeed.init_distributed` and the `DeepSpeedEngine`'s `forward`, `backward` and `step`.
    A call inside another entry counts once (in the outer one).
    """

    def __init__(self) -> None:
        import deepspeed
        from deepspeed.runtime.engine import DeepSpeedEngine

        self.package = _package_dir()
        self.seconds: dict[str, float] = {}
        self.beneath: dict[tuple[str, int, str], float] = {}  # pstats key -> entry seconds below it
        self._depth = 0
        self._wrap(deepspeed, "initialize", "initialize")
        self._wrap(deepspeed, "init_distributed", "initialize")
        for method in ("forward", "backward", "step"):
            self._wrap(DeepSpeedEngine, method, "engine forward/backward/step")

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)
            callers = set()
            frame = sys._getframe(1)
            while frame is not None:
                code = frame.f_code
                if code.co_filename.startswith(self.package):
                    callers.add((code.co_filename, code.co_firstlineno, code.co_name))
                frame = frame.f_back  # type: ignore[assignment]
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._depth -= 1
                self.seconds[label] = self.seconds.get(label, 0.0) + elapsed
                for key in callers:
                    self.beneath[key] = self.beneath.get(key, 0.0) + elapsed

        setattr(owner, attr, wrapper)


def construction_profile(
    profiler: cProfile.Profile, entries: DeepSpeedEntries, phases: dict[str, float], top: int = 8
) -> dict[str, Any]:
    """ds_engine's part of a profiled `Engine(...)` + `prepare(...)` + first optimizer step.

    "deepspeed_s": time inside DeepSpeed's entry points (see `DeepSpeedEntries`). "own_s": self
    time of ds_engine's functions. "top": ds_engine functions by their cumulative time less the
    DeepSpeed entry calls beneath them: the work ds_engine adds, and where.
    """
    package = entries.package
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own = 0.0
    functions = []
    for key, (_cc, nc, tt, ct, _callers) in stats.items():
        filename, line, name = key
        if not filename.startswith(package):
            continue
        own += tt
        functions.append(
            {
                "name": f"{filename[len(package) :]}:{line}({name})",
                "calls": nc,
                "cum_s": ct,
                "outside_s": max(ct - entries.beneath.get(key, 0.0), 0.0),
            }
        )
    functions.sort(key=lambda f: -f["outside_s"])
    wall = sum(phases.values())
    return {
        "phases": phases,
        "wall_s": wall,
        "deepspeed": entries.seconds,
        "deepspeed_s": sum(entries.seconds.values()),
        "outside_s": wall - sum(entries.seconds.values()),
        "own_s": own,
        "top": functions[:top],
    }


# ---------------------------------------------------------------------------- one setting
def build_pair(setting: str, args: argparse.Namespace, windows: int) -> tuple[Trainer, Trainer]:
    """The baseline and ds_engine trainers of a setting, built in the order the round says.

    `--first 0` builds ds_engine's trainer first, `--first 1` the baseline's, so that across
    rounds neither always gets the first allocations. A raw DeepSpeed baseline built first gets
    its JSON from a throwaway ds_engine probe (closed before either trainer is built).
    """
    base_first = args.first == 1
    if setting == "accelerate":
        if base_first:
            base: Trainer = RawAccelerate(args, windows=windows)
        ours: Trainer = DsEngine(args, backend="accelerate", zero_stage=0, coalesce=False, windows=windows)
        if not base_first:
            base = RawAccelerate(args, windows=windows)
    else:
        stage = 0 if setting == NULL_SETTING else int(setting[len("zero")])
        coalesce = setting.endswith("-coalesce")
        null = setting == NULL_SETTING

        def make_ours(ds_config: dict[str, Any] | None) -> Trainer:
            if not null:
                return DsEngine(
                    args, backend="deepspeed", zero_stage=stage, coalesce=coalesce, windows=windows
                )
            assert ds_config is not None
            trainer = RawDeepSpeed(args, ds_config, coalesce=False, windows=windows)
            trainer.name = "ds_engine"  # the second raw copy stands where ds_engine would
            return trainer

        ds_config = None
        if base_first or null:
            probe = DsEngine(args, backend="deepspeed", zero_stage=stage, coalesce=coalesce, windows=windows)
            ds_config = probe.engine.ds_config
            probe.close()
            del probe
            gc.collect()
        if not base_first:
            ours = make_ours(ds_config)
            if isinstance(ours, DsEngine):
                ds_config = ours.engine.ds_config
        assert ds_config is not None
        base = RawDeepSpeed(args, ds_config, coalesce=coalesce, windows=windows)
        if base_first:
            ours = make_ours(ds_config)
    for trainer in (base, ours):
        if trainer.ddp is not None:
            trainer.ddp.register_comm_hook(None, counting_comm_hook)  # type: ignore[operator]
    return base, ours


def run_setting(setting: str, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """Warm-up pairs, then timed pairs: `args.steps` of them, or until `seconds` of stepping."""
    fixed = args.steps > 0
    max_pairs = args.steps if fixed else args.max_steps
    windows = args.warmup + max_pairs + args.profile_steps
    setup_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base, ours = build_pair(setting, args, windows)
    setup_s = time.perf_counter() - setup_start
    COUNTER.calls.clear()
    COUNTER.passes.clear()
    ours_first: list[bool] = []  # per pair: did ds_engine's step run first (ABBA alternates)
    start = time.perf_counter()
    flag = torch.zeros(1, dtype=torch.int32)
    timed = 0
    for i in range(args.warmup + max_pairs):
        if i == args.warmup:
            start = time.perf_counter()
        first = (i + args.first) % 2 == 1
        for trainer in (ours, base) if first else (base, ours):
            trainer.optimizer_step()
        ours_first.append(first)
        if i < args.warmup:
            continue
        timed += 1
        if fixed:
            continue
        elapsed = time.perf_counter() - start
        flag[0] = int(timed >= args.min_steps and elapsed >= seconds)
        dist.broadcast(flag, 0)  # rank 0's clock decides for both ranks
        if flag.item():
            break
    stepping_s = time.perf_counter() - start
    total_steps = args.warmup + timed
    result: dict[str, Any] = {
        "setting": setting,
        "setup_s": setup_s,
        "stepping_s": stepping_s,
        "ours_first": ours_first[args.warmup :],
        "warnings": sorted(
            {
                str(w.message)
                for w in caught
                if not issubclass(w.category, (FutureWarning, DeprecationWarning))
            }
        ),
    }
    for key, trainer in (("baseline", base), ("ds_engine", ours)):
        times = (trainer.times[args.warmup :], trainer.cpu_times[args.warmup :])
        all_times: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_times, times)
        per_step = [max(ts) for ts in zip(*(t[0] for t in all_times))]  # the slowest rank's wall time
        cpu_per_step = [sum(ts) for ts in zip(*(t[1] for t in all_times))]  # CPU time of all ranks
        window_losses = torch.stack(trainer.losses).view(total_steps, args.ga).mean(dim=1)
        dist.all_reduce(window_losses)  # not counted: the counter is inactive here
        window_losses /= dist.get_world_size()
        result[key] = {
            "step_times": per_step,
            "median": statistics.median(per_step),
            "cpu_step_times": cpu_per_step,
            "reduction_calls_per_step": COUNTER.calls.get(trainer.name, 0) / total_steps,
            "reduction_passes_per_step": len(COUNTER.passes.get(trainer.name, ())) / total_steps,
            "losses": window_losses.tolist(),
        }
    b, o = result["baseline"]["losses"], result["ds_engine"]["losses"]
    result["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(b, o))
    if args.profile_steps and isinstance(ours, DsEngine):
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, profile_share(ours, args.profile_steps))
        result["profile"] = max(per_rank, key=lambda p: p["own_share"])  # the rank with the largest share
    base.close()
    ours.close()
    del base, ours
    gc.collect()
    return result


def main_steps(args: argparse.Namespace) -> None:
    COUNTER.install()  # before DeepSpeed binds its communication functions
    settings = args.settings.split(",")
    seconds = [float(s) for s in args.seconds.split(",")] if args.seconds else [0.0] * len(settings)
    if len(seconds) != len(settings):
        raise SystemExit(f"--seconds needs one value per setting ({len(settings)})")
    num_params = sum(p.numel() for p in make_model(args).parameters())
    results = []
    for setting, slice_s in zip(settings, seconds):
        results.append(run_setting(setting, args, slice_s))
        if rank() == 0:
            r = results[-1]
            pairs = [o / b for o, b in zip(r["ds_engine"]["step_times"], r["baseline"]["step_times"])]
            print(
                f"[bench] {setting}: {len(pairs)} pairs in {r['stepping_s']:.0f} s, "
                f"paired ratio {statistics.median(pairs):.3f}",
                flush=True,
            )
    if rank() == 0:
        info = {"num_params": num_params, "world_size": dist.get_world_size(), "args": vars(args)}
        out = Path(args.out) / "result.json"
        out.write_text(json.dumps({"info": info, "results": results}))


# ---------------------------------------------------------------------------- time to first step
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def file_barrier(sync: Path, name: str, timeout: float = 300.0) -> None:
    """Wait until every rank's child has reached `name` (polls every 0.5 ms)."""
    (sync / f"{name}.{rank()}").touch()
    deadline = time.monotonic() + timeout
    while not all((sync / f"{name}.{r}").exists() for r in range(world_size())):
        if any(sync.glob("*.error")):
            raise RuntimeError(f"another rank's child failed (see {sync})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"file barrier {name} in {sync}")
        time.sleep(0.0005)


def exchange_port(sync: Path, name: str, timeout: float = 300.0) -> int:
    """Rank 0's child picks a free port for this sample's process group; the others read it."""
    path = sync / f"{name}.port"
    if rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _write_atomic(path, str(port))
        return port
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port from rank 0 for {name}")
        time.sleep(0.0005)
    return int(path.read_text())


def ttfs_child(sample: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One sample in a fresh (forked) process: construction + prepare + the first optimizer step."""
    sync = out / "sync"
    name = sample["name"]
    stage, variant = sample["stage"], sample["variant"]
    os.environ["MASTER_PORT"] = str(exchange_port(sync, name))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # a fresh store per child, on rank 0
    model = make_model(args)
    optimizer = make_optimizer(model)
    dataset = make_dataset(args, world_size(), 1)
    import_s = 0.0
    ds_config: dict[str, Any] | None = None
    if variant == "ds_engine":
        start = time.perf_counter()
        from ds_engine import Engine

        import_s = time.perf_counter() - start
    else:
        import deepspeed

        ds_config = json.loads((out / f"{stage}.ds_config.json").read_text())
    profiler = entries = None
    if sample["kind"] == "profile":
        entries = DeepSpeedEntries()
        profiler = cProfile.Profile()
    file_barrier(sync, name + ".start")
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    if variant == "ds_engine":
        engine = Engine(backend="deepspeed", **engine_choices(args, int(stage[len("zero")]), False))
        t1 = time.perf_counter()
        loader = DataLoader(dataset, batch_size=args.micro_batch)
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        t2 = time.perf_counter()
        losses = engine_window(engine, model, optimizer, iter(loader), lambda: None)
        ds_config = engine.ds_config
    else:
        t1 = t0
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        batches = raw_loader(dataset, args.micro_batch)
        t2 = time.perf_counter()
        losses = raw_window(engine, batches, args.ga, False, lambda: None)
    t3 = time.perf_counter()
    if profiler is not None:
        profiler.disable()
    result: dict[str, Any] = {
        **sample,
        "rank": rank(),
        "import_s": import_s,
        "construct_s": t1 - t0,
        "prepare_s": t2 - t1,
        "step_s": t3 - t2,
        "total_s": t3 - t0,
        "loss": float(torch.stack(losses).mean()),
        "ds_config": ds_config,
    }
    if profiler is not None and entries is not None:
        phases = {"construct": t1 - t0, "prepare": t2 - t1, "first step": t3 - t2}
        result["profile"] = construction_profile(profiler, entries, phases)
    file_barrier(sync, name + ".done")  # nobody exits while the other rank still talks to it
    return result


def ttfs_schedule(stages: list[str], repeats: list[int], profile: bool) -> list[dict[str, Any]]:
    """Per stage a ds_engine warm-up (it writes the JSON; it also warms the file cache for both),
    then ABBA pairs over the stages, then the profiled children."""
    samples: list[dict[str, Any]] = []

    def add(stage: str, variant: str, kind: str, pair: int = -1) -> None:
        samples.append(
            {"name": f"s{len(samples)}", "stage": stage, "variant": variant, "kind": kind, "pair": pair}
        )

    for stage in stages:
        add(stage, "ds_engine", "warmup")
    for k in range(max(repeats)):
        for stage, n in zip(stages, repeats):
            if k >= n:
                continue
            order = ("ds_engine", "raw") if k % 2 == 0 else ("raw", "ds_engine")
            for variant in order:
                add(stage, variant, "timed", k)
    if profile:
        for stage in stages:
            add(stage, "ds_engine", "profile")
    return samples


def main_ttfs(args: argparse.Namespace) -> None:
    """Fork one child per sample; each child's results land in `<out>/ttfs/<sample>.rank<R>.json`."""
    import deepspeed  # noqa: F401  imported before the fork: not part of anyone's time
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401

    out = Path(args.out)
    (out / "sync").mkdir(exist_ok=True)
    (out / "ttfs").mkdir(exist_ok=True)
    stages = args.settings.split(",")
    repeats = [int(n) for n in args.repeats.split(",")]
    if len(repeats) == 1:
        repeats *= len(stages)
    if len(repeats) != len(stages):
        raise SystemExit(f"--repeats: one number, or one per stage ({len(stages)})")
    for sample in ttfs_schedule(stages, repeats, args.profile):
        pid = os.fork()
        if pid == 0:  # the child: one sample, then leave without atexit handlers or teardown
            code = 0
            try:
                result = ttfs_child(sample, args, out)
                if sample["kind"] == "warmup" and sample["variant"] == "ds_engine" and rank() == 0:
                    _write_atomic(out / f"{sample['stage']}.ds_config.json", json.dumps(result["ds_config"]))
                _write_atomic(out / "ttfs" / f"{sample['name']}.rank{rank()}.json", json.dumps(result))
            except BaseException:
                _write_atomic(out / "sync" / f"{sample['name']}.rank{rank()}.error", traceback.format_exc())
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"time-to-first-step sample {sample} failed on rank {rank()}")
        if rank() == 0:
            print(
                f"[bench] ttfs {sample['name']} {sample['stage']} {sample['variant']} {sample['kind']}",
                flush=True,
            )


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("steps", "ttfs"), default="steps")
    parser.add_argument("--out", required=True)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=0, help="timed pairs per setting (0: use --seconds)")
    parser.add_argument(
        "--seconds", default="", help="steps mode: comma list, seconds of timed pairs per setting"
    )
    parser.add_argument("--min-steps", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--first", type=int, default=0, help="round parity; 1: baseline built first, ds_engine steps first"
    )
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--repeats", default="4", help="ttfs mode: timed pairs, one number or one per stage")
    parser.add_argument("--profile", action="store_true", help="ttfs mode: one profiled child per stage")
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args()

    # torch deprecates the reduce-scatter / all-gather names DeepSpeed calls, warning on every
    # call; printing thousands of lines inside the timed steps would be measured too.
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.mode == "ttfs":
        main_ttfs(args)
    else:
        main_steps(args)


if __name__ == "__main__":
    main()
