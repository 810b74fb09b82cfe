"""`engine.generate` on 2 real CPU ranks whose prompts stop at different lengths.

One torchrun launch per environment runs every scenario (`workers/generate.py`): ZeRO-3 on the
synced path, the gathered path and the automatic choice, ZeRO-2 (DeepSpeed), and the plain
accelerate fallback. Each rank generates with per-rank `max_new_tokens` and with a per-rank EOS
that one rank's greedy output emits early; the ids must equal those of an unsharded copy of the
same model generating in one process, and every launch must finish (a hang is the launcher's
timeout).
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed]

ZERO3_PATHS = ["synced", "gathered", "auto"]
CASES = ["maxnew", "eos"]


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory):
    return run_workers(
        "generate.py", "--suite", "deepspeed", out_dir=tmp_path_factory.mktemp("generate"), timeout=600
    )


@pytest.fixture(scope="module")
def fallback_results(tmp_path_factory):
    return run_workers(
        "generate.py", "--suite", "fallback", out_dir=tmp_path_factory.mktemp("generate_fb"), timeout=600
    )


def _check_ids_and_lengths(ranks: list[dict], key: str) -> tuple[int, int]:
    """Every rank's ids equal the unsharded model's; the ranks stopped at different lengths.
    Returns each rank's forward count."""
    r0, r1 = (r[key] for r in ranks)
    for r in (r0, r1):
        assert r["ids"] == r["reference"], key
    lengths = [max(len(seq) for seq in r["ids"]) for r in (r0, r1)]
    assert lengths[0] < lengths[1], (key, lengths)  # rank 0 stops early
    if key.endswith(":eos"):
        assert lengths == [3, 10], (key, lengths)  # rank 0 hit its EOS, rank 1 ran to max_new_tokens
    else:
        assert lengths == [3, 9], (key, lengths)
    return r0["forwards"], r1["forwards"]


