"""Hostile-checkpoint worker: a real 2-rank DeepSpeed checkpoint with one file swapped per case.

Trains a small model on ZeRO-2 bf16 (its files hold every kind of DeepSpeed object: the ZeRO
stage enum, a loss scaler, fragment addresses), saves tag `good`, then for every case of
`tests/hostile_corpus.py` copies the tag with one file replaced by the hostile file and tries
it through each real entry point:

* ``engine``: `Engine.load_checkpoint` (every rank), victim rotating over all the tag's files;
* ``deepspeed``: DeepSpeed's own `load_checkpoint` inside ds_engine's restricted scope, past
  ds_engine's pre-read (`load_deepspeed_states`, every rank; victim: the model-states file,
  which every rank reads);
* ``universal``: `convert_to_universal` (rank 0), victim: a model-states or optimizer file;
* ``cached_universal``: `Engine.load_checkpoint` of a tag written by "another world size"
  whose cached universal folder holds the hostile file (every rank; three cases);
* ``consolidate``: `ds-engine consolidate` (rank 0), victim rotating over the DeepSpeed files.

Then the controls: the untouched tag loads (directly and through a universal checkpoint) and
consolidates, and the globals its files hold are all on ds_engine's allowlist. Each rank
reports every error and the traces payloads left (there must be none).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, TensorDataset


def attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def copy_tag(ckpt: Path, tag: str, world_size: int | None = None) -> Path:
    shutil.copytree(ckpt / "good", ckpt / tag)
    if world_size is not None:  # pretend another world size wrote it: loads go through universal
        meta_path = ckpt / tag / "ds_engine_meta.json"
        meta = json.loads(meta_path.read_text())
        meta_path.write_text(json.dumps({**meta, "world_size": world_size}))
    return ckpt / tag


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    from ds_engine import Engine
    from ds_engine.backends.deepspeed_states import (
        UNIVERSAL_SUFFIX,
        convert_to_universal,
        load_deepspeed_states,
    )
    from ds_engine.cli import main as cli
    from tests.hostile_corpus import CASES, extensions_registered, traces, write

    warnings.simplefilter("ignore")
    engine = Engine(
        backend="deepspeed",
        zero_stage=2,
        precision="bf16",
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    for step, (x, y) in enumerate(loader):
        with engine.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step == 1:
            break
    ckpt = out / "ckpt"
    engine.save_checkpoint(ckpt, tag="good")
    ds_engine = engine._backend.ds_engine
    files = sorted(p.name for p in (ckpt / "good").glob("*.pt"))
    deepspeed_files = [f for f in files if "model_states" in f or "optim_states" in f]
    model_states = next(f for f in files if "model_states" in f)
    markers = out / "markers"
    barrier = torch.distributed.barrier
    if rank() == 0:
        markers.mkdir()
    barrier()
    result: dict[str, Any] = {"files": files, "engine": {}, "deepspeed": {}, "cached_universal": {}}

    with extensions_registered():
        for index, case in enumerate(CASES):
            tag, victim = f"h{index}", files[index % len(files)]
            if rank() == 0:
                write(case, copy_tag(ckpt, tag) / victim, markers)
            barrier()
            result["engine"][case.name] = [
                victim,
                attempt(lambda tag=tag: engine.load_checkpoint(ckpt, tag=tag)),
            ]

        for index, case in enumerate(CASES):
            tag = f"d{index}"
            if rank() == 0:
                write(case, copy_tag(ckpt, tag) / model_states, markers)
            barrier()
            error = attempt(lambda tag=tag: load_deepspeed_states(ds_engine, ckpt, tag))
            result["deepspeed"][case.name] = [model_states, error]

        for index, case in enumerate(CASES[:3]):
            tag = f"cu{index}"
            if rank() == 0:
                universal = convert_to_universal(copy_tag(ckpt, tag, world_size=1))
                victim_path = sorted(universal.rglob("fp32.pt"))[0]
                write(case, victim_path, markers)
                victim = str(victim_path.relative_to(ckpt))
            barrier()
            error = attempt(lambda tag=tag: engine.load_checkpoint(ckpt, tag=tag))
            result["cached_universal"][case.name] = [victim if rank() == 0 else None, error]

        if rank() == 0:
            result["universal"], result["consolidate"] = {}, {}
            for index, case in enumerate(CASES):
                tag, victim = f"u{index}", deepspeed_files[index % len(deepspeed_files)]
                write(case, copy_tag(ckpt, tag) / victim, markers)
                error = attempt(lambda tag=tag: convert_to_universal(ckpt / tag))
                leftover = (ckpt / (tag + UNIVERSAL_SUFFIX)).exists()
                result["universal"][case.name] = [victim, error, leftover]

                tag = f"c{index}"
                write(case, copy_tag(ckpt, tag) / victim, markers)
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):
                    code = cli(["consolidate", str(ckpt), str(out / f"hf{index}"), "--tag", tag])
                result["consolidate"][case.name] = [victim, code, stderr.getvalue()]
        barrier()

        # controls: the untouched checkpoint loads and consolidates; its globals are allowlisted
        result["good_load"] = attempt(lambda: engine.load_checkpoint(ckpt, tag="good"))
        if rank() == 0:
            convert_to_universal(copy_tag(ckpt, "good_resized", world_size=1))
        barrier()
        result["good_universal_load"] = attempt(lambda: engine.load_checkpoint(ckpt, tag="good_resized"))
        if rank() == 0:
            result["good_consolidate"] = cli(
                ["consolidate", str(ckpt), str(out / "hf_good"), "--tag", "good"]
            )
            found: set[str] = set()
            for folder in (ckpt / "good", ckpt / ("good_resized" + UNIVERSAL_SUFFIX)):
                for path in folder.rglob("*.pt"):
                    found.update(torch.serialization.get_unsafe_globals_in_checkpoint(path))
            result["globals"] = sorted(found)
        result["traces"] = traces(markers)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
