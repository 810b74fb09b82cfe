"""A fork server for the test launches: imports torch, DeepSpeed, accelerate and transformers
once, then forks the ranks of each launch from that warm state.

Every rank is still a real process of its own in a real gloo process group (rendezvous over
`env://` at a store the launching side holds, as torchrun's agent holds it); what is shared is
only the import work (about 4 s a rank on two cores). A launch that needs what only torchrun
gives (restarts, signals to the launcher, an allocator set before the process starts) is
launched with torchrun; see `launcher.launch_ranks`.

Protocol, one JSON line each way: the request `{"script", "args", "env", "cwd", "nproc",
"log", "master_addr", "master_port", "error_dir"}`; the answer `{"pids": [...]}` once the
ranks are forked, then `{"codes": [...]}` when they have all ended (torchrun's convention: a
negative code is the signal that ended a rank; when one rank fails the others are sent SIGTERM
and, 30 s later, SIGKILL).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time

#: Imported once, before any fork; a module that is not installed is skipped.
WARM = ("torch", "torch.distributed", "deepspeed", "accelerate", "transformers", "peft")
#: What torchrun sets for its workers besides the rank variables: the store is held by the
#: launching side (`launcher._Zygote`), as torchrun's agent holds it.
TORCHRUN_ENV = {
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_NAME": "default",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}
STOP_GRACE_S = 30.0
#: Starts each answer line (anything an import prints on stdout is skipped by the reader).
MARK = "@@zygote "


def warm_up() -> None:
    for name in WARM:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with contextlib.suppress(ImportError):
        from transformers import BertModel, GPT2LMHeadModel  # noqa: F401 (the lazy modules)
    with contextlib.suppress(ImportError):
        # DeepSpeed's CPU op builders (CPU-Adam, FusedAdam) ask py-cpuinfo for the CPU's
        # architecture and SIMD width at every op load, twice, each a subprocess of about 1 s:
        # a fact of the machine, asked once here for every rank forked later
        import functools

        import cpuinfo

        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
        cpuinfo.get_cpu_info()


def rank_process(request: dict, rank: int) -> None:
    """In the forked child: become rank `rank` and run the script as `python script args`."""
    import runpy

    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    nproc = request["nproc"]
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(TORCHRUN_ENV)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR=request["master_addr"], MASTER_PORT=str(request["master_port"]),
        TORCHELASTIC_ERROR_FILE=os.path.join(request["error_dir"], f"error{rank}.json"),
    )  # fmt: skip
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # An exception or SystemExit goes on up as in `python script`: the interpreter prints it,
    # runs the atexit handlers and exits with its status.
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def code_of(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def supervise(pids: list[int]) -> list[int]:
    """Wait for every rank; once one fails, stop the others as torchrun does."""
    codes: dict[int, int] = {}
    stop_at: float | None = None
    killed = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = code_of(status)
        failed = any(code != 0 for code in codes.values())
        if failed and stop_at is None and len(codes) < len(pids):
            stop_at = time.monotonic() + STOP_GRACE_S
            signal_all([p for p in pids if p not in codes], signal.SIGTERM)
        if stop_at is not None and not killed and time.monotonic() > stop_at:
            signal_all([p for p in pids if p not in codes], signal.SIGKILL)
            killed = True
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def answer(message: dict) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    warm_up()
    answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                rank_process(request, rank)  # never returns
            pids.append(pid)
        answer({"pids": pids})
        answer({"codes": supervise(pids)})


if __name__ == "__main__":
    main()
