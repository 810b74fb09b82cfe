"""What `ds-engine launch` takes from the cluster it runs in: a Slurm job step, or the
variables Kubernetes' PyTorch operator sets.

Under `srun ds-engine launch ... script.py` (one launcher per node) the node layout comes from
the job step: the number of nodes (`SLURM_STEP_NUM_NODES`, else `SLURM_NNODES`), this node's
rank (`SLURM_NODEID`), the master address (the first host of `SLURM_STEP_NODELIST`, else
`SLURM_JOB_NODELIST`: a compressed host list such as `gpu[01-04,07]`, expanded by
`scontrol show hostnames` when it is on PATH, else by `expand_hostlist`), a port derived from
the job id (`port_for_job`), and the processes per node (the node's GPUs, else
`SLURM_NTASKS_PER_NODE`). In a pod of a PyTorchJob the operator's `PET_NNODES`, `PET_NODE_RANK`,
`PET_MASTER_ADDR`, `PET_MASTER_PORT` and `PET_NPROC_PER_NODE` (torchrun's own environment
names for its options), or with an `elasticPolicy` `PET_RDZV_ENDPOINT`, `PET_RDZV_ID`,
`PET_NNODES` (MIN:MAX) and `PET_MAX_RESTARTS`, are read the same way. A flag given on the
command line always wins.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Protocol

__all__ = [
    "NodeLayout",
    "SlurmError",
    "cluster_flags",
    "expand_hostlist",
    "first_host",
    "port_for_job",
]

#: Ports derived from a job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's
#: ephemeral range (32768-60999), so a port chosen by the kernel for another socket never collides.
PORT_BASE = 15000
PORT_SPAN = 15000


class NodeLayout(Protocol):
    """The launch options the cluster may fill (`ds_engine.launch.LaunchSpec` has them)."""

    nnodes: str
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    nproc_per_node: str
    rdzv_endpoint: str | None
    rdzv_id: str
    max_restarts: int


class SlurmError(ValueError):
    """A Slurm (or PyTorchJob `PET_*`) variable ds-engine launch cannot read; raised before any
    process starts."""


def _expand_range(text: str, hostlist: str) -> list[str]:
    """`01-04` -> ['01', '02', '03', '04'] (zero padding kept); `7` -> ['7']."""
    low, sep, high = text.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise SlurmError(
            f"SLURM host list {hostlist!r}: {text!r} is not a number or a range LOW-HIGH. "
            "HINT: a host list looks like gpu[01-04,07],login1"
        )
    if not sep:
        return [low]
    if int(high) < int(low):
        raise SlurmError(
            f"SLURM host list {hostlist!r}: the range {text!r} runs backwards. HINT: write it {high}-{low}"
        )
    width = len(low) if low.startswith("0") or len(low) == len(high) else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_host(pattern: str, hostlist: str) -> list[str]:
    """One host expression (`gpu[01-02]-ib[1,3]`) -> every host it names, in order."""
    hosts = [""]
    rest = pattern
    while rest:
        bracket = rest.find("[")
        if bracket < 0:
            if "]" in rest:
                raise SlurmError(
                    f"SLURM host list {hostlist!r}: a ']' without its '['. HINT: check the brackets"
                )
            return [h + rest for h in hosts]
        close = rest.find("]", bracket)
        if close < 0 or "[" in rest[bracket + 1 : close] or "]" in rest[:bracket]:
            raise SlurmError(f"SLURM host list {hostlist!r}: unbalanced brackets. HINT: check the brackets")
        inner = rest[bracket + 1 : close]
        if not inner:
            raise SlurmError(f"SLURM host list {hostlist!r}: empty brackets '[]'. HINT: gpu[01-04]")
        values = [v for part in inner.split(",") for v in _expand_range(part.strip(), hostlist)]
        prefix = rest[:bracket]
        hosts = [h + prefix + v for h in hosts for v in values]
        rest = rest[close + 1 :]
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    return parts


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compressed host list into host names, in Slurm's order.

    `gpu[01-03,07],login1` -> `['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']`; zero padding is
    kept (`n[08-10]` -> n08, n09, n10), and several bracketed parts multiply
    (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2).

    Raises:
        SlurmError: the list is empty or malformed (naming the value).
    """
    text = hostlist.strip()
    if not text:
        raise SlurmError("SLURM host list is empty. HINT: run inside a Slurm allocation (srun / sbatch)")
    hosts: list[str] = []
    for part in _split_top_level(text):
        part = part.strip()
        if not part or any(c.isspace() for c in part):
            raise SlurmError(
                f"SLURM host list {hostlist!r}: an empty or blank host name. HINT: a host list looks like "
                "gpu[01-04,07],login1"
            )
        hosts += _expand_host(part, hostlist)
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a Slurm host list: `scontrol show hostnames` when it is on PATH, else
    `expand_hostlist` (the same answer, for the lists both read).

    Raises:
        SlurmError: the list is malformed, or scontrol rejected it (naming the value).
    """
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(
                f"`scontrol show hostnames {hostlist}` failed ({exc}). "
                "HINT: check the Slurm client on this node"
            ) from None
        names = result.stdout.split()
        if result.returncode != 0 or not names:
            raise SlurmError(
                f"`scontrol show hostnames {hostlist}` failed (exit {result.returncode}: "
                f"{result.stderr.strip() or 'no host names'}). HINT: check SLURM_JOB_NODELIST"
            )
        return names[0]
    return expand_hostlist(hostlist)[0]


def port_for_job(job_id: str) -> int:
    """The master port of a Slurm job: PORT_BASE + job id modulo PORT_SPAN (every node of the
    job computes the same one; two jobs sharing a first node differ unless their ids are
    PORT_SPAN apart)."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def _count(name: str, value: str) -> int:
    """`SLURM_NTASKS_PER_NODE`-style values: `8`, `8(x2)`, `8,4` -> the first count."""
    match = re.fullmatch(r"\s*(\d+)(?:\(x\d+\))?(?:,.*)?", value)
    if not match or int(match.group(1)) < 1:
        raise SlurmError(
            f"{name}={value!r} is not a positive count. HINT: unset it, or pass the flag yourself"
        )
    return int(match.group(1))


