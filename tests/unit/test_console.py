"""The console policy: rank 0 speaks; the other ranks only when asked (`ds_engine._console`).

Each case runs in a fresh process with the launcher's `RANK` set, as torchrun sets it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import logging, warnings
    from ds_engine._console import quiet_console, quiet_unless_main
    quiet_console()
    warnings.warn("ds_engine: the same on every rank")
    warnings.warn("ds_engine: rank 1 of 2 has no saved RNG state")
    warnings.warn("torch.distributed.reduce_scatter_tensor is deprecated", FutureWarning)
    logging.getLogger("DeepSpeed").addHandler(logging.StreamHandler())
    logging.getLogger("DeepSpeed").warning("deepspeed chatter")
    logging.getLogger("DeepSpeed").error("deepspeed error")
    with quiet_unless_main():
        print("op built")
    """
)


def _run(rank: str, all_ranks: str = "") -> str:
    env = {"RANK": rank, "DS_ENGINE_LOG_ALL_RANKS": all_ranks, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def test_rank_0_speaks_without_deprecation_noise() -> None:
    out = _run("0")
    assert "the same on every rank" in out and "deepspeed chatter" in out and "op built" in out
    assert "is deprecated" not in out


@pytest.mark.parametrize("all_ranks", ["", "1"])
def test_other_ranks_speak_when_asked_and_errors_always(all_ranks: str) -> None:
    out = _run("1", all_ranks)
    assert "deepspeed error" in out and "rank 1 of 2 has no saved RNG state" in out  # always shown
    assert "is deprecated" not in out
    shown = all_ranks == "1"
    assert ("the same on every rank" in out) == shown, out
    assert ("deepspeed chatter" in out) == shown, out
    assert ("op built" in out) == shown, out
