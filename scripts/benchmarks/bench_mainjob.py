"""The main job's recipe, trained four ways side by side: raw DeepSpeed, plain accelerate, ds_engine.

    .venv/bin/python scripts/benchmarks/bench_mainjob.py               # full schedule, 1 repeat
    .venv/bin/python scripts/benchmarks/bench_mainjob.py --max-steps 40 --repeats 2
    .venv/bin/python scripts/benchmarks/bench_mainjob.py --arms raw-ds,ds_engine-ds --json /tmp/b.json

The main job is `ds-engine launch --nproc-per-node 2 scripts/examples/finetune_classification.py
--zero-stage 3` (`scripts/main.sh`). Every arm trains its recipe: the same data (the UCI
sentences found by `_recipe.load_data`, the fixed stratified split), the same batched
tokenisation, dynamic padding and length-grouped batch order, the same MiniLM with frozen word
embeddings, AdamW groups, lr, linear warm-up schedule, epochs and seed, all read from
`finetune_classification.parse_args` and `_recipe` (nothing is copied but the tokenising
closure). The arms:

- `raw-ds`: a hand-written DeepSpeed loop, `deepspeed.initialize(model=, optimizer=,
  config=<JSON>)`, `engine.backward(loss)`, `engine.step()`, the LR scheduler stepped once per
  optimizer step; the model is created under `HfDeepSpeedConfig` (transformers' own zero.Init);
  rank r takes the r-th micro-batch slice of each global batch of the same batch order;
- `accelerate`: plain `accelerate.Accelerator(cpu=True)` (no DeepSpeed plugin: DDP over gloo),
  the canonical loop (`accelerator.backward`, `clip_grad_norm_`, `step`, `zero_grad`);
- `ds_engine-ds`: `Engine(...)` + `prepare` + `accumulate` / `backward` / `step`, as
  `scripts/examples/finetune_classification.py` does, on DeepSpeed (ZeRO-3 as in the main job);
- `ds_engine-fallback`: the same through `Engine(backend="accelerate")` (DDP on CPU).

The DeepSpeed JSON is rendered once by ds_engine (`ds_config.render_ds_config` from the
script's engine choices) and written to a file: `raw-ds` loads it, and `ds_engine-ds` checks that
the config its Engine built (`engine.ds_config`) is the same dict ("config same" in the table).

Each arm is its own 2-process launch (`python -m torch.distributed.run --nproc-per-node 2` on
this file's `--worker ARM` mode, gloo, `GLOO_SOCKET_IFNAME=lo`, `OMP_NUM_THREADS` = cores / 2 as
`ds-engine launch` sets it, offline HF variables) with a timeout; the arms run interleaved (A, B,
C, D, then D, C, B, A in the next repeat) and each rank writes its figures as JSON into a temporary folder.
Every arm's step does the same bookkeeping as the script's (the step's mean loss reduced over
the ranks and read as a number). Figures: s/optimizer step (median over the steps after
`--warmup-steps`; a step's time is the slowest rank's, from the end of the previous step: data,
forward, backward, step, loss reduction; evaluation excluded), samples/s over those steps, peak
RSS per rank (`ru_maxrss`, the larger rank), accuracy on the whole validation set after
training (each held-out sentence counted exactly once over the ranks), training wall time.
"paired" is the median over step indices of (ds_engine step / baseline step at the same index):
both see the same batch there. Target: ds_engine / baseline <= 1.02 on time, accuracy within
1 point.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# the main job's script and its modules (`finetune_classification`, `_recipe`, `sentiment_data`)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

ARMS = ("raw-ds", "accelerate", "ds_engine-ds", "ds_engine-fallback")
LABELS = {
    "raw-ds": "raw DeepSpeed",
    "accelerate": "plain accelerate",
    "ds_engine-ds": "ds_engine DeepSpeed",
    "ds_engine-fallback": "ds_engine fallback",
}
PAIRS = (("ds_engine-ds", "raw-ds"), ("ds_engine-fallback", "accelerate"))
TARGET = 1.02
ACCURACY_POINTS = 1.0
PROCESSES = 2


# ======================================================================== the recipe
def recipe_args(max_steps: int) -> argparse.Namespace:
    """The main job's arguments: `finetune_classification`'s defaults with `--zero-stage 3`."""
    import finetune_classification

    argv = ["--zero-stage", "3"] + (["--max-steps", str(max_steps)] if max_steps > 0 else [])
    return finetune_classification.parse_args(argv)


def engine_choices_for(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The Engine choices the script makes for `backend` ("deepspeed" or "accelerate")."""
    from _recipe import engine_choices

    return engine_choices(argparse.Namespace(**{**vars(args), "backend": backend}))


