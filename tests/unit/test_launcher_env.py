"""The launcher's environment variables are checked when an Engine is built, before any library
reads them: a bad value names the variable and its value instead of a bare `int()` error."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from ds_engine import Engine


@pytest.mark.parametrize(
    ("name", "value", "minimum"),
    [("WORLD_SIZE", "abc", 1), ("WORLD_SIZE", "0", 1), ("LOCAL_RANK", "x", 0), ("RANK", "-1", 0),
     ("LOCAL_WORLD_SIZE", "2.5", 0), ("MASTER_PORT", "http", 0)],
)  # fmt: skip
def test_a_bad_launcher_variable_is_named(
    name: str, value: str, minimum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with warnings.catch_warnings(), pytest.raises(ValueError) as caught:
        warnings.simplefilter("ignore")
        Engine(backend="accelerate")
    message = str(caught.value)
    assert f"environment variable {name}={value!r} is not an integer >= {minimum}" in message
    assert "HINT: unset" in message and "ds-engine launch" in message
    assert not dist.is_initialized()


@pytest.mark.parametrize("call", ["save_state", "load_state"])
def test_accelerator_state_calls_after_end_training_name_themselves(call: str, tmp_path) -> None:
    from ds_engine import Accelerator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(cpu=True)
    accelerator.end_training()
    with pytest.raises(RuntimeError, match=rf"`accelerator\.{call}\(\.\.\.\)` after `end_training\(\)`"):
        getattr(accelerator, call)(str(tmp_path / "state"))
    assert list(tmp_path.iterdir()) == []
