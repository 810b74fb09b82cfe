"""`engine.init_context()` under ZeRO-3 on 2 real CPU ranks: parameters are partitioned at
creation (from_pretrained, direct construction, from_config, bf16, a plain nn.Module) and gathered
one module at a time while they are initialised; the weights and buffers (dtype and values), the
RNG state after creation and the first loss equal ZeRO-0's for the same seed; after the context a
plain `from_pretrained` is plain again."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

KINDS = ["minilm", "gpt2_direct", "gpt2_from_config", "llama_bf16", "plain"]
HF_BUILT = ["gpt2_direct", "gpt2_from_config", "llama_bf16"]  # weights from the model's own init


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


@pytest.mark.parametrize("kind", KINDS)
def test_weights_equal_zero0(results, kind):
    for rank_result in results:
        zero0, zero3 = rank_result[f"{kind}:zero0"]["weights"], rank_result[f"{kind}:zero3"]["weights"]
        assert zero0.keys() == zero3.keys()
        differing = {name: (zero0[name], zero3[name]) for name in zero0 if zero0[name] != zero3[name]}
        assert not differing, (kind, differing)


@pytest.mark.parametrize("kind", KINDS)
def test_first_loss_equals_zero0(results, kind):
    for rank_result in results:
        zero0, zero3 = rank_result[f"{kind}:zero0"]["loss"], rank_result[f"{kind}:zero3"]["loss"]
        assert zero3 == pytest.approx(zero0, rel=1e-6, abs=1e-6), (kind, zero0, zero3)


@pytest.mark.parametrize("kind", KINDS)
def test_same_random_draws_as_zero0(results, kind):
    """Creation consumed the RNG exactly as ZeRO-0 did, on every rank (dropout, shuffling and
    any later init see the same stream)."""
    for rank_result in results:
        assert rank_result[f"{kind}:zero3"]["rng_after"] == rank_result[f"{kind}:zero0"]["rng_after"]


@pytest.mark.parametrize("kind", HF_BUILT)
def test_init_gathers_one_module_at_a_time(results, kind):
    for rank_result in results:
        gathers = rank_result[f"{kind}:zero3"]["gathers"]
        full_numel = rank_result[f"{kind}:zero3"]["partition"]["full_numel"]
        # one gather per parameterised module (own + direct children), never the whole model
        assert gathers["num_gathers"] >= 2
        assert 0 < gathers["max_gathered_numel"] < full_numel // 2
        assert rank_result[f"{kind}:zero0"]["gathers"]["num_gathers"] == 0


def test_plain_module_is_not_gathered(results):
    for rank_result in results:
        assert rank_result["plain:zero3"]["gathers"]["num_gathers"] == 0


@pytest.mark.parametrize("kind", ["minilm", "gpt2_from_config"])
def test_plain_from_pretrained_after_the_context(results, kind):
    for rank_result in results:
        result = rank_result[f"{kind}:zero3"]
        assert result["hf_config_alive_after"] is False
        reload = result["reload_partition"]
        assert reload["num_partitioned"] == 0 and reload["local_numel"] == reload["full_numel"] > 0


def test_init_context_with_an_explicit_micro_batch_size(results):
    assert results[0]["explicit_micro_batch"] == ""
