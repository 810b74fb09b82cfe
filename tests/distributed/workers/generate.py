"""Worker: `engine.generate` on 2 real CPU ranks whose prompts stop at different lengths.

--suite deepspeed: one tiny GPT-2 under ZeRO-3 (created in `engine.init_context()`), generated
on the synced path (`gather=False`), the gathered path (`gather=True`) and the automatic choice
(`gather=None`), each with per-rank `max_new_tokens` and with a per-rank EOS that one rank's
greedy output emits early; then the same under ZeRO-2. --suite fallback: the accelerate
backend (DDP). Each scenario also runs an evaluation block in `engine.gathered(model)` (one
gather for several `generate` calls and plain forwards; rank 1 makes one call and one forward
more than rank 0, so anything collective inside would hang), checks what the block refuses on
ZeRO-3 and that the model is partitioned again after it. Every rank also generates with an
unsharded copy of the same seed-built model in this process (the reference), and counts the
forwards its model ran (a forward hook), which tells the synced path (every rank steps until
the longest is done) from the gathered one (each rank stops on its own).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from _common import error_of, parse_args, rank, write_result

SEED = 11
VOCAB = 256
MAX_NEW = {0: 3, 1: 9}  # rank -> max_new_tokens (min_new_tokens too, so lengths are exact)
EOS_MAX_NEW = 10
EOS_STEP = 2  # rank 0 stops by its 3rd new token (its EOS: the last new token it emits by then)


def build() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.3,  # varied greedy outputs (the default repeats one token)
    )
    return GPT2LMHeadModel(config)


def prompts() -> torch.Tensor:
    """Two prompts of 6 tokens, different on each rank (no token 0: the config's EOS)."""
    return torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 + rank()))


def new_tokens(ids: torch.Tensor) -> list[list[int]]:
    return ids[:, 6:].tolist()


def eos_kwargs(reference: torch.nn.Module) -> dict[str, Any]:
    """Per rank: rank 0's EOS is a token its greedy output emits (first) by step EOS_STEP, so it
    stops early; rank 1's EOS is a token its output never emits, so it runs to EOS_MAX_NEW."""
    prompt = prompts()[:1]
    with torch.no_grad():
        free = reference.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=EOS_MAX_NEW,
            min_new_tokens=EOS_MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    emitted = free[0, 6:].tolist()
    if rank() == 0:
        new = [i for i in range(len(emitted)) if emitted[i] not in emitted[:i]]
        eos = emitted[max(i for i in new if i <= EOS_STEP)]
    else:
        eos = next(t for t in range(1, VOCAB) if t not in emitted)
    return {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": EOS_MAX_NEW,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }


def maxnew_kwargs() -> dict[str, Any]:
    n = MAX_NEW[rank()]
    ids = prompts()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": n,
        "min_new_tokens": n,
        "pad_token_id": 0,
    }


class ForwardCounter:
    def __init__(self, module: torch.nn.Module) -> None:
        self.n = 0
        module.register_forward_hook(self.hook)

    def hook(self, *_: Any) -> None:
        self.n += 1


def run_case(engine: Any, model: Any, module: Any, reference: Any, kwargs: dict, gather: Any) -> dict:
    counter_start = COUNTER.n
    ids = engine.generate(model, do_sample=False, gather=gather, **kwargs)
    with torch.no_grad():
        want = reference.generate(do_sample=False, **kwargs)
    return {
        "ids": new_tokens(ids),
        "reference": new_tokens(want),
        "forwards": COUNTER.n - counter_start,
    }


