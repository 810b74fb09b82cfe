"""`engine.init_context()` under ZeRO-3 on 2 real CPU ranks: parameters are partitioned at
creation (from_pretrained, direct construction, from_config), the first loss equals ZeRO-0's for
the same seed and weights, and after the context a plain `from_pretrained` is plain again."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

KINDS = ["minilm", "gpt2_direct", "gpt2_from_config"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("init_context.py", out_dir=tmp_path_factory.mktemp("init_context"), timeout=900)


@pytest.mark.parametrize("kind", KINDS)
def test_zero3_partitions_at_creation(results, kind):
    for rank_result in results:
        zero3 = rank_result[f"{kind}:zero3"]["partition"]
        zero0 = rank_result[f"{kind}:zero0"]["partition"]
        assert zero3["num_partitioned"] == zero3["num_params"] > 0  # every parameter has a ds_id
        assert zero3["full_numel"] == zero0["full_numel"] == zero0["local_numel"]
        # each rank holds about half (partitions are padded to the world size)
        assert zero3["local_numel"] <= zero3["full_numel"] // 2 + zero3["num_params"]
        assert zero0["num_partitioned"] == 0  # the context is a no-op below ZeRO-3


_HF_INIT_LOST = pytest.mark.xfail(
    strict=True,
    reason="built inside the backend's own zero.Init, transformers 5.24 skips its zero3 path "
    "(initialize_weights_zero3) and runs _init_weights on empty shards: embeddings keep "
    "nn.Embedding's N(0, 1), c_proj misses GPT-2's scaled init; fix in DeepSpeedBackend.init_context",
)


@pytest.mark.parametrize(
    "kind",
    [
        "minilm",
        pytest.param("gpt2_direct", marks=_HF_INIT_LOST),
        pytest.param("gpt2_from_config", marks=_HF_INIT_LOST),
    ],
)
def test_first_loss_equals_zero0(results, kind):
    for rank_result in results:
        zero0, zero3 = rank_result[f"{kind}:zero0"]["loss"], rank_result[f"{kind}:zero3"]["loss"]
        assert zero3 == pytest.approx(zero0, rel=1e-6, abs=1e-6), (kind, zero0, zero3)


@pytest.mark.parametrize("kind", ["minilm", "gpt2_from_config"])
def test_plain_from_pretrained_after_the_context(results, kind):
    for rank_result in results:
        result = rank_result[f"{kind}:zero3"]
        assert result["hf_config_alive_after"] is False
        reload = result["reload_partition"]
        assert reload["num_partitioned"] == 0 and reload["local_numel"] == reload["full_numel"] > 0


def test_init_context_with_an_explicit_micro_batch_size(results):
    assert results[0]["explicit_micro_batch"] == ""
