"""Measure the memory held by model states under real DeepSpeed, ZeRO 0/2/3, on each rank.

Run by `tests/distributed/test_memory_real.py` and `scripts/benchmarks/bench_memory.py` through torchrun.
For each stage (sequentially, in one process group) it builds a GPT-2 from a config, wraps it
with raw `deepspeed.initialize` and a hand-written bf16 config, runs one optimizer step, and
sums the bytes of every tensor storage reachable from the DeepSpeed engine's module and
optimizer, each storage counted once (keyed by device and `untyped_storage().data_ptr()`).

Two moments are measured:

* `in_step`: from a post-hook on the wrapped torch optimizer, i.e. inside DeepSpeed's step
  right after the update, while the fp32 gradient partitions the update consumed are alive.
* `after_backward`: after `engine.backward`, before `engine.step` (16-bit gradients held).
* `after_step`: once `engine.step()` has returned (transient fp32 gradients freed again).
* `peak`: the larger of `in_step` and `after_backward`; this is what the estimate predicts.

All three are taken in the second optimizer step, so Adam's moments exist in every one.

Reported per rank: the totals, a breakdown by where each storage was found, the model's
parameter count and largest layer, and the world size.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import torch

from tests.distributed.workers._common import parse_args, write_result

# Under ZeRO-3 a parameter's shard lives in these tensor attributes; `ds_tensor` is the one
# that holds the partition, the others are views or bookkeeping.
_PARAM_ATTRS = ("ds_tensor",)


class _Census:
    """Every tensor storage reachable from a set of roots, each counted once."""

    def __init__(self) -> None:
        self.storages: dict[tuple[str, int], tuple[int, str]] = {}
        self._visited: set[int] = set()

    def add_tensor(self, tensor: torch.Tensor, where: str) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (str(tensor.device), storage.data_ptr())
        if key not in self.storages:
            self.storages[key] = (nbytes, where)

    def add_param(self, param: torch.Tensor, where: str) -> None:
        self.add_tensor(param, where)
        if param.grad is not None:
            self.add_tensor(param.grad, "grads")
        for attr in _PARAM_ATTRS:
            shard = getattr(param, attr, None)
            if isinstance(shard, torch.Tensor):
                self.add_tensor(shard, where)
                if shard.grad is not None:
                    self.add_tensor(shard.grad, "grads")

    def walk(self, obj: Any, where: str, depth: int = 0) -> None:
        """Follow containers and DeepSpeed/torch optimizer objects down to tensors."""
        if depth > 8 or id(obj) in self._visited:
            return
        if isinstance(obj, torch.nn.Parameter):
            self._visited.add(id(obj))
            self.add_param(obj, where)
            return
        if isinstance(obj, torch.Tensor):
            self.add_tensor(obj, where)
            if obj.grad is not None:
                self.add_tensor(obj.grad, where)
            return
        self._visited.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                self.add_param(p, "params")
            return
        if isinstance(obj, dict):
            for value in obj.values():
                self.walk(value, where, depth + 1)
            return
        if isinstance(obj, (list, tuple, set)):
            for value in obj:
                self.walk(value, where, depth + 1)
            return
        if isinstance(obj, torch.optim.Optimizer):
            self.walk(obj.state, "optimizer_states", depth + 1)
            self.walk(obj.param_groups, where, depth + 1)
            for name, value in vars(obj).items():
                if name not in ("state", "param_groups"):
                    self.walk(value, where, depth + 1)
            return
        module = type(obj).__module__ or ""
        if module.startswith("deepspeed") and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name in ("deepspeed", "engine", "timers", "module"):
                    continue  # back-references; the engine's module is walked as a root
                self.walk(value, where, depth + 1)

    def breakdown(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for nbytes, where in self.storages.values():
            out[where] = out.get(where, 0) + nbytes
        return out

    def total(self) -> int:
        return sum(nbytes for nbytes, _ in self.storages.values())


def model_states(engine: Any) -> dict[str, Any]:
    census = _Census()
    census.walk(engine.module, "params")
    census.walk(engine.optimizer, "optimizer_other")
    return {"total": census.total(), "breakdown": census.breakdown()}


def build_model(n_embd: int, n_layer: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=n_embd, n_layer=n_layer, n_head=8, vocab_size=vocab, n_positions=256, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def measure_stage(stage: int, args: Any) -> dict[str, Any]:
    import deepspeed

    from ds_engine.memory import count_params

    model = build_model(args.n_embd, args.n_layer, args.vocab)
    num_params, largest_layer = count_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = args.precision
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": stage,
            # Small communication buckets, so the fixed-size buffers DeepSpeed allocates next
            # to the model states stay small against them (the estimator does not model them).
            "reduce_bucket_size": args.bucket,
            "allgather_bucket_size": args.bucket,
            "stage3_prefetch_bucket_size": args.bucket,
        },
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    del model, optimizer

    # Two steps: the second one's moments have every state (Adam's moments exist from step 1).
    in_step: dict[str, Any] = {}

    def hook(opt: Any, a: Any, kw: Any, engine: Any = engine) -> None:
        in_step.clear()
        in_step.update(model_states(engine))

    handle = engine.basic_optimizer.register_step_post_hook(hook)
    gen = torch.Generator().manual_seed(1)
    after_backward: dict[str, Any] = {}
    for _ in range(2):
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        after_backward = model_states(engine)
        engine.step()
    handle.remove()
    after = model_states(engine)
    peak = max(in_step, after_backward, key=lambda m: m["total"])
    result = {
        "stage": stage,
        "precision": precision,
        "optimizer_class": type(engine.optimizer).__name__,
        "num_params": num_params,
        "largest_layer_params": largest_layer,
        "world_size": engine.world_size,
        "loss": float(loss.detach().float()),
        "peak": peak,
        "in_step": in_step,
        "after_backward": after_backward,
        "after_step": after,
    }
    engine.destroy()
    del engine, loss
    gc.collect()
    return result


def main() -> None:
    args = parse_args(
        [
            ("--stages", {"default": "0,2,3"}),
            ("--precision", {"default": "bf16", "choices": ["bf16", "fp32"]}),
            ("--n-embd", {"type": int, "default": 512}),
            ("--n-layer", {"type": int, "default": 8}),
            ("--vocab", {"type": int, "default": 50257}),
            ("--seq", {"type": int, "default": 16}),
            ("--bucket", {"type": int, "default": 2_000_000}),
        ]
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = [measure_stage(int(s), args) for s in args.stages.split(",")]
    write_result(args.out, {"results": results})
    print(json.dumps({"rank_results": len(results)}))


if __name__ == "__main__":
    main()
