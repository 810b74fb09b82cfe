"""Worker: raw deepspeed.initialize on ZeRO 0-3 x {bf16, fp32}, train 2 steps, then check
consolidated_state_dict against DeepSpeed's own consolidation and save_pretrained it.

Rank 0 stores, per scenario, what consolidated_state_dict returned (16-bit and fp32 master) in
`<out>/<scenario>/ref16.pt` / `ref32.pt`, the save_pretrained folder in `<out>/<scenario>/hf`, and
for ZeRO-3 the DeepSpeed checkpoint in `<out>/<scenario>/ckpt`, so the test process can reload them
without DeepSpeed and consolidate the checkpoint offline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args, rank, write_result

SCENARIOS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("bf16", "fp32")]


def consolidated_state_dict(
    module: torch.nn.Module, *, ds_engine: object = None, **options: object
) -> dict | None:
    """`ds_engine.weights.consolidated_state_dict` of a raw DeepSpeedEngine's `module` (collective);
    `ds_engine` (the DeepSpeedEngine) is needed for fp32 master weights only."""
    from ds_engine import weights
    from ds_engine.backends.deepspeed_states import DeepSpeedGather

    return weights.consolidated_state_dict(module, gather=DeepSpeedGather(ds_engine), **options)  # type: ignore[arg-type]


def save_pretrained(
    module: torch.nn.Module, folder: Path, *, ds_engine: object = None, **options: object
) -> None:
    """`ds_engine.weights.save_pretrained` of a raw DeepSpeedEngine's `module` (collective)."""
    from ds_engine import weights
    from ds_engine.backends.deepspeed_states import DeepSpeedGather

    weights.save_pretrained(module, folder, gather=DeepSpeedGather(ds_engine), **options)  # type: ignore[arg-type]


def ds_config(stage: int, precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_model(cfg: dict):
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    if cfg["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = GPT2LMHeadModel(config)
    else:
        model = GPT2LMHeadModel(config)
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter (exclude_frozen)
    return model


def mismatches(got: dict | None, want: dict) -> list[str]:
    if got is None:
        return ["<None>"]
    bad = [f"missing {k}" for k in want if k not in got] + [f"extra {k}" for k in got if k not in want]
    for key, value in want.items():
        if key in got and not (got[key].dtype == value.dtype and torch.equal(got[key], value.cpu())):
            bad.append(f"differs {key} ({got[key].dtype} vs {value.dtype})")
    return bad


def run(stage: int, precision: str, out: Path) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = ds_config(stage, precision)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(100 + rank())
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    res: dict = {}
    sd16 = consolidated_state_dict(engine.module)
    sd32 = consolidated_state_dict(engine.module, dtype=torch.float32, ds_engine=engine)
    trainable = consolidated_state_dict(engine.module, exclude_frozen=True)
    # DeepSpeed's own answers (collective too): the reference for the 16-bit state dict
    if stage == 3:
        ref16 = engine._zero3_consolidated_16bit_state_dict()
    else:
        ref16 = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    res["is_none_off_rank0"] = [sd16 is None, sd32 is None, trainable is None]

    scenario = out / f"zero{stage}_{precision}"
    ckpt = scenario / "ckpt"
    if stage > 0:
        engine.save_checkpoint(str(ckpt), tag="step2")
    save_pretrained(engine.module, scenario / "hf", ds_engine=engine, max_shard_size="40KB")
    save_pretrained(engine.module, scenario / "hf32", ds_engine=engine, dtype=torch.float32)

    # the anchors' pitfall: module.state_dict() under ZeRO-3 gives empty partitions -> refused
    if stage == 3:
        try:
            save_pretrained(engine.module, scenario / "empty", state_dict=engine.module.state_dict())
            res["empty_refused"] = "not raised"
        except RuntimeError as exc:
            res["empty_refused"] = str(exc)
        res["empty_dir_exists"] = (scenario / "empty").exists()

    if rank() == 0:
        want_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        res["keys_match_state_dict"] = list(sd16) == list(engine.module.state_dict())
        res["vs_deepspeed_16bit"] = mismatches(sd16, ref16)
        res["dtype16"] = sorted({str(v.dtype) for v in sd16.values() if v.is_floating_point()})
        res["want_dtype16"] = str(want_dtype)
        res["empty_tensors"] = [k for k, v in {**sd16, **sd32}.items() if v.numel() == 0]
        res["exclude_frozen_dropped"] = sorted(set(sd16) - set(trainable))
        res["master_rounds_to_16bit"] = mismatches({k: v.to(want_dtype) for k, v in sd32.items()}, sd16)
        res["master_differs_from_16bit"] = any(
            not torch.equal(sd32[k], sd16[k].float()) for k in sd16 if sd16[k].is_floating_point()
        )
        if stage > 0:
            # DeepSpeed's offline reader: trainable params exactly; frozen ones it may leave out
            # (ZeRO-1/2) or keep in their 16-bit dtype (ZeRO-3), while we cast them to fp32.
            ds32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="step2")
            frozen = set(sd16) - set(trainable)
            res["vs_zero_to_fp32"] = mismatches(
                {k: v for k, v in sd32.items() if k not in frozen},
                {k: v for k, v in ds32.items() if k not in frozen},
            )
            res["frozen_vs_zero_to_fp32"] = mismatches(
                {k: sd32[k] for k in frozen if k in ds32}, {k: ds32[k].float() for k in frozen if k in ds32}
            )
        scenario.mkdir(parents=True, exist_ok=True)
        torch.save(sd16, scenario / "ref16.pt")
        torch.save(sd32, scenario / "ref32.pt")
    engine.destroy()
    return res


def main() -> None:
    args = parse_args([("--only", {"default": ""})])
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(args.out)
    results = {}
    for stage, precision in SCENARIOS:
        name = f"zero{stage}_{precision}"
        if args.only and name not in args.only.split(","):
            continue
        results[name] = run(stage, precision, out)
        torch.distributed.barrier()
    write_result(args.out, results)


if __name__ == "__main__":
    main()
