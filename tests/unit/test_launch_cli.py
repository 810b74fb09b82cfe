"""`ds-engine launch`: argument checks, torchrun's argument list, worker environment (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_engine import cli
from ds_engine.launch import (
    CONFIG_ENV,
    LaunchError,
    LaunchSpec,
    _failure_message,
    resolve_config,
    torchrun_args,
    validate,
    worker_env,
)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _spec(script: str, **kw: object) -> LaunchSpec:
    return LaunchSpec(script=script, **kw)  # type: ignore[arg-type]


def test_single_node_args_leave_the_port_to_torchrun(script: str) -> None:
    args = torchrun_args(_spec(script, nproc_per_node="2", script_args=["--lr", "1e-3", "--x"]))
    assert args == ["--nproc-per-node=2", "--nnodes=1", "--max-restarts=0", script, "--lr", "1e-3", "--x"]


def test_static_multi_node_args_pass_through(script: str) -> None:
    spec = _spec(script, nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29511)
    validate(spec)
    assert torchrun_args(spec)[:6] == [
        "--nproc-per-node=1",
        "--nnodes=2",
        "--max-restarts=0",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=29511",
    ]


def test_elastic_args_use_c10d(script: str) -> None:
    spec = _spec(script, nnodes="1:4", rdzv_endpoint="node0:29400", rdzv_id="job7")
    validate(spec)
    assert "--rdzv-backend=c10d" in torchrun_args(spec)
    assert "--rdzv-endpoint=node0:29400" in torchrun_args(spec)
    assert "--rdzv-id=job7" in torchrun_args(spec)


def test_torchrun_parses_our_args(script: str) -> None:
    from torch.distributed.run import get_args_parser

    spec = _spec(
        script,
        nnodes="2",
        node_rank=1,
        master_addr="127.0.0.1",
        master_port=29511,
        nproc_per_node="3",
        script_args=["--nproc-per-node", "9"],
    )
    ns = get_args_parser().parse_args(torchrun_args(spec))
    assert (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.nproc_per_node) == (
        "2",
        1,
        "127.0.0.1",
        29511,
        "3",
    )
    assert ns.training_script == script
    assert ns.training_script_args == ["--nproc-per-node", "9"]  # the script's, not the launcher's


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"nproc_per_node": "0"}, r"`--nproc-per-node` '0' is not allowed.*HINT"),
        ({"nproc_per_node": "two"}, r"`--nproc-per-node` 'two'"),
        ({"nnodes": "x"}, r"`--nnodes` 'x' is not N or MIN:MAX"),
        ({"nnodes": "2"}, r"multi-node run needs `--master-addr` and `--node-rank`.*HINT"),
        ({"nnodes": "1:2"}, r"MIN:MAX range needs elastic rendezvous.*HINT"),
        ({"nnodes": "3:2", "rdzv_endpoint": "h:1"}, r"MIN is larger than MAX"),
        ({"nnodes": "2", "node_rank": 2, "master_addr": "a"}, r"`--node-rank` 2 is outside 0..1.*HINT"),
        ({"rdzv_endpoint": "h:1", "master_addr": "a"}, r"cannot be combined with `--master-addr`.*HINT"),
        ({"rdzv_endpoint": "nohost"}, r"`--rdzv-endpoint` 'nohost' is not HOST:PORT.*HINT"),
        ({"master_port": 70000}, r"`--master-port` 70000 is not a TCP port.*HINT"),
        ({"max_restarts": -1}, r"`--max-restarts` -1 is negative"),
    ],
)
def test_bad_layouts_are_refused(script: str, kw: dict[str, object], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        validate(_spec(script, **kw))


def test_missing_script_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"`SCRIPT` '.*nope.py': no such file.*HINT"):
        validate(_spec(str(tmp_path / "nope.py")))


def test_config_file_resolves_to_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.chdir(tmp_path)
    assert resolve_config("ds.json") == tmp_path / "ds.json"
    assert resolve_config("ds.json").is_absolute()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", r"is not valid JSON.*HINT"),
        ("[1, 2]", r"holds a JSON list, not an object.*HINT"),
    ],
)
def test_bad_config_files(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LaunchError, match=match):
        resolve_config(str(path))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"`--config` '.*missing.json': no such file.*HINT"):
        resolve_config(str(tmp_path / "missing.json"))


def test_unknown_preset(script: str) -> None:
    with pytest.raises(Exception, match=r"no_such_preset"):
        resolve_config("no_such_preset")


def test_worker_env_respects_the_user(script: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text("{}")
    spec = _spec(script, nproc_per_node="2", config=str(cfg))
    added = worker_env(spec, environ={})
    assert int(added["OMP_NUM_THREADS"]) >= 1
    assert added[CONFIG_ENV] == str(cfg.resolve())
    assert added.get("GLOO_SOCKET_IFNAME") in ("lo", "lo0", None)
    kept = worker_env(spec, environ={"OMP_NUM_THREADS": "7", "GLOO_SOCKET_IFNAME": "eth1"})
    assert "OMP_NUM_THREADS" not in kept and "GLOO_SOCKET_IFNAME" not in kept


def test_worker_env_leaves_the_interface_alone_across_machines(script: str) -> None:
    spec = _spec(script, nnodes="2", node_rank=0, master_addr="10.1.2.3")
    assert "GLOO_SOCKET_IFNAME" not in worker_env(spec, environ={})


def test_an_elastic_range_turns_off_torchruns_shared_rendezvous_store(script: str) -> None:
    # with the shared store, a node joining a later round waits for a master address that only
    # the first round published (tests/distributed/test_cluster_launch.py launches that case)
    elastic = _spec(script, nnodes="1:2", rdzv_endpoint="127.0.0.1:29400")
    assert worker_env(elastic, environ={})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(
        elastic, environ={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    )
    fixed = _spec(script, nnodes="2", rdzv_endpoint="127.0.0.1:29400")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(fixed, environ={})


# ---------------------------------------------------------------- through the CLI (exit 2, one line)
def test_cli_missing_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["launch", "--nproc-per-node", "2", str(tmp_path / "absent.py"), "--lr", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("ds-engine: error: `SCRIPT`") and "absent.py" in err
    assert len(err.splitlines()) == 1


def test_cli_bad_config_exits_2(script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    rc = cli.main(["launch", "--config", str(bad), script])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "is not valid JSON" in err and len(err.splitlines()) == 1


def test_cli_script_args_are_not_parsed_by_the_launcher(script: str) -> None:
    args = cli.build_parser().parse_args(["launch", "--nproc-per-node", "2", script, "--config", "x", "-v"])
    assert args.script == script
    assert args.script_args == ["--config", "x", "-v"]
    assert args.config is None and args.nproc_per_node == "2"


def _failed(*ranks: tuple[int, int, int]):
    """torchrun's own ChildFailedError for (rank, exit code or -signal, timestamp) triples."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {}
    for rank, exitcode, timestamp in ranks:
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")
        failure.timestamp = timestamp
        failures[rank] = failure
    return ChildFailedError("train.py", failures)


