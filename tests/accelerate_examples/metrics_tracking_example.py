"""Evaluation with `gather_for_metrics` on an uneven set, and TensorBoard tracking."""

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

    accelerator = Accelerator(cpu=args.cpu, log_with="tensorboard", project_dir=str(Path(args.out, "logs")))
    accelerator.init_trackers("metrics_example", config={"lr": 0.1, "epochs": 2})
    set_seed(11)
    centers = torch.randn(3, 5) * 2
    labels = torch.arange(60) % 3
    features = centers[labels] + torch.randn(60, 5)
    train = DataLoader(TensorDataset(features[:44], labels[:44]), batch_size=4, shuffle=False)
    # 13 samples on 2 processes in batches of 2: the last global batch is padded
    evaluation = DataLoader(TensorDataset(features[44:57], labels[44:57]), batch_size=2, shuffle=False)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)

    losses, accuracies, counted, step = [], [], [], 0
    for epoch in range(2):
        model.train()
        for inputs, targets in train:
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
            losses.append(mean_loss)
            accelerator.log({"train_loss": mean_loss}, step=step)
            step += 1
        model.eval()
        correct, seen = 0, 0
        for inputs, targets in evaluation:
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, targets))
            correct += (predictions == references).sum().item()
            seen += references.numel()
        accuracies.append(correct / seen)
        counted.append(seen)
        accelerator.log({"accuracy": correct / seen, "epoch": epoch}, step=step)
    # process utilities, each compared with accelerate's own run
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as mine:
        shares = accelerator.gather_for_metrics(mine, use_gather_object=True)
    ragged = torch.arange(accelerator.process_index + 2, dtype=torch.float32)
    padded = accelerator.gather(accelerator.pad_across_processes(ragged, pad_index=-1)).tolist()
    printed = []
    accelerator.on_main_process(lambda: printed.append("main"))()
    accelerator.on_last_process(lambda: printed.append("last"))()
    with accelerator.main_process_first():
        printed.append("first")
    utilities = {
        "shares": shares,
        "padded": padded,
        "printed": printed,
        "distributed": accelerator.use_distributed,
    }
    if accelerator.is_main_process:
        tracker = accelerator.get_tracker("tensorboard")
        Path(args.out, "result.json").write_text(
            json.dumps(
                {
                    "losses": losses,
                    "accuracies": accuracies,
                    "counted": counted,
                    "tracker": type(tracker).__name__,
                    "utilities": utilities,
                    "lrs": [optimizer.param_groups[0]["lr"]],
                }
            )
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