def partitioned_now(module: torch.nn.Module) -> list[str]:
    """Parameters whose full data is on this rank now (none after a ZeRO-3 generate, except
    DeepSpeed's persistent small ones)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        name
        for name, p in module.named_parameters()
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist
    ]


def released_after(module: torch.nn.Module) -> dict:
    """ZeRO-3: the non-persistent parameters hold an empty local tensor and only their shard in
    `ds_tensor` (as DeepSpeed leaves them partitioned)."""
    params: list[Any] = list(module.parameters())
    partitioned = [p for p in params if not p.ds_persist]
    return {
        "count": len(partitioned),
        "empty": all(p.numel() == 0 for p in partitioned),
        "sharded": all(0 < p.ds_tensor.numel() < p.ds_numel for p in partitioned),
    }


def eval_batch() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def gathered_block(engine: Any, model: Any, module: Any, reference: Any, optimizer: Any, stage: int) -> dict:
    """An evaluation loop in `engine.gathered(model)`: several `generate` calls (per-rank lengths,
    and one call more on rank 1) and plain forwards; what the block refuses (ZeRO-3); the state
    after it."""
    from ds_engine.generation import is_gathered

    out: dict = {}
    modes = [(sub, sub.training) for sub in module.modules()]
    batch = eval_batch()
    with torch.no_grad():
        want = reference(input_ids=batch).logits
    with engine.gathered(model):
        out["block_is_gathered"] = is_gathered(module)
        out["block:maxnew"] = run_case(engine, model, module, reference, maxnew_kwargs(), None)
        out["block:eos"] = run_case(engine, model, module, reference, eos_kwargs(reference), True)
        if rank() == 1:  # one generate call more on this rank only: nothing inside is collective
            out["block:extra"] = run_case(engine, module, module, reference, maxnew_kwargs(), None)
        module.eval()
        with torch.no_grad():
            start = COUNTER.n
            logits = model(input_ids=batch).logits
            bare_logits = module(input_ids=batch).logits
            if rank() == 1:
                model(input_ids=batch)  # a forward more on this rank only
            out["block_forwards"] = COUNTER.n - start
        out["block_logits_diff"] = float((logits - want).abs().max())
        out["block_bare_logits_diff"] = float((bare_logits - want).abs().max())
        with engine.gathered(module):  # nested (the bare module): a no-op
            out["block:nested"] = run_case(engine, model, module, reference, maxnew_kwargs(), None)
        out["block_after_nested"] = is_gathered(module)
        if stage == 3:
            out["block_still_whole"] = partitioned_now(module) == [
                n for n, p in module.named_parameters() if not p.ds_persist
            ]
            out["block_synced"] = error_of(lambda: engine.generate(model, gather=False, **maxnew_kwargs()))
            module.train()
            out["block_backward"] = error_of(
                lambda: engine.backward(model(input_ids=batch, labels=batch).loss)
            )
            out["block_step"] = error_of(optimizer.step)
            out["block_state_dict"] = error_of(lambda: engine.get_state_dict(model))
    for sub, training in modes:
        sub.training = training
    out["block_left"] = not is_gathered(module)
    if stage == 3:
        out["block_released"] = released_after(module)
    return out


COUNTER: ForwardCounter


def scenario(backend: str, stage: int, gathers: dict[str, Any]) -> dict:
    global COUNTER
    from ds_engine import Engine

    reference = build().eval()
    engine = Engine(backend=backend, zero_stage=stage, micro_batch_size=2)
    with engine.init_context():
        created = build()
    optimizer = torch.optim.SGD(created.parameters(), lr=0.1)
    model, optimizer = engine.prepare(created, optimizer)
    module = engine.unwrap_model(model)
    COUNTER = ForwardCounter(module)
    result: dict = {"backend": engine.backend_name}
    module.train()
    module.transformer.h[0].eval()  # a mixed mode, restored as it was
    for name, gather in gathers.items():
        result[f"{name}:maxnew"] = run_case(engine, model, module, reference, maxnew_kwargs(), gather)
        result[f"{name}:eos"] = run_case(engine, model, module, reference, eos_kwargs(reference), gather)
    result["modes_after"] = [module.training, module.transformer.training, module.transformer.h[0].training]
    # the bare module works too (its DeepSpeed engine is found)
    result["bare:maxnew"] = run_case(engine, module, module, reference, maxnew_kwargs(), None)
    result.update(gathered_block(engine, model, module, reference, optimizer, stage))
    if stage == 3:
        result["still_gathered"] = partitioned_now(module)
        result["bad_gather"] = error_of(lambda: engine.generate(model, gather="yes", **maxnew_kwargs()))
        result["unsynced"] = error_of(
            lambda: engine.generate(model, gather=False, synced_gpus=False, **maxnew_kwargs())
        )
    # training still works after generation (ZeRO-3: hooks and partitions restored)
    batch = eval_batch()
    with torch.no_grad():
        model.eval()
        result["loss"] = float(model(input_ids=batch, labels=batch).loss)
        result["reference_loss"] = float(reference(input_ids=batch, labels=batch).loss)
    model.train()
    with engine.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        result["loss_after_step"] = float(model(input_ids=batch, labels=batch).loss)
    # the same step on the unsharded reference (both ranks train on the same batch)
    reference.train()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(input_ids=batch, labels=batch).loss.backward()
    reference_optimizer.step()
    with torch.no_grad():
        result["reference_loss_after_step"] = float(reference(input_ids=batch, labels=batch).loss)
    return result


def main() -> None:
    args = parse_args([("--suite", {"required": True, "choices": ["deepspeed", "fallback"]})])
    results: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.suite == "deepspeed":
            results["zero3"] = scenario("deepspeed", 3, {"synced": False, "gathered": True, "auto": None})
            results["zero2"] = scenario("deepspeed", 2, {"plain": None, "plain_gather": True})
        else:
            results["fallback"] = scenario("accelerate", 0, {"plain": None, "plain_gather": True})
    write_result(args.out, results)


if __name__ == "__main__":
    main()