def _integer(name: str, value: str) -> int:
    if not value.strip().isdigit():
        raise SlurmError(
            f"{name}={value!r} is not a non-negative integer. HINT: unset it, or pass the flag yourself"
        )
    return int(value)


def _gpus_on_node(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(name, "").strip()
        if value:
            # SLURM_GPUS_PER_NODE may name a type: "a100:4"
            count = value.rpartition(":")[2]
            if count.isdigit() and int(count) > 0:
                return int(count)
    return None


def _slurm(spec: NodeLayout, environ: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    changes: dict[str, object] = {}
    taken: list[str] = []
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID", "")
    nodes_name = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in environ else "SLURM_NNODES"
    nodes = _integer(nodes_name, environ.get(nodes_name, "1"))
    launchers = environ.get("SLURM_STEP_NUM_TASKS")
    if launchers is not None and _integer("SLURM_STEP_NUM_TASKS", launchers) != nodes:
        raise SlurmError(
            f"srun started SLURM_STEP_NUM_TASKS={launchers} launchers on {nodes} node(s); ds-engine launch "
            "starts the processes of its node itself, so run one per node. HINT: srun --ntasks-per-node=1 "
            "ds-engine launch ..."
        )
    elastic = spec.rdzv_endpoint is not None
    if spec.nnodes == "1" and nodes > 1 and not elastic:
        changes["nnodes"] = str(nodes)
        taken.append(f"nnodes={nodes} ({nodes_name})")
    multi_node = nodes > 1 and not elastic and changes.get("nnodes", spec.nnodes) != "1"
    if multi_node and spec.node_rank is None:
        rank = _integer("SLURM_NODEID", environ.get("SLURM_NODEID", "0"))
        changes["node_rank"] = rank
        taken.append(f"node_rank={rank} (SLURM_NODEID)")
    if multi_node and spec.master_addr is None:
        list_name = next(
            (n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if environ.get(n)),
            None,
        )
        if list_name is None:
            raise SlurmError(
                "a Slurm job step without SLURM_JOB_NODELIST: the master address is unknown. "
                "HINT: pass --master-addr yourself"
            )
        host = first_host(environ[list_name])
        changes["master_addr"] = host
        taken.append(f"master_addr={host} (first host of {list_name}={environ[list_name]})")
    if multi_node and spec.master_port is None and job_id:
        port = port_for_job(str(_integer("SLURM_JOB_ID", job_id)))
        changes["master_port"] = port
        taken.append(f"master_port={port} (from SLURM_JOB_ID={job_id})")
    if spec.nproc_per_node == "1":
        # one launcher per node starts a process per GPU; without GPUs, the job's tasks per node
        # (`--ntasks-per-node` of sbatch, when the step was started with one task per node)
        gpus = _gpus_on_node(environ)
        per_node = environ.get("SLURM_NTASKS_PER_NODE")
        if gpus:
            count, source = gpus, "the node's GPUs, SLURM_GPUS_ON_NODE/SLURM_GPUS_PER_NODE"
        elif per_node:
            count, source = _count("SLURM_NTASKS_PER_NODE", per_node), "SLURM_NTASKS_PER_NODE"
        else:
            count, source = 1, ""
        if count != 1:
            changes["nproc_per_node"] = str(count)
            taken.append(f"nproc_per_node={count} ({source})")
    return changes, taken


#: torchrun's environment names for its options, as the PyTorch operator sets them in a pod.
_PET_STATIC = {
    "nnodes": "PET_NNODES",
    "node_rank": "PET_NODE_RANK",
    "master_addr": "PET_MASTER_ADDR",
    "master_port": "PET_MASTER_PORT",
    "nproc_per_node": "PET_NPROC_PER_NODE",
}
#: ... and those of a PyTorchJob with an `elasticPolicy` (c10d rendezvous).
_PET_ELASTIC = {
    "rdzv_endpoint": "PET_RDZV_ENDPOINT",
    "rdzv_id": "PET_RDZV_ID",
    "nnodes": "PET_NNODES",
    "max_restarts": "PET_MAX_RESTARTS",
    "nproc_per_node": "PET_NPROC_PER_NODE",
}
_DEFAULTS: dict[str, object] = {
    "nnodes": "1",
    "node_rank": None,
    "master_addr": None,
    "master_port": None,
    "nproc_per_node": "1",
    "rdzv_endpoint": None,
    "rdzv_id": "ds-engine",
    "max_restarts": 0,
}


def _operator(spec: NodeLayout, environ: Mapping[str, str]) -> tuple[dict[str, object], list[str]]:
    changes: dict[str, object] = {}
    taken: list[str] = []
    static_given = any(getattr(spec, a) is not None for a in ("node_rank", "master_addr", "master_port"))
    elastic = bool(environ.get("PET_RDZV_ENDPOINT", "").strip()) and not static_given
    if elastic:
        backend = environ.get("PET_RDZV_BACKEND", "c10d").strip()
        if backend != "c10d":
            raise SlurmError(
                f"PET_RDZV_BACKEND={backend!r}: ds-engine launch uses c10d rendezvous. "
                "HINT: set rdzvBackend: c10d in the PyTorchJob's elasticPolicy"
            )
    names = _PET_ELASTIC if elastic or spec.rdzv_endpoint is not None else _PET_STATIC
    if spec.rdzv_endpoint is not None:  # the command line chose elastic: only the processes per node
        names = {"nproc_per_node": "PET_NPROC_PER_NODE"}
    for attr, name in names.items():
        value = environ.get(name, "").strip()
        if not value or getattr(spec, attr) != _DEFAULTS[attr]:
            continue
        parsed: object = value
        if attr in ("node_rank", "master_port", "max_restarts"):
            parsed = _integer(name, value)
        changes[attr] = parsed
        taken.append(f"{attr}={value} ({name})")
    return changes, taken


def cluster_flags(spec: NodeLayout, environ: Mapping[str, str]) -> tuple[dict[str, object], str | None]:
    """Fill what the command line left out from a Slurm job step or a PyTorchJob pod.

    A value counts as left out when it is the option's default (`--nnodes 1`,
    `--nproc-per-node 1`, no `--node-rank`/`--master-addr`/`--master-port`); a flag given with
    another value always wins. Outside an srun step (no `SLURM_STEP_NUM_NODES`) and without
    `PET_*` variables nothing changes.

    Args:
        spec: the launch request as given.
        environ: the launcher's environment.

    Returns:
        The options to change (name -> value) and one line saying what was taken from where
        (`{}` and None when nothing).

    Raises:
        SlurmError: a Slurm variable cannot be read (naming it and its value).
    """
    if environ.get("SLURM_JOB_ID") and "SLURM_STEP_NUM_NODES" in environ:
        changes, taken = _slurm(spec, environ)
        source = f"Slurm job {environ['SLURM_JOB_ID']}"
    elif any(environ.get(name) for name in (*_PET_STATIC.values(), *_PET_ELASTIC.values())):
        changes, taken = _operator(spec, environ)
        source = "the PyTorch operator's PET_* variables"
    else:
        return {}, None
    if not changes:
        return {}, None
    return changes, f"from {source}: {', '.join(taken)}"
