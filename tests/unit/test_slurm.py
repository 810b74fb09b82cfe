"""What `ds-engine launch` takes from a Slurm job step or a PyTorchJob pod (no processes but a
stand-in `scontrol`): the host-list parser, the derived port, and which flags win."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ds_engine import cli
from ds_engine.launch import LaunchSpec, torchrun_args, validate, with_cluster_flags
from ds_engine.slurm import PORT_BASE, PORT_SPAN, SlurmError, expand_hostlist, first_host, port_for_job


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("login1,login2", ["login1", "login2"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("gpu[1-2],cpu[10-11],login", ["gpu1", "gpu2", "cpu10", "cpu11", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("rack[1,3]-gpu[01-02]-ib", ["rack1-gpu01-ib", "rack1-gpu02-ib", "rack3-gpu01-ib", "rack3-gpu02-ib"]),
        ("[1-2]", ["1", "2"]),
        ("a[7]", ["a7"]),
        (" node1 ", ["node1"]),
        ("node-1.cluster.example", ["node-1.cluster.example"]),
    ],
)
def test_host_lists_expand_like_slurm(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "match"),
    [
        ("", "empty"),
        ("gpu[01-04", "unbalanced brackets"),
        ("gpu01-04]", r"a '\]' without its '\['"),
        ("gpu[[1-2]]", "unbalanced brackets"),
        ("gpu[]", "empty brackets"),
        ("gpu[a-b]", "'a-b' is not a number"),
        ("gpu[1-]", "'1-' is not a number"),
        ("gpu[4-1]", "runs backwards"),
        ("gpu1,,gpu2", "empty or blank host"),
        ("gpu1, gpu 2", "empty or blank host"),
    ],
)
def test_malformed_host_lists_name_the_value(hostlist: str, match: str) -> None:
    with pytest.raises(SlurmError, match=match) as caught:
        expand_hostlist(hostlist)
    assert f"SLURM host list {hostlist!r}" in str(caught.value) or not hostlist.strip()


def _stand_in_scontrol(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "scontrol"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def test_first_host_asks_scontrol_when_it_is_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    # a site whose scontrol resolves names differently from our parser: its answer is taken
    bin_dir = _stand_in_scontrol(tmp_path / "bin", f'echo "$@" >> {calls}\necho head-a\necho head-b')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert first_host("gpu[01-02]") == "head-a"
    assert calls.read_text() == "show hostnames gpu[01-02]\n"


def test_first_host_reports_a_failing_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _stand_in_scontrol(tmp_path / "bin", 'echo "Invalid hostlist: $3" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(
        SlurmError, match=r"scontrol show hostnames gpu\[1-\` failed \(exit 1: Invalid hostlist"
    ):
        first_host("gpu[1-")


def test_first_host_parses_itself_without_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol there
    assert first_host("gpu[07-09],login") == "gpu07"


def test_the_port_follows_the_job_id() -> None:
    assert port_for_job("4242") == PORT_BASE + 4242
    assert port_for_job(str(PORT_SPAN + 3)) == PORT_BASE + 3
    ports = {port_for_job(str(job)) for job in range(10**6, 10**6 + 5000, 7)}
    assert min(ports) >= PORT_BASE and max(ports) < PORT_BASE + PORT_SPAN < 32768


def _slurm_env(node: int, **extra: str) -> dict[str, str]:
    """What srun sets in a step of `sbatch -N 2 --ntasks-per-node=4`, `srun --ntasks-per-node=1`."""
    env = {
        "SLURM_JOB_ID": "31337",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "PATH": "/nonexistent",
    }
    env.update(extra)
    return env


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_an_srun_step_fills_the_layout_and_says_so(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = with_cluster_flags(LaunchSpec(script=script), _slurm_env(1))
    validate(spec)
    assert torchrun_args(spec)[:6] == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--max-restarts=0",
        "--node-rank=1",
        "--master-addr=gpu07",
        f"--master-port={port_for_job('31337')}",
    ]
    line = capsys.readouterr().err.strip()
    assert line == (
        "ds-engine launch: INFO: from Slurm job 31337: nnodes=2 (SLURM_STEP_NUM_NODES), "
        "node_rank=1 (SLURM_NODEID), master_addr=gpu07 (first host of SLURM_STEP_NODELIST=gpu[07-08]), "
        f"master_port={port_for_job('31337')} (from SLURM_JOB_ID=31337), "
        "nproc_per_node=4 (SLURM_NTASKS_PER_NODE)"
    )


def test_gpus_give_the_processes_per_node_before_tasks_per_node(script: str) -> None:
    # sbatch --ntasks-per-node=1 --gpus-per-node=8: one launcher per node, 8 processes each
    env = _slurm_env(0, SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="1")
    assert with_cluster_flags(LaunchSpec(script=script), env).nproc_per_node == "8"
    env = _slurm_env(0, SLURM_GPUS_PER_NODE="h100:2", SLURM_NTASKS_PER_NODE="4(x2)")
    assert with_cluster_flags(LaunchSpec(script=script), env).nproc_per_node == "2"
    env = _slurm_env(0, SLURM_NTASKS_PER_NODE="3(x2)")  # no GPUs: the job's tasks per node
    assert with_cluster_flags(LaunchSpec(script=script), env).nproc_per_node == "3"
    del env["SLURM_NTASKS_PER_NODE"]
    assert with_cluster_flags(LaunchSpec(script=script), env).nproc_per_node == "1"


def test_explicit_flags_win(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    given = LaunchSpec(
        script=script, nproc_per_node="2", node_rank=0, master_addr="10.1.1.1", master_port=29511
    )
    spec = with_cluster_flags(given, _slurm_env(1))
    assert (spec.nproc_per_node, spec.node_rank, spec.master_addr, spec.master_port) == (
        "2",
        0,
        "10.1.1.1",
        29511,
    )
    assert spec.nnodes == "2"
    assert (
        capsys.readouterr().err.strip()
        == "ds-engine launch: INFO: from Slurm job 31337: nnodes=2 (SLURM_STEP_NUM_NODES)"
    )
    # elastic rendezvous: the rendezvous assigns ranks, Slurm only gives the processes per node
    elastic = with_cluster_flags(
        LaunchSpec(script=script, rdzv_endpoint="gpu07:29400", nnodes="1:2"), _slurm_env(1)
    )
    assert (elastic.nnodes, elastic.node_rank, elastic.master_addr, elastic.nproc_per_node) == (
        "1:2",
        None,
        None,
        "4",
    )


def test_outside_a_job_step_nothing_changes(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    batch_shell = {k: v for k, v in _slurm_env(0).items() if not k.startswith("SLURM_STEP_")}
    given = LaunchSpec(script=script)
    assert with_cluster_flags(given, batch_shell) == given
    assert with_cluster_flags(given, {"PATH": "/bin"}) == given
    assert capsys.readouterr().err == ""


def test_a_one_node_step_keeps_single_node_defaults(script: str) -> None:
    env = _slurm_env(0, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST="gpu07")
    spec = with_cluster_flags(LaunchSpec(script=script), env)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.nproc_per_node) == ("1", None, None, "4")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"SLURM_STEP_NUM_TASKS": "8"},
            r"SLURM_STEP_NUM_TASKS=8 launchers on 2 node\(s\).*srun --ntasks-per-node=1",
        ),
        ({"SLURM_NODEID": "x"}, r"SLURM_NODEID='x' is not a non-negative integer"),
        ({"SLURM_STEP_NUM_NODES": "two"}, r"SLURM_STEP_NUM_NODES='two'"),
        ({"SLURM_NTASKS_PER_NODE": "0"}, r"SLURM_NTASKS_PER_NODE='0' is not a positive count"),
        ({"SLURM_STEP_NODELIST": "gpu[07-"}, r"SLURM host list 'gpu\[07-'"),
    ],
)
def test_unreadable_slurm_variables_name_themselves(script: str, extra: dict[str, str], match: str) -> None:
    with pytest.raises(SlurmError, match=match):
        with_cluster_flags(LaunchSpec(script=script), _slurm_env(0, **extra))


def test_the_cli_reports_a_bad_slurm_variable_in_one_line(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in _slurm_env(1, SLURM_JOB_NODELIST="gpu[1-", SLURM_STEP_NODELIST="gpu[1-").items():
        monkeypatch.setenv(name, value)
    assert cli.main(["launch", script]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds-engine: error: SLURM host list 'gpu[1-': unbalanced brackets"), err


def test_pytorch_operator_variables_fill_the_layout(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "PET_NNODES": "3",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_NPROC_PER_NODE": "2",
    }
    spec = with_cluster_flags(LaunchSpec(script=script), env)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port, spec.nproc_per_node) == (
        "3",
        2,
        "job-master-0",
        23456,
        "2",
    )
    assert "PET_MASTER_ADDR" in capsys.readouterr().err
    flagged = with_cluster_flags(LaunchSpec(script=script, nproc_per_node="4", master_port=29500), env)
    assert (flagged.nproc_per_node, flagged.master_port) == ("4", 29500)
    with pytest.raises(SlurmError, match="PET_NODE_RANK='one'"):
        with_cluster_flags(LaunchSpec(script=script), {**env, "PET_NODE_RANK": "one"})


def test_an_elastic_pytorchjob_gives_the_rendezvous(script: str) -> None:
    env = {
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_ID": "job",
        "PET_NNODES": "1:4",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "8",
        "MASTER_ADDR": "job-worker-0",  # the operator's plain variables are for the workers, not read
    }
    spec = with_cluster_flags(LaunchSpec(script=script), env)
    validate(spec)
    assert (spec.rdzv_endpoint, spec.rdzv_id, spec.nnodes, spec.max_restarts, spec.nproc_per_node) == (
        "job-worker-0:23456",
        "job",
        "1:4",
        3,
        "8",
    )
    assert spec.master_addr is None and spec.node_rank is None
    with pytest.raises(SlurmError, match=r"PET_RDZV_BACKEND='etcd'.*rdzvBackend: c10d"):
        with_cluster_flags(LaunchSpec(script=script), {**env, "PET_RDZV_BACKEND": "etcd"})
