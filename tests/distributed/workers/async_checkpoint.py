"""Background checkpoint saves (`blocking=False`) on 2 ranks, one backend per launch.

--mode train: (1) engine A trains 6 optimizer steps and saves step_2, step_4, step_6 without
blocking (training goes on at once); engine B trains the same with blocking saves; engine C
loads A's step_4 and trains steps 5-6. Each reports a digest of its final weights. (2) A
background write that fails on rank 1 only (EROFS, injected into that rank's writes) is raised
at the next wait, on both ranks, naming rank 1; nothing new is published.

--mode kill: saves step_2 (waited for), trains, starts step_4 in the background with slow
writes and rank 0 SIGKILLs itself while the thread writes. --mode resume: a fresh engine
resumes from the newest complete checkpoint and reports which one and its steps.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

from ds_engine import Engine
from ds_engine.checkpoint import resolve_checkpoint, wait_for_checkpoint

TIMEOUT_S = 90


def _prepared(backend: str) -> tuple[Any, ...]:
    choices: dict[str, Any] = {"backend": backend, "dist_timeout_s": TIMEOUT_S}
    if backend == "deepspeed":
        choices["zero_stage"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(**choices)
    torch.manual_seed(0)
    with engine.init_context():
        model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return (engine, *engine.prepare(model, optimizer, DataLoader(data, batch_size=2)))


def _save(engine: Engine, model: Any, directory: Path, blocking: bool) -> None:
    engine.save_checkpoint(directory, blocking=blocking)


def _train(engine: Engine, model: Any, optimizer: Any, loader: Any, until: int, save: Any = None) -> None:
    for x, y in loader:
        if engine.num_optimizer_steps >= until:
            return
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if save is not None and engine.num_optimizer_steps % 2 == 0:
            save(engine.num_optimizer_steps)


def _digest(engine: Engine, model: Any) -> str:
    state = engine.get_state_dict(model)
    if state is None:
        return ""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].float().numpy().tobytes())
    return h.hexdigest()


def train_mode(backend: str, root: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    a = _prepared(backend)
    _train(*a, until=6, save=lambda step: _save(a[0], a[1], root / "async", blocking=False))
    wait_for_checkpoint()
    result["async"] = _digest(a[0], a[1])
    result["async_listing"] = sorted(os.listdir(root / "async"))
    b = _prepared(backend)
    _train(*b, until=6, save=lambda step: _save(b[0], b[1], root / "blocking", blocking=True))
    result["blocking"] = _digest(b[0], b[1])
    c = _prepared(backend)
    c[0].load_checkpoint(root / "async", tag="step_4")
    result["resumed_from"] = c[0].num_optimizer_steps
    _train(*c, until=6)
    result["resumed"] = _digest(c[0], c[1])

    # a background write that fails on rank 1 only (as a folder read-only for that rank would)
    _save(c[0], c[1], root / "failing", blocking=True)  # step_6: the last good one
    _train(*c, until=8)
    real = torch.save
    if rank() == 1:

        def failing(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(f))

        torch.save = failing
    started = time.monotonic()
    _save(c[0], c[1], root / "failing", blocking=False)
    result["returned_after_s"] = time.monotonic() - started
    _train(*c, until=9)  # training goes on
    try:
        wait_for_checkpoint()
        result["error"] = ""
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.save = real
    dist.barrier()
    result["failing_listing"] = sorted(os.listdir(root / "failing"))
    result["newest"] = resolve_checkpoint(root / "failing")[0]
    return result


def kill_mode(backend: str, root: Path) -> dict[str, Any]:
    engine, model, optimizer, loader = _prepared(backend)
    _train(engine, model, optimizer, loader, until=2)
    _save(engine, model, root / "ckpt", blocking=False)
    _train(engine, model, optimizer, loader, until=4)
    real = torch.save
    writing = []

    def slow(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        writing.append(str(f))
        real(obj, f, *args, **kwargs)
        time.sleep(2.0)

    torch.save = slow
    _save(engine, model, root / "ckpt", blocking=False)  # waits for step_2 first
    if rank() == 0:
        deadline = time.monotonic() + 60
        while not writing and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # the first file is written, the thread sleeps before the next
        Path(root / "killed_while_writing").write_text("\n".join(writing))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 1 is stopped by the launcher when rank 0 dies
    return {}


def resume_mode(backend: str, root: Path) -> dict[str, Any]:
    engine, model, optimizer, loader = _prepared(backend)
    result: dict[str, Any] = {"newest": resolve_checkpoint(root / "ckpt")[0]}
    engine.load_checkpoint(root / "ckpt")
    result["steps"] = engine.num_optimizer_steps
    result["listing"] = sorted(os.listdir(root / "ckpt"))
    _train(engine, model, optimizer, loader, until=4)
    _save(engine, model, root / "ckpt", blocking=False)  # over the dead save's staging folder
    wait_for_checkpoint()
    result["after"] = sorted(os.listdir(root / "ckpt"))
    return result


def main() -> None:
    args = parse_args(
        [("--backend", {"required": True}), ("--mode", {"required": True}), ("--root", {"required": True})]
    )
    modes = {"train": train_mode, "kill": kill_mode, "resume": resume_mode}
    try:
        result = modes[args.mode](args.backend, Path(args.root))
    except Exception:
        result = {"crash": traceback.format_exc()}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
