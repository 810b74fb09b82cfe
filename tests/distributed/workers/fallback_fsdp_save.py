"""The fallback under FSDP2 (pretended platform, see `_common.pretend_fsdp_platform`):
grad norms equal DDP's, `get_state_dict` is complete, `save_pretrained` reloads with plain
`from_pretrained` and gives the live sharded model's logits.

Engines run one after another in this process: FSDP (ZeRO-3), DDP (ZeRO-0), FSDP (ZeRO-2),
so accelerate's process-wide state is switched both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _common import parse_args, pretend_fsdp_platform, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

STEPS = 3


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0
    )
    cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def train(stage: int, precision: str, out: Path) -> dict:
    from ds_engine import Engine

    engine = Engine(
        backend="accelerate",
        zero_stage=stage,
        precision=precision,
        gradient_accumulation_steps=2,
        gradient_clipping=0.5,
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (2 * 2 * 2 * STEPS, 12), generator=g)
    loader = DataLoader(TensorDataset(ids), batch_size=2)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    norms = []
    for (batch,) in loader:
        with engine.accumulate(model):
            engine.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            norms.append(engine.grad_norm)
    probe = torch.arange(12).reshape(1, 12) % 64
    with torch.no_grad(), engine.autocast():
        live_logits = model(input_ids=probe.to(engine.device)).logits.float().cpu()
    state = engine.get_state_dict(model)
    folder = out / f"zero{stage}_{precision}"
    engine.save_pretrained(model, folder)
    # tiny shards: every layer is larger than the gather bucket, so sharded tensors are sent to
    # rank 0 one rank's rows at a time (WeightGather.pieces) and written at their offsets
    engine.save_pretrained(model, out / f"zero{stage}_{precision}_pieces", max_shard_size="4KB")
    result = {
        "fsdp": hasattr(model, "set_requires_gradient_sync"),
        "norms": norms,
        "steps": engine.num_optimizer_steps,
    }
    if rank() == 0:
        from transformers import GPT2LMHeadModel

        assert state is not None
        reloaded = GPT2LMHeadModel.from_pretrained(folder)
        reloaded_state = reloaded.state_dict()
        result["state_keys_match"] = sorted(state) == sorted(reloaded_state)
        result["state_max_diff"] = max(
            float((state[k].float() - reloaded_state[k].float()).abs().max()) for k in state
        )
        result["state_dtypes"] = sorted({str(v.dtype) for v in state.values()})
        with torch.no_grad():
            logits = reloaded.to(torch.float32)(input_ids=probe).logits
        result["logits_max_diff"] = float((logits - live_logits).abs().max())
        result["tied"] = reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    else:
        result["state_is_none"] = state is None
    return result


def main() -> None:
    args = parse_args([("--runs", {"required": True})])
    pretend_fsdp_platform()
    results = {}
    for stage, precision in json.loads(args.runs):
        results[f"zero{stage}_{precision}"] = train(stage, precision, Path(args.out))
    write_result(args.out, results)


if __name__ == "__main__":
    main()
