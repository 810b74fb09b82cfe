"""Checkpoint and resume: `save_state` / `load_state`, `skip_first_batches`, a registered object."""

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset


class StepCounter:
    def __init__(self):
        self.optimizer_steps = 0

    def state_dict(self):
        return {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state):
        self.optimizer_steps = state["optimizer_steps"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument(
        "--checkpoint-at", type=int, default=5, help="save after this many batches of epoch 0"
    )
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    project = os.path.join(args.out, "project")
    accelerator = Accelerator(
        cpu=args.cpu,
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2
        ),
        step_scheduler_with_optimizer=False,
    )
    set_seed(7)
    x = torch.randn(40, 6)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    epochs = 2
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    scheduler = accelerator.prepare(scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)

    start_epoch, skip = 0, 0
    if args.resume:
        accelerator.load_state()  # the newest checkpoint_<i> under project/checkpoints
        start_epoch, skip = divmod(counter.optimizer_steps, len(loader))
    losses, lrs = [], []
    for epoch in range(start_epoch, epochs):
        model.train()
        active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for step, (inputs, targets) in enumerate(active, start=skip if epoch == start_epoch else 0):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.optimizer_steps += 1
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            lrs.append(scheduler.get_last_lr()[0])
            if not args.resume and epoch == 0 and step + 1 == args.checkpoint_at:
                accelerator.save_state()
    name = "resumed.json" if args.resume else "full.json"
    if accelerator.is_main_process:
        Path(args.out, name).write_text(
            json.dumps({"losses": losses, "lrs": lrs, "steps": counter.optimizer_steps})
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
