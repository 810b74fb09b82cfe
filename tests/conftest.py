"""Shared test set-up: offline Hugging Face, markers checked against the environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ds_engine._imports import is_deepspeed_available

try:  # a dev dependency; the property tests import it themselves and fail loudly without it
    from hypothesis import settings
except ImportError:  # pragma: no cover
    pass
else:
    # "ci" (the default): a bounded, reproducible search that adds well under a minute;
    # HYPOTHESIS_PROFILE=thorough searches longer (and randomly) when working on the builder.
    settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, print_blob=True)
    settings.register_profile("thorough", max_examples=3000, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The quick tier (`pytest -m quick -n 2`, under 3 minutes on 2 cores): every unit test not marked
# `slow`, and these real 2-rank launches, which check the core semantics end to end (the
# window mean for every window length, parity with a one-process reference, every loop shape,
# the schedule and overflow rules, hand-written accumulation, exact resume, the quick start).
QUICK_DISTRIBUTED = (
    "tests/distributed/test_window_exact.py::test_deepspeed_zero_0_and_1_",
    "tests/distributed/test_window_exact.py::test_fallback_ddp_and_fsdp2_",
    "tests/distributed/test_parity.py::test_deepspeed_zero_0_to_3_match_the_big_batch_reference",
    "tests/distributed/test_parity.py::test_accelerate_fallback_matches_the_reference_and_reduces_once",
    "tests/distributed/test_loop_shapes.py::",
    "tests/distributed/test_schedule_convention.py::",
    "tests/distributed/test_overflow.py::test_deepspeed_fp16_and_bf16_",
    "tests/distributed/test_overflow.py::test_fallback_skips_non_finite_steps",
    "tests/distributed/test_hand_accumulation.py::",
    "tests/distributed/test_resume.py::test_resume_equals_uninterrupted_run_exactly",
    "tests/distributed/test_examples.py::test_quickstart_",
)


# Launches that exercise only the accelerate fallback (an explicit `backend="accelerate"`, never
# "auto") or only the launcher with plain torch workers. Nothing in them depends on DeepSpeed
# being installed, so the whole suite (scripts/test.sh) runs them once, in the environment
# where DeepSpeed is absent (marked `dsfree`, deselected in the DeepSpeed environment); there
# they also prove the fallback needs no DeepSpeed. Where DeepSpeed is installed the fallback
# is still exercised by the quick tier's fallback launches (not listed here, so they run in
# both environments), by the fallback scenarios that share a launch with DeepSpeed's
# (test_resume, test_peft, test_accelerate_port, test_consolidation) and by the unit tests.
# A test that uses the "auto" backend (DeepSpeed where installed) does not belong here.
DSFREE_DISTRIBUTED = (
    "tests/distributed/test_accelerate_idiom.py::test_fallback_",
    "tests/distributed/test_async_checkpoint.py::test_background_saves_train_identically_and_agree_on_errors[fallback]",
    "tests/distributed/test_async_checkpoint.py::test_a_sigkill_during_the_background_write_resumes_from_the_previous_checkpoint[fallback]",
    "tests/distributed/test_autosave.py::test_a_signal_to_one_rank_saves_the_same_step_on_both_and_the_rerun_ends_identical[fallback-",
    "tests/distributed/test_autosave.py::test_a_sigkilled_rank_restarts_and_ends_identical[fallback]",
    "tests/distributed/test_autosave_faults.py::test_a_rank_killed_inside_a_save_restarts_from_the_one_before_and_ends_identical[fallback-",
    "tests/distributed/test_autosave_faults.py::test_sigterm_in_the_middle_of_a_backward_saves_one_agreed_step_and_the_rerun_ends_identical[fallback]",
    "tests/distributed/test_borrowed_group.py::test_a_group_the_host_formed_survives_end_training[keep-accelerate]",
    "tests/distributed/test_borrowed_group.py::test_a_group_the_host_formed_survives_end_training[strip-accelerate]",
    "tests/distributed/test_borrowed_group.py::test_a_group_the_engine_formed_is_destroyed_by_end_training[accelerate]",
    "tests/distributed/test_crash_during_save.py::test_kill_during_saves_fallback",
    "tests/distributed/test_data_pipelines.py::test_fallback_",
    "tests/distributed/test_dead_rank.py::test_a_dead_rank_ends_every_rank_within_60s[fallback-",
    "tests/distributed/test_engine_misuse.py::test_engine_misuse_on_two_ranks[accelerate]",
    "tests/distributed/test_fallback_fsdp.py::",
    "tests/distributed/test_generate.py::test_fallback_",
    "tests/distributed/test_hangs.py::test_a_hang_is_named_within_the_timeout[fallback-",
    "tests/distributed/test_launch.py::",
    "tests/distributed/test_launcher_forks.py::",
    "tests/distributed/test_multi_model.py::test_fallback_",
    "tests/distributed/test_nonfinite_policy.py::test_fallback_",
    "tests/distributed/test_ray_train.py::test_a_ray_run_stopped_and_resumed_trains_step_for_step_what_torchrun_ranks_train[fallback]",
    "tests/distributed/test_save_faults.py::test_a_failed_save_ends_every_rank_within_seconds_naming_rank_file_and_cause[fallback]",
    "tests/distributed/test_scripts.py::test_scripts_on_the_accelerate_fallback_",
    "tests/distributed/test_token_weighted.py::test_the_fallback_",
    "tests/distributed/test_utilities.py::test_utilities_on_the_accelerate_fallback",
)


def _is_quick(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow"):
        return False
    if item.nodeid.startswith("tests/unit/"):
        return True
    return item.nodeid.startswith(QUICK_DISTRIBUTED)


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (`-n 2`) the launches go to one worker, one at a time (the group below),
    # while the other workers take the unit tests, which keep the second core busy (a second
    # stream of launches beside them would only add load).
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    matched: set[str] = set()
    for item in items:
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("launches"))
        dsfree = [prefix for prefix in DSFREE_DISTRIBUTED if item.nodeid.startswith(prefix)]
        if dsfree and not _is_quick(item):
            if item.get_closest_marker("deepspeed"):
                raise pytest.UsageError(f"{item.nodeid}: marked `deepspeed`, listed in DSFREE_DISTRIBUTED")
            item.add_marker(pytest.mark.dsfree)
            matched.update(dsfree)
    # an entry that no longer names a test would silently move nothing: where whole folders
    # were collected (no test ids, no -k), every entry of a collected file must match
    whole = all("::" not in arg and os.path.isdir(arg) for arg in config.option.file_or_dir or [])
    if whole and not config.option.keyword:
        files = {item.nodeid.split("::")[0] for item in items}
        stale = [p for p in DSFREE_DISTRIBUTED if p not in matched and p.split("::")[0] in files]
        if stale:
            raise pytest.UsageError(f"DSFREE_DISTRIBUTED entries that name no test: {stale}")
    # A test marked `deepspeed` must never be silently skipped: in the DeepSpeed-free
    # environment scripts/test.sh deselects them with -m "not deepspeed"; anywhere else a
    # missing DeepSpeed is a failure, not a skip.
    for item in items:
        if item.get_closest_marker("nodeepspeed") and is_deepspeed_available():
            item.add_marker(pytest.mark.skip(reason="runs only where DeepSpeed is not installed"))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that forms a process group in this process must end it (`engine.end_training()`):
    a group left behind would change what the next test on the same worker sees."""
    from ds_engine import process_group

    before = process_group.is_initialized()
    yield
    if before or not process_group.is_initialized():
        return
    for engine in process_group.users():
        engine.end_training()
    if process_group.is_initialized():  # formed by the test itself, not by an Engine
        import torch.distributed as dist

        dist.destroy_process_group()
    pytest.fail("the test left a process group behind: end every Engine it made with `end_training()`")
