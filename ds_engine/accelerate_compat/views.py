"""`accelerator.state` and `accelerator.state.deepspeed_plugin`: accelerate's views of a run.

Both read the Engine's public facts only (its config, its final DeepSpeed JSON, the
Accelerator's answers); what accelerate's `PartialState` knows comes from it.
"""

from __future__ import annotations

from typing import Any

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
