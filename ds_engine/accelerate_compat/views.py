"""accelerate's views of a run: `accelerator.state`, `accelerator.state.deepspeed_plugin`, and
of several prepared models (which Engine prepares each model, optimizer and scheduler, and which
trained models a loss reaches).

The state views read the Engine's public facts only (its config, its final DeepSpeed JSON, the
Accelerator's answers); what accelerate's `PartialState` knows comes from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from ds_engine.engine import Engine


class DeepSpeedPluginView:
    """`accelerator.state.deepspeed_plugin` on the DeepSpeed backend: the run's DeepSpeed config.

    `deepspeed_config` is the final JSON after `prepare`; before it, the configured blocks
    (`optimizer`, `scheduler`, `zero_optimization.stage`, `gradient_accumulation_steps`, precision),
    which is what scripts test (``"optimizer" in plugin.deepspeed_config``).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        final = self._engine.ds_config
        if final is not None:
            return final
        eff = self._engine.config
        config: dict[str, Any] = {
            "zero_optimization": {"stage": eff.zero_stage},
            "gradient_accumulation_steps": eff.gradient_accumulation_steps,
            "gradient_clipping": eff.gradient_clipping,
            "fp16": {"enabled": eff.precision == "fp16"},
            "bf16": {"enabled": eff.precision == "bf16"},
        }
        if eff.optimizer is not None:
            config["optimizer"] = eff.optimizer
        if eff.scheduler is not None:
            config["scheduler"] = eff.scheduler
        return config

    @property
    def zero_stage(self) -> int:
        return int(self._engine.config.zero_stage)

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self._engine.config.gradient_accumulation_steps)

    @property
    def hf_ds_config(self) -> Any:
        from accelerate.utils.deepspeed import HfDeepSpeedConfig

        return HfDeepSpeedConfig(self.deepspeed_config)

    def is_zero3_init_enabled(self) -> bool:
        return self.zero_stage == 3

    def __repr__(self) -> str:
        return f"DeepSpeedPluginView(zero_stage={self.zero_stage})"


class AcceleratorStateView:
    """`accelerator.state`: accelerate's process state, with this run's facts where they differ.

    Everything accelerate's `PartialState` knows (process index, device, `main_process_first`,
    `split_between_processes`, ...) comes from it; `distributed_type`, `mixed_precision` and
    `deepspeed_plugin` describe the Engine's run.
    """

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    @property
    def distributed_type(self) -> DistributedType:
        return self._accelerator.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self._accelerator.mixed_precision

    @property
    def deepspeed_plugin(self) -> DeepSpeedPluginView | None:
        return self._accelerator.deepspeed_plugin

    @property
    def use_distributed(self) -> bool:
        return self._accelerator.use_distributed

    @property
    def num_processes(self) -> int:
        return self._accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self._accelerator.process_index

    @property
    def is_fsdp2(self) -> bool:
        return self._accelerator.is_fsdp2

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(PartialState(), name)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\nDevice: {self._accelerator.device}\n"
            f"Mixed precision type: {self.mixed_precision}\n"
            + (f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n" if self.deepspeed_plugin else "")
        )


def label(model: Any, call: Sequence[Any]) -> str:
    """A model as the user passed it: its argument position in `prepare` and its class."""
    position = next(i for i, o in enumerate(call) if o is model) + 1
    return f"the model passed as argument {position} to `prepare` ({type(model).__name__})"


def holds(module: torch.nn.Module, tensors: list[Any]) -> bool:
    return bool(tensors) and any(p is tensors[0] for p in module.parameters())


def reached_engines(loss: torch.Tensor, engines: list[Engine]) -> list[Engine]:
    """The Engines whose trainable parameters `loss`'s graph reaches (its AccumulateGrad leaves)."""
    owner = {id(p): e for e in engines if e.model is not None for p in e.unwrap_model(e.model).parameters()}
    found: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack and len(found) < len(engines):
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            engine = owner.get(id(variable))
            if engine is not None:
                found.add(id(engine))
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [e for e in engines if id(e) in found]


def check_windows(loaders: Sequence[Any], ga: int) -> None:
    """With models trained beside the first, each counts its windows GA micro-steps at a time:
    refuse a training loader (the first prepared) whose epoch would end inside a window (only the
    first Engine sees the loader's short last window)."""
    for loader in loaders if ga > 1 else ():
        batches = loader.schedule_lengths()
        if batches is None or batches[1] % ga:
            raise ValueError(
                f"ds_engine.Accelerator: several trained models with gradient_accumulation_steps={ga} "
                "need every epoch to end at a window's end, and the training dataloader has "
                f"{'no known length' if batches is None else f'{batches[1]} batches per process'}. "
                f"HINT: make its batches per process a multiple of {ga} (the dataset size, "
                "`batch_size` or `drop_last=True`), or accumulate over 1 step."
            )


