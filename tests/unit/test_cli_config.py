"""`ds-engine config`: build and --validate through the real CLI entry point."""

from __future__ import annotations

import json

import pytest

from ds_engine.cli import main


def test_config_prints_resolved_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "config",
            "--zero-stage",
            "3",
            "--precision",
            "bf16",
            "--gradient-accumulation-steps",
            "2",
            "--gradient-clipping",
            "1.0",
            "--micro-batch-size",
            "4",
            "--world-size",
            "2",
            "--hidden-size",
            "8",
            "--offload-optimizer",
            "cpu",
            "--no-pin-memory",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["train_batch_size"],
        out["train_micro_batch_size_per_gpu"],
        out["gradient_accumulation_steps"],
    ) == (16, 4, 2)
    assert out["gradient_clipping"] == 1.0 and out["bf16"]["enabled"] is True
    zero = out["zero_optimization"]
    assert (
        zero["stage"] == 3
        and zero["reduce_bucket_size"] == 64
        and zero["stage3_param_persistence_threshold"] == 80
    )
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


def test_config_with_preset_base(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["config", "--base", "zero2_offload", "--micro-batch-size", "2", "--hidden-size", "4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["zero_optimization"]["stage"] == 2
        and out["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )
    assert out["train_batch_size"] == 2


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["config", "--zero-stage", "2", "--offload-params", "cpu", "--micro-batch-size", "1"],
            "`offload_params`",
        ),
        (
            ["config", "--gradient-accumulation-steps", "0", "--micro-batch-size", "1"],
            "`gradient_accumulation_steps`",
        ),
        (["config", "--zero-stage", "1"], "`train_micro_batch_size_per_gpu`"),
        (
            ["config", "--base", "zero3", "--zero-stage", "1", "--micro-batch-size", "1"],
            "`zero_optimization.stage`",
        ),
        (["config", "--base", "nosuch", "--micro-batch-size", "1"], "`nosuch` is not a preset"),
        (["config", "--world-size", "0", "--micro-batch-size", "1"], "`world_size`"),
    ],
)
def test_config_user_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-engine: error: ") and err.count("\n") == 1 and match in err and "HINT:" in err


def test_argparse_rejects_stage_4(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--zero-stage", "4"])
    assert info.value.code == 2
    assert "--zero-stage" in capsys.readouterr().err


def test_validate_ok_and_problems(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 2},
            }
        )
    )
    assert main(["config", "--validate", str(good), "--world-size", "2"]) == 0
    assert capsys.readouterr().out.strip() == "OK"
    # the same file is wrong for 4 ranks
    assert main(["config", "--validate", str(good), "--world-size", "4"]) == 2
    assert "`train_batch_size` = 8 !=" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 7},
                "gradient_clippin": 1.0,
            }
        )
    )
    assert main(["config", "--validate", str(bad)]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 3, lines
    assert any("`gradient_clippin`" in line and "`gradient_clipping`" in line for line in lines)
    assert any('`train_micro_batch_size_per_gpu` = "auto"' in line for line in lines)
    assert any("`zero_optimization.stage` = 7" in line for line in lines)
    assert "3 problem(s)" in captured.err


def test_validate_corrupt_file_is_one_line_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "c.json"
    corrupt.write_text('{"a": ')
    assert main(["config", "--validate", str(corrupt)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "c.json` is not valid JSON" in err and "line 1 column 7" in err


def test_config_reports_every_problem_on_its_one_error_line(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"zero_optimisation": {"stage": 2}, "gradient_accumulation_steps": 0}))
    assert main(["config", "--base", str(base), "--micro-batch-size", "1", "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "ds-engine: error: 2 configuration problems: [1] `zero_optimisation` is not a known top-level "
        "DeepSpeed key. HINT: did you mean `zero_optimization`? [2] `gradient_accumulation_steps` = 0 "
    )


def test_config_without_micro_batch_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--zero-stage", "2"]) == 2
    err = capsys.readouterr().err
    assert '`train_micro_batch_size_per_gpu` = "auto" is left over' in err
    assert "ds-engine config: --micro-batch-size" in err


def test_validate_lists_optimizer_scheduler_and_misspelt_keys(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5},
                "optimizer": {"type": "AdamW", "params": {"lr": "1e-5", "max_grad_norm": 1.0}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0}},
            }
        )
    )
    assert main(["config", "--validate", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[0] == (
        "`zero_optimization.reduce_bucket_sise` is not a known zero_optimization key. "
        "HINT: did you mean `reduce_bucket_size`?"
    )
    for part in (
        '`optimizer.params.lr` = "1e-5" is invalid: expected a finite number >= 0',
        "`optimizer.params.max_grad_norm` = 1.0 is refused by DeepSpeed",
        "`scheduler.params.total_num_steps` is missing: WarmupDecayLR requires it",
        "`scheduler.params.warmup_num_steps` = 0 is invalid: expected an integer >= 1",
    ):
        assert sum(line.startswith(part) for line in lines) == 1, (part, lines)
    assert len(lines) == 5 and "5 problem(s)" in captured.err


def test_config_builds_from_every_preset_name(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.ds_config import PRESETS

    for name in PRESETS:
        extra = ["--nvme-path", "/local_nvme"] if "nvme" in name else []
        argv = ["config", "--base", name, "--micro-batch-size", "2", "--hidden-size", "8", *extra]
        assert main(argv) == 0, name
        out = json.loads(capsys.readouterr().out)
        assert out["train_batch_size"] == 2 and "auto" not in json.dumps(out), name