def _generated_several_tokens(ranks: list[dict], key: str) -> None:
    """The reference emits varied tokens (a model that repeats one token would prove little)."""
    ids = ranks[1][key]["ids"][0]
    assert len(set(ids)) > 3, ids


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_zero3_synced_path_steps_every_rank_until_all_finish(deepspeed_results, case):
    f0, f1 = _check_ids_and_lengths([r["zero3"] for r in deepspeed_results], f"synced:{case}")
    assert f0 == f1  # rank 0 kept stepping (dummy forwards) until rank 1 was done
    _generated_several_tokens([r["zero3"] for r in deepspeed_results], f"synced:{case}")


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("path", ["gathered", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_zero3_gathered_path_lets_each_rank_stop(deepspeed_results, path, case):
    """`gather=True`, and `gather=None` for a model that fits: one gather, no collective per
    token, so each rank runs only its own forwards."""
    f0, f1 = _check_ids_and_lengths([r["zero3"] for r in deepspeed_results], f"{path}:{case}")
    assert f0 < f1
    # prefill plus one forward per new token after the first, each rank its own count
    lengths = [3, 10] if case == "eos" else [3, 9]
    assert [f0, f1] == lengths


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_model_is_partitioned_and_trains_after_generation(deepspeed_results):
    for rank in deepspeed_results:
        zero3 = rank["zero3"]
        assert zero3["still_gathered"] == []  # every non-persistent parameter released again
        assert zero3["loss"] == pytest.approx(zero3["reference_loss"], rel=1e-6)
        assert zero3["loss_after_step"] < zero3["loss"]  # hooks restored: a real optimizer step
        assert zero3["modes_after"] == [True, True, False]  # each submodule's mode restored
    assert (
        deepspeed_results[0]["zero3"]["loss_after_step"] == deepspeed_results[1]["zero3"]["loss_after_step"]
    )


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_bare_module_and_bad_input(deepspeed_results):
    zero3 = [r["zero3"] for r in deepspeed_results]
    f0, f1 = _check_ids_and_lengths(zero3, "bare:maxnew")
    assert f0 < f1  # the bare module's DeepSpeed engine was found: gathered path
    for rank in zero3:
        assert rank["bad_gather"].startswith("TypeError: `gather='yes'`: allowed values are True, False")
        assert rank["unsynced"].startswith("ValueError: `engine.generate(..., synced_gpus=False)`")
        assert "HINT:" in rank["bad_gather"] and "HINT:" in rank["unsynced"]


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("key", ["plain:maxnew", "plain:eos", "plain_gather:maxnew", "plain_gather:eos"])
def test_zero2_generates_plainly(deepspeed_results, key):
    f0, f1 = _check_ids_and_lengths([r["zero2"] for r in deepspeed_results], key)
    assert f0 < f1  # nothing is partitioned: each rank stops on its own (gather=True is a no-op)
    for rank in deepspeed_results:
        assert rank["zero2"]["modes_after"] == [True, True, False]


@pytest.mark.parametrize("key", ["plain:maxnew", "plain:eos", "plain_gather:maxnew", "bare:maxnew"])
def test_fallback_generates_plainly(fallback_results, key):
    assert [r["fallback"]["backend"] for r in fallback_results] == ["accelerate", "accelerate"]
    f0, f1 = _check_ids_and_lengths([r["fallback"] for r in fallback_results], key)
    assert f0 < f1
    for rank in fallback_results:
        fallback = rank["fallback"]
        assert fallback["modes_after"] == [True, True, False]
        assert fallback["loss"] == pytest.approx(fallback["reference_loss"], rel=1e-6)
        assert fallback["loss_after_step"] < fallback["loss"]


# ---------------------------------------------------------------- engine.gathered: one gather per block
@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("key", ["block:maxnew", "block:eos", "block:nested"])
def test_zero3_gathered_block_generates_without_gathering_per_call(deepspeed_results, key):
    """In `engine.gathered(model)`: every `generate` (gather=None, True, nested block) gives the
    unsharded model's ids, each rank running only its own forwards (no synced stepping)."""
    zero3 = [r["zero3"] for r in deepspeed_results]
    f0, f1 = _check_ids_and_lengths(zero3, key)
    lengths = [3, 10] if key.endswith(":eos") else [3, 9]
    assert [f0, f1] == lengths


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_gathered_block_forwards_and_uneven_calls(deepspeed_results):
    """Rank 1 makes one `generate` call and one forward more than rank 0 inside the block (a
    collective there would hang); plain forwards give the unsharded logits."""
    r0, r1 = (r["zero3"] for r in deepspeed_results)
    assert "block:extra" not in r0
    assert r1["block:extra"]["ids"] == r1["block:extra"]["reference"]
    assert [r0["block_forwards"], r1["block_forwards"]] == [2, 3]
    for rank in (r0, r1):
        assert rank["block_is_gathered"] and rank["block_after_nested"] and rank["block_still_whole"]
        assert rank["block_logits_diff"] < 1e-5 and rank["block_bare_logits_diff"] < 1e-5


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_gathered_block_refuses_training_and_repartitions(deepspeed_results):
    for rank in deepspeed_results:
        zero3 = rank["zero3"]
        assert zero3["block_synced"].startswith("ValueError: `engine.generate(..., gather=False)` inside")
        for key, call in [("block_backward", "engine.backward(loss)"), ("block_step", "optimizer.step()")]:
            message = zero3[key]
            assert message.startswith(f"RuntimeError: `{call}` inside `engine.gathered(model)`"), message
            assert "HINT:" in message
        # another gather of the same parameters inside the block: DeepSpeed's own refusal
        assert zero3["block_state_dict"].startswith("RuntimeError:"), zero3["block_state_dict"]
        assert zero3["block_left"]
        released = zero3["block_released"]
        assert released["count"] > 0 and released["empty"] and released["sharded"], released
        assert zero3["still_gathered"] == []
        # training after the block: the step the unsharded model takes (SGD, same batch on both ranks)
        assert zero3["loss_after_step"] == pytest.approx(zero3["reference_loss_after_step"], rel=1e-5)


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("key", ["block:maxnew", "block:eos", "block:nested"])
def test_zero2_gathered_block_is_a_no_op(deepspeed_results, key):
    zero2 = [r["zero2"] for r in deepspeed_results]
    f0, f1 = _check_ids_and_lengths(zero2, key)
    assert f0 < f1
    for rank in zero2:
        assert not rank["block_is_gathered"] and rank["block_left"]
        assert rank["block_logits_diff"] < 1e-5
        assert rank["loss_after_step"] == pytest.approx(rank["reference_loss_after_step"], rel=1e-5)


@pytest.mark.parametrize("key", ["block:maxnew", "block:eos", "block:nested"])
def test_fallback_gathered_block_is_a_no_op(fallback_results, key):
    fallback = [r["fallback"] for r in fallback_results]
    f0, f1 = _check_ids_and_lengths(fallback, key)
    assert f0 < f1
    assert [r["block_forwards"] for r in fallback] == [2, 3]
    assert fallback[1]["block:extra"]["ids"] == fallback[1]["block:extra"]["reference"]
    for rank in fallback:
        assert not rank["block_is_gathered"] and rank["block_left"]
        assert rank["block_logits_diff"] < 1e-5 and rank["block_bare_logits_diff"] < 1e-5
        assert rank["loss_after_step"] == pytest.approx(rank["reference_loss_after_step"], rel=1e-5)
