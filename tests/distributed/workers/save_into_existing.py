"""`engine.save_pretrained` under ZeRO-3 on 2 CPU ranks into a run folder that holds other files.

Run by tests/distributed/test_save_into_existing.py. Rank 0 plants a `checkpoint-1/` folder
(a real `engine.save_checkpoint` of this run), `metrics.jsonl` and notes into `<out>/run`; the
model is saved there single-file, trained one step, saved again sharded (`40KB`), and its full
state dict written to `<out>/state.pt` (rank 0). Then a save into `<out>/conflict`, whose
`config.json` is a folder, must fail on both ranks with the same error (no rank hangs).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from _common import error_of, parse_args, rank, write_result


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    warnings.simplefilter("ignore")
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_engine import Engine

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    engine = Engine(zero_stage=3, precision="fp32", micro_batch_size=1)
    torch.manual_seed(0)
    with engine.init_context():
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.prepare(model, optimizer)

    run = out / "run"
    engine.save_checkpoint(run / "checkpoint-1")
    if rank() == 0:
        (run / "metrics.jsonl").write_text('{"step": 0}\n')
        (run / "notes.md").write_text("kept\n")
    engine.save_pretrained(model, run)

    batch = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    engine.save_pretrained(model, run, max_shard_size="40KB")
    state = engine.get_state_dict(model)
    if rank() == 0:
        assert state is not None
        torch.save(state, out / "state.pt")
        (out / "conflict" / "config.json").mkdir(parents=True)
    torch.distributed.barrier()
    conflict = error_of(lambda: engine.save_pretrained(model, out / "conflict"))
    write_result(args.out, {"conflict": conflict})
    engine.end_training()


if __name__ == "__main__":
    main()
