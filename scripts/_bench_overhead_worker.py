"""Worker for `scripts/bench_overhead.py` (runs inside torchrun; one process per rank).

For each setting it builds two trainers on identically seeded copies of the same GPT-2 and
the same data, a *baseline* (raw DeepSpeed or plain accelerate, written the way their docs
show) and *ds_engine*, then alternates them one optimizer step at a time (ABBA...) so that
load from other processes on the machine hits both alike. Each optimizer step is timed from
a barrier to its end on every rank; the step time is the slowest rank's.

Gradient reductions are counted by wrapping `torch.distributed`'s reduction functions before
DeepSpeed forms its communication backend (DeepSpeed binds `reduce_scatter_tensor` then).
Only tensors with more than one element count: scalar all-reduces are grad-norm / overflow
bookkeeping. DDP reduces in C++, so there a counting comm hook (the default all-reduce hook
plus a counter) is registered on both DDP models. A "reduction pass" is a micro-step that
issued at least one gradient reduction (a bucketed reduction is many calls, one pass).

With --profile, after the timed steps the ds_engine trainer runs as many optimizer steps
again under cProfile (every rank), and the result gives the share of that profiled time spent
in ds_engine's own Python code (self time of the functions in the `ds_engine` package).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import os
import pstats
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

COUNTED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_reduce_coalesced")
SETTINGS = ("zero0", "zero2", "zero2-coalesce", "zero3", "zero3-coalesce", "accelerate")
#: Raw DeepSpeed ZeRO-0 against itself: the ratio's noise floor on this machine (opt-in).
NULL_SETTING = "zero0-null"


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


def make_dataset(args: argparse.Namespace, world: int) -> TensorDataset:
    """Exactly one epoch of data for warm-up + timed (+ profiled) steps (every window is full)."""
    windows = args.warmup + args.steps + (args.steps if args.profile else 0)
    num = windows * args.ga * args.micro_batch * world
    ids = torch.randint(0, args.vocab, (num, args.seq), generator=torch.Generator().manual_seed(99))
    return TensorDataset(ids, ids.clone())


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


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

    def micro_steps(self) -> Iterator[None]:
        """Yield once per micro-step, with the counter pointing at this trainer's micro-step."""
        raise NotImplementedError

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


class RawDeepSpeed(Trainer):
    """The canonical DeepSpeed loop: `engine.backward(loss); engine.step()` on every micro-step.

    With `coalesce`, the window's backwards run inside `engine.coalesce_grad_reduction()` and
    `engine.step()` follows once, with the boundary flag set as DeepSpeed requires there.
    """

    def __init__(self, args: argparse.Namespace, ds_config: dict[str, Any], *, coalesce: bool) -> None:
        import deepspeed

        super().__init__()
        self.name = "baseline"
        self.ga = args.ga
        self.coalesce = coalesce
        model = make_model(args)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=copy.deepcopy(ds_config)
        )
        dataset = make_dataset(args, dist.get_world_size())
        self.loader = iter(
            DataLoader(
                dataset, batch_size=args.micro_batch, sampler=DistributedSampler(dataset, shuffle=False)
            )
        )
        self.device = self.engine.device

    def _forward_backward(self) -> None:
        ids, labels = (t.to(self.device) for t in next(self.loader))
        loss = self.engine(input_ids=ids, labels=labels).loss
        self.engine.backward(loss)
        self.losses.append(loss.detach())

    def run_window(self) -> None:
        if not self.coalesce:
            for _ in range(self.ga):
                self._tick()
                self._forward_backward()
                self.engine.step()
            return
        with self.engine.coalesce_grad_reduction():
            for j in range(self.ga):
                self._tick()
                self.engine.set_gradient_accumulation_boundary(j == self.ga - 1)
                self._forward_backward()
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()

    def close(self) -> None:
        self.engine.destroy()


