"""Run a worker script on N real CPU processes (gloo) and collect per-rank results.

The ranks are forked from a warm fork server (`zygote.py`, see `launch_ranks`) or launched with
torchrun where the launch itself is under test.

Each worker writes `rank{R}.json` into the directory passed as `--out`; `run_workers` returns
those dicts in rank order. A hard timeout kills the whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).resolve().parents[2]
#: accelerate's example loops, as their authors run them (ported copies go elsewhere).
ACCELERATE_EXAMPLES = ROOT / "tests" / "accelerate_examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra or {})
    return env


EXIT_HANG = "ds_engine test launcher: killed after the results were written (exit-time hang)"


def run_command(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    finished: Callable[[], bool] | None = None,
    exit_grace: float = 90.0,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in its own session; on timeout kill the whole group and raise.

    `finished`: a check that the run's results are all written. If it holds and the processes
    still have not exited `exit_grace` seconds later, they are killed and the output ends with
    `EXIT_HANG` (returncode -9): the same exit-time teardown race of torch's gloo threads as
    the abort `only_exit_abort` tolerates, seen as a hang in plain accelerate's end_training.
    """
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or worker_env(),
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    if finished is None:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            out, _ = proc.communicate()
            raise TimeoutError(
                f"{' '.join(cmd)} did not finish in {timeout}s; output tail:\n{out[-6000:]}"
            ) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    chunks: list[str] = []
    reader = threading.Thread(
        target=lambda: chunks.append(proc.stdout.read() if proc.stdout else ""), daemon=True
    )
    reader.start()

    def ended(poll: float) -> bool:  # every process of the group closed the output
        reader.join(poll)
        return not reader.is_alive()

    outcome = _watch(
        ended, lambda: _kill_tree(proc.pid), timeout=timeout, finished=finished, exit_grace=exit_grace
    )
    reader.join(_PIPE_CLOSE_S)
    proc.wait()
    out = (
        "".join(chunks)
        if not reader.is_alive()
        else f"(the output pipe stayed open {_PIPE_CLOSE_S:.0f} s after the kill)"
    )
    if outcome == "hung":
        return subprocess.CompletedProcess(cmd, -9, out + "\n" + EXIT_HANG, None)
    if outcome == "timeout" and proc.returncode == -signal.SIGKILL:
        raise TimeoutError(f"{' '.join(cmd)} did not finish in {timeout}s; output tail:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _watch(
    ended: Callable[[float], bool],
    kill: Callable[[], None],
    *,
    timeout: float,
    finished: Callable[[], bool] | None,
    exit_grace: float,
) -> str:
    """Wait until `ended(poll)` (which may wait up to `poll` seconds) holds: "" then. Past
    `timeout`, or `exit_grace` seconds after `finished()` first held (results written, the
    processes still there), call `kill()` and return "timeout" or "hung"."""
    deadline = time.monotonic() + timeout
    done_at: float | None = None
    while not ended(0.2):
        now = time.monotonic()
        if done_at is None and finished is not None and finished():
            done_at = now
        outcome = "hung" if done_at is not None and now - done_at > exit_grace else "timeout"
        if outcome == "hung" or now > deadline:
            kill()
            return outcome
    return ""


#: Seconds to wait for the output pipe to close once every process of a run was killed.
_PIPE_CLOSE_S = 30.0


def _kill_tree(pid: int) -> None:
    """SIGKILL the run's session and every descendant, also those that left it (a helper process
    started in a new session of its own keeps the output pipe open, and a read would wait forever)."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()


def torchrun_command(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """`python -m torch.distributed.run` on `nproc` local ranks, a free port, no restarts."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        str(script),
        *args,
    ]


_EXIT_ABORT = "terminate called without an active exception"


def _aborted_after_finishing(output: str, out: Path, nproc: int) -> bool:
    """True when every rank wrote its result and the only failure is torch's exit-time abort.

    A C++ thread of torch that touches Python while the interpreter finalizes ends the process
    with SIGABRT after the work is done (pytorch/pytorch#190489, open). It struck 3 worker
    launches in 4 full CI runs (about 100 launches each), also with the process group
    destroyed, and none in 13 local repeats of those workers (nor in 18 dead-rank runs). Such
    a run is judged by its results; any other failure (a traceback, another exit code or
    signal, a missing result) still fails.
    """
    return only_exit_abort(output, finished=all((out / f"rank{rank}.json").exists() for rank in range(nproc)))


