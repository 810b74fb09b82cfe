"""Run a training script on N processes per node and K nodes, on top of torchrun.

`ds-engine launch` is a thin, checked front end to PyTorch's elastic launcher
(`torch.distributed.run`): it validates what it can see before anything starts (the
script, the node layout, the DeepSpeed config), builds torchrun's own argument list, and
calls torchrun in-process. Multi-node runs therefore behave exactly as PyTorch users know:

* static rendezvous: every node runs
  `ds-engine launch --nnodes K --node-rank R --master-addr A --master-port P ...`;
* elastic (c10d) rendezvous: every node runs
  `ds-engine launch --nnodes K --rdzv-endpoint HOST:PORT ...` and ranks are assigned;
* inside a Slurm job step (`srun ds-engine launch ... script.py`, one launcher per node) or a
  PyTorchJob pod, what the command line leaves out comes from the cluster's variables
  (`ds_engine.slurm`), and one line says what was taken.

With `--config`, the absolute path of the DeepSpeed JSON is exported to the workers as
`DS_ENGINE_CONFIG`, which `Engine()` (constructed without a config) picks up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_engine._values import no_duplicate_keys
from ds_engine.ds_config import PRESETS, preset_path
from ds_engine.engine_env import CONFIG_ENV  # through it `--config` reaches `Engine()` in every worker
from ds_engine.preemption import PREEMPTED_EXIT_CODE
from ds_engine.slurm import cluster_flags

_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


class LaunchError(ValueError):
    """A launch request that cannot work; raised before any process starts."""


@dataclass(kw_only=True, slots=True)
class LaunchSpec:
    """What to run and where (the arguments of `ds-engine launch`)."""

    script: str
    """Path of the training script (a Python file)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed to the script unchanged."""
    nproc_per_node: str = "1"
    """Processes per node: a positive integer, or torchrun's `auto`/`cpu`/`gpu`/`xpu`."""
    nnodes: str = "1"
    """Number of nodes, or `MIN:MAX` for an elastic (`--rdzv-endpoint`) run."""
    node_rank: int | None = None
    """This node's rank (static rendezvous with `--master-addr`)."""
    master_addr: str | None = None
    """Address of node 0 (static rendezvous)."""
    master_port: int | None = None
    """Port on node 0 (static rendezvous); torchrun's default 29500 when only the address is given."""
    rdzv_endpoint: str | None = None
    """`HOST:PORT` of the c10d rendezvous store (elastic rendezvous)."""
    rdzv_id: str = "ds-engine"
    """Job id shared by all nodes of one elastic run."""
    max_restarts: int = 0
    """How often torchrun restarts the group after a failure (0: a failing rank ends the run)."""
    config: str | None = None
    """A preset name (`zero3`, ...) or a DeepSpeed JSON file, exported as `DS_ENGINE_CONFIG`."""


def available_presets() -> list[str]:
    """Names of the preset DeepSpeed configs shipped in the package (`ds_engine/configs/`)."""
    return sorted(PRESETS)


