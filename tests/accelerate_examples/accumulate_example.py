"""Gradient accumulation with `accelerator.accumulate`, AdamW and a linear LR schedule."""

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

logger = get_logger(__name__)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--accelerate-sizing",
        action="store_true",
        help="size the schedule from the un-prepared loader and let prepare step it",
    )
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision="no",
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        # one scheduler step per optimizer step, stepped below at the boundaries
        step_scheduler_with_optimizer=args.accelerate_sizing,
    )
    logger.info(accelerator.state, main_process_only=False)
    logger.info(f"precision {accelerator.mixed_precision}", main_process_only=True)
    set_seed(1234)
    x = torch.randn(48, 8)
    y = (x @ torch.randn(8, 1)).tanh() + 0.1 * torch.randn(48, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if args.accelerate_sizing:  # accelerate's examples: from the un-prepared loader
        total = math.ceil(len(loader) / accelerator.gradient_accumulation_steps) * args.epochs
    else:
        total = None
    if total is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:  # sized from the prepared loader: optimizer steps per process
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        total = math.ceil(len(loader) / accelerator.gradient_accumulation_steps) * args.epochs
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
        scheduler = accelerator.prepare(scheduler)
    assert accelerator.distributed_type != DistributedType.NO

    losses, lrs = [], []
    for _ in range(args.epochs):
        model.train()
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                if args.accelerate_sizing or accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            if accelerator.sync_gradients:
                lrs.append(scheduler.get_last_lr()[0])
    if accelerator.is_main_process:
        Path(args.out, "result.json").write_text(json.dumps({"losses": losses, "lrs": lrs}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
