"""The whole-peak memory model, the stage planner and the communication volumes (no process group;
the measured side is tests/distributed/test_memory_peak.py)."""

from __future__ import annotations

import pytest

from ds_engine import memory
from ds_engine.cli import main as cli_main

GB = 10**9


def _gpt_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaConfig(**{**base, **kw})


def _peaks(model, **kw):
    return {
        (st, oo, op): memory.estimate_peak(
            model, zero_stage=st, offload_optimizer=oo, offload_params=op, **kw
        )
        for st, oo, op in memory.PLAN_ORDER
    }


# --------------------------------------------------------------------------- peak terms
def test_peak_terms_follow_the_config_and_the_options():
    cfg = _gpt_config()
    plain = memory.estimate_peak(cfg, zero_stage=0, micro_batch=2, seq_len=128, device="cpu")
    assert plain.states.num_params > 20_000_000
    # activations grow with tokens; the logits term is the vocabulary's (18 bytes per logit, 16-bit)
    assert plain.logits == 18 * 2 * 128 * 8192
    longer = memory.estimate_peak(cfg, zero_stage=0, micro_batch=2, seq_len=256, device="cpu")
    assert longer.activations == pytest.approx(2 * plain.activations, rel=0.01)
    ckpt = memory.estimate_peak(
        cfg, zero_stage=0, micro_batch=2, seq_len=128, activation_checkpointing=True, device="cpu"
    )
    assert ckpt.activations < 0.5 * plain.activations
    # not a causal LM: no logits term
    no_lm = memory.estimate_peak(cfg, zero_stage=0, micro_batch=2, seq_len=128, causal_lm=False, device="cpu")
    assert no_lm.logits == 0
    # ZeRO-3 gathers the rest of the weights (the model is below stage3_max_live_parameters)
    z3 = memory.estimate_peak(cfg, zero_stage=3, micro_batch=2, seq_len=128, world_size=2, device="cpu")
    assert z3.live_params == 2 * (z3.states.num_params - z3.states.largest_layer_params)
    # a GPU adds the CUDA context and allocator slack to the accelerator's figure
    gpu = memory.estimate_peak(cfg, zero_stage=0, micro_batch=2, seq_len=128)
    assert gpu.overhead > plain.overhead + 500 * 10**6
    assert gpu.per_rank_total == gpu.accelerator_total


