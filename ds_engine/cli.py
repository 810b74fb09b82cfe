"""`ds-engine` command line: config | estimate | launch | consolidate | env | plot.

Every user mistake ends with exit status 2 and a one-line `ds-engine: error: ...` message
(no traceback). Each subcommand's work lives in the module it belongs to; this file only
parses arguments and reports.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ds_engine._console import quiet_deepspeed_log


class CLIError(Exception):
    """A user error the CLI reports in one line with exit status 2."""


def _in_flag_terms(message: str, flags: dict[str, str]) -> str:
    """`message` with the Python keyword names in `flags` written as the CLI flags that set them.

    Library errors name keywords (`zero_stage`, `HINT: pass nvme_path=...`); on the command line
    the user typed `--zero-stage` / `--nvme-path`. Backticked names and `name=` become the flag,
    and so do bare names with an underscore (plain words such as "optimizer" stay as they are).
    """
    for name, flag in sorted(flags.items(), key=lambda item: -len(item[0])):
        message = re.sub(rf"`{re.escape(name)}`", f"`{flag}`", message)
        message = re.sub(rf"(?<![\w.`-]){re.escape(name)}=", f"{flag} ", message)
        if "_" in name:
            message = re.sub(rf"(?<![\w.`-]){re.escape(name)}(?![\w`])", flag, message)
    return message


# --------------------------------------------------------------------------- config
_CONFIG_CHOICES: dict[str, tuple[type, dict]] = {
    # EngineConfig field -> (argparse type, extra add_argument kwargs); only given flags are explicit.
    "zero_stage": (int, {"choices": [0, 1, 2, 3], "help": "ZeRO stage: 0 data parallel, 1 optimizer states, "
                                                          "2 +gradients, 3 +parameters partitioned"}),
    "precision": (str, {"choices": ["fp32", "fp16", "bf16"], "help": "training precision"}),
    "gradient_accumulation_steps": (int, {"help": "micro-steps per optimizer step"}),
    "gradient_clipping": (float, {"help": "clip the global gradient norm to this (0: no clipping)"}),
    "offload_optimizer": (str, {"choices": ["none", "cpu", "nvme"], "help": "where optimizer states live "
                                                                         "(ZeRO 1-3)"}),
    "offload_params": (str, {"choices": ["none", "cpu", "nvme"], "help": "where parameters live (ZeRO-3)"}),
    "nvme_path": (str, {"help": "folder on a local NVMe drive, for nvme offload"}),
    "loss_scale": (float, {"help": "fp16 static loss scale (0: dynamic)"}),
    "initial_scale_power": (int, {"help": "fp16 dynamic loss scale starts at 2**this"}),
    "reduce_bucket_size": (int, {"help": "elements per gradient reduction bucket (auto: hidden_size**2)"}),
    "allgather_bucket_size": (int, {"help": "elements per all-gather bucket (ZeRO 1-2)"}),
    "stage3_prefetch_bucket_size": (int, {"help": "ZeRO-3 elements prefetched (auto: 0.9 * hidden_size**2)"}),
    "stage3_param_persistence_threshold": (int, {"help": "ZeRO-3: parameters below this many elements stay "
                                                         "whole (auto: 10 * hidden_size)"}),
    "stage3_max_live_parameters": (int, {"help": "ZeRO-3: most parameter elements gathered at once"}),
    "steps_per_print": (int, {"help": "DeepSpeed's own progress log every N steps (0: never)"}),
}  # fmt: skip
_CONFIG_FLAGS = {
    "overlap_comm": "overlap gradient reduction with the backward pass",
    "contiguous_gradients": "copy gradients into one contiguous buffer",
    "pin_memory": "pin the host memory of offloaded tensors",
    "activation_checkpointing": "recompute activations in backward (less memory, more compute)",
}
#: Every `config` flag's keyword name -> the flag (error messages name flags, not keywords).
_CONFIG_FLAG_NAMES = {
    name: "--" + name.replace("_", "-")
    for name in (*_CONFIG_CHOICES, *_CONFIG_FLAGS, "micro_batch_size", "world_size", "hidden_size")
}


def _add_config(sub: argparse._SubParsersAction) -> None:
    import dataclasses

    from ds_engine.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    p = sub.add_parser(
        "config",
        help="build (or --validate) a DeepSpeed JSON config",
        description="Print the DeepSpeed JSON config the given choices make (or, with --validate FILE, every "
        "problem in FILE). Options not given keep ds_engine's default (shown) or, from --base, the base's "
        "value. Without --micro-batch-size the JSON is a template: batch sizes and the other values "
        'filled at prepare are left "auto" (ds_engine, and the HF Trainer, fill them).',
    )
    for name, (typ, extra) in _CONFIG_CHOICES.items():
        shown = {
            **extra,
            "help": f"{extra['help']} (default: {'none' if defaults[name] is None else defaults[name]})",
        }
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, **shown)
    for name, text in _CONFIG_FLAGS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            action=argparse.BooleanOptionalAction,
            help=f"{text} (default: {'on' if defaults[name] else 'off'})",
        )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help='per-rank micro batch size (default: none, so the JSON is a template: batch sizes "auto")',
    )
    p.add_argument(
        "--base", default=None, help="a DeepSpeed JSON file or a preset name, e.g. zero3 (default: none)"
    )
    p.add_argument(
        "--world-size", type=int, default=None, help="data-parallel ranks, for train_batch_size (default: 1)"
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="model hidden size, for the auto bucket sizes (default: DeepSpeed's bucket sizes)",
    )
    p.add_argument(
        "--for-trainer",
        action="store_true",
        help="a JSON for transformers.TrainingArguments(deepspeed=FILE): the values the HF Trainer fills "
        "(batch sizes, accumulation, clipping, fp16/bf16, optimizer and scheduler values, bucket sizes) "
        '"auto" (default: off, a JSON for ds_engine)',
    )
    p.add_argument(
        "--validate",
        metavar="FILE",
        default=None,
        help='check FILE and print every problem; "auto" values are reported as filled at prepare '
        "(default: none, build a config)",
    )
    p.set_defaults(func=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    import contextlib

    from ds_engine.config import ConfigError, EngineConfig, load_json_config
    from ds_engine.ds_config import build_ds_config, for_trainer, validate_ds_config
    from ds_engine.ds_schema import auto_keys

    template = args.micro_batch_size is None
    if args.for_trainer and (args.validate is not None or not template):
        flag = "--validate" if args.validate is not None else "--micro-batch-size"
        raise CLIError(
            f"`{flag}` with `--for-trainer`: the Trainer fills the batch sizes from its TrainingArguments "
            f"and the JSON it gets is a template. HINT: drop {flag} (set per_device_train_batch_size in "
            "TrainingArguments)"
        )
    if args.validate is None and template:
        facts = (("--world-size", args.world_size), ("--hidden-size", args.hidden_size))
        given = [flag for flag, value in facts if value is not None]
        if given:
            raise CLIError(
                f"`{given[0]}` is only used for a complete config, which needs `--micro-batch-size`; without "
                'it the JSON is a template whose batch and bucket sizes are "auto", filled at prepare. '
                f"HINT: add --micro-batch-size 8, or drop {given[0]}"
            )
        nvme = [
            f"--{k.replace('_', '-')}"
            for k in ("offload_optimizer", "offload_params")
            if getattr(args, k) == "nvme"
        ]
        if nvme and args.nvme_path is None:  # a preset leaves the folder open; a command line names it
            raise CLIError(
                f'`--nvme-path` is required when `{nvme[0]}` = "nvme" (allowed: a folder on a fast local '
                'NVMe drive). HINT: pass --nvme-path "/local_nvme/ds_swap"'
            )
    # DeepSpeed logs to stdout when imported (for its config models): keep stdout pure JSON/report.
    with contextlib.redirect_stdout(sys.stderr):
        if args.validate is not None:
            loaded = load_json_config(args.validate)
            autos = auto_keys(loaded)  # a template: "auto" values are filled at prepare
            problems = validate_ds_config(loaded, world_size=args.world_size, partial=bool(autos))
        else:
            names = (*_CONFIG_CHOICES, *_CONFIG_FLAGS)
            choices = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
            try:
                ds = (
                    for_trainer(EngineConfig.from_dict(choices), base=args.base)
                    if args.for_trainer
                    else build_ds_config(
                        EngineConfig.from_dict(choices),
                        world_size=args.world_size if args.world_size is not None else 1,
                        base=args.base,
                        micro_batch_size=args.micro_batch_size,
                        hidden_size=args.hidden_size,
                        resolve=not template,
                    )
                )
            except ConfigError as exc:  # every problem, still on the one error line, in flag terms
                # a problem about the --base file names its JSON keys, which keep their names
                shown = [
                    p if re.search(r"\((in|from) [^)]+\)", p) else _in_flag_terms(p, _CONFIG_FLAG_NAMES)
                    for p in exc.problems
                ]
                if len(shown) < 2:
                    raise CLIError(
                        shown[0] if shown else _in_flag_terms(str(exc), _CONFIG_FLAG_NAMES)
                    ) from None
                listed = " ".join(f"[{i}] {p}" for i, p in enumerate(shown, start=1))
                raise CLIError(f"{len(shown)} configuration problems: {listed}") from None
    if args.validate is None:
        print(json.dumps(ds, indent=2))
        if args.for_trainer:
            print(
                'note: for the Hugging Face Trainer: TrainingArguments(deepspeed="<this file>") fills its '
                '"auto" values from the training arguments and the model',
                file=sys.stderr,
            )
        elif template:
            print(
                'note: no --micro-batch-size, so this is a template: its "auto" values are filled at prepare '
                "(by ds_engine's Engine, or the Hugging Face Trainer)",
                file=sys.stderr,
            )
        return 0
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {args.validate}", file=sys.stderr)
        return 2
    for key in autos:
        if key.endswith("nvme_path"):  # no fact fills a folder: the user names it
            print(f'filled from your NVMe folder: {key} = "auto" (Engine(nvme_path=...) or --nvme-path)')
        else:
            print(f'filled at prepare: {key} = "auto"')
    print(f"OK (a template: {len(autos)} value(s) filled at prepare)" if autos else "OK")
    return 0


# --------------------------------------------------------------------------- estimate
def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="ZeRO-aware memory estimate for every stage/offload choice")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model",
        help="local HF model folder or its config.json: the model is built on the meta device (no memory, "
        "no download) from transformers' own classes only, to count its parameters (this or --params "
        "is required)",
    )
    what.add_argument("--params", help="parameter count, e.g. 1.3e9 or 7B (this or --model is required)")
    p.add_argument(
        "--largest-layer",
        help="parameters of the largest single layer (the one ZeRO-3 gathers); default: counted from "
        "--model, or estimated from --params for a usual transformer (128k vocabulary)",
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=1, help="accelerators per node (default: %(default)s)"
    )
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default: %(default)s)")
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp16", "fp32"],
        help="training precision (default: %(default)s)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "adam", "lion", "adagrad", "sgd_momentum", "sgd"],
        help="sizes the optimizer state (default: %(default)s)",
    )
    p.add_argument(
        "--budget",
        help="memory of one accelerator, e.g. 80GB or 79GiB: adds a `fits` column and recommends the "
        "cheapest choice that fits (least offload, then lowest ZeRO stage); default: none",
    )
    p.add_argument(
        "--host-budget", help="host memory of one node, e.g. 512GB (needs --budget); default: unchecked"
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.2,
        help="fraction kept free on top of the estimate (default: %(default)s)",
    )
    p.add_argument(
        "--no-zero-init",
        action="store_true",
        help="the ZeRO-3 model is not built under zero.Init (the host holds it whole while loading), as "
        'Engine(zero_stage="auto") counts it',
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence: adds the whole-peak column (with --micro-batch; default: none, no column)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per rank per micro-step (default: %(default)s)"
    )
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="layers recompute activations in backward"
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="what --budget is: one GPU's memory (cuda), or one CPU rank's (cpu: accelerator and host are "
        "one memory, no CUDA context) (default: %(default)s)",
    )
    p.add_argument(
        "--recommend",
        action="store_true",
        help="choose the stage/offload with the least communication whose whole peak fits --budget "
        "(needs --seq-len and --budget; margin: --headroom)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="gradient accumulation steps, for the communication table (default: %(default)s)",
    )
    p.add_argument(
        "--bandwidth",
        help="network bandwidth per rank, e.g. 100Gbps or 25GB/s: adds the time each stage's communication "
        "takes per optimizer step (default: none, bytes only)",
    )
    p.set_defaults(func=_run_estimate)


#: memory.py keyword -> the `estimate` flag that sets it (for error messages).
_ESTIMATE_FLAGS = {
    "model_or_num_params": "--params",
    "largest_layer_params": "--largest-layer",
    "num_gpus_per_node": "--gpus-per-node",
    "num_nodes": "--nodes",
    "accelerator_memory_bytes": "--budget",
    "host_memory_bytes": "--host-budget",
    "headroom": "--headroom",
    "precision": "--precision",
    "optimizer": "--optimizer",
    "seq_len": "--seq-len",
    "micro_batch": "--micro-batch",
    "budget_bytes": "--budget",
    "margin": "--headroom",
    "world_size": "--gpus-per-node x --nodes",
    "activation_checkpointing": "--activation-checkpointing",
    "gradient_accumulation_steps": "--grad-accum",
    "device": "--device",
}


_MAX_RANKS = 1_000_000  # accelerators per node, or nodes: beyond it a number is a typo


def _run_estimate(args: argparse.Namespace) -> int:
    import math
    from collections.abc import Callable

    from ds_engine import memory
    from ds_engine._values import parse_size

    def parse(flag: str, text: str | None, parser: Callable[[str], int]) -> int | None:
        if text is None:
            return None
        try:
            return parser(text)
        except ValueError as exc:
            raise CLIError(f"`{flag}` {exc}") from None

    if not math.isfinite(args.headroom) or not 0 <= args.headroom < 10:
        raise CLIError(
            f"`--headroom` {args.headroom!r} is not a fraction from 0 to 10. HINT: e.g. --headroom 0.2 (20 %)"
        )
    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--nodes", args.nodes)):
        if value > _MAX_RANKS:
            raise CLIError(
                f"`{flag}` {value} is more than {_MAX_RANKS:,}, the most this estimate takes. "
                f"HINT: e.g. {flag} 8"
            )
    if args.bandwidth is not None:
        _parse_bandwidth(args.bandwidth)  # checked before anything is printed
    if args.recommend and (args.budget is None or args.seq_len is None):
        raise CLIError(
            "`--recommend` needs `--budget` (memory per accelerator) and `--seq-len`. "
            "HINT: add e.g. --budget 80GB --seq-len 2048"
        )
    if args.host_budget is not None and args.budget is None:
        raise CLIError(
            f"`--host-budget` {args.host_budget!r} needs `--budget` (the accelerator memory) to recommend. "
            "HINT: add e.g. --budget 80GB"
        )
    model: memory.ModelLike = (
        args.model if args.model is not None else parse("--params", args.params, memory.parse_count)
    )
    largest = parse("--largest-layer", args.largest_layer, memory.parse_count)
    budget = parse("--budget", args.budget, parse_size)
    host_budget = parse("--host-budget", args.host_budget, parse_size)
    common: dict[str, Any] = dict(
        largest_layer_params=largest,
        num_gpus_per_node=args.gpus_per_node,
        num_nodes=args.nodes,
        precision=args.precision,
        optimizer=args.optimizer,
        zero_init=not args.no_zero_init,
    )
    try:
        candidates = memory.estimate_all(model, **common)
    except ValueError as exc:
        raise CLIError(_in_flag_terms(str(exc), _ESTIMATE_FLAGS)) from None
    chosen, failure, rec = None, None, None
    if budget is not None:
        try:
            rec = memory.recommend_config(
                candidates[0].num_params,
                accelerator_memory_bytes=budget,
                host_memory_bytes=host_budget,
                headroom=args.headroom,
                **{**common, "largest_layer_params": candidates[0].largest_layer_params},
            )
            chosen = (rec.zero_stage, rec.offload_optimizer, rec.offload_params)
        except ValueError as exc:
            failure = _in_flag_terms(str(exc), _ESTIMATE_FLAGS)
    first = candidates[0]
    print(
        f"model: {memory.format_count(first.num_params)} params, largest layer "
        f"{memory.format_count(first.largest_layer_params)}; {first.num_nodes} node(s) x "
        f"{first.num_gpus_per_node} accelerator(s); {first.precision}, {first.optimizer}"
    )
    peaks = _peaks(model, args, candidates) if args.seq_len is not None else None
    if args.params is not None and largest is None:
        print(
            "largest layer not given: estimated from the count for a usual transformer "
            "(128k-token embedding); pass --largest-layer for your model's"
        )
    header = f"  {'choice':<34} {'per accelerator':>16} {'per host':>12}"
    if peaks is not None:
        header += f" {'whole peak':>12}"
    if budget is not None:
        header += f"  fits (+{args.headroom:.0%})"
    print(header)
    for i, est in enumerate(candidates):
        key = (est.zero_stage, est.offload_optimizer, est.offload_params)
        mark = "*" if key == chosen else " "
        line = (
            f"{mark} {est.label:<34} {memory.format_bytes(est.accelerator.total):>16} "
            f"{memory.format_bytes(est.host.total):>12}"
        )
        if peaks is not None:
            line += f" {memory.format_bytes(peaks[i].accelerator_total):>12}"
        if budget is not None:
            ok = memory.fits(est, budget, host_budget, args.headroom)
            line += f"  {'yes' if ok else 'no':<4}" + ("  <- recommended" if key == chosen else "")
        print(line.rstrip())
    print(
        "per accelerator: model states on one accelerator (16-bit weights and gradients, fp32 master "
        "weights and gradients, optimizer state, as partitioned by the stage), plus under stage 3 the "
        "gathered largest layer and its gradient"
    )
    print(
        "per host: host memory of one node: offloaded states of its ranks, or the loading peak (each "
        "rank's full fp32 copy while the model is built) if larger"
    )
    if peaks is not None:
        print(
            f"whole peak: per accelerator plus activations and logits for micro batch {args.micro_batch} x "
            f"{args.seq_len} tokens, ZeRO-3 gathered weights, buckets, framework and CUDA context"
        )
    if budget is not None:
        print(
            f"fits: model states x (1 + {args.headroom:g}) within --budget (and --host-budget); "
            + memory.CHEAPEST
        )
    if failure is not None:
        raise CLIError(failure)
    if rec is not None:
        print(f"recommended: {rec.reason}")
    _print_communication(first, args)
    if args.recommend:
        _print_plan(model, args, budget)
    return 0


def _peaks(model: Any, args: argparse.Namespace, candidates: list) -> list:
    """`estimate_peak` for every choice of the table (same order)."""
    from ds_engine import memory

    try:
        return [
            memory.estimate_peak(
                model,
                zero_stage=est.zero_stage,
                offload_optimizer=est.offload_optimizer,
                offload_params=est.offload_params,
                micro_batch=args.micro_batch,
                seq_len=args.seq_len,
                world_size=est.num_gpus,
                gpus_per_node=est.num_gpus_per_node,
                activation_checkpointing=args.activation_checkpointing,
                precision=est.precision,
                optimizer=est.optimizer,
                largest_layer_params=est.largest_layer_params,
                zero_init=est.zero_init,
                device=args.device,
            )
            for est in candidates
        ]
    except ValueError as exc:
        raise CLIError(_in_flag_terms(str(exc), _ESTIMATE_FLAGS)) from None


def _print_communication(first: Any, args: argparse.Namespace) -> None:
    """Bytes each rank sends per optimizer step, per stage, and the time at --bandwidth."""
    from ds_engine import memory

    bandwidth = None if args.bandwidth is None else _parse_bandwidth(args.bandwidth)
    try:
        plain, coalesced = (
            memory.communication_per_step(
                first.num_params,
                world_size=first.num_gpus,
                gradient_accumulation_steps=args.grad_accum,
                coalesce=coalesce,
                precision=first.precision,
                trainable_params=first.trainable_params,
            )
            for coalesce in (False, True)
        )
    except ValueError as exc:
        raise CLIError(_in_flag_terms(str(exc), _ESTIMATE_FLAGS)) from None
    print(
        f"communication per optimizer step, bytes each rank sends ({first.num_gpus} ranks, "
        f"gradient accumulation {args.grad_accum}):"
    )
    print(
        f"  {'stage':<7} {'per step':>12} {'coalesced':>12}"
        + (f" {'time':>9} {'coalesced':>9}" if bandwidth else "")
    )
    for stage in (0, 1, 2, 3):
        one, once = plain[stage].total, coalesced[stage].total
        line = f"  stage {stage} {memory.format_bytes(one):>12} {memory.format_bytes(once):>12}"
        if bandwidth:
            line += f" {one / bandwidth:>8.3g}s {once / bandwidth:>8.3g}s"
        print(line)
    print(
        "  ring algorithms: all-reduce 2(N-1)/N x the 16-bit gradients, reduce-scatter and all-gather "
        "(N-1)/N; stages 0 and 1 reduce once per step, stages 2 and 3 on every micro-step unless coalesced "
        "(coalesce_grad_reduction: the `coalesced` column); stages 1 and 2 all-gather the updated "
        "weights; stage 3 all-gathers the weights in forward (and again in backward past "
        "stage3_max_live_parameters) on every micro-step"
    )


_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kKmMgGtT]?)(bps|bit/s|b/s|B/s|Bps)\s*$")


def _parse_bandwidth(text: str) -> float:
    """`100Gbps` / `100Gbit/s` (bits) or `25GB/s` (bytes) -> bytes per second."""
    match = _BANDWIDTH.match(text)
    if not match or float(match.group(1)) <= 0:
        raise CLIError(
            f"`--bandwidth` {text!r} is not a bandwidth. "
            "HINT: e.g. --bandwidth 100Gbps (bits) or 25GB/s (bytes)"
        )
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
    bits = match.group(3) in ("bps", "bit/s", "b/s")
    return float(match.group(1)) * scale / (8 if bits else 1)


def _print_plan(model: Any, args: argparse.Namespace, budget: int | None) -> None:
    """`--recommend`: `choose_zero_stage`'s decision, runner-up and log line."""
    from ds_engine import memory

    if budget is None or args.seq_len is None:
        raise CLIError(
            "`--recommend` needs `--budget` (memory per accelerator) and `--seq-len`. "
            "HINT: add e.g. --budget 80GB --seq-len 2048"
        )
    try:
        plan = memory.choose_zero_stage(
            model,
            world_size=args.gpus_per_node * args.nodes,
            gpus_per_node=args.gpus_per_node,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            budget_bytes=budget,
            margin=args.headroom,
            activation_checkpointing=args.activation_checkpointing,
            precision=args.precision,
            optimizer=args.optimizer,
            device=args.device,
            zero_init=not args.no_zero_init,
        )
    except ValueError as exc:
        raise CLIError(_in_flag_terms(str(exc), _ESTIMATE_FLAGS)) from None
    print(f"choice: {plan.log_line}")
    runner = plan.runner_up
    print(
        "runner-up: "
        + (
            f"{runner.states.label} ({memory.format_bytes(runner.accelerator_total)})"
            if runner
            else "none fits"
        )
    )


