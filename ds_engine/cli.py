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
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ds_engine._cli_errors import CLIError, _in_flag_terms
from ds_engine._console import quiet_deepspeed_log
from ds_engine.cli_estimate import _add_estimate

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
        self.exit(2, f"ds-engine: error: {message}{self._command_hint(message)}\n")

    def _command_hint(self, message: str) -> str:
        """ "; did you mean config?" for a misspelt command."""
        typed = re.search(r"invalid choice: '([^']*)'", message)
        commands = [c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
        close = difflib.get_close_matches(typed.group(1), commands, n=1, cutoff=0.6) if typed else []
        return f"; did you mean {close[0]}?" if close else ""


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def _did_you_mean(
    parser: argparse.ArgumentParser, unknown: Sequence[str], commands: Mapping[str, Any] | None = None
) -> str:
    """ "; did you mean --zero-stage?" for each misspelt flag in `unknown` close to one of `parser`'s,
    or which other command has it ("--zero-stage is an option of `ds-engine config`, ...")."""
    options = _long_options(parser)
    hints = []
    for arg in unknown:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
        longer = [o for o in options if o.startswith(flag + "-")]
        if close or len(longer) == 1:
            hints.append(f"{flag}: did you mean {(close or longer)[0]}?")
            continue
        elsewhere = [
            name
            for name, other in (commands or {}).items()
            if other is not parser and flag in _long_options(other)
        ]
        if elsewhere:
            names = ", ".join(f"`ds-engine {name}`" for name in elsewhere)
            hints.append(f"{flag} is an option of {names}, not of `{parser.prog}`")
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
        hints = _did_you_mean(command, unknown, args.commands)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")
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
