"""The Engine's generation surface: `generate` and `gathered` on a prepared model.

`EngineGeneration` is a part of `ds_engine.engine.Engine` (a base class of it); the work is done
by `ds_engine.generation`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from ds_engine.generation import any_gathered as _any_gathered
from ds_engine.generation import gathered as _gathered
from ds_engine.generation import generate as _generate
from ds_engine.generation import is_gathered as _is_gathered

__all__ = ["EngineGeneration"]


class EngineGeneration:
    """The Engine's generation methods (see `ds_engine.engine.Engine`)."""

    if TYPE_CHECKING:  # provided by the Engine
        _model: torch.nn.Module | None

        def _dist(self, call: str | None = None) -> bool: ...

        def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def _refuse_training_while_gathered(self, call: str) -> None:
        """Raise inside `gathered(model)`: DeepSpeed's hooks are off and the parameters in use are
        whole copies, which ZeRO-3's backward and optimizer step would not keep consistent."""
        # per micro-step: nothing to look up unless some block is open (unwrap_model is not free
        # on the accelerate backend, which asks accelerate about DeepSpeed on every call)
        if _any_gathered() and self._model is not None and _is_gathered(self.unwrap_model(self._model)):
            raise RuntimeError(
                f"`{call}` inside `engine.gathered(model)`: the block holds the ZeRO-3 parameters "
                "whole for inference, with DeepSpeed's fetch/release hooks off; training there would "
                "leave the partitions and the gathered copies out of step. HINT: leave the block "
                "before training (it re-partitions on exit); inside it, evaluate under torch.no_grad()."
            )

    def generate(
        self, model: torch.nn.Module, *args: Any, gather: bool | None = None, **generate_kwargs: Any
    ) -> Any:
        """`model.generate(...)` on a prepared model: never hangs under ZeRO-3, fast when it fits.

        Collective for a ZeRO-3 (or FSDP) model: every rank calls it, each with its own prompts;
        ranks may stop at different lengths. `args` / `generate_kwargs` are those of Hugging
        Face `generate` and the result is its result. Runs under `torch.no_grad()` in eval mode;
        each submodule's train/eval mode is restored afterwards.

        - ZeRO 0-2 and the DDP fallback: plain `generate`.
        - ZeRO-3, gathered (fast): the whole model is gathered once, generated with no
          collective per token (each rank stops on its own), then re-partitioned.
        - ZeRO-3 (and FSDP), synced: parameters stay sharded and `synced_gpus=True` is set
          when there are several ranks, so a finished rank keeps stepping until all are done.
        - Inside `engine.gathered(model)` (ZeRO-3): no gather of its own; the gathered path on
          the parameters the block holds.

        Args:
            model: The model `prepare` returned (or the module inside it).
            gather: True / False force the gathered / synced path; None (default) gathers when
                the full parameters take at most half the memory available on every rank
                (`ds_engine.generation.GATHER_MEMORY_FRACTION`).

        Raises:
            TypeError: A bad `gather`, or a model without `generate`.
            ValueError: `gather=True` where the model cannot be gathered (FSDP), `gather=False`
                inside `gathered`, or `synced_gpus=False` on the synced path with several ranks.
        """
        self._dist("generate(...)")
        wrapper, module = self._generation_target(model)
        return _generate(wrapper, module, *args, gather=gather, **generate_kwargs)

    def gathered(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context: hold a ZeRO-3 model's parameters whole for a block, e.g. a whole evaluation loop.

        ``with engine.gathered(model):`` gathers every parameter once on entry (collective:
        every rank enters) and re-partitions on exit (also on an exception; no collective).
        Inside, `generate` skips its own gather and runs with no collective at all (ranks may
        call it different numbers of times and stop at different lengths), and plain forwards
        (``model(**batch)``) gather nothing per layer: one all-gather per block instead of one
        per `generate` call. The block needs the whole model's memory on every rank, as
        `generate(gather=True)` does. It does not change train/eval or grad mode: evaluate under
        `torch.no_grad()` (`generate` does so itself).

        Training in the block is refused: `engine.backward` and the prepared optimizer's `step`
        raise (DeepSpeed's fetch/release hooks are off and the parameters in use are gathered
        copies); train again after the block. Other gathers of the same parameters in the
        block (`get_state_dict`, `save_pretrained`) are refused by DeepSpeed; call them outside.
        A block inside a block for the same model is a no-op. ZeRO 0-2 and the DDP fallback
        (nothing partitioned): a no-op. FSDP2 shards: a no-op; `generate` inside stays synced.

        Args:
            model: The model `prepare` returned (or the module inside it).

        Raises:
            ValueError: A ZeRO-3 module whose DeepSpeed engine this Engine does not hold (a
                bare module prepared by another Engine: pass it to that Engine).
        """
        self._dist("gathered(model)")
        wrapper, module = self._generation_target(model)
        return _gathered(wrapper, module)

    def _generation_target(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the wrapper that owns DeepSpeed's hooks, the user's module) for `model`."""
        wrapper = model
        if self._model is not None and model is not self._model and self.unwrap_model(self._model) is model:
            wrapper = self._model  # the bare module: find its DeepSpeed engine
        return wrapper, self.unwrap_model(model)
