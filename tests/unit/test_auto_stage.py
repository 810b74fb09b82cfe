"""`zero_stage="auto"` / `offload_*="auto"`: the decision (`ds_engine.auto_stage`), its errors, its
agreement with `ds-engine estimate --recommend`, and the fallback's "auto". The decision through a
real one-process DeepSpeed Engine is the last test (DeepSpeed only); the 2-rank run that checks the
measured peak against the budget is tests/distributed/test_auto_stage.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_engine import memory
from ds_engine.auto_stage import PlanInputs, plan_inputs, plan_setup
from ds_engine.cli import main as cli_main
from ds_engine.config import ConfigError, EngineConfig
from ds_engine.ds_config import build_ds_config

GB = 10**9
MODEL = 3 * 10**9  # a bare count: shapes assumed for a usual decoder
BASE = dict(world_size=8, gpus_per_node=8, micro_batch=1, seq_len=2048, margin=0.1, precision="bf16")


def _inputs(budget: float, **kw) -> PlanInputs:
    values = {**BASE, "optimizer": "adamw", "activation_checkpointing": False, "device": "cuda", **kw}
    return PlanInputs(budget_bytes=int(budget), **values)


def _peak(stage: int, oo: str = "none", op: str = "none", **kw) -> int:
    inputs = _inputs(1, **kw)
    return memory.estimate_peak(
        MODEL,
        zero_stage=stage,
        offload_optimizer=oo,
        offload_params=op,
        world_size=inputs.world_size,
        gpus_per_node=inputs.gpus_per_node,
        micro_batch=inputs.micro_batch,
        seq_len=inputs.seq_len,
        precision="bf16",
        device=inputs.device,
        zero_init=False,
    ).per_rank_total


def test_zero_3_where_zero_2_does_not_fit():
    z2, z3 = _peak(2), _peak(3)
    assert z3 < z2
    plan = plan_setup(MODEL, _inputs((z2 + z3) / 2 * 1.1))
    assert (plan.zero_stage, plan.offload_optimizer, plan.offload_params) == (3, "none", "none")
    assert "ZeRO-2 needs" in plan.log_line and "runner-up ZeRO-3 + offload" in plan.log_line


def test_below_zero_3_it_offloads_and_below_everything_it_says_what_would_fit():
    z3, off = _peak(3), _peak(3, "cpu")
    plan = plan_setup(MODEL, _inputs((z3 + off) / 2 * 1.1))
    assert (plan.zero_stage, plan.offload_optimizer) == (3, "cpu")
    smallest = min(_peak(3, "cpu"), _peak(3, "cpu", "cpu"))
    with pytest.raises(ConfigError, match=r'`zero_stage` = "auto": no ZeRO stage/offload fits') as info:
        plan_setup(MODEL, _inputs(smallest * 0.9))
    assert "HINT: what would fit: a budget of" in str(info.value)


def test_a_cpu_rank_counts_host_and_accelerator_as_one_memory():
    """On CPU ranks offloading moves nothing out of the budget: ZeRO-3's peak decides, not ZeRO-3's
    accelerator share with the optimizer offloaded."""
    z3 = _peak(3, device="cpu")
    off = memory.estimate_peak(
        MODEL, zero_stage=3, offload_optimizer="cpu", world_size=8, micro_batch=1, seq_len=2048, device="cpu"
    )
    assert off.accelerator_total < z3 * 0.9 < off.per_rank_total
    with pytest.raises(ConfigError, match="per rank"):
        plan_setup(MODEL, _inputs(z3 * 0.95, device="cpu", margin=0.0))


def test_fixed_choices_narrow_the_plan():
    z2, z3 = _peak(2), _peak(3)
    roomy = _inputs(10**15, fixed={"zero_stage": 3})
    assert (plan_setup(MODEL, roomy).zero_stage, plan_setup(MODEL, roomy).offload_optimizer) == (3, "none")
    offload = plan_setup(MODEL, _inputs(10**15, fixed={"offload_optimizer": "cpu"}))
    assert (offload.zero_stage, offload.offload_optimizer) == (3, "cpu")
    assert "least communication that fits with offload_optimizer='cpu'" in offload.log_line
    with pytest.raises(ConfigError, match=r"HINT: what would fit: ZeRO-3 \(drop zero_stage=2\)"):
        plan_setup(MODEL, _inputs((z2 + z3) / 2 * 1.1, fixed={"zero_stage": 2}))


def test_the_inputs_come_from_the_choices_the_loader_and_the_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = torch.nn.Linear(4, 4)
    config = EngineConfig(zero_stage="auto", seq_len=256, memory_budget="2GB", precision="bf16")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    got = plan_inputs(config, model=model, optimizer=sgd, dataloader=loader, device=torch.device("cpu"))
    assert (got.world_size, got.gpus_per_node, got.micro_batch, got.seq_len) == (4, 2, 4, 256)
    assert (got.budget_bytes, got.margin, got.optimizer, got.device) == (2 * GB, 0.2, "sgd_momentum", "cpu")
    assert got.fixed == {}  # offloads left at their default follow the plan
    fixed = EngineConfig(zero_stage="auto", seq_len=8, offload_optimizer="none", memory_budget=10**9)
    got = plan_inputs(fixed, model=model, optimizer=None, dataloader=loader, device=torch.device("cpu"))
    assert got.fixed == {"offload_optimizer": "none"} and got.optimizer == "adamw"


def test_what_auto_needs_is_an_error_with_a_hint():
    model = torch.nn.Linear(4, 4)
    cpu = torch.device("cpu")
    no_budget = EngineConfig(zero_stage="auto", seq_len=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"needs `memory_budget`.*HINT: pass memory_budget="):
        plan_inputs(no_budget, model=model, optimizer=None, dataloader=None, device=cpu)
    no_micro = EngineConfig(zero_stage="auto", seq_len=8, memory_budget="1GB")
    with pytest.raises(ConfigError, match=r"needs the micro batch size.*HINT: pass micro_batch_size="):
        plan_inputs(no_micro, model=model, optimizer=None, dataloader=None, device=cpu)
    from ds_engine import Engine

    with pytest.raises(ConfigError, match=r'`zero_stage` = "auto" needs `seq_len`.*HINT: pass seq_len='):
        Engine(backend="accelerate", zero_stage="auto")
    with pytest.raises(ConfigError, match=r"`memory_budget` = '40GB' is read only when .*HINT: drop"):
        Engine(backend="accelerate", zero_stage=2, memory_budget="40GB")
    with pytest.raises(ConfigError, match=r'`memory_budget` = "lots" is invalid.*40GB'):
        EngineConfig(zero_stage="auto", seq_len=8, memory_budget="lots")
    with pytest.raises(
        ConfigError, match=r'`offload_params` = "nvme" with `zero_stage` = "auto".*zero_stage=3'
    ):
        EngineConfig(zero_stage="auto", seq_len=8, offload_params="nvme", nvme_path="/x")
    with pytest.raises(ConfigError, match=r"decided at `prepare`.*HINT: pass zero_stage=0..3"):
        build_ds_config(EngineConfig(zero_stage="auto", seq_len=8), world_size=1, micro_batch_size=1)


def test_a_json_stage_is_never_auto():
    """ "auto" is the Engine's choice; a DeepSpeed JSON's stage stays a number (DeepSpeed reads it)."""
    with pytest.raises(ConfigError, match=r'`zero_optimization.stage` = "auto" is invalid'):
        build_ds_config(
            EngineConfig(zero_stage=2),
            world_size=1,
            micro_batch_size=1,
            base={"zero_optimization": {"stage": "auto"}},
        )


def _bert_folder(tmp_path):
    from transformers import BertConfig

    config = BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=8000
    )
    config.architectures = ["BertForSequenceClassification"]
    config.save_pretrained(tmp_path)
    return config


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cli_prints_the_same_choice_for_the_same_inputs(tmp_path, capsys, device):
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(_bert_folder(tmp_path))
    common = dict(world_size=2, gpus_per_node=2, micro_batch=4, seq_len=128, precision="bf16")
    z2 = memory.estimate_peak(model, zero_stage=2, device=device, zero_init=False, **common).per_rank_total
    z3 = memory.estimate_peak(model, zero_stage=3, device=device, zero_init=False, **common).per_rank_total
    budget = int(max(z2, z3) * 1.2)  # whatever it is, both must say the same
    plan = plan_setup(model, _inputs(budget, **{**common, "margin": 0.2}, device=device))
    flags = ["--gpus-per-node", "2", "--micro-batch", "4", "--seq-len", "128", "--precision", "bf16"]
    cli = ["estimate", "--model", str(tmp_path), "--budget", str(budget), "--recommend", "--headroom", "0.2"]
    code = cli_main([*cli, "--device", device, "--no-zero-init", *flags])
    out = capsys.readouterr().out
    assert code == 0
    assert f"choice: {plan.log_line}\n" in out


def test_the_fallback_runs_auto_as_zero_0_and_says_so_once(caplog):
    from ds_engine import Engine

    with caplog.at_level(logging.INFO, logger="ds_engine"):
        engine = Engine(backend="accelerate", zero_stage="auto", seq_len=64, offload_optimizer="auto")
    assert (engine.config.zero_stage, engine.config.offload_optimizer, engine.config.offload_params) == (
        0,
        "none",
        "none",
    )
    said = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
    assert said == ['ds_engine: "auto" on the accelerate fallback: ZeRO-0, offload none; the planner\'s '
                    "choice needs DeepSpeed"]  # fmt: skip
    # a stage you chose stays (the fallback shards ZeRO-2/3 with FSDP where it can); "auto" offloads are none
    with pytest.warns(UserWarning, match="cannot honour"):  # on CPU: DDP, said as for any ZeRO-2
        kept = Engine(backend="accelerate", zero_stage=2, offload_optimizer="auto", seq_len=64)
    assert (kept.config.zero_stage, kept.config.offload_optimizer) == (2, "none")


# --------------------------------------------------------------------------- for the HF Trainer
TRAINER_AUTOS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16.enabled",
    "bf16.enabled",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "zero_optimization.reduce_bucket_size",
)
STAGE3_AUTOS = (
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def _get(d, dotted):
    for part in dotted.split("."):
        d = d[part]
    return d


@pytest.mark.parametrize("stage", [2, 3])
def test_for_trainer_leaves_what_the_trainer_fills_auto(stage, capsys):
    from ds_engine.ds_config import for_trainer, validate_ds_config

    out = for_trainer(EngineConfig(zero_stage=stage))
    for key in TRAINER_AUTOS + (STAGE3_AUTOS if stage == 3 else ()):
        assert _get(out, key) == "auto", key
    assert out["zero_optimization"]["stage"] == stage
    assert "train_batch_size" not in out  # DeepSpeed derives it (the Trainer's fill is wrong on CPU ranks)
    assert validate_ds_config(out, partial=True) == []
    assert cli_main(["config", "--zero-stage", str(stage), "--for-trainer"]) == 0
    assert json.loads(capsys.readouterr().out) == out


def test_for_trainer_refuses_what_the_trainer_owns(capsys):
    from ds_engine.ds_config import for_trainer

    with pytest.raises(
        ConfigError, match=r"`precision` = 'bf16' is filled by the Hugging Face Trainer.*HINT"
    ):
        for_trainer(EngineConfig(zero_stage=2, precision="bf16"))
    assert cli_main(["config", "--for-trainer", "--micro-batch-size", "4"]) == 2
    assert "HINT: drop --micro-batch-size" in capsys.readouterr().err


# --------------------------------------------------------------------------- through the Engine
ENGINE = textwrap.dedent(
    """
    import json, logging, sys
    import deepspeed, torch
    import torch.distributed as dist
    from transformers import BertConfig, BertForSequenceClassification
    from ds_engine import Engine
    from ds_engine.config import ConfigError
    seen, lines = {}, []
    real = deepspeed.initialize
    def initialize(*args, **kwargs):
        seen["config"] = json.loads(json.dumps(kwargs["config"]))
        return real(*args, **kwargs)
    deepspeed.initialize = initialize
    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.getLogger("ds_engine").addHandler(Lines())
    folder, budget = sys.argv[1], sys.argv[2]
    model = BertForSequenceClassification(BertConfig.from_pretrained(folder))
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=4)
    choices = dict(zero_stage="auto", seq_len=128, precision="bf16", backend="deepspeed")
    try:  # nothing fits: the error comes before any process group
        Engine(memory_budget="1MB", **choices).prepare(model, torch.optim.AdamW(model.parameters()), loader)
    except ConfigError as exc:
        print("ERROR=" + json.dumps([str(exc), dist.is_initialized()]))
    engine = Engine(memory_budget=budget, **choices)
    engine.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    result = {"config": seen["config"], "lines": lines, "stage": engine.config.zero_stage}
    print("RESULT=" + json.dumps(result))
    engine.end_training()
    """
)


@pytest.mark.deepspeed
def test_prepare_decides_logs_the_cli_line_and_renders_the_decision(tmp_path, capsys):
    from tests.distributed.launcher import free_port, worker_env

    config = _bert_folder(tmp_path)
    budget = 2 * GB
    env = worker_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                      "LOCAL_RANK": "0", "WORLD_SIZE": "1"})  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(tmp_path), str(budget)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = {
        k: json.loads(v)
        for k, _, v in (x.partition("=") for x in proc.stdout.splitlines())
        if k in ("ERROR", "RESULT")
    }
    message, group_formed = found["ERROR"]
    assert not group_formed and "no ZeRO stage/offload fits 1.00 MB per rank" in message and "HINT" in message
    result = found["RESULT"]
    decided = [line for line in result["lines"] if 'zero_stage="auto" chose' in line]
    assert len(decided) == 1
    cli = ["estimate", "--model", str(tmp_path), "--budget", str(budget), "--recommend", "--device", "cpu"]
    cli += ["--no-zero-init", "--micro-batch", "4", "--seq-len", "128", "--precision", "bf16"]
    assert cli_main(cli) == 0
    printed = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("choice: "))
    assert decided[0] == f'ds_engine: zero_stage="auto" chose {printed.removeprefix("choice: ")}'
    # the decision is what DeepSpeed ran: the JSON `ds-engine config` prints for that stage
    expected = build_ds_config(
        EngineConfig(zero_stage=result["stage"], precision="bf16"),
        world_size=1,
        micro_batch_size=4,
        hidden_size=config.hidden_size,
    )
    assert result["config"] == expected