class RawAccelerate(Trainer):
    """The canonical accelerate loop: `accelerator.accumulate(model)` with GA=4."""

    def __init__(self, args: argparse.Namespace) -> None:
        from accelerate import Accelerator

        super().__init__()
        self.name = "baseline"
        self.ga = args.ga
        self.clip = args.clip
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.ga)
        model = make_model(args)
        loader = DataLoader(make_dataset(args, dist.get_world_size()), batch_size=args.micro_batch)
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
    """The ds_engine loop from DESIGN.md: `accumulate` / `backward` / `optimizer.step()`."""

    def __init__(self, args: argparse.Namespace, *, backend: str, zero_stage: int, coalesce: bool) -> None:
        from ds_engine import Engine

        super().__init__()
        self.name = "ds_engine"
        self.ga = args.ga
        self.engine = Engine(
            backend=backend,
            zero_stage=zero_stage,
            precision=args.precision,
            gradient_accumulation_steps=args.ga,
            gradient_clipping=args.clip,
            coalesce_grad_reduction=coalesce,
        )
        model = make_model(args)
        loader = DataLoader(make_dataset(args, self.engine.num_processes), batch_size=args.micro_batch)
        self.model, self.optimizer, loader = self.engine.prepare(model, make_optimizer(model), loader)
        self.loader = iter(loader)
        if self.engine.backend_name == "accelerate":
            self.ddp = self.model

    def run_window(self) -> None:
        backend = getattr(self.engine, "_backend", None)
        accelerator = getattr(backend, "accelerator", None)
        if accelerator is not None:  # see RawAccelerate.run_window: the shared GradientState
            accelerator.gradient_accumulation_steps = 1
        for _ in range(self.ga):
            self._tick()
            ids, labels = next(self.loader)
            with self.engine.accumulate(self.model):
                loss = self.model(input_ids=ids, labels=labels).loss
                self.engine.backward(loss)
                self.optimizer.step()
                self.optimizer.zero_grad()
            self.losses.append(loss.detach())

    def close(self) -> None:
        ds = getattr(getattr(self.engine, "_backend", None), "ds_engine", None)
        if ds is not None:
            ds.destroy()


# ---------------------------------------------------------------------------- profile
def profile_share(trainer: Trainer, steps: int) -> dict[str, Any]:
    """Run `steps` more optimizer steps under cProfile; ds_engine's share of the profiled time.

    "own" is the self time of the functions defined in the `ds_engine` package; "direct" adds
    the builtins (C functions, torch ops among them) that those functions call directly. Both
    are shares of the total self time under the profiler, which slows Python-heavy code such
    as ds_engine's more than torch's C++: they overstate rather than understate its cost.
    """
    import ds_engine

    package = os.path.dirname(ds_engine.__file__) + os.sep
    profiler = cProfile.Profile()
    for _ in range(steps):
        dist.barrier()
        profiler.enable()
        try:
            trainer.run_window()
        finally:
            profiler.disable()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats
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


# ---------------------------------------------------------------------------- one setting
def build_pair(setting: str, args: argparse.Namespace) -> tuple[Trainer, Trainer]:
    if setting == "accelerate":
        ours: Trainer = DsEngine(args, backend="accelerate", zero_stage=0, coalesce=False)
        base: Trainer = RawAccelerate(args)
    elif setting == NULL_SETTING:
        probe = DsEngine(args, backend="deepspeed", zero_stage=0, coalesce=False)
        ds_config = probe.engine.ds_config
        assert ds_config is not None
        probe.close()
        base = RawDeepSpeed(args, ds_config, coalesce=False)
        ours = RawDeepSpeed(args, ds_config, coalesce=False)
        ours.name = "ds_engine"  # the second copy stands where ds_engine would
    else:
        stage = int(setting[len("zero")])
        coalesce = setting.endswith("-coalesce")
        ours = DsEngine(args, backend="deepspeed", zero_stage=stage, coalesce=coalesce)
        ds_config = ours.engine.ds_config
        assert ds_config is not None
        base = RawDeepSpeed(args, ds_config, coalesce=coalesce)
    for trainer in (base, ours):
        if trainer.ddp is not None:
            trainer.ddp.register_comm_hook(None, counting_comm_hook)  # type: ignore[operator]
    return base, ours


