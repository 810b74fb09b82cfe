"""DeepSpeed-backend features: CPU-Adam swap keeps betas/eps/weight decay (accelerate drops
them), a config-native optimizer, and `engine.grad_norm` is the real global pre-clip norm."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]


def test_deepspeed_engine_features():
    result = run_workers("engine_features.py", timeout=900)[0]
    offload = result["offload"]
    assert offload["type"] == "DeepSpeedCPUAdam" and offload["adamw_mode"]
    assert offload["betas"] == [0.8, 0.95] and offload["eps"] == 1e-6 and offload["weight_decay"] == 0.05
    # the user's LambdaLR still drives CPU Adam's learning rate
    assert offload["lrs"] == pytest.approx([3e-3 * 0.5**k for k in range(1, 3)])
    native = result["native"]
    assert native["changed"] and native["ds_optimizer_block"]["params"]["betas"] == [0.85, 0.99]
    for case in result["norms"]:
        assert case["got"] == pytest.approx(case["expected"], rel=1e-4), case
