"""A shuffled loader over a dataset that does not divide into the ranks' batches, dropout in the
model, three epochs: the batches each rank draws and the random stream the model sees."""

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

    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=2)
    set_seed(42)
    x = torch.randn(60, 8)  # 8 global batches of 8, the last one padded: whole windows of 2
    y = (x @ torch.randn(8, 1)).tanh()
    index = torch.arange(60)
    loader = DataLoader(TensorDataset(x, y, index), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, orders = [], []
    for _ in range(3):
        model.train()
        order = []
        for inputs, targets, ids in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).mean().item())
            order.append(accelerator.gather(ids).tolist())
        orders.append(order)
    if accelerator.is_main_process:
        Path(args.out, "result.json").write_text(
            json.dumps({"losses": losses, "lrs": [0.05], "orders": orders})
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
