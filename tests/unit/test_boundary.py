"""The boundary policy on its own (no process group, no model): every window length and
loader-end case of a small space, the applied-window sizes it reports, and its misuse errors."""

from __future__ import annotations

import pytest

from ds_engine.boundary import BoundaryPolicy
from ds_engine.step_state import StepState


class FakeLoader:
    """The part of a prepared loader the policy reads: its length, batch index and position."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.batch_index = -1
        self.kept: int | None = None

    def __len__(self) -> int:
        return self.length

    def known_len(self) -> int:
        return self.length

    def keep_position(self, next_batch: int) -> None:
        self.kept = next_batch


def _policy(problem: str = "") -> BoundaryPolicy:
    return BoundaryPolicy(StepState(), lambda: problem)


def _micro_step(policy: BoundaryPolicy, ga: int, *, applied: bool = True) -> int | None:
    """One micro-step of the Engine's loop; the window length when it applied a step."""
    policy.begin_micro_step(ga)
    policy.step.micro_backwards += 1  # engine.backward
    policy.step.grads_pending = True
    window = policy.step.window_len
    if policy.step_is_due(in_accumulate=True):
        policy.record_step(applied, grad_norm=1.0, loss_scale=None, max_consecutive_skips=0)
        return window
    assert not policy.zero_grad_clears()  # mid-window: zero_grad keeps accumulating
    return None


def _epoch(policy: BoundaryPolicy, loader: FakeLoader, ga: int, stop: int | None = None) -> list[int]:
    windows = []
    for index in range(len(loader)):
        if stop is not None and index == stop:
            break
        loader.batch_index = index
        policy.on_batch(loader, index)
        window = _micro_step(policy, ga)
        if window is not None:
            windows.append(window)
    else:
        loader.batch_index = len(loader)
    policy.on_loader_end(loader)
    return windows


@pytest.mark.parametrize("ga", [1, 2, 3, 4])
@pytest.mark.parametrize("length", range(1, 10))
def test_every_window_length_and_the_short_last_window(ga, length):
    policy = _policy()
    loader = FakeLoader(length)
    windows = _epoch(policy, loader, ga)
    expected = [ga] * (length // ga) + ([length % ga] if length % ga else [])
    assert windows == expected
    assert policy.step.num_optimizer_steps == len(expected) and policy.step.num_micro_steps == length
    assert not policy.step.grads_pending and policy.current_loader is None
    # a second epoch starts a new window at its first batch
    assert _epoch(policy, loader, ga) == expected


@pytest.mark.parametrize("ga", [2, 3])
def test_a_break_keeps_the_position_after_the_last_trained_batch(ga):
    policy = _policy()
    loader = FakeLoader(7)
    windows = _epoch(policy, loader, ga, stop=4)
    assert windows == [ga] * (4 // ga)
    assert loader.kept == 4  # resumes at the batch after the last one trained on
    assert policy.current_loader is None


def test_loaders_are_at_trained_batches_only_where_a_micro_step_trained():
    policy = _policy()
    train, evaluation = FakeLoader(4), FakeLoader(2)
    assert policy.at_trained_batches()  # no loader in progress
    train.batch_index = 0
    policy.on_batch(train, 0)
    assert not policy.at_trained_batches()  # batch 0 drawn, not trained yet
    _micro_step(policy, 2)
    assert policy.at_trained_batches()
    evaluation.batch_index = 0
    policy.on_batch(evaluation, 0)  # an evaluation loop inside the training loop
    assert not policy.at_trained_batches()
    evaluation.batch_index = 2
    policy.on_loader_end(evaluation)
    assert policy.at_trained_batches()


def test_micro_steps_outside_a_loader_count_on_their_own():
    policy = _policy()
    applied = [_micro_step(policy, 3) for _ in range(7)]
    assert applied == [None, None, 3, None, None, 3, None]
    assert policy.step.free_micro_steps == 7


def test_a_pass_that_never_steps_is_refused_at_its_end():
    policy = _policy()
    loader = FakeLoader(3)
    for index in range(3):
        loader.batch_index = index
        policy.on_batch(loader, index)
        policy.begin_micro_step(1)
        policy.step.micro_backwards += 1
        policy.step.grads_pending = True  # backward, never optimizer.step()
    loader.batch_index = 3
    with pytest.raises(RuntimeError, match=r"^a whole pass over a prepared dataloader \(3 micro-steps\)"):
        policy.on_loader_end(loader)


def test_ga_1_lets_the_user_accumulate_by_hand_unless_the_backend_cannot():
    policy = _policy()
    for _ in range(3):  # backward three times, step once: plain torch semantics
        policy.begin_micro_step(1)
        policy.step.micro_backwards += 1
        policy.step.grads_pending = True
    assert policy.step_is_due(in_accumulate=False)
    policy = _policy(problem="DeepSpeed reduces at every boundary")
    policy.begin_micro_step(1)
    policy.step.grads_pending = True
    with pytest.raises(RuntimeError, match=r"\(DeepSpeed reduces at every boundary\)\. HINT: let the Engine"):
        policy.begin_micro_step(1)


def test_misuse_of_the_window_gives_the_existing_errors():
    policy = _policy()
    policy.begin_micro_step(2)
    policy.step.micro_backwards, policy.step.grads_pending = 1, True
    policy.begin_micro_step(2)  # the window's last micro-step
    with pytest.raises(RuntimeError, match=r"^`optimizer\.step\(\)` before `engine\.backward\(loss\)`"):
        policy.step_is_due(in_accumulate=True)
    policy.step.micro_backwards = 1
    with pytest.raises(RuntimeError, match=r"^`engine\.backward` was called twice"):
        policy.check_second_backward()
    with pytest.raises(RuntimeError, match=r"^`optimizer\.zero_grad\(\)` between `engine\.backward"):
        policy.zero_grad_clears()
    with pytest.raises(RuntimeError, match=r"^a new micro-step began, but the previous one \(micro-step 2\)"):
        policy.begin_micro_step(2)


def test_skipped_steps_are_counted_and_a_run_of_them_raises():
    policy = _policy()
    for _ in range(2):
        policy.begin_micro_step(1)
        policy.step.micro_backwards, policy.step.grads_pending = 1, True
        assert policy.step_is_due(in_accumulate=True)
        policy.record_step(False, grad_norm=None, loss_scale=1024.0, max_consecutive_skips=3)
    assert policy.step.step_was_skipped and policy.step.num_skipped_steps == 2
    assert policy.step.num_optimizer_steps == 0 and policy.step.loss_scale == 1024.0
    policy.begin_micro_step(1)
    policy.step.micro_backwards, policy.step.grads_pending = 1, True
    with pytest.raises(
        FloatingPointError, match=r"^3 optimizer steps in a row were skipped.*loss scale 1024"
    ):
        policy.record_step(False, grad_norm=None, loss_scale=1024.0, max_consecutive_skips=3)


def test_reset_forgets_loaders_and_the_window():
    policy = _policy()
    loader = FakeLoader(4)
    loader.batch_index = 0
    policy.on_batch(loader, 0)
    policy.begin_micro_step(2)
    policy.step.grads_pending = True
    policy.reset()
    assert policy.current_loader is None and not policy.step.grads_pending and policy.step.boundary