# --------------------------------------------------------------------------- launch
def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script on N processes / K nodes (torchrun)",
        description="Run SCRIPT on N processes per node (and K nodes) with torchrun's elastic launcher. "
        "Multi-node: run the same command on every node, either with --nnodes K --node-rank R "
        "--master-addr A --master-port P (static) or with --nnodes K --rdzv-endpoint HOST:PORT (c10d).",
    )
    p.add_argument(
        "--nproc-per-node",
        default="1",
        help="processes on this node: an int, or auto/cpu/gpu (default: %(default)s)",
    )
    p.add_argument(
        "--nnodes", default="1", help="number of nodes, MIN:MAX with --rdzv-endpoint (default: %(default)s)"
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank, static rendezvous (default: 0 on one node)",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="address of node 0, static rendezvous (default: torchrun's, this host)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="port on node 0, static rendezvous (default: torchrun's)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of the c10d rendezvous, elastic (default: static rendezvous)",
    )
    p.add_argument(
        "--rdzv-id", default="ds-engine", help="job id shared by all nodes, elastic (default: %(default)s)"
    )
    p.add_argument(
        "--max-restarts", type=int, default=0, help="restarts after a failure (default: %(default)s)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="preset name (zero3, ...) or DeepSpeed JSON, exported as DS_ENGINE_CONFIG for Engine() "
        "(default: none, the script's own choices)",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from ds_engine.launch import LaunchSpec, launch

    spec = LaunchSpec(
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        config=args.config,
    )
    return launch(spec)


# --------------------------------------------------------------------------- consolidate
def _add_consolidate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consolidate", help="turn a ZeRO checkpoint into a from_pretrained folder, offline")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="folder given to save_checkpoint")
    p.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        help="from_pretrained folder to write, apart from CHECKPOINT_DIR (not it, not inside it, not "
        "holding it); in an existing folder only the files written are replaced, the rest is kept",
    )
    p.add_argument("--tag", default=None, help="tag folder to read (default: the one in `latest`)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="output dtype")
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB, 1GiB")
    p.add_argument("--config-from", default=None, help="folder holding the model's config.json")
    p.set_defaults(func=_run_consolidate)


def _run_consolidate(args: argparse.Namespace) -> int:
    from ds_engine.consolidate import consolidate_checkpoint

    out = consolidate_checkpoint(
        args.checkpoint_dir,
        args.output_dir,
        tag=args.tag,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        config_from=args.config_from,
    )
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- env
def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="versions, the backend `auto` picks, and whether CPU Adam is built")
    p.add_argument("--json", action="store_true", help="print JSON instead of text (default: text)")
    p.set_defaults(func=_run_env)


