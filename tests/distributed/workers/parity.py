"""Parity + communication worker: train the same model/data under several Engine settings and
compare the final fp32 weights with a single-process plain-torch reference that takes each
accumulation window as one big batch. Also counts gradient reductions per optimizer step.

Scenarios (JSON list of dicts) come in --scenarios; keys: model (mlp|gpt2), ga, backend,
zero_stage, coalesce. With --pretend-fsdp the fallback is granted FSDP on these CPU ranks
(see `_common.pretend_fsdp_platform`), so ZeRO-2/3 run as FSDP2 on the fallback.
"""

from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist
from _common import parse_args, pretend_fsdp_platform, write_result
from torch.utils.data import DataLoader, TensorDataset

MICRO_BATCH = 2
LR = 1e-2
COUNTED = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",  # FSDP2 (torch >= 2.13)
    "reduce_scatter",
    "reduce",
    "all_reduce_coalesced",
)
calls = {"n": 0, "active": False, "phase": 0, "phases": set()}


def _count_reductions() -> None:
    """Wrap torch.distributed reductions before DeepSpeed binds them (tensors > 1 element only:
    scalar all-reduces are grad-norm / overflow bookkeeping, not gradient reductions)."""
    for name in COUNTED:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, __original=original, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()))
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            if calls["active"] and isinstance(tensor, torch.Tensor) and tensor.numel() > 1:
                calls["n"] += 1
                calls["phases"].add(calls["phase"])
            return __original(*args, **kwargs)

        setattr(dist, name, wrapper)


def windows(ga: int) -> list[int]:
    return [ga, ga, max(ga // 2, 1)]  # the last window is short when GA > 1


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def make_data(kind: str, num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    if kind == "mlp":
        x = torch.randn(num_samples, 8, generator=g)
        y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(num_samples, 1, generator=g)
        return TensorDataset(x, y)
    ids = torch.randint(0, 64, (num_samples, 12), generator=g)
    return TensorDataset(ids, ids.clone())


def loss_of(model: torch.nn.Module, kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return torch.nn.functional.mse_loss(model(a), b)
    return model(input_ids=a, labels=b).loss


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "mlp":
        return torch.optim.AdamW(model.parameters(), lr=LR)
    # GPT-2's attention key bias has a gradient that is zero in exact arithmetic (softmax is
    # shift-invariant), so its float gradient is pure rounding noise; Adam would normalise
    # that noise into +-lr updates and no two summation orders could agree. SGD keeps noise
    # at noise level, so the comparison tests the accumulation, not Adam's noise amplifier.
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def reference(kind: str, ga: int, world: int) -> dict[str, torch.Tensor]:
    model = make_model(kind)
    opt = make_optimizer(kind, model)
    data = make_data(kind, world * MICRO_BATCH * sum(windows(ga)))
    start = 0
    for window in windows(ga):
        n = window * world * MICRO_BATCH
        a, b = data.tensors[0][start : start + n], data.tensors[1][start : start + n]
        start += n
        opt.zero_grad()
        loss_of(model, kind, a, b).backward()
        opt.step()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def full_params(engine, model) -> dict[str, torch.Tensor]:
    module = engine.unwrap_model(model)
    out = {}
    for name, param in module.named_parameters():
        if hasattr(param, "full_tensor"):  # FSDP2 shard
            out[name] = param.full_tensor().detach().float().clone()
        elif hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                out[name] = param.detach().float().clone()
        else:
            out[name] = param.detach().float().clone()
    return out


def _reshard_after_forward(model: torch.nn.Module) -> list[bool]:
    """FSDP2's reshard-after-forward setting of every sharded unit (empty when not FSDP2)."""
    settings = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            settings.append(group.post_forward_mesh_info is not None)
    return settings


def run(scenario: dict, world: int) -> dict:
    from ds_engine import Engine

    kind, ga = scenario["model"], scenario["ga"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine(
            backend=scenario["backend"],
            zero_stage=scenario.get("zero_stage", 0),
            gradient_accumulation_steps=ga,
            precision="fp32",
            coalesce_grad_reduction=scenario.get("coalesce", False),
        )
        model = make_model(kind)
        optimizer = make_optimizer(kind, model)
        loader = DataLoader(make_data(kind, world * MICRO_BATCH * sum(windows(ga))), batch_size=MICRO_BATCH)
        model, optimizer, loader = engine.prepare(model, optimizer, loader)
        hook_calls = {"n": 0}
        if hasattr(model, "register_comm_hook"):  # DDP reduces in C++: count its bucket hooks
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                if calls["active"]:
                    hook_calls["n"] += 1
                    calls["phases"].add(calls["phase"])
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting_hook)
        calls["n"] = 0
        calls["phases"] = set()
        calls["active"] = True
        boundaries = []
        for step, batch in enumerate(loader):
            calls["phase"] = step
            with engine.accumulate(model):
                loss = loss_of(model, kind, *batch)
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            boundaries.append(engine.sync_gradients)
        calls["active"] = False
    got = full_params(engine, model)
    ref = reference(kind, ga, world)
    max_rel = 0.0
    for name, value in got.items():
        r = ref[name]
        max_rel = max(max_rel, float(((value - r).abs() / (r.abs() + 1e-6)).max()))
    return {
        **scenario,
        "num_optimizer_steps": engine.num_optimizer_steps,
        "boundaries": boundaries,
        "reduction_calls": calls["n"] + hook_calls["n"],
        # micro-steps in which gradients were reduced (a bucketed reduction is many calls, one pass)
        "reductions": len(calls["phases"]),
        "max_rel_diff": max_rel,
        "max_abs_diff": max(float((got[n] - ref[n]).abs().max()) for n in got),
        "all_close": all(torch.allclose(got[n], ref[n], rtol=1e-5, atol=1e-6) for n in got),
        "backend_name": engine.backend_name,
        "warnings": [str(w.message) for w in caught if "coalesce" in str(w.message)],
        "fallback_warnings": [str(w.message) for w in caught if "fallback" in str(w.message)],
        "fsdp": type(model).__name__.startswith("FSDP") and hasattr(model, "set_requires_gradient_sync"),
        "fsdp_reshard_after_forward": _reshard_after_forward(model),
    }


def main() -> None:
    args = parse_args([("--scenarios", {"required": True}), ("--pretend-fsdp", {"action": "store_true"})])
    if args.pretend_fsdp:
        pretend_fsdp_platform()
    _count_reductions()
    results = []
    for scenario in json.loads(args.scenarios):
        results.append(run(scenario, int(__import__("os").environ["WORLD_SIZE"])))
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