def only_exit_abort(output: str, *, finished: bool) -> bool:
    """True when the work `finished` (its results are written) and torchrun's `output` shows no
    failure but torch's exit-time abort (see `_aborted_after_finishing`); warns when so."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", output)
    if not (finished and _EXIT_ABORT in output and "-6" in codes):
        return False
    if not set(codes) <= {"-6", "-15"} or re.search(r"^\[rank\d+\]: Traceback", output, re.M):
        return False
    warnings.warn(f"workers finished, then a rank hit torch's exit-time abort: {_EXIT_ABORT!r}", stacklevel=3)
    return True


def run_workers(
    script: str,
    *args: str,
    nproc: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    out_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Launch `workers/<script>` on `nproc` ranks and return each rank's JSON result."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="ds_engine_test_"))
    out.mkdir(parents=True, exist_ok=True)
    result = launch_ranks(
        WORKERS / script, "--out", str(out), *args, nproc=nproc, timeout=timeout, env=worker_env(env)
    )
    if result.returncode != 0 and not _aborted_after_finishing(result.stdout, out, nproc):
        raise RuntimeError(
            f"workers failed (exit {result.returncode}); output tail:\n{result.stdout[-8000:]}"
        )
    results = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no result; output tail:\n{result.stdout[-8000:]}")
        results.append(json.loads(path.read_text()))
    return results


def shared_scenarios(
    request: Any, table: dict[str, list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], dict[str, slice]]:
    """The scenarios of several tests, for one launch that a module-scoped fixture shares.

    `table`: test name (without parameters) -> that test's scenarios. Returns the scenarios of
    those tests of the fixture's module that this run selects (deselected ones are left out,
    so `-m quick` launches only the quick test's), in one list, and each such test's slice of
    it: a worker that returns one result per scenario, in order, answers every test at once,
    and each test still checks (and fails on) its own results alone.
    """
    selected = {
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    scenarios: list[dict[str, Any]] = []
    slices = {}
    for name, own in table.items():
        if name in selected:
            slices[name] = slice(len(scenarios), len(scenarios) + len(own))
            scenarios += own
    return scenarios, slices


def exit_probes(out: Path) -> list[bool]:
    """Per rank, whether the process group was still alive at interpreter exit.

    Written by workers that call `_common.probe_exit`; the Engine destroys a gloo group in an
    exit handler, before interpreter finalization.
    """
    files = sorted(Path(out).glob("exit*.json"))
    return [json.loads(f.read_text())["group_alive_at_exit"] for f in files]


#: The one line a ported accelerate script changes.
ACCELERATE_IMPORT = "from accelerate import "


def port_accelerate_script(script: Path, into: Path) -> Path:
    """`script` copied into `into` with only its `from accelerate import` line changed."""
    text = script.read_text()
    assert text.count(ACCELERATE_IMPORT) == 1, f"{script.name} must have one `{ACCELERATE_IMPORT}` line"
    ported = into / script.name
    ported.write_text(text.replace(ACCELERATE_IMPORT, "from ds_engine import "))
    return ported


#: Seconds an example's ranks get to exit once its result files are all written.
EXIT_GRACE_S = 20.0


def launch_example(
    script: Path, out: Path, *args: str, env: dict[str, str] | None = None, files: tuple[str, ...] = ()
) -> None:
    """Run an example script on 2 CPU ranks (`--out OUT --cpu ARGS`); raise with its output if it
    failed. With `files`, a run that wrote them all and then hung or aborted at exit (torch's
    gloo teardown race) is accepted with a warning."""
    out.mkdir(parents=True, exist_ok=True)

    def written() -> bool:
        return bool(files) and all((out / f).exists() for f in files)

    # plain accelerate's own runs (the references, never ported) start fresh: forked, their
    # ranks sometimes hang at exit in a destructor after `end_training` (no ds_engine involved).
    # On torchrun too, about 1 reference run in 12: torch's DDP `Reducer`, freed at interpreter
    # exit with the GIL held, joins gloo's worker thread, which waits for the GIL to free a
    # tensor. A rank that exits normally does so within about 1 s of writing its results, so
    # such a run is judged by its results after EXIT_GRACE_S, not after a minute and a half.
    fresh = script.is_relative_to(ACCELERATE_EXAMPLES)
    result = launch_ranks(
        script, "--out", str(out), "--cpu", *args,
        timeout=420, env=worker_env(env), finished=written if files else None, torchrun=fresh,
        exit_grace=EXIT_GRACE_S,
    )  # fmt: skip
    if result.returncode != 0 and not only_exit_abort(result.stdout, finished=written()):
        if result.stdout.endswith(EXIT_HANG) and written():
            warnings.warn(f"{script.name}: results written, then a rank hung at exit (killed)", stacklevel=2)
            return
        raise RuntimeError(f"{script.name} failed (exit {result.returncode}):\n{result.stdout[-6000:]}")


#: `DS_ENGINE_TEST_LAUNCHER=torchrun` launches every test's ranks with torchrun itself.
LAUNCHER_ENV = "DS_ENGINE_TEST_LAUNCHER"
#: Variables read when a process starts (the allocator's, the interpreter's): a launch that sets
#: one of them gets fresh processes from torchrun, not forks.
_START_TIME_VARIABLES = ("MALLOC_", "LD_", "PYTHON", "GLIBC_", "OMP_", "MKL_")


def launch_ranks(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float,
    env: dict[str, str],
    finished: Callable[[], bool] | None = None,
    exit_grace: float = 90.0,
    torchrun: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `script args` on `nproc` ranks as `run_command` runs its `torchrun_command`, the ranks
    forked from the warm fork server (`zygote.py`) unless `torchrun`, `LAUNCHER_ENV`, or a
    variable `env` sets that is read when a process starts asks for torchrun. A forked run's
    output ends with torchrun's failure lines (`exitcode : N` per failed rank) when one failed."""
    base = worker_env()
    changed = {k for k in {*env, *base} if env.get(k) != base.get(k)}
    torchrun = torchrun or any(k.startswith(_START_TIME_VARIABLES) for k in changed)
    options: dict[str, Any] = {"timeout": timeout, "finished": finished, "exit_grace": exit_grace}
    if torchrun or os.environ.get(LAUNCHER_ENV) == "torchrun":
        return run_command(torchrun_command(script, *args, nproc=nproc), env=env, **options)
    return _zygote().launch(str(script), list(args), env=env, nproc=nproc, **options)