def resolve_config(value: str) -> Path:
    """Turn `--config PRESET_OR_JSON` into the absolute path of a readable JSON object.

    Args:
        value: a preset name such as `zero3`, or the path of a DeepSpeed JSON file.

    Returns:
        The absolute path of the JSON file.

    Raises:
        LaunchError: the file does not exist or is not a JSON object.
        ConfigError: the name is no preset (`ds_config.preset_path` lists them).
    """
    path = Path(value).expanduser()
    looks_like_path = path.suffix == ".json" or os.sep in value or path.exists()
    if looks_like_path:
        if not path.is_file():
            raise LaunchError(
                f"`--config` {value!r}: no such file. "
                f"HINT: give an existing DeepSpeed JSON or a preset ({', '.join(available_presets())})"
            )
    else:
        path = preset_path(value)  # importlib.resources; a ConfigError names the presets
    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicate_keys(f"`--config` {str(path)!r}"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise LaunchError(
            f"`--config` {str(path)!r} is not valid JSON ({exc}). "
            "HINT: fix the file, or build one with `ds-engine config`"
        ) from None
    except ValueError as exc:  # a key written twice
        raise LaunchError(str(exc)) from None
    if not isinstance(data, dict):
        raise LaunchError(
            f"`--config` {str(path)!r} holds a JSON {type(data).__name__}, not an object. "
            "HINT: a DeepSpeed config is a JSON object such as {'zero_optimization': {'stage': 3}}"
        )
    return path.resolve()


def _check_host_port(value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(
            f"`--rdzv-endpoint` {value!r} is not HOST:PORT. HINT: e.g. --rdzv-endpoint node0.example:29400"
        )


def with_cluster_flags(spec: LaunchSpec, environ: Mapping[str, str]) -> LaunchSpec:
    """`spec` completed from a Slurm job step or a PyTorchJob pod (`ds_engine.slurm.cluster_flags`);
    prints one INFO line to stderr saying what was taken, when anything was.

    Raises:
        SlurmError: a Slurm variable cannot be read (naming it and its value).
    """
    changes, taken = cluster_flags(spec, environ)
    if taken is None:
        return spec
    print(f"ds-engine launch: INFO: {taken}", file=sys.stderr, flush=True)
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def validate(spec: LaunchSpec) -> None:
    """Check a launch request before anything starts.

    Raises:
        LaunchError: naming the option, its value, what is allowed, and one fix.
    """
    script = Path(spec.script)
    if not script.is_file():
        raise LaunchError(
            f"`SCRIPT` {spec.script!r}: no such file. HINT: give the path of your training script, "
            "e.g. ds-engine launch --nproc-per-node 2 scripts/examples/finetune_classification.py"
        )
    nproc = spec.nproc_per_node
    if not (nproc in _NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1)):
        raise LaunchError(
            f"`--nproc-per-node` {nproc!r} is not allowed; use a positive integer or one of "
            f"{', '.join(_NPROC_WORDS)}. HINT: --nproc-per-node 2"
        )
    elastic = spec.rdzv_endpoint is not None
    if not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", spec.nnodes):
        raise LaunchError(f"`--nnodes` {spec.nnodes!r} is not N or MIN:MAX. HINT: --nnodes 2")
    if ":" in spec.nnodes:
        low, high = (int(x) for x in spec.nnodes.split(":"))
        if not elastic:
            raise LaunchError(
                f"`--nnodes` {spec.nnodes!r}: a MIN:MAX range needs elastic rendezvous. "
                "HINT: add --rdzv-endpoint HOST:PORT, or give a fixed --nnodes"
            )
        if low > high:
            raise LaunchError(f"`--nnodes` {spec.nnodes!r}: MIN is larger than MAX. HINT: --nnodes 1:{low}")
        max_nodes = high
    else:
        max_nodes = int(spec.nnodes)
    if elastic:
        static_opts = [
            name
            for name, v in (
                ("--master-addr", spec.master_addr),
                ("--master-port", spec.master_port),
                ("--node-rank", spec.node_rank),
            )
            if v is not None
        ]
        if static_opts:
            raise LaunchError(
                f"`--rdzv-endpoint` cannot be combined with {', '.join(f'`{o}`' for o in static_opts)} "
                "(c10d rendezvous assigns node ranks itself). "
                "HINT: use either --rdzv-endpoint HOST:PORT or --master-addr/--master-port/--node-rank"
            )
        _check_host_port(str(spec.rdzv_endpoint))
    elif max_nodes > 1 and (spec.master_addr is None or spec.node_rank is None):
        raise LaunchError(
            f"`--nnodes` {spec.nnodes}: a multi-node run needs `--master-addr` and `--node-rank` "
            "(or `--rdzv-endpoint`). "
            "HINT: on node R run --nnodes N --node-rank R --master-addr NODE0 --master-port 29500"
        )
    if spec.node_rank is not None and not 0 <= spec.node_rank < max_nodes:
        raise LaunchError(
            f"`--node-rank` {spec.node_rank} is outside 0..{max_nodes - 1} for --nnodes {spec.nnodes}. "
            f"HINT: node ranks run from 0 to {max_nodes - 1}"
        )
    if spec.master_port is not None and not 0 < spec.master_port < 65536:
        raise LaunchError(
            f"`--master-port` {spec.master_port} is not a TCP port (1-65535). HINT: --master-port 29500"
        )
    if spec.max_restarts < 0:
        raise LaunchError(f"`--max-restarts` {spec.max_restarts} is negative. HINT: --max-restarts 0")
    if spec.config is not None:
        resolve_config(spec.config)


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """The argument list `torch.distributed.run` gets for `spec` (script and its args last)."""
    args = [
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--nnodes={spec.nnodes}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if spec.rdzv_endpoint is not None:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
    elif (
        spec.max_restarts > 0
        and spec.nnodes == "1"
        and (spec.master_addr, spec.master_port, spec.node_rank) == (None, None, None)
    ):
        # A restart needs a fresh rendezvous round: under static rendezvous the restarted group
        # reads the previous group's gloo addresses from the reused store and never connects.
        # torchrun's `--standalone` (c10d on a free local port) starts a new round per restart.
        args.append("--standalone")
    else:
        # Static rendezvous. With neither address nor port on one node, torchrun itself
        # picks a free local port (c10d on localhost:0), so parallel jobs do not collide.
        if spec.node_rank is not None:
            args.append(f"--node-rank={spec.node_rank}")
        if spec.master_addr is not None:
            args.append(f"--master-addr={spec.master_addr}")
        if spec.master_port is not None:
            args.append(f"--master-port={spec.master_port}")
    return [*args, str(spec.script), *spec.script_args]


def _loopback_interface() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _is_local_run(spec: LaunchSpec) -> bool:
    if spec.rdzv_endpoint is not None:
        host = spec.rdzv_endpoint.rpartition(":")[0]
        return host in ("localhost", "127.0.0.1", "::1", "[::1]")
    if spec.master_addr is None:
        return spec.nnodes == "1"
    return spec.master_addr in ("localhost", "127.0.0.1", "::1")


def worker_env(spec: LaunchSpec, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables the launch adds for its workers (never overriding the user's).

    * `OMP_NUM_THREADS`: the node's cores shared among its processes (at least 1), so N ranks do
      not each start one thread per core.
    * `GLOO_SOCKET_IFNAME`: the loopback interface when every rank is on this machine (gloo
      otherwise binds the address the host name resolves to, which may be unreachable). On a real
      multi-node run it is left to the user, who knows which interface connects the nodes.
    * `DS_ENGINE_CONFIG`: the absolute path of `--config`, read by `Engine()`.
    * `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` with an elastic `--nnodes MIN:MAX`: torchrun's shared
      store publishes the workers' master address in the first round only, so a node that joins
      a later round waits for it and fails after a minute; without sharing, every round
      publishes it.
    """
    environ = os.environ if environ is None else environ
    added: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in environ:
        nproc = int(spec.nproc_per_node) if spec.nproc_per_node.isdigit() else 1
        added["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, nproc)))
    if "GLOO_SOCKET_IFNAME" not in environ and _is_local_run(spec):
        loopback = _loopback_interface()
        if loopback is not None:
            added["GLOO_SOCKET_IFNAME"] = loopback
    if spec.config is not None:
        added[CONFIG_ENV] = str(resolve_config(spec.config))
    if ":" in spec.nnodes and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        added["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return added


@contextlib.contextmanager
def _environment(added: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# How a rank ends when it is the consequence of another rank's failure: SIGTERM is torchrun
# stopping the survivors; SIGABRT is how c10d/gloo threads end a process whose peer vanished.
_CONSEQUENTIAL_SIGNALS = {"SIGTERM": 2, "SIGABRT": 1}
#: Seconds by which such a death must precede every other failure to be named as the cause: the
#: failing rank's process may still be exiting (its traceback printed, its group torn down, which
#: is what aborts its peers) when a peer's abort is recorded.
_CONSEQUENCE_DELAY_S = 5


def _recorded(failure: Any) -> dict[str, Any] | None:
    """What a rank wrote into torchrun's error file before it ended (its exception), or None."""
    data = getattr(failure, "error_file_data", None)
    if not isinstance(data, dict) or not isinstance(data.get("message"), dict):
        return None
    text = str(data["message"].get("message") or "").strip().splitlines()
    if not text:
        return None
    first = text[0]
    ours = data.get("ds_engine")
    if not isinstance(ours, dict):
        ours = {}
    when = ours.get("time")
    return {
        "message": first,
        "time": float(when) if isinstance(when, (int, float)) else float(failure.timestamp),
        "peer_failure": ours.get("peer_failure") is True,
    }


def _how(failure: Any, limit: int = 300) -> str:
    recorded = _recorded(failure)
    if recorded is not None:
        text = recorded["message"]
        return f"raised {text if len(text) <= limit else text[: limit - 3] + '...'}"
    code = failure.exitcode
    return f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"


def _failure_message(exc: Exception) -> str:
    failures = getattr(exc, "failures", None) or {}
    if not failures:
        return f"the launch failed: {exc}"

    def order(rank: int) -> tuple[float, int, int]:
        failure = failures[rank]
        recorded = _recorded(failure)
        if recorded is not None:  # it raised: when, exactly, and whether only a peer's loss
            consequence = 1 if recorded["peer_failure"] else 0
            return recorded["time"] + (_CONSEQUENCE_DELAY_S if consequence else 0), consequence, rank
        signal = failure.signal_name() if failure.exitcode < 0 else ""
        consequence = _CONSEQUENTIAL_SIGNALS.get(signal, 0)
        # torchrun stamps failures in whole seconds, and a rank that raised without recording
        # it is stamped when its process has exited, after the peers it aborted: name the
        # failure that is not the usual consequence of another's unless that consequence came
        # clearly first.
        return failure.timestamp + (_CONSEQUENCE_DELAY_S if consequence else 0), consequence, rank

    rank, *others = sorted(failures, key=order)
    failure = failures[rank]
    tail = "; ".join(f"rank {r} {_how(failures[r], limit=100)}" for r in sorted(others))
    tail = f" (also failed: {tail})" if tail else ""
    return (
        f"rank {rank} (local rank {failure.local_rank}) {_how(failure)}{tail}; the other ranks were "
        "stopped. Its traceback is in the output above."
    )


#: Signals the launcher forwards to its workers (torchrun's own four, plus the two that batch
#: systems send ahead of a preemption, e.g. Slurm's ``--signal=USR1@120``).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
#: Seconds the launcher, once signalled, waits for its workers (their preemption save) before
#: SIGKILL, unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise; the batch system's own grace
#: period (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds) bounds it anyway.
SHUTDOWN_TIMEOUT_S = 300


def _preempted_message(report: Path) -> str | None:
    """What the workers' preemption report (`ds_engine.autosave.REPORT_ENV`) says, or None."""
    try:
        saved = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    return (
        f"the run was preempted ({saved.get('signal')}): every rank saved optimizer step {saved.get('step')} "
        f"to {saved.get('folder')!r} and exited with status {PREEMPTED_EXIT_CODE}. Run the same command "
        "again to resume from it."
    )


def launch(spec: LaunchSpec) -> int:
    """Validate `spec`, then run it with torchrun's elastic launcher in this process.

    A signal to the launcher (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) is forwarded to
    every worker; the launcher then waits up to `SHUTDOWN_TIMEOUT_S` (or
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT) for them, time for `engine.autosave`'s preemption save.

    Args:
        spec: what to run and where.

    Returns:
        0 when every rank finished; 143 (`PREEMPTED_EXIT_CODE`) when the run was preempted and its
        ranks saved a checkpoint (`engine.autosave`), or when every failed rank exited with 143;
        128 + the signal's number when the launcher was stopped by a signal and no save was
        reported; 1 when a rank failed (torchrun has then stopped the others and a one-line
        summary was printed to stderr).

    Raises:
        LaunchError: the request cannot work (nothing was started).
        SlurmError: a Slurm variable cannot be read (nothing was started).
    """
    spec = with_cluster_flags(spec, os.environ)
    validate(spec)
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from ds_engine.autosave import REPORT_ENV

    torchrun_ns = get_args_parser().parse_args(torchrun_args(spec))
    torchrun_ns.signals_to_handle = FORWARDED_SIGNALS
    if torchrun_ns.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        torchrun_ns.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="ds_engine_launch_") as scratch:
        report = Path(scratch) / "preempted.json"
        with _environment({**worker_env(spec), REPORT_ENV: str(report)}):
            try:
                torchrun(torchrun_ns)
            except ChildFailedError as exc:
                codes = {f.exitcode for f in (getattr(exc, "failures", None) or {}).values()}
                preempted = _preempted_message(report)
                # the first rank to exit 143 makes torchrun stop the others with SIGTERM: a rank
                # past its save may end by that signal instead of its own 143
                if preempted is None and codes == {PREEMPTED_EXIT_CODE}:
                    preempted = f"every rank exited with status {PREEMPTED_EXIT_CODE} (preempted)."
                stopped = {PREEMPTED_EXIT_CODE, -15}  # 143, or SIGTERM from torchrun after the save
                if preempted is not None and PREEMPTED_EXIT_CODE in codes and codes <= stopped:
                    print(f"ds-engine launch: {preempted}", file=sys.stderr, flush=True)
                    return PREEMPTED_EXIT_CODE
                print(f"ds-engine launch: {_failure_message(exc)}", file=sys.stderr, flush=True)
                return 1
            except SignalException as exc:
                preempted = _preempted_message(report)
                if preempted is not None:
                    print(f"ds-engine launch: {preempted}", file=sys.stderr, flush=True)
                    return PREEMPTED_EXIT_CODE
                print(
                    f"ds-engine launch: received {exc.sigval.name} and forwarded it to the workers; they "
                    "stopped without reporting a saved checkpoint (a script saves on preemption with "
                    "`engine.autosave(directory)`).",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 + int(exc.sigval)
    return 0
