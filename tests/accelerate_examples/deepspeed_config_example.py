"""DeepSpeed's own optimizer and scheduler from the config (`DummyOptim` / `DummyScheduler`),
weight-decay param groups, and a schedule sized from the un-prepared loader, as accelerate's
`deepspeed_with_config_support` example does: DeepSpeed's scheduler when the config has a
`scheduler` block, a transformers schedule over DeepSpeed's optimizer when it has only an
`optimizer` block, torch AdamW and the same schedule when it has neither."""

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import get_linear_schedule_with_warmup


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=1)
    set_seed(1234)
    x = torch.randn(64, 8)
    y = (x @ torch.randn(8, 1)).tanh() + 0.1 * torch.randn(64, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    no_decay = ["bias"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if n.split(".")[-1] not in no_decay],
            "weight_decay": 0.1,
        },
        {
            "params": [p for n, p in model.named_parameters() if n.split(".")[-1] in no_decay],
            "weight_decay": 0.0,
        },
    ]
    plugin = accelerator.state.deepspeed_plugin
    ds_config = plugin.deepspeed_config if plugin is not None else {}
    optimizer_cls = DummyOptim if "optimizer" in ds_config else torch.optim.AdamW
    optimizer = optimizer_cls(groups, lr=args.lr)
    max_train_steps = math.ceil(len(loader) / accelerator.gradient_accumulation_steps) * args.epochs
    if "scheduler" in ds_config:  # DeepSpeed's scheduler, its "auto" values filled by prepare
        scheduler = DummyScheduler(optimizer, total_num_steps=max_train_steps, warmup_num_steps=args.warmup)
    elif "optimizer" in ds_config:  # DeepSpeed's optimizer, a transformers schedule over it
        scheduler = DummyScheduler(
            optimizer,
            lr_scheduler_callable=lambda opt: get_linear_schedule_with_warmup(
                opt, args.warmup, max_train_steps
            ),
        )
    else:
        scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, max_train_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, lrs = [], []
    for _ in range(args.epochs):
        model.train()
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            lrs.append(scheduler.get_last_lr()[0])
    if accelerator.is_main_process:
        Path(args.out, "result.json").write_text(
            json.dumps({"losses": losses, "lrs": lrs, "optimizer": type(optimizer).__name__})
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
