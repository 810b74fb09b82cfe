"""Streaming save of a ~110M-parameter GPT-2 under ZeRO-3 on 2 CPU ranks, rank 0's memory measured.

Run by tests/distributed/test_streaming_save.py. glibc is told to serve every block over 64 KiB
from mmap (M_MMAP_THRESHOLD), so freed memory leaves the resident set and RSS tracks live memory.
Rank 0 records, for `engine.save_pretrained(model, dir, max_shard_size=SHARD)`, the rise of its
peak RSS (VmHWM, reset through /proc/self/clear_refs) over the RSS just before the call, and
the sizes it is judged against (largest shard written, largest layer); then the full state dict
(`engine.get_state_dict`) to check the bytes. After `save_checkpoint`, rank 0 runs offline
`consolidate_checkpoint` on the checkpoint while a thread samples its anonymous memory
(RssAnon, every 2 ms): the checkpoint files are memory-mapped, and their clean page-cache pages
count in RSS but not in RssAnon.
"""

from __future__ import annotations

import ctypes
import threading
import time
import warnings
from pathlib import Path

import torch
from _common import parse_args, rank, write_result

SHARD = "100MB"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def trim() -> None:
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class AnonSampler:
    """The highest RssAnon seen every 2 ms while in the block."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.002)

    def __enter__(self) -> AnonSampler:
        self.base = _status("RssAnon")
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
    warnings.simplefilter("ignore")
    from transformers import GPT2Config, GPT2LMHeadModel

    from ds_engine import Engine

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=32000, n_positions=256)
    engine = Engine(zero_stage=3, precision="fp32", micro_batch_size=1)
    torch.manual_seed(0)
    with engine.init_context():
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = engine.prepare(model, optimizer)
    batch = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

    module = engine.unwrap_model(model)
    result: dict = {"params": sum(int(p.ds_numel) for p in module.parameters())}
    layers = [sum(int(p.ds_numel) * 4 for p in m.parameters(recurse=False)) for m in module.modules()]
    result["largest_layer"] = max(layers)

    trim()
    torch.distributed.barrier()
    base = rss()
    reset_peak()
    engine.save_pretrained(model, out / "streamed", max_shard_size=SHARD)
    result["save_rise"] = _status("VmHWM") - base
    torch.distributed.barrier()

    state = engine.get_state_dict(model)  # the reference bytes are built from it (rank 0)
    if rank() == 0:
        assert state is not None
        torch.save(state, out / "state.pt")
    del state
    trim()

    engine.save_checkpoint(out / "ckpt")
    torch.distributed.barrier()
    if rank() == 0:
        from ds_engine.consolidate import consolidate_checkpoint

        trim()
        base = rss()
        reset_peak()
        with AnonSampler() as sampler:
            consolidate_checkpoint(out / "ckpt", out / "offline", max_shard_size=SHARD)
        result["offline_anon_rise"] = sampler.peak - sampler.base
        result["offline_rss_rise"] = _status("VmHWM") - base
        result["largest_tensor"] = max(int(p.ds_numel) * 4 for p in module.parameters())
    odd_sizes(out)
    result.update(converted(out))
    write_result(args.out, result)
    engine.end_training()


def odd_sizes(out: Path) -> None:
    """A layer whose size the 2 ranks do not divide (the last partition is padded), larger than
    the gather bucket (so it is sent a partition at a time), in bf16 and fp32."""
    from ds_engine import Engine

    for precision in ("bf16", "fp32"):
        engine = Engine(zero_stage=3, precision=precision, micro_batch_size=1)
        torch.manual_seed(2)
        with engine.init_context():
            model = torch.nn.Sequential(torch.nn.Linear(1001, 1001), torch.nn.Linear(1001, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.prepare(model, optimizer)
        engine.save_pretrained(model, out / f"odd_{precision}", max_shard_size="2MB")
        state = engine.get_state_dict(model)
        if rank() == 0:
            assert state is not None
            torch.save(state, out / f"odd_{precision}.pt")
        del state, model, optimizer


def _counting_collect() -> list[int]:
    """Count calls of `weights._collect`, the whole-dict gather (streaming never calls it)."""
    from ds_engine import weights

    calls = [0]
    original = weights._collect

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    weights._collect = counted
    return calls


def converted(out: Path) -> dict:
    """Models whose names transformers converts back on save, saved through ds_engine (ZeRO-3) and
    through transformers' own `save_pretrained` (rank 0, unsharded copy), with the same
    max_shard_size:

    * a BERT loaded from a checkpoint with legacy names (`LayerNorm.gamma`/`beta`, as old BERT
      checkpoints have): renames only, so streamed (whole-dict gathers counted);
    * a tiny Mixtral built from its config: transformers fuses its experts on load and splits
      them on save (`WeightConverter`), which needs the whole dict.
    """
    from transformers import BertForMaskedLM, MixtralForCausalLM

    from ds_engine import Engine
    from tests.converted_models import tiny_mixtral_config, write_legacy_bert

    calls = _counting_collect()
    result = {}
    legacy = out / "legacy_src"
    if rank() == 0:
        write_legacy_bert(legacy)
        BertForMaskedLM.from_pretrained(legacy).save_pretrained(out / "legacy_hf", max_shard_size="100KB")
    torch.distributed.barrier()
    engine = Engine(zero_stage=3, precision="fp32", micro_batch_size=1)
    with engine.init_context():
        model = BertForMaskedLM.from_pretrained(legacy)
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = calls[0]
    engine.save_pretrained(model, out / "legacy_streamed", max_shard_size="100KB")
    result["legacy_collect_calls"] = calls[0] - before
    del model

    engine = Engine(zero_stage=3, precision="fp32", micro_batch_size=1)
    config = tiny_mixtral_config()
    torch.manual_seed(4)
    with engine.init_context():
        model = MixtralForCausalLM(config)
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = calls[0]
    engine.save_pretrained(model, out / "moe_engine", max_shard_size="100KB")
    result["moe_collect_calls"] = calls[0] - before
    state = engine.get_state_dict(model)
    if rank() == 0:
        assert state is not None
        plain = MixtralForCausalLM(config)
        plain.load_state_dict(state)
        plain.save_pretrained(out / "moe_hf", max_shard_size="100KB")
    torch.distributed.barrier()
    return result


if __name__ == "__main__":
    main()