def test_lora_adapters_are_the_trainable_parameters():
    cfg = _gpt_config()
    lora = memory.LoraShape(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    est = memory.estimate_peak(cfg, zero_stage=2, micro_batch=2, seq_len=128, world_size=2, lora=lora)
    adapter = 4 * 4 * 16 * (512 + 512)  # layers x targets x rank x (in + out)
    assert est.states.trainable_params == adapter
    assert est.lora == adapter * (2 + 2 + 16)
    full = memory.estimate_peak(cfg, zero_stage=2, micro_batch=2, seq_len=128, world_size=2)
    assert est.states.accelerator.total < 0.3 * full.states.accelerator.total
    with pytest.raises(ValueError, match="`lora` target 'nope'"):
        memory.estimate_peak(
            cfg, zero_stage=0, micro_batch=1, seq_len=8, lora=memory.LoraShape(rank=4, targets=("nope",))
        )


def test_a_peft_model_is_read_as_it_is():
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    model = peft.get_peft_model(
        LlamaForCausalLM(
            _gpt_config(
                num_hidden_layers=1,
                hidden_size=64,
                intermediate_size=128,
                vocab_size=256,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
        ),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    est = memory.estimate_peak(model, zero_stage=0, micro_batch=1, seq_len=16)
    assert est.states.trainable_params == 2 * 4 * (64 + 64)
    assert est.logits > 0 and est.lora == est.states.trainable_params * 20


def test_a_bare_count_assumes_usual_shapes_and_the_largest_layer():
    est = memory.estimate_peak(7 * 10**9, zero_stage=3, micro_batch=1, seq_len=4096, world_size=1)
    # the largest layer is estimated, not the whole model: ZeRO-3 on one GPU is not far above ZeRO-0's states
    assert est.states.largest_layer_params < 0.1 * est.states.num_params
    z0 = memory.estimate_memory(7 * 10**9, zero_stage=0)
    assert est.states.accelerator.total < 1.05 * z0.accelerator.total


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="`seq_len`"):
        memory.estimate_peak(10**6, zero_stage=0, micro_batch=1, seq_len=0)
    with pytest.raises(ValueError, match="`world_size`=6 is not a multiple of `gpus_per_node`=4"):
        memory.estimate_peak(10**6, zero_stage=0, micro_batch=1, seq_len=8, world_size=6, gpus_per_node=4)
    with pytest.raises(ValueError, match="`device`"):
        memory.estimate_peak(10**6, zero_stage=0, micro_batch=1, seq_len=8, device="tpu")


# --------------------------------------------------------------------------- planner
PLAN = dict(world_size=8, micro_batch=1, seq_len=2048, margin=0.1)


def _peak(model, stage, oo="none", op="none"):
    kw = {k: v for k, v in PLAN.items() if k != "margin"}
    return memory.estimate_peak(
        model, zero_stage=stage, offload_optimizer=oo, offload_params=op, **kw
    ).accelerator_total


def test_planner_picks_zero_3_where_zero_2_does_not_fit():
    model = 3 * 10**9
    z2, z3 = _peak(model, 2), _peak(model, 3)
    assert z3 < z2
    plan = memory.choose_zero_stage(model, budget_bytes=int((z2 + z3) / 2 * 1.1), **PLAN)
    assert (plan.zero_stage, plan.offload_optimizer) == (3, "none")
    assert plan.runner_up is not None and plan.runner_up.states.offload_optimizer == "cpu"
    assert "ZeRO-3" in plan.log_line and "ZeRO-2 needs" in plan.log_line and "\n" not in plan.log_line
    # with room for everything: ZeRO-0 (least communication)
    assert memory.choose_zero_stage(model, budget_bytes=10**15, **PLAN).zero_stage == 0


def test_planner_offloads_below_zero_3():
    model = 3 * 10**9
    z3, off = _peak(model, 3), _peak(model, 3, "cpu")
    assert off < z3
    plan = memory.choose_zero_stage(model, budget_bytes=int((z3 + off) / 2 * 1.1), **PLAN)
    assert (plan.zero_stage, plan.offload_optimizer) == (3, "cpu")


def test_planner_says_what_would_fit_when_nothing_does():
    model = 3 * 10**9
    smallest = min(_peak(model, 3, "cpu"), _peak(model, 3, "cpu", "cpu"))
    with pytest.raises(
        ValueError, match=r"no ZeRO stage/offload fits .* HINT: what would fit: a budget of"
    ) as info:
        memory.choose_zero_stage(model, budget_bytes=int(smallest * 0.9), **PLAN)
    assert "activation_checkpointing=True" in str(info.value)


def test_planner_takes_the_users_model_object():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(
        _gpt_config(
            num_hidden_layers=1,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=256,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    )
    plan = memory.choose_zero_stage(model, world_size=2, micro_batch=2, seq_len=64, budget_bytes=80 * GB)
    assert plan.zero_stage == 0 and plan.choice.states.num_params == sum(
        p.numel() for p in model.parameters()
    )


# --------------------------------------------------------------------------- communication
def test_communication_matches_the_zero_papers_formulas():
    psi, n = 7 * 10**9, 64
    ring = (n - 1) / n
    vol = memory.communication_per_step(psi, world_size=n)
    # data parallel: one ring all-reduce of the 16-bit gradients, 2(N-1)/N x 2 bytes x psi
    assert vol[0].total == pytest.approx(2 * ring * 2 * psi)
    # ZeRO-1/2 in DeepSpeed: the same all-reduce plus an all-gather of the updated weights
    assert vol[1].total == pytest.approx(3 * ring * 2 * psi)
    assert vol[2].total == pytest.approx(3 * ring * 2 * psi)
    # ZeRO-3 past stage3_max_live_parameters: the paper's 3 psi (gather in forward and in backward,
    # reduce-scatter of the gradients)
    assert vol[3].total == pytest.approx(3 * ring * 2 * psi)
    assert vol[3].parameter_gather == pytest.approx(2 * ring * 2 * psi)
    # a model below it stays gathered: no backward all-gather
    small = memory.communication_per_step(10**8, world_size=n)
    assert small[3].total == pytest.approx(2 * ring * 2 * 10**8)


def test_accumulation_multiplies_zero_2_and_3_unless_coalesced():
    psi, n, ga = 10**9, 8, 4
    ring = (n - 1) / n
    per = memory.communication_per_step(psi, world_size=n, gradient_accumulation_steps=ga)
    once = memory.communication_per_step(psi, world_size=n, gradient_accumulation_steps=ga, coalesce=True)
    assert per[0].total == once[0].total == pytest.approx(2 * ring * 2 * psi)
    assert per[2].gradient_reduction == pytest.approx(ga * 2 * ring * 2 * psi)
    assert once[2].gradient_reduction == pytest.approx(2 * ring * 2 * psi)
    assert per[2].reductions_per_step == ga and once[2].reductions_per_step == 1
    assert per[3].gradient_reduction == pytest.approx(ga * ring * 2 * psi)
    assert once[3].parameter_gather == pytest.approx(ga * ring * 2 * psi)  # weights gathered every micro-step
    lora = memory.communication_per_step(psi, world_size=n, trainable_params=10**6)
    assert lora[0].total == pytest.approx(2 * ring * 2 * 10**6)


# --------------------------------------------------------------------------- command line
def test_estimate_prints_peak_plan_and_communication(capsys):
    code = cli_main(
        [
            "estimate",
            "--params",
            "7B",
            "--gpus-per-node",
            "8",
            "--seq-len",
            "4096",
            "--budget",
            "80GB",
            "--recommend",
            "--bandwidth",
            "100Gbps",
            "--grad-accum",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "whole peak" in out and "per accelerator:" in out and "per host:" in out and "Cheapest means" in out
    )
    plan = memory.choose_zero_stage(
        7 * 10**9,
        world_size=8,
        gpus_per_node=8,
        micro_batch=1,
        seq_len=4096,
        budget_bytes=80 * GB,
        margin=0.2,
    )
    assert f"choice: {plan.log_line}" in out
    vol = memory.communication_per_step(7 * 10**9, world_size=8, gradient_accumulation_steps=4)
    assert f"{vol[2].total / 12.5e9:>8.3g}s" in out  # 100 Gbit/s = 12.5 GB/s


def test_estimate_bad_bandwidth_and_recommend_without_budget(capsys):
    assert cli_main(["estimate", "--params", "1B", "--bandwidth", "fast"]) == 2
    captured = capsys.readouterr()
    assert "`--bandwidth` 'fast' is not a bandwidth" in captured.err and captured.out == ""
    assert cli_main(["estimate", "--params", "1B", "--recommend", "--seq-len", "128"]) == 2
    assert "`--recommend` needs `--budget`" in capsys.readouterr().err
