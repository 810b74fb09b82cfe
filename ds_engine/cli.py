"""`ds-engine` command line: config | estimate | launch | consolidate | env.

Every user mistake ends with exit status 2 and a one-line `ds-engine: error: ...` message
(no traceback). Each subcommand's work lives in the module it belongs to; this file only
parses arguments and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


class CLIError(Exception):
    """A user error the CLI reports in one line with exit status 2."""


# --------------------------------------------------------------------------- config
_CONFIG_CHOICES: dict[str, tuple[type, dict]] = {
    # EngineConfig field -> (argparse type, extra add_argument kwargs); only given flags are explicit.
    "zero_stage": (int, {"choices": [0, 1, 2, 3]}),
    "precision": (str, {"choices": ["fp32", "fp16", "bf16"]}),
    "gradient_accumulation_steps": (int, {}),
    "gradient_clipping": (float, {}),
    "offload_optimizer": (str, {"choices": ["none", "cpu", "nvme"]}),
    "offload_params": (str, {"choices": ["none", "cpu", "nvme"]}),
    "nvme_path": (str, {}),
    "loss_scale": (float, {}),
    "initial_scale_power": (int, {}),
    "reduce_bucket_size": (int, {}),
    "allgather_bucket_size": (int, {}),
    "stage3_prefetch_bucket_size": (int, {}),
    "stage3_param_persistence_threshold": (int, {}),
    "stage3_max_live_parameters": (int, {}),
    "steps_per_print": (int, {}),
}
_CONFIG_FLAGS = ("overlap_comm", "contiguous_gradients", "pin_memory", "activation_checkpointing")


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="build (or --validate) a DeepSpeed JSON config")
    for name, (typ, extra) in _CONFIG_CHOICES.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, **extra)
    for name in _CONFIG_FLAGS:
        p.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=None, action=argparse.BooleanOptionalAction
        )
    p.add_argument("--micro-batch-size", type=int, default=None, help="per-rank micro batch size")
    p.add_argument("--base", default=None, help="a DeepSpeed JSON file or a preset name (e.g. zero3)")
    p.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default 1)")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size for auto bucket sizes")
    p.add_argument("--validate", metavar="FILE", default=None, help="check FILE and print every problem")
    p.set_defaults(func=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    from ds_engine.config import EngineConfig, load_json_config
    from ds_engine.ds_config import build_ds_config, validate_ds_config

    if args.validate is not None:
        problems = validate_ds_config(load_json_config(args.validate), world_size=args.world_size)
        for problem in problems:
            print(problem)
        if problems:
            print(f"{len(problems)} problem(s) in {args.validate}", file=sys.stderr)
            return 2
        print("OK")
        return 0
    names = (*_CONFIG_CHOICES, *_CONFIG_FLAGS)
    choices = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    config = EngineConfig.from_dict(choices)
    ds = build_ds_config(
        config,
        world_size=args.world_size if args.world_size is not None else 1,
        base=args.base,
        micro_batch_size=args.micro_batch_size,
        hidden_size=args.hidden_size,
    )
    print(json.dumps(ds, indent=2))
    return 0


# --------------------------------------------------------------------------- estimate
def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="ZeRO-aware memory estimate for every stage/offload choice")
    p.set_defaults(func=_run_estimate)


def _run_estimate(args: argparse.Namespace) -> int:
    raise CLIError("`ds-engine estimate` is not available yet")


# --------------------------------------------------------------------------- launch
def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script on N processes / K nodes (torchrun)",
        description="Run SCRIPT on N processes per node (and K nodes) with torchrun's elastic launcher. "
        "Multi-node: run the same command on every node, either with --nnodes K --node-rank R "
        "--master-addr A --master-port P (static) or with --nnodes K --rdzv-endpoint HOST:PORT (c10d).",
    )
    p.add_argument("--nproc-per-node", default="1", help="processes on this node (int, or auto/cpu/gpu)")
    p.add_argument("--nnodes", default="1", help="number of nodes (MIN:MAX with --rdzv-endpoint)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--master-addr", default=None, help="address of node 0 (static rendezvous)")
    p.add_argument("--master-port", type=int, default=None, help="port on node 0 (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (elastic)")
    p.add_argument("--rdzv-id", default="ds-engine", help="job id shared by all nodes (elastic)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure (default 0)")
    p.add_argument(
        "--config",
        default=None,
        help="preset name (zero3, ...) or DeepSpeed JSON; exported as DS_ENGINE_CONFIG for Engine()",
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
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="from_pretrained folder to write")
    p.add_argument("--tag", default=None, help="tag folder to read (default: the one in `latest`)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="output dtype")
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB, 1GiB")
    p.add_argument("--config-from", default=None, help="folder holding the model's config.json")
    p.set_defaults(func=_run_consolidate)


def _run_consolidate(args: argparse.Namespace) -> int:
    from ds_engine.checkpoint import consolidate_checkpoint

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
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
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


# --------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors: keep them to one line plus the usage, exit 2.
        self.print_usage(sys.stderr)
        self.exit(2, f"ds-engine: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ds-engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_config, _add_estimate, _add_launch, _add_consolidate, _add_env):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ds-engine` console script."""
    from ds_engine.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ConfigError, FileNotFoundError, ValueError, ImportError) as exc:
        message = str(exc).strip().replace("\n", " ")
        print(f"ds-engine: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
