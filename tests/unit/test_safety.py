"""The pickle pre-check that guards DeepSpeed's weights_only=False loads."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from ds_engine.safety import UnsafeCheckpointError, check_checkpoint_folder, check_pickle_file


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tensors_containers_and_numpy_pass(tmp_path: Path):
    import collections

    import numpy as np

    path = tmp_path / "ok.pt"
    torch.save(
        {
            "w": torch.ones(3),
            "od": collections.OrderedDict(a=torch.zeros(1, dtype=torch.bfloat16)),
            "np": np.arange(3),
            "size": torch.Size([2]),
            "n": 3,
            "s": {1, 2},
        },
        path,
    )
    check_pickle_file(path)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path: Path, protocol: int):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"state": _Evil(marker)}, path, pickle_protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt.*system"):
        check_pickle_file(path)
    legacy = tmp_path / "evil.pkl"
    legacy.write_bytes(pickle.dumps(_Evil(marker), protocol=protocol))
    with pytest.raises(UnsafeCheckpointError, match="HINT"):
        check_checkpoint_folder(tmp_path)
    assert not marker.exists()


def test_a_truncated_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "model_states.pt"
    torch.save({"w": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"model_states\.pt.*truncated"):
        check_pickle_file(path)


@pytest.mark.deepspeed
def test_deepspeed_classes_are_allowed_but_not_its_functions(tmp_path: Path):
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils import logger

    ok = tmp_path / "ok.pt"
    torch.save({"zero_stage": ZeroStageEnum.weights}, ok)
    check_pickle_file(ok)

    class CallsDeepSpeedFunction:
        def __reduce__(self):
            import deepspeed.utils.zero_to_fp32 as z

            return (z.get_fp32_state_dict_from_zero_checkpoint, ("/nonexistent",))

    bad = tmp_path / "bad.pt"
    torch.save({"x": CallsDeepSpeedFunction()}, bad)
    with pytest.raises(UnsafeCheckpointError, match="get_fp32_state_dict_from_zero_checkpoint"):
        check_pickle_file(bad)
    assert logger is not None
