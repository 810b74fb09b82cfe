"""Preemption and resume by itself, in one process: signals only set a flag (checked in real
subprocesses sent real signals), a second signal during the save leaves it complete, the run
exits with 143 after a Slurm requeue through a stand-in `scontrol`, the previous handler comes
back at `end_training`, and a newest tag whose files do not match its manifest is skipped with a
warning naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.autosave import newest_complete_tag
from ds_engine.manifest import MANIFEST_NAME, check_manifest, write_manifest
from ds_engine.preemption import PREEMPTED_EXIT_CODE, SignalFlag, requeue_slurm_job, resolve_signals
from tests.helpers import micro_step, prepared_linear, quiet_fallback

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    environ = {k: v for k, v in os.environ.items() if k not in launcher}  # a process of its own
    environ.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    )


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# --------------------------------------------------------------------------- signals
def test_a_signal_only_sets_the_flag_and_close_restores_the_handler(tmp_path: Path) -> None:
    ready, done = tmp_path / "ready", tmp_path / "done"
    proc = _child(
        f"""
        import signal, time
        from pathlib import Path
        from ds_engine.preemption import SignalFlag, resolve_signals
        flag = SignalFlag(resolve_signals(("SIGTERM", "USR1")))
        flag.install()
        Path({str(ready)!r}).write_text("1")
        deadline = time.monotonic() + 60
        while flag.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        flag.restore()
        restored = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        Path({str(done)!r}).write_text(f"{{flag.count}} {{flag.received}} {{restored}}")
        time.sleep(60)  # the default handler is back: the next SIGTERM ends the process
        """,
        tmp_path,
    )
    _wait_for(ready)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGUSR1)
    _wait_for(done)
    assert done.read_text() == f"2 {int(signal.SIGUSR1)} True"
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.parametrize(
    ("signals", "match"),
    [
        (("SIGTERM", "SIGNOPE"), r"`signals` holds 'SIGNOPE', which is no signal.*HINT: signals="),
        (("SIGKILL",), r"`signals` holds SIGKILL, which autosave does not catch.*HINT: signals="),
        (("INT",), r"`signals` holds SIGINT.*Ctrl-C.*HINT"),
        ((999,), r"`signals` holds 999, which is no signal"),
    ],
)
def test_bad_signals_are_refused(signals: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_signals(signals)


def test_signal_names_resolve() -> None:
    assert resolve_signals("USR1") == (signal.SIGUSR1,)
    assert resolve_signals(("SIGTERM", 15, "sigusr2")) == (signal.SIGTERM, signal.SIGUSR2)
    assert resolve_signals(()) == () and resolve_signals(None) == ()


def test_handlers_need_the_main_thread() -> None:
    import threading

    errors: list[str] = []

    def install() -> None:
        try:
            SignalFlag((signal.SIGTERM,)).install()
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors and "must be called from the main thread" in errors[0] and "HINT: " in errors[0]


# --------------------------------------------------------------------------- Slurm requeue
def _stand_in_scontrol(tmp_path: Path, status: int = 0) -> tuple[Path, Path]:
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit {status}\n')
    scontrol.chmod(0o755)
    return bin_dir, record


def test_requeue_runs_scontrol_with_the_job_id(tmp_path: Path) -> None:
    bin_dir, record = _stand_in_scontrol(tmp_path)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    assert requeue_slurm_job({"SLURM_JOB_ID": "4242", "PATH": path}) == "requeued Slurm job 4242"
    assert record.read_text().split("\n")[0] == "requeue 4242"
    assert "not a Slurm job" in requeue_slurm_job({"PATH": path})
    assert record.read_text().count("requeue") == 1


def test_a_failing_requeue_is_reported_not_raised(tmp_path: Path) -> None:
    bin_dir, _ = _stand_in_scontrol(tmp_path, status=1)
    with pytest.warns(UserWarning, match=r"`scontrol requeue 7` exited with 1"):
        message = requeue_slurm_job({"SLURM_JOB_ID": "7", "PATH": str(bin_dir)})
    assert "exited with 1" in message
    assert "not on PATH" in requeue_slurm_job({"SLURM_JOB_ID": "7", "PATH": str(tmp_path / "none")})


# --------------------------------------------------------------------------- a preempted run
_TRAINING = """
import os, signal, sys, time, warnings
import torch
from torch.utils.data import DataLoader, TensorDataset
from ds_engine import Engine

