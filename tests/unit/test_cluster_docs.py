"""docs/cluster.md's job files: the sbatch script shown is `scripts/examples/slurm_job.sbatch`,
its srun line is a launch the command line accepts, and each pod of
`scripts/examples/pytorchjob.yaml`, given the variables the PyTorch operator sets, launches its
node of the job."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from ds_engine import cli
from ds_engine.launch import LaunchSpec, torchrun_args, validate, with_cluster_flags

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "cluster.md").read_text(encoding="utf-8")
SBATCH = ROOT / "scripts" / "examples" / "slurm_job.sbatch"
PYTORCHJOB = ROOT / "scripts" / "examples" / "pytorchjob.yaml"


def test_the_sbatch_block_is_the_example_file() -> None:
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC, flags=re.S) if b.startswith("#!/bin/bash")]
    assert blocks == [SBATCH.read_text(encoding="utf-8")]


def _spec(argv: list[str]) -> LaunchSpec:
    args = cli.build_parser().parse_args(argv)
    assert args.command == "launch"
    return LaunchSpec(
        script=str(ROOT / args.script),
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


def test_the_sbatch_job_asks_for_the_preemption_signal_and_launches_each_node() -> None:
    text = SBATCH.read_text(encoding="utf-8")
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert options["signal"] == "USR1@120" and "requeue" in options and options["ntasks-per-node"] == "1"
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    argv = shlex.split(srun)[2:]  # after `srun ds-engine`
    step = {
        "SLURM_JOB_ID": "77",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_GPUS_ON_NODE": options["gpus-per-node"],
        "PATH": "/nonexistent",
    }
    spec = with_cluster_flags(_spec(argv), step)
    validate(spec)
    assert torchrun_args(spec)[:5] == [
        "--nproc-per-node=8",
        "--nnodes=2",
        "--max-restarts=0",
        "--node-rank=1",
        "--master-addr=gpu01",
    ]
    assert spec.script_args == ["--torchrun", "--autosave", "ckpt/"]


def test_each_pod_of_the_pytorchjob_launches_its_node() -> None:
    job = yaml.safe_load(PYTORCHJOB.read_text(encoding="utf-8"))
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master", "Worker"]
    for rank, (kind, replica) in enumerate(replicas.items()):
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 120, kind
        (container,) = pod["containers"]
        assert container["command"][:2] == ["ds-engine", "launch"]
        operator = {  # what the operator sets in this pod (`setPodEnv`)
            "MASTER_ADDR": "ds-engine-master-0",
            "MASTER_PORT": "23456",
            "WORLD_SIZE": "16",
            "RANK": str(rank),
            "PET_MASTER_ADDR": "ds-engine-master-0",
            "PET_MASTER_PORT": "23456",
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
            "PET_NODE_RANK": str(rank),
            "PET_NNODES": "2",
        }
        spec = with_cluster_flags(_spec(container["command"][1:]), operator)
        validate(spec)
        assert torchrun_args(spec)[:6] == [
            "--nproc-per-node=8",
            "--nnodes=2",
            "--max-restarts=0",
            f"--node-rank={rank}",
            "--master-addr=ds-engine-master-0",
            "--master-port=23456",
        ], kind