def two_trained_models(labels: list[str]) -> RuntimeError:
    """The error for one loss that reaches the trainable parameters of two trained models."""
    return RuntimeError(
        f"`accelerator.backward(loss)`: the loss reaches the trainable parameters of two trained "
        f"models, {labels[0]} and {labels[1]}; ds_engine trains each model on an Engine of its own "
        "(under DeepSpeed, one DeepSpeed engine each), and one backward drives one of them: the other "
        "model would get gradients outside its own accumulation. HINT: freeze the model this loss "
        "must not train while computing it, e.g. `discriminator.requires_grad_(False)` before its "
        "forward and `requires_grad_(True)` after the backward (the pix2pix / CycleGAN idiom; call "
        "it through `accelerator.unwrap_model(discriminator)` then), or `.detach()` the output that "
        "feeds it; for one loss over both models, wrap them in one `torch.nn.Module` with one "
        "optimizer."
    )


def plan_models(
    objects: Sequence[Any], call: Sequence[Any], is_scheduler: Callable[[Any], bool], *, has_model: bool
) -> tuple[list[Any], list[tuple[Any, Any, Any]]]:
    """Which Engine prepares what: (the first Engine's objects, [(model, optimizer or None, scheduler
    or None)] for each model prepared beside it on an Engine of its own).

    Each optimizer goes with the model whose parameters it holds, each scheduler with its
    optimizer; the first model that has an optimizer (else the first model) is the first Engine's
    unless it holds one already; dataloaders are the first Engine's. A call with at most one of
    each and no model before it is left as it is. `call`: `prepare`'s arguments (for messages).

    Raises:
        ValueError: An optimizer over no model of the call or over two, two optimizers of one
            model, a scheduler of an optimizer not in the call, two schedulers of one optimizer.
    """
    models: list[Any] = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers: list[Any] = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    schedulers = [o for o in objects if is_scheduler(o) and not isinstance(o, torch.optim.Optimizer)]
    if len(models) + has_model <= 1 and len(optimizers) <= 1 and len(schedulers) <= 1:
        return list(objects), []

    def named(obj: Any) -> str:
        return f"argument {next(i for i, o in enumerate(call) if o is obj) + 1} ({type(obj).__name__})"

    owner = {id(p): m for m in models for p in m.parameters()}
    trains: dict[int, Any] = {}  # id(model) -> its optimizer
    for opt in optimizers:
        found: list[Any] = []
        for group in opt.param_groups:
            params = group.get("params", [])
            for param in [params] if isinstance(params, torch.Tensor) else params:
                model = owner.get(id(param))
                if model is not None and not any(model is f for f in found):
                    found.append(model)
        shown = ", ".join(named(m) for m in models) or "none"
        if not found:
            raise ValueError(
                f"`accelerator.prepare`: the optimizer passed as {named(opt)} steps none of the "
                f"parameters of the models passed with it (models: {shown}); each optimizer goes with "
                "the model whose parameters it holds. HINT: create it from the model it trains, after "
                "creating that model (`torch.optim.AdamW(model.parameters(), ...)`), and pass both to "
                "the same `prepare` call."
            )
        if len(found) > 1:
            raise ValueError(
                f"`accelerator.prepare`: the optimizer passed as {named(opt)} steps the parameters of "
                f"{named(found[0])} and of {named(found[1])}; ds_engine trains each model with its own "
                "optimizer (one DeepSpeed engine per model). HINT: one optimizer per model, e.g. "
                "`opt_g = Adam(generator.parameters())` and `opt_d = Adam(discriminator.parameters())`, "
                "or put both models in one `torch.nn.Module` and prepare that."
            )
        if id(found[0]) in trains:
            raise ValueError(
                f"`accelerator.prepare`: the optimizers passed as {named(trains[id(found[0])])} and "
                f"{named(opt)} both step {named(found[0])}. HINT: one optimizer per model (param groups "
                "for different learning rates)."
            )
        trains[id(found[0])] = opt
    driven: dict[int, Any] = {}  # id(optimizer) -> its scheduler
    for sched in schedulers:
        driving = getattr(sched, "optimizer", None)
        if not any(driving is o for o in optimizers):
            raise ValueError(
                f"`accelerator.prepare`: the scheduler passed as {named(sched)} drives an optimizer "
                f"({type(driving).__name__}) that is neither passed to this call nor prepared before. HINT: "
                "create the scheduler from the optimizer you prepare, and pass both to `prepare` (or "
                "the scheduler alone after its optimizer was prepared)."
            )
        if id(driving) in driven:
            raise ValueError(
                f"`accelerator.prepare`: the schedulers passed as {named(driven[id(driving)])} and "
                f"{named(sched)} both drive the optimizer passed as {named(driving)}. HINT: one scheduler "
                "per optimizer (chain schedules with `torch.optim.lr_scheduler.SequentialLR`)."
            )
        driven[id(driving)] = sched
    trained = [m for m in models if id(m) in trains]
    first = None if has_model else (trained or models or [None])[0]
    groups = [(m, trains.get(id(m)), driven.get(id(trains.get(id(m))))) for m in models]
    taken = {id(o) for group in groups for o in group if o is not None}
    mine = [o for o in objects if id(o) not in taken]  # dataloaders (and what prepare refuses)
    extras = []
    for group in groups:
        if group[0] is first:
            mine += [o for o in group if o is not None]
        else:
            extras.append(group)
    return mine, extras
