"""Several models in one `accelerator.prepare`: accelerate's own run vs the same script ported.

Two accelerate-style examples in `tests/accelerate_examples/` run on 2 CPU ranks (gloo) under
plain accelerate, then with only `from accelerate import` rewritten to `from ds_engine import`
under ds_engine ("auto": the fallback without DeepSpeed, ZeRO-0 with it; ZeRO-2 and ZeRO-3
through `DS_ENGINE_CONFIG`):

- `distillation_example.py`: a frozen teacher and a reference model without an optimizer beside
  the trained student (GA 2, a StepLR), all in one `prepare`;
- `gan_example.py`: generator and discriminator, each with its optimizer and StepLR, in one
  `prepare` in mixed order, `accumulate(generator, discriminator)` at GA 2, the generator's
  step with the discriminator frozen and called unwrapped.

Every step's losses, the learning rates and the final weights of every model must agree within
1e-5 relative. Each ported run (but ZeRO-3's) saves its state after 4 batches (`save_state`); a
second launch `load_state`s it and finishes: its losses and final weights must equal the
uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launcher import (
    ROOT,
    launch_example,
    port_accelerate_script,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLES = ROOT / "tests" / "accelerate_examples"
#: example -> the models whose final weights it writes
WEIGHTS = {
    "distillation_example.py": ("student", "teacher", "reference"),
    "gan_example.py": ("generator", "discriminator"),
}


def _run(example: str, tmp: Path, flavour: str, *, resume: bool = True) -> dict[str, Any]:
    """`example` under accelerate ("accelerate") or ported ("auto", or a preset name given to
    `DS_ENGINE_CONFIG`, as `ds-engine launch --config` hands it over); with `resume`, a second
    launch resumes from the state the first saved."""
    script = EXAMPLES / example
    out = tmp / flavour
    env: dict[str, str] = {}
    if flavour != "accelerate":
        script = port_accelerate_script(script, tmp)
        if flavour != "auto":
            env["DS_ENGINE_CONFIG"] = flavour
    launch_example(script, out, env=env, files=("full.json",))
    results = {"full": json.loads((out / "full.json").read_text()), "out": out}
    if resume:
        launch_example(script, out, "--resume", env=env, files=("resumed.json",))
        results["resumed"] = json.loads((out / "resumed.json").read_text())
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """accelerate's own run of each example (uninterrupted), once per module."""
    cache: dict[str, dict[str, Any]] = {}

    def get(example: str) -> dict[str, Any]:
        if example not in cache:
            cache[example] = _run(example, tmp_path_factory.mktemp("accelerate"), "accelerate", resume=False)
        return cache[example]["full"]

    return get


def _largest(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))


def _check(example: str, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    full = ours["full"]
    assert len(full["losses"]) == len(theirs["losses"]) > 0
    assert full["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-7)
    assert full["lrs"] == pytest.approx(theirs["lrs"], rel=1e-6, abs=1e-12)
    for model in WEIGHTS[example]:
        assert full[model] == pytest.approx(theirs[model], rel=1e-5, abs=1e-6), model
    print(f"{example}: largest relative loss difference {_largest(full['losses'], theirs['losses']):.2e}")
    resumed = ours.get("resumed")
    if resumed is not None:  # resumed after 4 batches: the rest of the uninterrupted run exactly
        tail = len(resumed["losses"])
        assert 0 < tail < len(full["losses"])
        assert resumed["losses"] == pytest.approx(full["losses"][-tail:], rel=1e-6, abs=1e-9)
        assert resumed["lrs"] == full["lrs"][-len(resumed["lrs"]) :]
        for model in WEIGHTS[example]:
            assert resumed[model] == pytest.approx(full[model], rel=1e-6, abs=1e-9), model
    if example == "distillation_example.py":
        assert full["teacher"] == theirs["teacher"] and full["reference"] == theirs["reference"]  # untrained
        assert full["unwrapped"] == "Sequential"
        assert (ours["out"] / "student" / "model.safetensors").is_file()  # save_model
    else:  # the generator, accelerate's model 1 (the discriminator came first), in model_1/
        assert (ours["out"] / "state" / "model_1" / "latest").is_file()


@pytest.mark.parametrize("example", sorted(WEIGHTS))
def test_ported_several_models_match_accelerate_and_resume_exactly(example, reference, tmp_path):
    """`auto`: the fallback without DeepSpeed, DeepSpeed ZeRO-0 with it."""
    _check(example, _run(example, tmp_path, "auto"), reference(example))


@pytest.mark.deepspeed
@pytest.mark.parametrize("example", sorted(WEIGHTS))
def test_ported_several_models_match_accelerate_on_zero2(example, reference, tmp_path):
    _check(example, _run(example, tmp_path, "zero2"), reference(example))


@pytest.mark.deepspeed
@pytest.mark.parametrize("example", sorted(WEIGHTS))
def test_ported_several_models_match_accelerate_on_zero3(example, reference, tmp_path):
    """ZeRO-3 (no resume): the teacher and the reference model partitioned and gathered layer by
    layer; the GAN's frozen discriminator called unwrapped inside the generator's backward."""
    _check(example, _run(example, tmp_path, "zero3", resume=False), reference(example))