warnings.simplefilter("ignore")
engine = Engine(backend="accelerate", gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=2)
model, optimizer, loader = engine.prepare(model, optimizer, loader)
"""


def test_preemption_saves_once_through_a_second_signal_requeues_and_exits_143(tmp_path: Path) -> None:
    bin_dir, record = _stand_in_scontrol(tmp_path)
    ckpt = tmp_path / "ckpt"
    proc = _child(
        _TRAINING
        + f"""
backend = engine._backend
original = backend.save_states
def slow_save(*args, **kwargs):  # a long save, and a second signal in its middle
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    return original(*args, **kwargs)
backend.save_states = slow_save
engine.autosave({str(ckpt)!r}, requeue=True)
for batch_index, (x, y) in enumerate(loader):
    with engine.accumulate(model):
        if batch_index == 5:  # mid-window of optimizer step 3: the save waits for its boundary
            os.kill(os.getpid(), signal.SIGTERM)
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
print("not reached", flush=True)
""",
        tmp_path,
        env={"SLURM_JOB_ID": "777", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert "not reached" not in out
    assert (
        f"ds_engine: preempted (SIGTERM received): saved optimizer step 3 to {str(ckpt / 'step_3')!r}" in err
    )
    assert "requeued Slurm job 777" in err
    assert record.read_text().strip() == "requeue 777"
    assert newest_complete_tag(ckpt) == ("step_3", [])
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_3"]


def test_end_training_restores_the_previous_handler(tmp_path: Path) -> None:
    done = tmp_path / "done"
    proc = _child(
        _TRAINING
        + f"""
from pathlib import Path
def mine(signum, frame):
    print("user handler", flush=True)
signal.signal(signal.SIGUSR1, mine)
assert engine.autosave({str(tmp_path / "ckpt")!r}, signals=("SIGTERM", "SIGUSR1")) is None
caught = signal.getsignal(signal.SIGUSR1) is not mine and signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
engine.end_training()
Path({str(done)!r}).write_text(f"{{caught}} {{signal.getsignal(signal.SIGUSR1) is mine}} "
                                f"{{signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}}")