def render_main_job_ds_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON ds_engine builds for the main job (the script's choices, MiniLM, micro batch)."""
    from _recipe import minilm_path
    from transformers import AutoConfig

    from ds_engine.config import resolve_config
    from ds_engine.ds_config import render_ds_config

    choices = engine_choices_for(args, "deepspeed")
    resolved = resolve_config(None, choices, world_size=world_size)
    hidden = AutoConfig.from_pretrained(args.model or minilm_path()).hidden_size
    return render_ds_config(
        resolved, world_size=world_size, micro_batch_size=args.batch_size, hidden_size=hidden
    )


class _DataHost:
    """What `_recipe.load_data` asks of an Engine, before any process group exists."""

    def __init__(self, rank: int) -> None:
        self.is_main_process = rank == 0

    def wait_for_everyone(self) -> None:
        return None


def prepare_data(args: argparse.Namespace, rank: int, scratch: Path) -> dict[str, Any]:
    """Data, tokenisation and loaders exactly as `finetune_classification.main` builds them."""
    from _recipe import load_data, minilm_path, tokenized_dataloaders
    from transformers import AutoTokenizer, DataCollatorWithPadding

    raw, source = load_data(args, scratch, _DataHost(rank))  # type: ignore[arg-type]
    if source.kind != "real":
        raise SystemExit("bench_mainjob: the UCI sentences were not found; the bench measures the real data")
    model_path = args.model or minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    collate = DataCollatorWithPadding(tokenizer)
    data, train_dl, eval_dl = tokenized_dataloaders(
        raw, tokenizer, args, collate, num_replicas=PROCESSES, labels=True
    )
    return {
        "data": data,
        "collate": collate,
        "train_dl": train_dl,
        "eval_dl": eval_dl,
        "model_path": model_path,
        "source": source.origin,
    }


def build_model(args: argparse.Namespace, model_path: str) -> Any:
    """MiniLM with a 2-class head, embeddings frozen as the script does (call inside any init context)."""
    from sentiment_data import LABEL_NAMES
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        model_path,
        num_labels=2,
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
        id2label=dict(enumerate(LABEL_NAMES)),
        label2id={n: i for i, n in enumerate(LABEL_NAMES)},
    )
    return model


def build_optimizer(args: argparse.Namespace, model: Any, total_steps: int) -> tuple[Any, Any]:
    """The script's AdamW groups and linear warm-up schedule."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trained if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trained if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    warmup = round(args.warmup_ratio * total_steps)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    return optimizer, scheduler


def total_optimizer_steps(args: argparse.Namespace, num_train: int, ga: int) -> int:
    """`_recipe.num_optimizer_steps` for 2 processes (it reads only these two facts of the engine)."""
    from _recipe import num_optimizer_steps

    facts = argparse.Namespace(
        num_processes=PROCESSES, config=argparse.Namespace(gradient_accumulation_steps=ga)
    )
    return num_optimizer_steps(facts, num_train, args)  # type: ignore[arg-type]


def rank_positions(num: int, batch_size: int, world: int, rank: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches as positions in an epoch order of `num` samples: its slice of each
    global batch; positions >= `num` complete the last global batch by cycling from the start (what
    DistributedSampler, accelerate and ds_engine do: every rank gets as many batches)."""
    global_batch = batch_size * world
    return [
        list(range(b * global_batch + rank * batch_size, b * global_batch + (rank + 1) * batch_size))
        for b in range(math.ceil(num / global_batch))
    ]


def rank_batches(order: Sequence[int], batch_size: int, world: int, rank: int) -> list[list[int]]:
    """The sample indices of `rank_positions` over `order`."""
    order = list(order)
    batches = rank_positions(len(order), batch_size, world, rank)
    return [[order[p % len(order)] for p in batch] for batch in batches]


class _RankBatchSampler:
    """A batch sampler over rank batches of a (length-grouped) sampler's epoch order."""

    def __init__(self, sampler: Any, batch_size: int, world: int, rank: int) -> None:
        self.sampler, self.batch_size, self.world, self.rank = sampler, batch_size, world, rank

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / (self.batch_size * self.world))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(rank_batches(list(self.sampler), self.batch_size, self.world, self.rank))


# ======================================================================== the worker
PHASES = ("data", "forward", "backward", "step", "loss")
PROFILE_ENV = "BENCH_MAINJOB_PROFILE"  # set by --profile: cProfile over rank 0's training loop


