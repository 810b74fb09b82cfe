"""`Engine(**choices)` is typed: IDEs complete the `EngineConfig` fields and type checkers catch typos."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from ds_engine.config import EngineChoices, EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_choices_are_exactly_the_config_fields() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig) if not f.name.startswith("_")}
    assert set(typing.get_type_hints(EngineChoices)) == fields


@pytest.mark.slow
def test_a_type_checker_catches_a_misspelt_choice(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(
        "from ds_engine import Engine\n"
        'Engine(zero_stage=3, precision="bf16")\n'
        "Engine(zero_stag=3)\n"
        'Engine(precision="bf32")\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", str(script)],
        cwd=ROOT,  # the project's mypy cache (scripts/test.sh's lint step fills it first)
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["3", "4"], result.stdout
    assert '"zero_stag"' in errors[0] and "bf32" in errors[1], result.stdout
