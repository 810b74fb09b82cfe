"""Accumulation written by hand (accelerate's original DeepSpeed loop): `loss / gas`, step every gas."""

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()

    gradient_accumulation_steps = 3
    accelerator = Accelerator(cpu=args.cpu, step_scheduler_with_optimizer=False)
    set_seed(99)
    x = torch.randn(36, 4)
    y = x[:, :1] * 2 - x[:, 1:2]
    loader = DataLoader(TensorDataset(x, y), batch_size=3, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    updates = len(loader) // gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (updates + 1))
    scheduler = accelerator.prepare(scheduler)

    losses, lrs = [], []
    model.train()
    for step, (inputs, targets) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
        accelerator.backward(loss / gradient_accumulation_steps)
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
    if accelerator.is_main_process:
        Path(args.out, "result.json").write_text(json.dumps({"losses": losses, "lrs": lrs}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