def test_failure_summary_names_the_rank_that_failed_first() -> None:
    message = _failure_message(_failed((0, 1, 110), (1, -6, 100)))
    assert message.startswith(
        "rank 1 (local rank 1) was killed by SIGABRT (also failed: rank 0 exited with code 1)"
    )
    message = _failure_message(_failed((0, 1, 101), (1, 1, 100)))
    assert message.startswith("rank 1 (local rank 1) exited with code 1 (also failed: rank 0")


def test_failure_summary_names_a_raising_rank_stamped_after_the_peer_it_aborted() -> None:
    # rank 1 raised; tearing its group down at exit aborted rank 0, whose death torchrun
    # stamped two seconds before rank 1's process had finished exiting
    message = _failure_message(_failed((0, -6, 100), (1, 1, 102)))
    assert message.startswith(
        "rank 1 (local rank 1) exited with code 1 (also failed: rank 0 was killed by SIGABRT)"
    )


def test_failure_summary_names_the_exception_a_rank_recorded_even_if_it_was_stopped_later(tmp_path) -> None:
    # rank 1 raised and recorded it (the Engine's hook writes torchrun's error file); still
    # exiting when rank 0 aborted, it was then stopped by torchrun's SIGTERM
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: boom",
                    "extraInfo": {"py_callstack": "", "timestamp": "103"},
                }
            }
        )
    )
    raised = ProcessFailure(local_rank=1, pid=1001, exitcode=-15, error_file=str(error_file))
    aborted = ProcessFailure(local_rank=0, pid=1000, exitcode=-6, error_file="")
    aborted.timestamp = 101
    message = _failure_message(ChildFailedError("train.py", {0: aborted, 1: raised}))
    assert message.startswith(
        "rank 1 (local rank 1) raised RuntimeError: boom (also failed: rank 0 was killed by SIGABRT)"
    ), message


def test_a_recorded_lost_peer_is_a_consequence_not_the_cause(tmp_path) -> None:
    # rank 1 SIGKILLed (no error file); rank 0's collective then raised "Connection closed by
    # peer", recorded with its exact time, which is later than rank 1's death though torchrun
    # stamped that death in the next whole second
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ds_engine.backends.base import is_peer_failure

    text = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:43140"
    assert is_peer_failure(RuntimeError(text)) and not is_peer_failure(RuntimeError("boom"))
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {"message": text, "extraInfo": {"py_callstack": "", "timestamp": "100"}},
                "ds_engine": {"time": 100.4, "peer_failure": True},
            }
        )
    )
    lost = ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=1, pid=1001, exitcode=-9, error_file="")
    killed.timestamp = 101
    message = _failure_message(ChildFailedError("train.py", {0: lost, 1: killed}))
    assert message.startswith(
        "rank 1 (local rank 1) was killed by SIGKILL (also failed: rank 0 raised RuntimeError: [pair.cc:553]"
    ), message


def test_failure_summary_breaks_whole_second_ties_towards_the_cause() -> None:
    # rank 1 SIGKILLed; in the same second rank 0 aborted on the broken connection, and
    # torchrun stamped both alike: rank 1 is the cause, rank 0 the consequence
    message = _failure_message(_failed((0, -6, 100), (1, -9, 100)))
    assert message.startswith(
        "rank 1 (local rank 1) was killed by SIGKILL (also failed: rank 0 was killed by SIGABRT)"
    )
    message = _failure_message(_failed((0, -15, 100), (1, 1, 100), (2, -6, 100)))
    assert message.startswith(
        "rank 1 (local rank 1) exited with code 1 (also failed: rank 0 was killed by SIGTERM; rank 2"
    )
    # equal in every respect: the lowest rank
    message = _failure_message(_failed((0, 1, 100), (1, 1, 100)))
    assert message.startswith("rank 0 (local rank 0) exited with code 1 (also failed: rank 1")
