"""`ds-engine estimate`: its options, and the memory, communication and stage tables it prints.

The arithmetic is `ds_engine.memory`'s; this module parses the flags, names them in errors and
lays out the tables.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from ds_engine._cli_errors import CLIError, _in_flag_terms

__all__ = ["_add_estimate"]


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
