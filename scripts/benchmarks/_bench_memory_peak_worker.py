"""One rank of `bench_memory_peak.py`: train one model under one ZeRO set-up through the Engine and
report the peak resident memory over this process's baseline, and the bytes of every collective.

Run by torchrun (2 ranks, gloo), one launch per set-up, so each process's peak belongs to one set-up
only. The launcher sets the allocator so RSS tracks live memory (`MALLOC_ARENA_MAX`,
`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`). The baseline is the resident memory after the
imports (torch, DeepSpeed, transformers, peft, ds_engine), before the Engine exists; the kernel's
high-water mark is reset there (`/proc/self/clear_refs`), so the peak is what training added.

Collectives: `torch.distributed`'s functions are wrapped before DeepSpeed starts, and each call's
payload (the tensor bytes a ring algorithm moves: all_reduce 2(N-1)/N x its tensor, reduce-scatter
and all-gather (N-1)/N x the full tensor, broadcast (N-1)/N x its tensor) is added up per
optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_COUNTS: dict[str, float] = {}
_CALLS: dict[str, int] = {}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


def _wrap(name: str, payload: Any) -> None:
    original = getattr(dist, name, None)
    if original is None:
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:
            _COUNTS[name] = _COUNTS.get(name, 0.0) + payload(args, kwargs, world)
            _CALLS[name] = _CALLS.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(dist, name, wrapped)


def _first(args: tuple, kwargs: dict, *names: str) -> Any:
    for key in names:
        if key in kwargs:
            return kwargs[key]
    return args[0] if args else None


def _second(args: tuple, kwargs: dict, *names: str) -> Any:
    for key in names:
        if key in kwargs:
            return kwargs[key]
    return args[1] if len(args) > 1 else None


def count_collectives() -> None:
    """Wrap the collectives DeepSpeed and the Engine call; bytes each rank sends, ring algorithms."""
    ring = lambda n: (n - 1) / n  # noqa: E731
    _wrap("all_reduce", lambda a, k, n: 2 * ring(n) * _nbytes(_first(a, k, "tensor")))
    _wrap("broadcast", lambda a, k, n: ring(n) * _nbytes(_first(a, k, "tensor")))
    # reduce-scatter: the input is the full tensor; all-gather: the output is the full tensor
    _wrap("reduce_scatter_tensor", lambda a, k, n: ring(n) * _nbytes(_second(a, k, "input")))
    _wrap("_reduce_scatter_base", lambda a, k, n: ring(n) * _nbytes(_second(a, k, "input")))
    _wrap("reduce_scatter", lambda a, k, n: ring(n) * _nbytes(_second(a, k, "input_list")))
    _wrap("all_gather_into_tensor", lambda a, k, n: ring(n) * _nbytes(_first(a, k, "output_tensor")))
    _wrap("_all_gather_base", lambda a, k, n: ring(n) * _nbytes(_first(a, k, "output_tensor")))
    _wrap("all_gather", lambda a, k, n: ring(n) * _nbytes(_first(a, k, "tensor_list")))
    _wrap("reduce", lambda a, k, n: ring(n) * _nbytes(_first(a, k, "tensor")))


def build_model(kind: str, seq: int) -> torch.nn.Module:
    """The three shapes: a MiniLM-sized BERT encoder, a small Llama decoder, the decoder with LoRA."""
    torch.manual_seed(0)
    from bench_memory_peak import model_config

    config = model_config(kind, seq)
    if kind == "encoder":
        from transformers import BertForSequenceClassification

        return BertForSequenceClassification(config)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    if kind == "lora":
        from bench_memory_peak import LORA_RANK, LORA_TARGETS
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"),
        )
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, choices=["encoder", "decoder", "lora"])
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--offload", default="none")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()

    import deepspeed  # noqa: F401  (imported before the baseline: part of it)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from ds_engine import Engine

    count_collectives()
    gc.collect()
    with contextlib.suppress(OSError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from here

    engine = Engine(
        zero_stage=args.stage,
        precision="bf16",
        gradient_accumulation_steps=args.ga,
        micro_batch_size=args.micro,
        gradient_clipping=1.0,
        offload_optimizer=args.offload,
    )
    context = engine.init_context() if args.stage == 3 else contextlib.nullcontext()
    with context:
        model = build_model(args.model, args.seq)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = model.config
    vocab = config.vocab_size
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer)
    after_prepare = _status("VmHWM") - baseline
    g = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))
    per_step: list[float] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        _COUNTS.clear()
        _CALLS.clear()
        for _ in range(args.ga):
            ids = torch.randint(1, vocab, (args.micro, args.seq), generator=g).to(engine.device)
            labels = ids if args.model != "encoder" else torch.randint(0, 2, (args.micro,), generator=g)
            with engine.accumulate(model):
                loss = model(input_ids=ids, labels=labels).loss
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            del loss
        per_step.append(sum(_COUNTS.values()))
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - baseline
    unwrapped = engine.unwrap_model(model)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in unwrapped.parameters())
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in unwrapped.parameters() if p.requires_grad)
    result = {
        "peak": peak,
        "after_prepare": after_prepare,
        "baseline": baseline,
        "num_params": total,
        "trainable_params": trainable,
        "comm_bytes_last_step": per_step[-1],
        "comm_calls_last_step": dict(_CALLS),
        "comm_bytes_by_call": dict(_COUNTS),
        "seconds": seconds,
        "world_size": dist.get_world_size(),
    }
    path = Path(args.out) / f"rank{dist.get_rank()}.json"
    path.write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
