"""Distillation: a frozen teacher and a reference model without an optimizer beside the trained
student, all in one `accelerator.prepare`; gradient accumulation, a schedule, and
`save_state` / `load_state` with every model prepared."""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


class BatchCounter:
    def __init__(self):
        self.batches = 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def flat(state):
    return [float(v) for name in sorted(state) for v in state[name].float().flatten()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--checkpoint-at", type=int, default=4, help="save after this many batches")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu, gradient_accumulation_steps=2, step_scheduler_with_optimizer=False
    )
    set_seed(11)
    x = torch.randn(40, 6)
    y = torch.randn(40, 3)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)
    teacher = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = torch.nn.Linear(6, 3)  # no optimizer over it, used under no_grad (DPO-style)
    student = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    teacher, student, reference, optimizer, loader, scheduler = accelerator.prepare(
        teacher, student, reference, optimizer, loader, scheduler
    )
    teacher.requires_grad_(False)  # frozen (accelerate's DDP refuses a model frozen before prepare)
    teacher.eval()
    counter = BatchCounter()
    accelerator.register_for_checkpointing(counter)
    state_dir = os.path.join(args.out, "state")
    start_epoch, skip = 0, 0
    if args.resume:
        accelerator.load_state(state_dir)
        start_epoch, skip = divmod(counter.batches, len(loader))

    temperature, epochs = 2.0, 2
    losses, lrs = [], []
    for epoch in range(start_epoch, epochs):
        student.train()
        active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for inputs, targets in active:
            with accelerator.accumulate(student):
                with torch.no_grad():
                    teacher_logits = teacher(inputs)
                    reference_out = reference(inputs)
                out = student(inputs)
                kl = F.kl_div(
                    F.log_softmax(out / temperature, dim=-1),
                    F.log_softmax(teacher_logits / temperature, dim=-1),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = (
                    kl * temperature**2
                    + 0.5 * F.mse_loss(out, targets)
                    + 0.1 * F.mse_loss(out, reference_out)
                )
                accelerator.backward(loss)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            counter.batches += 1
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            lrs.append(scheduler.get_last_lr()[0])
            if not args.resume and counter.batches == args.checkpoint_at:
                accelerator.save_state(state_dir)
    student_state = accelerator.get_state_dict(student)
    teacher_state = accelerator.get_state_dict(teacher)
    reference_state = accelerator.get_state_dict(reference)
    if not args.resume:
        accelerator.save_model(student, os.path.join(args.out, "student"))
    if accelerator.is_main_process:
        result = {
            "losses": losses,
            "lrs": lrs,
            "student": flat(student_state),
            "teacher": flat(teacher_state),
            "reference": flat(reference_state),
            "unwrapped": type(accelerator.unwrap_model(teacher)).__name__,
        }
        Path(args.out, "resumed.json" if args.resume else "full.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