def _run_env(args: argparse.Namespace) -> int:
    from ds_engine.env import collect_env

    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


# --------------------------------------------------------------------------- plot
def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw a run's metrics.jsonl as a PNG (loss, lr, grad norm, validation)",
        description="Draw METRICS (a run's metrics.jsonl) as one PNG: training loss, learning rate, "
        "gradient norm with skipped steps marked, and validation accuracy/perplexity per evaluation. "
        'Needs matplotlib: pip install "ds-engine[matplotlib]".',
    )
    p.add_argument("metrics", metavar="METRICS", help="the run's metrics.jsonl")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: METRICS with a .png suffix)")
    p.set_defaults(func=_run_plot)


def _run_plot(args: argparse.Namespace) -> int:
    from ds_engine.plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.output)}")
    return 0


# --------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # exact flags only: `--zero-stag 3` is an error
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse's own errors: keep them to one line plus the usage, exit 2.
        self.print_usage(sys.stderr)
        self.exit(2, f"ds-engine: error: {message}\n")


def _did_you_mean(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """ "; did you mean --zero-stage?" for each misspelt flag in `unknown` close to one of `parser`'s."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    return "".join(f"; {hint}" for hint in hints)


def build_parser() -> argparse.ArgumentParser:
    from ds_engine._version import __version__

    parser = _Parser(prog="ds-engine", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_config, _add_estimate, _add_launch, _add_consolidate, _add_env, _add_plot):
        add(sub)
    parser.set_defaults(commands=sub.choices)
    return parser


#: Errors caused by what the user gave (a value, a file, a folder, a missing extra): one line and
#: exit 2. Anything else is a bug in ds_engine and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    CLIError,
    ValueError,  # ConfigError, LaunchError, UnsafeCheckpointError and the plain ones
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    ImportError,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ds-engine` console script."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = args.commands.get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command, unknown)}")
    if args.command != "launch":  # the launched script's Engine decides what its ranks print
        quiet_deepspeed_log()
    try:
        return int(args.func(args) or 0)
    except OSError as exc:
        if not isinstance(exc, USER_ERRORS) and exc.errno not in _DISK_HINTS:
            raise  # not the user's disk or folder: a bug, with its traceback
        message = str(exc).strip().replace("\n", " ")
        if "HINT:" not in message:
            message += " HINT: " + (_DISK_HINTS.get(exc.errno) or _OS_HINTS.get(type(exc), "check that path"))
        print(f"ds-engine: error: {message}", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:
        message = str(exc).strip().replace("\n", " ")
        print(f"ds-engine: error: {message}", file=sys.stderr)
        return 2


#: What the disk or folder said (errno) -> the fix: errors of the user's machine, not of ds_engine.
_DISK_HINTS: dict[int | None, str] = {
    errno.ENOSPC: "free space on that filesystem, or write somewhere with room; nothing partial was left",
    errno.EDQUOT: "your disk quota is used up; free some, or write somewhere else",
    errno.EROFS: "that filesystem is mounted read-only; write somewhere else",
    errno.EACCES: "check the permissions of that path (or run where you may read/write it)",
    errno.EPERM: "check the permissions of that path (or run where you may read/write it)",
}


_OS_HINTS: dict[type[BaseException], str] = {
    FileNotFoundError: "check the path (relative paths start from the current folder)",
    FileExistsError: "choose another path, or move the existing one away",
    IsADirectoryError: "a folder stands where a file belongs; remove or rename it",
    NotADirectoryError: "a file stands where a folder belongs; check the path",
    PermissionError: "check the permissions of that path (or run where you may read/write it)",
}


if __name__ == "__main__":
    sys.exit(main())