class StepClock:
    """Wall and CPU seconds per optimizer step, the step's mean loss and its global samples.

    `mark(phase)` adds the wall time since the previous mark to `phase` of the current step:
    data (waiting for the batch), forward, backward, step (optimizer, clipping, scheduler,
    zero_grad and any wrapper around them), loss (the reduction of the step's loss over ranks).
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.samples: list[int] = []
        self.lrs: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self._current = dict.fromkeys(PHASES, 0.0)
        self.profiler: Any = None
        if os.environ.get(PROFILE_ENV) and os.environ.get("RANK", "0") == "0":
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self.start = self._wall = self._mark = time.perf_counter()
        self._cpu = time.process_time()

    def finish(self) -> float:
        """End of training: the training wall time (the profiler, if any, stops here)."""
        train_s = time.perf_counter() - self.start
        if self.profiler is not None:
            self.profiler.disable()
        return train_s

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._current[phase] += now - self._mark
        self._mark = now

    def tick(self, loss: float, samples: int, lr: float) -> None:
        self.mark("loss")
        self.lrs.append(lr)
        now, cpu = time.perf_counter(), time.process_time()
        self.wall.append(now - self._wall)
        self.cpu.append(cpu - self._cpu)
        self.losses.append(loss)
        self.samples.append(samples)
        for phase in PHASES:
            self.phases[phase].append(self._current[phase])
        self._current = dict.fromkeys(PHASES, 0.0)
        self._wall, self._cpu, self._mark = now, cpu, time.perf_counter()


def _train_raw_ds(args: argparse.Namespace, prep: dict[str, Any], ds_config_path: Path) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = json.loads(ds_config_path.read_text())
    ga = int(ds_config.get("gradient_accumulation_steps", 1))
    hf_ds_config = HfDeepSpeedConfig(copy.deepcopy(ds_config))  # noqa: F841  keep: from_pretrained under zero.Init
    model = build_model(args, prep["model_path"])
    data = prep["data"]
    total = total_optimizer_steps(args, len(data["train"]), ga)
    optimizer, scheduler = build_optimizer(args, model, total)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=copy.deepcopy(ds_config), dist_init_required=False
    )
    train_sampler = prep["train_dl"].sampler
    train_dl = DataLoader(
        data["train"],
        batch_sampler=_RankBatchSampler(train_sampler, args.batch_size, world, rank),
        collate_fn=prep["collate"],
    )

    engine.train()
    clock = StepClock()
    step, window_loss, window_batches, samples = 0, torch.zeros(()), 0, 0
    for epoch in range(args.epochs):
        if step >= total:
            break
        if hasattr(train_sampler, "set_epoch"):
            train_sampler.set_epoch(epoch)
        for batch in train_dl:
            clock.mark("data")
            loss = engine(**batch).loss
            clock.mark("forward")
            engine.backward(loss)
            clock.mark("backward")
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            window_loss += loss.detach().float()
            window_batches += 1
            samples += len(batch["labels"]) * world
            if not boundary:
                continue
            scheduler.step()
            clock.mark("step")
            step += 1
            reduced = window_loss.clone()
            dist.all_reduce(reduced)
            clock.tick((reduced / world / window_batches).item(), samples, scheduler.get_last_lr()[0])
            window_loss.zero_()
            window_batches, samples = 0, 0
            if step >= total:
                break
    train_s = clock.finish()

    eval_start = time.perf_counter()
    validation = data["validation"]
    engine.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for positions in rank_positions(len(validation), args.eval_batch_size, world, rank):
            real = torch.tensor([p < len(validation) for p in positions])  # the rest is padding
            batch = prep["collate"]([validation[p % len(validation)] for p in positions])
            labels = batch.pop("labels")
            hit = (engine(**batch).logits.float().argmax(-1) == labels).double()
            correct += torch.stack([hit[real].sum(), real.sum().double()])
    dist.all_reduce(correct)  # each held-out sentence counted exactly once over the ranks
    return _result(clock, train_s, time.perf_counter() - eval_start, correct, total, extra={"ga": ga})


def _train_accelerate(args: argparse.Namespace, prep: dict[str, Any]) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    precision = engine_choices_for(args, "accelerate").get("precision", "fp32")
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "no"}[precision]
    ga = int(engine_choices_for(args, "accelerate").get("gradient_accumulation_steps", 1))
    clip = float(engine_choices_for(args, "accelerate").get("gradient_clipping", 0.0) or 0.0)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed, gradient_accumulation_steps=ga)
    model = build_model(args, prep["model_path"])
    data = prep["data"]
    total = total_optimizer_steps(args, len(data["train"]), ga)
    optimizer, scheduler = build_optimizer(args, model, total)
    train_sampler = prep["train_dl"].sampler
    # the scheduler is stepped by hand once per optimizer step (accelerate's prepared scheduler
    # steps num_processes times per step unless built for that)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(
        model, optimizer, prep["train_dl"], prep["eval_dl"]
    )

    model.train()
    clock = StepClock()
    step, window_loss, window_batches, samples = 0, torch.zeros(()), 0, 0
    world = accelerator.num_processes
    for epoch in range(args.epochs):
        if step >= total:
            break
        if hasattr(train_sampler, "set_epoch"):
            train_sampler.set_epoch(epoch)
        for batch in train_dl:
            clock.mark("data")
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                clock.mark("forward")
                accelerator.backward(loss)
                clock.mark("backward")
                if accelerator.sync_gradients and clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
            window_loss += loss.detach().float()
            window_batches += 1
            samples += len(batch["labels"]) * world
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            clock.mark("step")
            step += 1
            mean = (accelerator.reduce(window_loss, "mean") / window_batches).item()
            clock.tick(mean, samples, scheduler.get_last_lr()[0])
            window_loss.zero_()
            window_batches, samples = 0, 0
            if step >= total:
                break
    train_s = clock.finish()

    eval_start = time.perf_counter()
    correct = _correct_and_count(model, eval_dl, accelerator.gather_for_metrics)
    return _result(clock, train_s, time.perf_counter() - eval_start, correct, total, extra={"ga": ga})


def _train_ds_engine(
    args: argparse.Namespace, prep: dict[str, Any], backend: str, ds_config_path: Path | None
) -> dict[str, Any]:
    import torch
    from _recipe import LengthGroupedSampler

    from ds_engine import Engine

    engine = Engine(backend=backend, **engine_choices_for(args, backend))
    ga = engine.config.gradient_accumulation_steps
    data = prep["data"]
    with engine.init_context():
        model = build_model(args, prep["model_path"])
    total = total_optimizer_steps(args, len(data["train"]), ga)
    optimizer, scheduler = build_optimizer(args, model, total)
    train_sampler = prep["train_dl"].sampler
    model, optimizer, train_dl, eval_dl, scheduler = engine.prepare(
        model, optimizer, prep["train_dl"], prep["eval_dl"], scheduler
    )
    extra: dict[str, Any] = {"ga": ga, "backend": engine.backend_name}
    if ds_config_path is not None and ds_config_path.exists():
        expected = json.loads(ds_config_path.read_text())
        extra["ds_config_same"] = json.loads(json.dumps(engine.ds_config)) == expected

    model.train()  # from_pretrained returns eval mode (the script's evaluation before training sets train)
    clock = StepClock()
    step, window_loss, window_batches, samples = 0, torch.zeros((), device=engine.device), 0, 0
    for epoch in range(train_dl.epoch, args.epochs):
        if step >= total:
            break
        if isinstance(train_sampler, LengthGroupedSampler):
            train_sampler.set_epoch(epoch)
        for batch in train_dl:
            clock.mark("data")
            with engine.accumulate(model):
                loss = model(**batch).loss
                clock.mark("forward")
                engine.backward(loss)
                clock.mark("backward")
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            clock.mark("step")
            window_loss += loss.detach().float()
            window_batches += 1
            samples += len(batch["labels"]) * engine.num_processes
            if not engine.sync_gradients:
                continue
            step += 1
            mean = (engine.reduce(window_loss, "mean") / window_batches).item()
            clock.tick(mean, samples, scheduler.get_last_lr()[0])
            window_loss.zero_()
            window_batches, samples = 0, 0
            if step >= total:
                break
    train_s = clock.finish()

    eval_start = time.perf_counter()
    correct = _correct_and_count(model, eval_dl, engine.gather_for_metrics)
    return _result(clock, train_s, time.perf_counter() - eval_start, correct, total, extra=extra)


def _correct_and_count(model: Any, eval_dl: Any, gather_for_metrics: Any) -> Any:
    """(correct, count) over the whole validation set, each sentence once (`gather_for_metrics`)."""
    import torch

    model.eval()
    hits = []
    with torch.no_grad():
        for batch in eval_dl:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
            hits.append(gather_for_metrics((logits.argmax(-1) == batch["labels"]).double()).cpu())
    all_hits = torch.cat(hits)
    return torch.stack([all_hits.sum(), torch.tensor(float(len(all_hits)), dtype=torch.float64)])


def _result(
    clock: StepClock, train_s: float, eval_s: float, correct: Any, total: int, *, extra: dict[str, Any]
) -> dict[str, Any]:
    hits, count = (float(x) for x in correct.tolist())
    return {
        "step_wall_s": clock.wall,
        "step_cpu_s": clock.cpu,
        "losses": clock.losses,
        "lrs": clock.lrs,
        "step_samples": clock.samples,
        "phases": clock.phases,
        "profile": profile_summary(clock.profiler, len(clock.wall)) if clock.profiler else None,
        "train_s": train_s,
        "eval_s": eval_s,
        "accuracy": hits / count if count else float("nan"),
        "eval_samples": int(count),
        "optimizer_steps": len(clock.wall),
        "planned_steps": total,
        **extra,
    }


def profile_summary(profiler: Any, steps: int) -> dict[str, Any]:
    """ds_engine's own share of the profiled loop, its largest self times, and DeepSpeed's calls."""
    import pstats

    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in stats.values())
    ours = {k: v for k, v in stats.items() if f"{os.sep}ds_engine{os.sep}" in k[0]}
    own = sum(tt for (_, _, tt, _, _) in ours.values())
    top = sorted(ours.items(), key=lambda kv: -kv[1][2])[:6]
    watched: dict[str, float] = {}
    for (path, _, name), (_, _, _, ct, _) in stats.items():
        if path.endswith(os.path.join("deepspeed", "runtime", "engine.py")) and name in (
            "forward",
            "backward",
            "step",
        ):
            watched[f"DeepSpeedEngine.{name}"] = ct / max(steps, 1)
        if f"{os.sep}ds_engine{os.sep}" in path and name in ("backward", "_optimizer_step", "accumulate"):
            watched[f"ds_engine {Path(path).stem}.{name}"] = ct / max(steps, 1)
    return {
        "steps": steps,
        "total_s": total,
        "ds_engine_self_share": own / total if total else 0.0,
        "ds_engine_top_ms_per_step": [
            (f"{Path(k[0]).stem}.{k[2]}", v[2] / max(steps, 1) * 1e3) for k, v in top
        ],
        "cumulative_s_per_step": watched,
    }


def worker(arm: str, out: Path, max_steps: int, ds_config_path: Path) -> None:
    """One rank of one arm: train, evaluate, write `out/rank<R>.json`."""
    started = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    from _recipe import quiet_libraries, seed_everything

    args = recipe_args(max_steps)
    seed_everything(args.seed)
    quiet_libraries(rank == 0)
    import warnings

    warnings.filterwarnings("ignore")
    prep = prepare_data(args, rank, out / f"scratch{rank}")
    setup_start = time.perf_counter()
    if arm == "raw-ds":
        result = _train_raw_ds(args, prep, ds_config_path)
    elif arm == "accelerate":
        result = _train_accelerate(args, prep)
    elif arm == "ds_engine-ds":
        result = _train_ds_engine(args, prep, "deepspeed", ds_config_path)
    else:
        result = _train_ds_engine(args, prep, "accelerate", None)
    result |= {
        "arm": arm,
        "rank": rank,
        "data_origin": prep["source"],
        "num_train": len(prep["data"]["train"]),
        "startup_s": setup_start - started,
        "process_s": time.perf_counter() - started,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": __import__("torch").get_num_threads(),
        "recipe": {
            k: getattr(args, k)
            for k in ("epochs", "batch_size", "lr", "warmup_ratio", "max_length", "seed", "max_steps")
        },
    }
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")


# ======================================================================== the parent
def launch_arm(
    arm: str, *, max_steps: int, ds_config_path: Path, timeout: float, log_dir: Path, profile: bool = False
) -> list[dict[str, Any]]:
    """One 2-process launch of `arm`; returns the ranks' results (raises with the output tail on failure)."""
    from _launch import run_command, torchrun_command, worker_env

    out = Path(tempfile.mkdtemp(prefix=f"bench_mainjob_{arm}_", dir=log_dir))
    cmd = torchrun_command(
        Path(__file__).resolve(),
        "--worker",
        arm,
        "--out",
        str(out),
        "--max-steps",
        str(max_steps),
        "--ds-config",
        str(ds_config_path),
        nproc=PROCESSES,
    )
    env = worker_env({"OMP_NUM_THREADS": omp_threads(), "MKL_NUM_THREADS": omp_threads()})
    if profile:
        env[PROFILE_ENV] = "1"
    env.pop("DS_ENGINE_CONFIG", None)  # the script's defaults, not a config from the caller's shell
    proc = run_command(cmd, timeout=timeout, env=env)
    (out / "output.log").write_text(proc.stdout or "")
    files = [out / f"rank{r}.json" for r in range(PROCESSES)]
    if proc.returncode != 0 and not all(f.exists() for f in files):
        raise RuntimeError(f"arm {arm} failed (exit {proc.returncode}):\n{(proc.stdout or '')[-6000:]}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise RuntimeError(f"arm {arm}: no result from {missing}:\n{(proc.stdout or '')[-6000:]}")
    ranks = [json.loads(f.read_text()) for f in files]
    for r in ranks:
        r["exit_code"] = proc.returncode  # a torch exit race can abort a finished rank (docs/reliability.md)
    return ranks


def arm_order(arms: Sequence[str], repeat: int) -> list[str]:
    """The arms in the order of round `repeat`: A B C D, then D C B A, ... (ABBA: a load that drifts
    during the bench weighs on every arm alike over two rounds)."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


def omp_threads() -> str:
    """What `ds-engine launch` gives each rank: the cores shared among the processes, at least 1."""
    return str(max(1, (os.cpu_count() or 1) // PROCESSES))


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize_run(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One launch's figures: per-step wall time is the slowest rank's."""
    steps = min(len(r["step_wall_s"]) for r in ranks)
    wall = [max(r["step_wall_s"][i] for r in ranks) for i in range(steps)]
    cpu = [sum(r["step_cpu_s"][i] for r in ranks) for i in range(steps)]
    samples = ranks[0]["step_samples"][:steps]
    skip = min(warmup, max(0, steps - 1))
    timed = wall[skip:]
    return {
        "steps": steps,
        "warmup_steps": skip,
        "step_wall_s": wall,
        "step_cpu_s": cpu,
        "s_per_step": _median(timed),
        "cpu_s_per_step": _median(cpu[skip:]),
        "samples_per_s": sum(samples[skip:]) / sum(timed) if timed else float("nan"),
        "train_s": max(r["train_s"] for r in ranks),
        "eval_s": max(r["eval_s"] for r in ranks),
        "startup_s": max(r["startup_s"] for r in ranks),
        "process_s": max(r["process_s"] for r in ranks),
        "maxrss_mb": [r["maxrss_mb"] for r in ranks],
        "accuracy": ranks[0]["accuracy"],
        "accuracy_same_on_ranks": len({r["accuracy"] for r in ranks}) == 1,
        "eval_samples": ranks[0]["eval_samples"],
        "losses": ranks[0]["losses"],
        "lrs": ranks[0]["lrs"],
        "phases_rank0": {k: v[:steps] for k, v in ranks[0]["phases"].items()},
        "profile": ranks[0].get("profile"),
        "final_loss": ranks[0]["losses"][-1] if ranks[0]["losses"] else float("nan"),
        "exit_code": ranks[0]["exit_code"],
        "ds_config_same": ranks[0].get("ds_config_same"),
        "data_origin": ranks[0]["data_origin"],
        "num_train": ranks[0]["num_train"],
        "threads": ranks[0]["torch_threads"],
        "recipe": ranks[0]["recipe"],
    }


def summarize_arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm over its repeats: medians pooled over every repeat's timed steps."""
    timed = [t for run in runs for t in run["step_wall_s"][run["warmup_steps"] :]]
    cpu = [t for run in runs for t in run["step_cpu_s"][run["warmup_steps"] :]]
    phases = {
        phase: _median([t for run in runs for t in run["phases_rank0"][phase][run["warmup_steps"] :]])
        for phase in PHASES
    }
    return {
        "s_per_step": _median(timed),
        "cpu_s_per_step": _median(cpu),
        "phases_rank0_s": phases,
        "samples_per_s": _median([run["samples_per_s"] for run in runs]),
        "train_s": _median([run["train_s"] for run in runs]),
        "eval_s": _median([run["eval_s"] for run in runs]),
        "maxrss_mb": max(max(run["maxrss_mb"]) for run in runs),
        "accuracy": _median([run["accuracy"] for run in runs]),
        "eval_samples": runs[0]["eval_samples"],
        "steps": runs[0]["steps"],
        "final_loss": _median([run["final_loss"] for run in runs]),
        "ds_config_same": runs[0]["ds_config_same"],
        "profile": runs[0]["profile"],
        "runs": runs,
    }


def compare(ours: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """ds_engine arm vs its baseline: time ratio, paired per-step ratio, CPU ratio, accuracy, losses."""
    paired = []
    for a, b in zip(ours["runs"], base["runs"]):
        skip = max(a["warmup_steps"], b["warmup_steps"])
        paired += [x / y for x, y in zip(a["step_wall_s"][skip:], b["step_wall_s"][skip:]) if y > 0]
    loss_diff = max(
        (
            abs(x - y) / max(abs(y), 1e-12)
            for a, b in zip(ours["runs"], base["runs"])
            for x, y in zip(a["losses"], b["losses"])
        ),
        default=float("nan"),
    )
    lr_diff = max(
        (abs(x - y) for a, b in zip(ours["runs"], base["runs"]) for x, y in zip(a["lrs"], b["lrs"])),
        default=float("nan"),
    )
    return {
        "time_ratio": ours["s_per_step"] / base["s_per_step"],
        "max_lr_diff": lr_diff,
        "paired_ratio": _median(paired),
        "cpu_ratio": ours["cpu_s_per_step"] / base["cpu_s_per_step"],
        "train_time_ratio": ours["train_s"] / base["train_s"],
        "accuracy_points": 100 * (ours["accuracy"] - base["accuracy"]),
        "max_loss_rel_diff": loss_diff,
    }


def format_table(result: dict[str, Any]) -> str:
    info, arms = result["info"], result["arms"]
    recipe = info["recipe"]
    lines = [
        f"$ {info['command']}",
        f"main job recipe: MiniLM (embeddings frozen), {info['data']}, {info['num_train']} train / "
        f"{info['num_validation']} validation sentences, micro batch {recipe['batch_size']} x "
        f"{PROCESSES} ranks, max length {recipe['max_length']}, lr {recipe['lr']:g}, warm-up "
        f"{recipe['warmup_ratio']:g}, {recipe['epochs']} epoch(s), seed {recipe['seed']}, "
        f"{info['precision']}, GA {info['ga']}; DeepSpeed arms ZeRO-{info['zero_stage']}, "
        "accelerate arms DDP",
        f"2 CPU ranks (gloo), OMP_NUM_THREADS={info['omp_threads']}, machine load (1-min average) "
        f"{info['load_range'][0]:.1f}..{info['load_range'][1]:.1f}; {info['repeats']} repeat(s), arms "
        f"interleaved ABBA; s/step = median over steps {info['warmup'] + 1}..{info['steps']} (slowest rank), "
        "evaluation excluded",
        "",
        f"{'arm':<20} | {'s/opt step':>10} | {'samples/s':>9} | {'peak RSS/rank':>13} | "
        f"{'accuracy':>8} | {'train wall':>10} | {'CPU s/step':>10} | {'final loss':>10}",
    ]
    lines.append("-" * len(lines[-1]))
    for arm in info["arms"]:
        a = arms[arm]
        lines.append(
            f"{LABELS[arm]:<20} | {a['s_per_step']:>10.3f} | {a['samples_per_s']:>9.1f} | "
            f"{a['maxrss_mb']:>10.0f} MB | {a['accuracy']:>8.4f} | {a['train_s']:>9.1f}s | "
            f"{a['cpu_s_per_step']:>10.3f} | {a['final_loss']:>10.4f}"
        )
    lines += ["", "rank 0's step by phase (median s over the timed steps):"]
    lines.append(f"{'arm':<20} | " + " | ".join(f"{p:>8}" for p in PHASES))
    for arm in info["arms"]:
        phases = arms[arm]["phases_rank0_s"]
        lines.append(f"{LABELS[arm]:<20} | " + " | ".join(f"{phases[p]:>8.3f}" for p in PHASES))
    lines.append("")
    for name, c in result["ratios"].items():
        ours, base = name.split("/")
        meets = c["time_ratio"] <= TARGET and abs(c["accuracy_points"]) <= ACCURACY_POINTS
        verdict = "meets" if meets else "MISSES"
        lines.append(
            f"{LABELS[ours]} / {LABELS[base]}: time {c['time_ratio']:.3f} (paired {c['paired_ratio']:.3f}, "
            f"CPU {c['cpu_ratio']:.3f}, train wall {c['train_time_ratio']:.3f}), accuracy "
            f"{c['accuracy_points']:+.2f} points, loss rel diff {c['max_loss_rel_diff']:.1e}, lr diff "
            f"{c['max_lr_diff']:.1e}: {verdict} "
            f"the target (time <= {TARGET}, accuracy within {ACCURACY_POINTS:g} point)"
        )
    if "ds_engine-ds" in arms:
        lines.append(
            f"DeepSpeed JSON: raw-ds loads {info['ds_config_path']}; ds_engine's own equals it: "
            f"{arms['ds_engine-ds']['ds_config_same']}"
        )
    profiled = [arm for arm in info["arms"] if arms[arm].get("profile")]
    if profiled:
        lines += [
            "",
            "profiled (--profile: cProfile on rank 0 over the training loop; the timings above are slowed):",
        ]
        for arm in profiled:
            p = arms[arm]["profile"]
            calls = ", ".join(f"{k} {v:.3f}s" for k, v in sorted(p["cumulative_s_per_step"].items()))
            top = ", ".join(f"{k} {ms:.2f}ms" for k, ms in p["ds_engine_top_ms_per_step"][:4])
            lines.append(
                f"{LABELS[arm]:<20} | ds_engine self time {p['ds_engine_self_share']:.3%} | per step: {calls}"
                + (f" | largest ds_engine self times per step: {top}" if top else "")
            )
    lines.append(
        "CPU s/step: CPU seconds of both ranks per step; on a shared machine their ratio is the one "
        "blind to other processes' load"
    )
    lines.append(f"bench wall time {info['wall_s']:.0f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop each arm after N optimizer steps (0: full schedule)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the interleaved arms")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed optimizer steps at the start")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile rank 0's training loop (slows it: for finding overhead, not for the figures)",
    )
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ds-config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out, args.max_steps, args.ds_config)
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms {args.arms!r}: unknown {unknown}; allowed: {', '.join(ARMS)}")
    if args.repeats < 1 or args.max_steps < 0 or args.warmup_steps < 0:
        parser.error("need --repeats >= 1, --max-steps >= 0, --warmup-steps >= 0")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    start = time.perf_counter()
    argv_shown = [
        ".venv/bin/python",
        "scripts/benchmarks/bench_mainjob.py",
        *(sys.argv[1:] if argv is None else argv),
    ]
    command = " ".join(shlex.quote(a) for a in argv_shown)
    recipe = recipe_args(args.max_steps)
    work = Path(tempfile.mkdtemp(prefix="bench_mainjob_"))
    ds_config = render_main_job_ds_config(recipe, PROCESSES)
    ds_config_path = work / "ds_config.json"
    ds_config_path.write_text(json.dumps(ds_config, indent=2))
    print(f"DeepSpeed JSON (rendered by ds_engine): {ds_config_path}; logs under {work}", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arm_order(arms, repeat):
            t0 = time.perf_counter()
            load_before = os.getloadavg()[0]
            ranks = launch_arm(
                arm,
                max_steps=args.max_steps,
                ds_config_path=ds_config_path,
                timeout=args.timeout,
                log_dir=work,
                profile=args.profile,
            )
            run = summarize_run(ranks, args.warmup_steps)
            run["load_avg_1min"] = [load_before, os.getloadavg()[0]]
            runs[arm].append(run)
            print(
                f"[{repeat + 1}/{args.repeats}] {LABELS[arm]:<20} {run['steps']} steps, "
                f"{run['s_per_step']:.3f} s/step, accuracy {run['accuracy']:.4f}, "
                f"train {run['train_s']:.1f}s, "
                f"launch {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
    summary = {arm: summarize_arm(runs[arm]) for arm in arms}
    ratios = {f"{o}/{b}": compare(summary[o], summary[b]) for o, b in PAIRS if o in summary and b in summary}
    first = summary[arms[0]]["runs"][0]
    result = {
        "info": {
            "command": command,
            "arms": arms,
            "repeats": args.repeats,
            "warmup": first["warmup_steps"],
            "steps": first["steps"],
            "omp_threads": omp_threads(),
            "recipe": first["recipe"],
            "data": f"real UCI sentences ({first['data_origin']})",
            "num_train": first["num_train"],
            "num_validation": first["eval_samples"],
            "precision": ds_config_precision(ds_config),
            "ga": int(ds_config.get("gradient_accumulation_steps", 1)),
            "zero_stage": ds_config.get("zero_optimization", {}).get("stage"),
            "ds_config_path": str(ds_config_path),
            "ds_config": ds_config,
            "wall_s": time.perf_counter() - start,
            "load_range": [
                min(x for arm in arms for run in runs[arm] for x in run["load_avg_1min"]),
                max(x for arm in arms for run in runs[arm] for x in run["load_avg_1min"]),
            ],
        },
        "arms": summary,
        "ratios": ratios,
    }
    print()
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"figures: {args.json}")
    return 0


def ds_config_precision(ds_config: dict[str, Any]) -> str:
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


if __name__ == "__main__":
    raise SystemExit(main())
