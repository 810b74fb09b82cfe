"""One rank of test_trainer_json.py: a few steps of the Hugging Face Trainer with the DeepSpeed JSON
`ds-engine config --for-trainer` wrote (`TrainingArguments(deepspeed=path)`), on a tiny BERT
classifier built from a config (nothing downloaded). Reports the losses the Trainer logged and the
values it filled into the JSON's "auto" entries."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, vocab, (n, 16), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(16, dtype=torch.long),
            "labels": self.labels[i],
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out_dir:
        training = TrainingArguments(
            output_dir=out_dir,
            deepspeed=args.config,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=args.steps,
            learning_rate=1e-3,
            warmup_steps=1,
            weight_decay=0.01,
            max_grad_norm=1.0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        config = BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=512
        )
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        trainer = Trainer(model=model, args=training, train_dataset=_Pairs(64, config.vocab_size))
        trainer.train()
        filled = trainer.accelerator.deepspeed_plugin.deepspeed_config
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        result = {
            "losses": losses,
            "finite": bool(losses) and all(math.isfinite(x) for x in losses),
            "global_step": trainer.state.global_step,
            "world_size": dist.get_world_size(),
            "stage": filled["zero_optimization"]["stage"],
            "filled": json.loads(json.dumps(filled, default=str)),
        }
        (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