class _Zygote:
    """The pytest process's one fork server (started on first use, kept for the session)."""

    def __init__(self) -> None:
        from tests.distributed import zygote

        self.mark = zygote.MARK
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(zygote.__file__))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=worker_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        self.answer(timeout=300)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def answer(self, timeout: float) -> dict[str, Any] | None:
        """The next answer line, or None when none came within `timeout` seconds."""
        import select

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the test fork server ended")
            if line.startswith(self.mark):
                return dict(json.loads(line[len(self.mark) :]))

    def launch(
        self,
        script: str,
        args: list[str],
        *,
        env: dict[str, str],
        nproc: int,
        timeout: float,
        finished: Callable[[], bool] | None,
        exit_grace: float,
    ) -> subprocess.CompletedProcess[str]:
        import torch.distributed as dist

        log = Path(tempfile.mkstemp(prefix="ds_engine_ranks_", suffix=".log")[1])
        errors = Path(tempfile.mkdtemp(prefix="ds_engine_errors_"))
        # As torchrun's agent does, this side holds the store, so that it outlives every rank
        # (a rank 0 that held it and left first would keep the others waiting at their exit).
        store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False)
        request = {
            "script": script, "args": args, "env": env, "cwd": str(ROOT), "nproc": nproc, "log": str(log),
            "master_addr": "127.0.0.1", "master_port": store.port, "error_dir": str(errors),
        }  # fmt: skip
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            forked = self.answer(timeout=60)
            assert forked is not None, "the test fork server did not fork"
            codes: list[int] = [-9] * nproc  # unless the server says how each rank ended

            def ended(poll: float) -> bool:
                answer = self.answer(timeout=poll)
                if answer is not None:
                    codes[:] = answer["codes"]
                return answer is not None

            def kill() -> None:
                for pid in forked["pids"]:
                    _kill_tree(pid)
                ended(60)

            outcome = _watch(ended, kill, timeout=timeout, finished=finished, exit_grace=exit_grace)
            out = log.read_text(errors="replace")
        finally:
            del store
            log.unlink()
            shutil.rmtree(errors, ignore_errors=True)
        cmd = ["(forked)", script, *args]
        if outcome == "timeout":
            raise TimeoutError(f"{' '.join(cmd)} did not finish in {timeout}s; output tail:\n{out[-6000:]}")
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        out += "".join(f"\n  rank      : {rank}\n  exitcode  : {code}" for rank, code in failed)
        if outcome == "hung":
            return subprocess.CompletedProcess(cmd, -9, out + "\n" + EXIT_HANG, None)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, out, None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            _kill_tree(self.proc.pid)
            self.proc.wait(10)


_ZYGOTE: list[_Zygote] = []


def _zygote() -> _Zygote:
    if not (_ZYGOTE and _ZYGOTE[0].alive()):
        import atexit

        _ZYGOTE[:] = [_Zygote()]
        atexit.register(_ZYGOTE[0].close)
    return _ZYGOTE[0]