""",
        tmp_path,
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert done.read_text() == "True True True"


# --------------------------------------------------------------------------- resume by itself
def _prepared(ga: int = 1) -> tuple[Any, ...]:
    engine = quiet_fallback(gradient_accumulation_steps=ga)
    return prepared_linear(engine, n=16, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))


def _train(engine: Any, model: Any, optimizer: Any, loader: Any, stop: int | None = None) -> list[float]:
    losses = []
    for batch in loader:
        losses.append(micro_step(engine, model, optimizer, batch).item())
        if stop is not None and engine.num_optimizer_steps == stop:
            break
    return losses


def test_periodic_saves_rotate_and_skip_an_epochs_last_batch(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared()
    assert engine.autosave(tmp_path, every_steps=2, keep_last=2, signals=()) is None
    _train(engine, model, optimizer, loader)  # 8 steps; step 8 ends the epoch: no save there
    assert newest_complete_tag(tmp_path) == ("step_6", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]
    _train(engine, model, optimizer, loader, stop=10)  # the next boundary (step 9) saves instead
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_6", "step_9"]
    engine.end_training()


def test_a_damaged_newest_tag_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared()
    engine.autosave(
        tmp_path, every_steps=1, signals=(), client_state=lambda: {"at": engine.num_optimizer_steps}
    )
    _train(engine, model, optimizer, loader, stop=4)
    engine.end_training()
    assert newest_complete_tag(tmp_path)[0] == "step_3"  # the loop left before step 4's hook
    states = tmp_path / "step_3" / "optimizer_states.pt"
    states.write_bytes(states.read_bytes()[:-100])  # truncated
    (tmp_path / "step_2" / "rng_state_rank0.pt").unlink()  # a rank's file missing

    engine, model, optimizer, loader = _prepared()
    with pytest.warns(UserWarning) as caught:
        client = engine.autosave(tmp_path, every_steps=1, signals=())
    messages = [str(w.message) for w in caught if "skipped checkpoint" in str(w.message)]
    assert len(messages) == 2, messages
    assert str(tmp_path / "step_3") in messages[0] and "optimizer_states.pt has" in messages[0]
    assert "resuming from 'step_1' instead" in messages[0]
    assert str(tmp_path / "step_2") in messages[1] and "rng_state_rank0.pt is missing" in messages[1]
    assert client == {"at": 1} and engine.num_optimizer_steps == 1
    engine.end_training()

    with pytest.raises(ValueError, match=r"optimizer_states\.pt"):  # an explicit tag still raises
        engine2, *_ = _prepared()
        engine2.load_checkpoint(tmp_path, tag="step_3")


def test_a_loop_without_accumulate_saves_at_boundaries(tmp_path: Path) -> None:
    engine, model, optimizer, loader = _prepared(ga=2)
    engine.autosave(tmp_path, every_steps=1, keep_last=1, signals=())
    for x, y in loader:  # engine.backward outside accumulate(): a micro-step of its own
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if engine.num_optimizer_steps == 2 and engine.sync_gradients:
            break
    assert newest_complete_tag(tmp_path) == ("step_1", [])
    engine.end_training()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"every_steps": 0},
            ValueError,
            r"`every_steps`=0 must be a positive int or None\. HINT: every_steps=50",
        ),
        ({"keep_last": True}, ValueError, r"`keep_last`=True must be a positive int or None\. HINT"),
        (
            {"every_minutes": -1},
            ValueError,
            r"`every_minutes`=-1 must be a positive number.*HINT: every_minutes=30",
        ),
        ({"requeue": "yes"}, TypeError, r"`requeue`='yes' must be True or False\. HINT"),
        ({"client_state": {"a": 1}}, TypeError, r"`client_state`=.* must be a function.*HINT"),
        ({"signals": ("SIGSTOP",)}, ValueError, r"SIGSTOP, which autosave does not catch"),
    ],
)
def test_bad_autosave_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type, match: str) -> None:
    engine, *_ = _prepared()
    with pytest.raises(error, match=match):
        engine.autosave(tmp_path, **kwargs)
    engine.end_training()


def test_autosave_is_refused_before_prepare_after_training_and_twice(tmp_path: Path) -> None:
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = Engine(backend="accelerate")
    with pytest.raises(RuntimeError, match=r"`engine.autosave` before the model.*HINT: call"):
        bare.autosave(tmp_path)
    engine, model, optimizer, loader = _prepared()
    engine.autosave(tmp_path, signals=())
    with pytest.raises(RuntimeError, match=r"already called.*HINT: call it once"):
        engine.autosave(tmp_path, signals=())
    engine.end_training()
    engine, model, optimizer, loader = _prepared()
    _train(engine, model, optimizer, loader, stop=1)
    with pytest.raises(RuntimeError, match=r"after training began \(1 micro-steps taken\).*HINT"):
        engine.autosave(tmp_path / "other", signals=())
    engine.end_training()


# --------------------------------------------------------------------------- the manifest
def test_the_manifest_names_what_differs(tmp_path: Path) -> None:
    tag = tmp_path / "tag"
    (tag / "sub").mkdir(parents=True)
    (tag / "small.pt").write_bytes(b"abc" * 10)
    (tag / "sub" / "other.bin").write_bytes(b"x" * 100)
    write_manifest(tag)
    manifest = json.loads((tag / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"small.pt", "sub/other.bin"}
    assert check_manifest(tag) == ""
    (tag / "small.pt").write_bytes(b"abd" * 10)
    assert "small.pt differs from what the save wrote (CRC-32" in check_manifest(tag)
    (tag / "small.pt").write_bytes(b"ab")
    assert check_manifest(tag) == "small.pt has 2 bytes, the save wrote 30"
    (tag / "small.pt").unlink()
    assert check_manifest(tag) == "small.pt is missing (the save wrote 30 bytes)"
    (tag / MANIFEST_NAME).write_text("{")
    assert "manifest ds_engine_manifest.json cannot be read" in check_manifest(tag)
    (tag / MANIFEST_NAME).unlink()
    assert check_manifest(tag) == ""  # a tag from before manifests: checked by loading it


# --------------------------------------------------------------------------- the accelerate surface
def _accelerator(tmp_path: Path) -> tuple[Any, ...]:
    import ds_engine

    pc = ds_engine.ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = ds_engine.Accelerator(backend="accelerate", project_config=pc)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    return acc, *acc.prepare(model, optimizer, loader)


def test_load_state_resumes_the_newest_complete_checkpoint_in_one_line(tmp_path: Path) -> None:
    acc, model, optimizer, loader = _accelerator(tmp_path)
    with pytest.raises(
        FileNotFoundError, match=r"no complete checkpoint_<i> folder under .*HINT: save_state\(\)"
    ):
        acc.load_state()  # nothing saved yet: an error, as accelerate raises
    saved = []
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        acc.save_state()
        saved.append([p.detach().clone() for p in model.parameters()])
    acc.end_training()
    model_file = next((tmp_path / "checkpoints" / "checkpoint_3").rglob("model_states.pt"))
    model_file.write_bytes(model_file.read_bytes()[:-50])  # the newest is damaged

    acc, model, optimizer, loader = _accelerator(tmp_path)
    with pytest.warns(UserWarning, match=r"skipped checkpoint '.*checkpoint_3': .*model_states\.pt has"):
        acc.load_state()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved[2]))
    assert acc.save_iteration == 3  # the next save_state writes checkpoint_3 again, complete
    acc.end_training()


def test_the_accelerator_has_autosave(tmp_path: Path) -> None:
    acc, model, optimizer, loader = _accelerator(tmp_path)
    assert acc.autosave(tmp_path / "auto", every_steps=1, signals=()) is None
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    assert newest_complete_tag(tmp_path / "auto") == ("step_3", [])
    acc.end_training()


# --------------------------------------------------------------------------- the launcher
def test_restarts_on_one_node_get_a_fresh_rendezvous_per_restart(tmp_path: Path) -> None:
    from torch.distributed.run import get_args_parser

    from ds_engine.launch import LaunchSpec, torchrun_args

    script = tmp_path / "train.py"
    script.write_text("")
    args = torchrun_args(LaunchSpec(script=str(script), nproc_per_node="2", max_restarts=2))
    assert args == ["--nproc-per-node=2", "--nnodes=1", "--max-restarts=2", "--standalone", str(script)]
    assert get_args_parser().parse_args(args).standalone
    fixed = torchrun_args(
        LaunchSpec(script=str(script), max_restarts=2, master_addr="127.0.0.1", master_port=29511)
    )
    assert "--standalone" not in fixed and "--master-port=29511" in fixed
    assert "--standalone" not in torchrun_args(LaunchSpec(script=str(script)))


def test_the_launchers_preemption_message_names_the_step_and_folder(tmp_path: Path) -> None:
    from ds_engine.launch import _preempted_message

    report = tmp_path / "preempted.json"
    assert _preempted_message(report) is None
    report.write_text(json.dumps({"step": 12, "folder": "/runs/a/ckpt/step_12", "signal": "SIGUSR1"}))
    assert _preempted_message(report) == (
        "the run was preempted (SIGUSR1): every rank saved optimizer step 12 to '/runs/a/ckpt/step_12' and "
        "exited with status 143. Run the same command again to resume from it."
    )
    report.write_text("[1")
    assert _preempted_message(report) is None