def run_setting(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base, ours = build_pair(setting, args)
    COUNTER.calls.clear()
    COUNTER.passes.clear()
    for i in range(args.warmup + args.steps):
        order = (base, ours) if i % 2 == 0 else (ours, base)  # ABBA: neither always goes first
        for trainer in order:
            trainer.optimizer_step()
    total_steps = args.warmup + args.steps
    result: dict[str, Any] = {
        "setting": setting,
        "warnings": sorted(
            {
                str(w.message)
                for w in caught
                if not issubclass(w.category, (FutureWarning, DeprecationWarning))
            }
        ),
    }
    for key, trainer in (("baseline", base), ("ds_engine", ours)):
        timed = (trainer.times[args.warmup :], trainer.cpu_times[args.warmup :])
        all_times: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_times, timed)
        per_step = [max(ts) for ts in zip(*(t[0] for t in all_times))]  # the slowest rank's wall time
        cpu_per_step = [sum(ts) for ts in zip(*(t[1] for t in all_times))]  # CPU time of all ranks
        window_losses = torch.stack(trainer.losses).view(total_steps, args.ga).mean(dim=1)
        dist.all_reduce(window_losses)  # not counted: the counter is inactive here
        window_losses /= dist.get_world_size()
        result[key] = {
            "step_times": per_step,
            "median": statistics.median(per_step),
            "cpu_step_times": cpu_per_step,
            "cpu_median": statistics.median(cpu_per_step),
            "reduction_calls_per_step": COUNTER.calls.get(trainer.name, 0) / total_steps,
            "reduction_passes_per_step": len(COUNTER.passes.get(trainer.name, ())) / total_steps,
            "losses": window_losses.tolist(),
        }
    b, o = result["baseline"]["losses"], result["ds_engine"]["losses"]
    result["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(b, o))
    result["ratio"] = result["ds_engine"]["median"] / result["baseline"]["median"]
    # each pair of steps ran back to back: their ratio cancels slow drifts in machine load
    pairs = zip(result["ds_engine"]["step_times"], result["baseline"]["step_times"])
    result["paired_ratio"] = statistics.median(o / b for o, b in pairs)
    result["cpu_ratio"] = result["ds_engine"]["cpu_median"] / result["baseline"]["cpu_median"]
    if args.profile and isinstance(ours, DsEngine):
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, profile_share(ours, args.steps))
        result["profile"] = max(per_rank, key=lambda p: p["own_share"])  # the rank with the largest share
    base.close()
    ours.close()
    del base, ours
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true", help="profile ds_engine's steps (see docstring)")
    args = parser.parse_args()

    # torch deprecates the reduce-scatter / all-gather names DeepSpeed calls, warning on every
    # call; printing thousands of lines inside the timed steps would be measured too.
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    COUNTER.install()  # before DeepSpeed binds its communication functions
    results = []
    num_params = sum(p.numel() for p in make_model(args).parameters())
    for setting in args.settings.split(","):
        results.append(run_setting(setting, args))
        if int(os.environ.get("RANK", "0")) == 0:
            r = results[-1]
            print(
                f"[bench] {setting}: baseline {r['baseline']['median']:.3f}s ds_engine "
                f"{r['ds_engine']['median']:.3f}s ratio {r['ratio']:.3f}",
                flush=True,
            )
    if int(os.environ.get("RANK", "0")) == 0:
        info = {"num_params": num_params, "world_size": dist.get_world_size(), "args": vars(args)}
        out = Path(args.out) / "result.json"
        out.write_text(json.dumps({"info": info, "results": results}))


if __name__ == "__main__":
    main()
