"""Where an accumulation window ends: the one policy every backend carries out.

Micro-step ``k`` of a prepared training dataloader is a boundary when ``(k + 1) % GA == 0`` or
it is the loader's last batch: a loader's end shortens its last window, and every loss is
divided by the real length of its window, so the applied gradient is the mean over the window's
micro-batches. Outside a prepared loader, micro-steps are counted on their own (`free`) and
every GA-th is a boundary. `BoundaryPolicy` decides this, says what a misuse of the window looks
like (the errors below), and counts an optimizer step as applied or skipped. It changes only
the `StepState` it is given and its own per-loader bookkeeping: no tensors, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from ds_engine.step_state import StepState

__all__ = ["BoundaryPolicy", "Loader"]


class Loader(Protocol):
    """What the policy reads of a prepared dataloader (`ds_engine.dataloader.PreparedDataLoader`)."""

    batch_index: int

    def known_len(self) -> int:
        """Batches in the loader's epoch as far as known (a stream's, once its end is in sight)."""
        ...

    def keep_position(self, next_batch: int) -> None: ...


class BoundaryPolicy:
    """Decides each micro-step's window and boundary; refuses misuse of the window.

    Args:
        step: The Engine's `StepState` (counters, the current window, the last boundary).
        user_accumulation_problem: The backend's `user_accumulation_problem`: '' when several
            `backward` calls before one `step()` add up exactly at GA=1, else why not (asked only
            at GA=1 after a boundary whose step was not taken).
        caller: What the user's script calls the Engine ("engine", "accelerator"), for errors.
    """

    def __init__(
        self,
        step: StepState,
        user_accumulation_problem: Callable[[], str],
        caller: Callable[[], str] = lambda: "engine",
    ) -> None:
        self.step = step
        self._user_accumulation_problem = user_accumulation_problem
        self._caller = caller
        self.loaders_in_progress: list[Any] = []
        """Prepared loaders being iterated, innermost last."""
        self.loader_marks: dict[int, tuple[int, int]] = {}
        """Loader id -> `marks()` at its pass's first batch."""
        self.trained_batch: dict[int, int] = {}
        """Loader id -> last batch of its pass a micro-step ran on."""
        self.prefetched: dict[int, list[int]] = {}
        """Loader id -> batches drawn ahead by `windows` that no micro-step trained yet."""

    # -------------------------------------------------------------- loaders
    @property
    def current_loader(self) -> Any:
        """The innermost prepared loader being iterated, or None."""
        return self.loaders_in_progress[-1] if self.loaders_in_progress else None

    def at_trained_batches(self) -> bool:
        """True when every loader in progress is at a batch a micro-step trained on (not inside an
        evaluation loop over another prepared loader): each position is then "batches consumed"."""
        trained = self.trained_batch
        return all(trained.get(id(loader)) == loader.batch_index for loader in self.loaders_in_progress)

    def reset(self) -> None:
        """Forget every loader and the current window (nothing prepared any more)."""
        self.loaders_in_progress = []
        self.loader_marks.clear()
        self.trained_batch.clear()
        self.prefetched.clear()
        self.step.grads_pending = False
        self.step.boundary, self.step.stepped, self.step.micro_backwards = True, False, 0

    def marks(self) -> tuple[int, int]:
        """(optimizer steps taken, skipped included; micro-steps)."""
        return self.step.num_optimizer_steps + self.step.num_skipped_steps, self.step.num_micro_steps

    def on_batch(self, loader: Loader, index: int) -> None:
        """A prepared loader yields batch `index`: it is the innermost loader in progress."""
        in_progress = self.loaders_in_progress
        if not in_progress or in_progress[-1] is not loader:
            if loader in in_progress:
                in_progress.remove(loader)
            in_progress.append(loader)
        if id(loader) not in self.loader_marks:  # the pass's first batch
            self.loader_marks[id(loader)] = self.marks()
            self.trained_batch.pop(id(loader), None)

    def on_loader_end(self, loader: Loader) -> None:
        """A prepared loader's pass ended (exhausted, `break`, or an exception).

        Raises:
            RuntimeError: A whole pass called `backward` but never applied an optimizer step.
        """
        if loader in self.loaders_in_progress:
            self.loaders_in_progress.remove(loader)
        self.prefetched.pop(id(loader), None)
        start = self.loader_marks.pop(id(loader), None)
        finished = loader.batch_index == loader.known_len()  # not a `break` or an exception
        trained = self.trained_batch.pop(id(loader), None)
        if not finished and trained is not None:
            # the loop was left after training on batch `trained`: a checkpoint saved now resumes
            # at the next batch, as the run that did not stop here goes on
            loader.keep_position(trained + 1)
        if finished and start is not None and self.step.grads_pending:
            (steps_before, micro_before), (steps_now, micro_now) = start, self.marks()
            never_stepped = steps_now == steps_before and micro_now > micro_before
        else:
            never_stepped = False
        if never_stepped:
            # At GA=1 gradients add up until `step()` (hand-written accumulation); a whole
            # epoch of `backward` without one optimizer step is a loop that never trains.
            raise RuntimeError(
                f"a whole pass over a prepared dataloader ({loader.known_len()} micro-steps) called "
                "`engine.backward` but never `optimizer.step()`: its gradients were accumulated and "
                "never applied. HINT: call `optimizer.step()` and `optimizer.zero_grad()` after "
                "`engine.backward(loss)` (every micro-step, or every N micro-steps when you "
                "accumulate by hand)."
            )

    # -------------------------------------------------------------- micro-steps
    def begin_micro_step(self, ga: int) -> None:
        """Decide whether this micro-step ends an accumulation window, and the window's length.

        Args:
            ga: The configured gradient_accumulation_steps.

        Raises:
            RuntimeError: The previous micro-step ended a window and its step was not taken, or
                at GA > 1 a second micro-step began on the same batch of a prepared loader.
        """
        in_progress, trained_batch = self.loaders_in_progress, self.trained_batch
        loader = in_progress[-1] if in_progress else None
        if (
            ga > 1
            and loader is not None
            and trained_batch.get(id(loader)) == loader.batch_index
            and not self.prefetched.get(id(loader))
        ):
            caller = self._caller()
            raise RuntimeError(
                f"a second micro-step on batch {loader.batch_index} of a prepared dataloader "
                f"(gradient_accumulation_steps={ga}): the Engine places each micro-step at the batch "
                "the loader yielded last, so micro-steps without a new batch between them share one "
                "place in the window, and a loop that draws a window's batches ahead (to count "
                "their tokens) would train them all in the last batch's place. HINT: iterate "
                f"`for window in {caller}.windows(loader):`, count the window's items, then for each "
                f"batch `{caller}.backward(loss_sum, num_items=...)` and `optimizer.step()` inside "
                f"`with {caller}.accumulate(model):` (docs/guarantees.md); otherwise one micro-step "
                "per batch."
            )
        step = self.step
        if step.grads_pending and step.boundary and not step.stepped:
            # At GA=1 the user owns accumulation (accelerate's hand-written loop: `loss / gas`,
            # `step()` every gas micro-steps): gradients keep adding up until their `step()`,
            # exactly as in plain torch, on every backend that can defer its reduction.
            problem = self._user_accumulation_problem() if ga == 1 else ""
            if ga > 1 or problem:
                why = (
                    f" ({problem})"
                    if problem
                    else ": its gradients would be mixed into the next window or lost"
                )
                raise RuntimeError(
                    f"a new micro-step began, but the previous one (micro-step {step.num_micro_steps}) "
                    f"ended an accumulation window (gradient_accumulation_steps={ga}) and "
                    f"`optimizer.step()` was not called after its `engine.backward`{why}. HINT: let the "
                    "Engine accumulate: Engine(gradient_accumulation_steps=N), call "
                    "`engine.backward(loss)` (without dividing the loss by N) and then "
                    "`optimizer.step()`, `scheduler.step()`, `optimizer.zero_grad()` on every "
                    "micro-step, ideally inside `with engine.accumulate(model):`; they take effect "
                    "only at boundaries. Accumulating by hand (`loss / N`, `step()` every N "
                    "micro-steps) needs Engine(gradient_accumulation_steps=1)."
                )
        prefetched = self.prefetched
        for each in in_progress:  # their current batches are being trained on
            ahead = prefetched.get(id(each)) if prefetched else None
            trained_batch[id(each)] = ahead.pop(0) if ahead else each.batch_index
        if loader is not None:
            index, length = trained_batch[id(loader)], loader.known_len()
            start = (index // ga) * ga
            window = min(ga, length - start)
            position = index - start
        else:
            position = step.free_micro_steps % ga
            window = ga
            step.free_micro_steps += 1
        step.window_len = window
        step.window_start = position == 0
        step.boundary = position + 1 == window
        step.stepped = False
        step.micro_backwards = 0
        step.num_micro_steps += 1

    def windows(self, loader: Any, ga: int, caller: str) -> Iterator[list[Any]]:
        """Draw `loader`'s batches one accumulation window at a time (see `Engine.windows`); the
        micro-steps that follow train the window's batches in order.

        Raises:
            TypeError: `loader` is not a prepared dataloader.
            RuntimeError: A window was left with batches no micro-step trained.
        """
        if not hasattr(loader, "keep_position"):
            raise TypeError(
                f"`{caller}.windows(...)` got a {type(loader).__name__}: it needs a dataloader "
                f"returned by `{caller}.prepare`. HINT: loader = {caller}.prepare(loader), then "
                f"`for window in {caller}.windows(loader):`."
            )
        batches: list[Any] = []
        for batch in loader:
            batches.append(batch)
            index = loader.batch_index
            if (index + 1) % ga and index + 1 < loader.known_len():
                continue
            self._prefetch(loader, range(index + 1 - len(batches), index + 1))
            yield batches
            left = self.prefetched.pop(id(loader), [])
            if left:
                raise RuntimeError(
                    f"the window of batches {index + 1 - len(batches)}..{index} was left with "
                    f"{len(left)} batch(es) not trained: one micro-step per batch of a window. "
                    f"HINT: `for batch in window:` with `{caller}.accumulate(model)`, `backward` and "
                    "`optimizer.step()` for each."
                )
            batches = []

    def _prefetch(self, loader: Any, indexes: Iterable[int]) -> None:
        self.prefetched[id(loader)] = list(indexes)

    def check_second_backward(self) -> None:
        """Inside `accumulate()`: refuse a second `backward` in the same micro-step."""
        if self.step.micro_backwards:
            raise RuntimeError(
                "`engine.backward` was called twice in one `accumulate()` micro-step; at an accumulation "
                "boundary DeepSpeed ZeRO-1/2 would keep only the last call's gradients. HINT: add the "
                "losses and call `engine.backward(total_loss)` once per micro-step."
            )

    # -------------------------------------------------------------- optimizer calls
    def step_is_due(self, in_accumulate: bool) -> bool:
        """`optimizer.step()` was called: True when the window's step is to be taken now.

        Raises:
            RuntimeError: `step()` before this micro-step's `backward` at a window's last
                micro-step inside `accumulate()`.
        """
        step = self.step
        if in_accumulate and step.micro_backwards == 0 and step.grads_pending and step.boundary:
            raise RuntimeError(
                "`optimizer.step()` before `engine.backward(loss)` in the last micro-step of an "
                "accumulation window: this micro-batch's gradients would spill into the next window. "
                "HINT: inside `accumulate()`, call `engine.backward(loss)` first, then `optimizer.step()`."
            )
        # mid-window, already stepped, or nothing to apply (torch: a no-op too)
        return step.boundary and not step.stepped and step.grads_pending

    def record_step(
        self, applied: bool, grad_norm: float | None, loss_scale: float | None, max_consecutive_skips: int
    ) -> None:
        """Count the window's optimizer step as applied or skipped.

        Raises:
            FloatingPointError: `max_consecutive_skips` (when non-zero) steps in a row were skipped.
        """
        step = self.step
        step.stepped = True
        step.grads_pending = False
        step.step_was_skipped = not applied
        if applied:
            step.num_optimizer_steps += 1
            step.consecutive_skips = 0
        else:
            step.num_skipped_steps += 1
            step.consecutive_skips += 1
        step.grad_norm = grad_norm
        step.loss_scale = loss_scale
        if max_consecutive_skips and step.consecutive_skips >= max_consecutive_skips:
            raise FloatingPointError(
                f"{step.consecutive_skips} optimizer steps in a row were skipped (non-finite gradients"
                f"{'; loss scale ' + str(loss_scale) if loss_scale is not None else ''}): training "
                "is not progressing. HINT: lower the learning rate, check the data for inf/nan, use bf16 "
                "instead of fp16, or raise `max_consecutive_skipped_steps` (0 never raises)."
            )

    def zero_grad_clears(self) -> bool:
        """`optimizer.zero_grad()` was called: True when the gradients are to be cleared now
        (nothing accumulated since the last step); False mid-window or at a boundary's start.

        Raises:
            RuntimeError: Between `backward` and `step()` at a boundary.
        """
        step = self.step
        if not step.grads_pending:
            return True
        if step.boundary and step.micro_backwards and not step.stepped:
            raise RuntimeError(
                "`optimizer.zero_grad()` between `engine.backward(loss)` and `optimizer.step()` at an "
                "accumulation boundary would discard the window's gradients before they are applied. "
                "HINT: call `optimizer.step()` first, then `optimizer.zero_grad()`."
            )
        return False
