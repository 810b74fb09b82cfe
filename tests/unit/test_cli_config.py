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
            '`--offload-params` = "cpu" needs ZeRO stage 3, got `--zero-stage` = 2',
        ),
        (
            ["config", "--gradient-accumulation-steps", "0", "--micro-batch-size", "1"],
            "`--gradient-accumulation-steps` = 0 is invalid",
        ),
        (
            ["config", "--zero-stage", "1", "--world-size", "2"],
            "`--world-size` is only used for a complete config",
        ),
        (
            ["config", "--zero-stage", "3", "--offload-params", "nvme", "--micro-batch-size", "1"],
            'HINT: pass --nvme-path "/local_nvme/ds_swap"',
        ),
        (
            ["config", "--base", "zero3", "--zero-stage", "1", "--micro-batch-size", "1"],
            "`zero_optimization.stage`",
        ),
        (["config", "--base", "nosuch", "--micro-batch-size", "1"], "`nosuch` is not a preset"),
        (["config", "--world-size", "0", "--micro-batch-size", "1"], "`--world-size` = 0 is invalid"),
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
    assert len(lines) == 2, lines  # "auto" is no problem in a template: it is filled at prepare
    assert any("`gradient_clippin`" in line and "`gradient_clipping`" in line for line in lines)
    assert any("`zero_optimization.stage` = 7" in line for line in lines)
    assert "2 problem(s)" in captured.err


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


def test_config_without_micro_batch_prints_a_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--zero-stage", "3", "--gradient-accumulation-steps", "4"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # stdout is the JSON alone
    assert out["zero_optimization"]["stage"] == 3 and out["gradient_accumulation_steps"] == 4
    assert out["train_micro_batch_size_per_gpu"] == "auto" and out["train_batch_size"] == "auto"
    assert 'a template: its "auto" values are filled at prepare' in captured.err


def test_a_printed_template_is_accepted_by_the_engine(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    from ds_engine import Engine

    assert main(["config", "--zero-stage", "2", "--precision", "bf16"]) == 0
    path = tmp_path / "ds.json"
    path.write_text(capsys.readouterr().out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(config=str(path), backend="accelerate")
    assert engine.config.zero_stage == 2 and engine.config.precision == "bf16"
    assert main(["config", "--validate", str(path)]) == 0
    assert "OK (a template:" in capsys.readouterr().out


def test_validate_accepts_every_shipped_preset_as_a_template(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.ds_config import PRESETS, preset_path

    for name in PRESETS:
        assert main(["config", "--validate", str(preset_path(name))]) == 0, name
        out = capsys.readouterr().out
        assert 'filled at prepare: train_micro_batch_size_per_gpu = "auto"' in out, (name, out)
        assert "OK (a template: " in out.splitlines()[-1], (name, out)
        nvme = [line for line in out.splitlines() if "nvme_path" in line]
        assert all(line.startswith("filled from your NVMe folder: ") for line in nvme), nvme
        assert bool(nvme) == ("nvme" in name), (name, out)


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


# --------------------------------------------------------------------------- the parser itself
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ds-engine {__version__}"


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (
            ["config", "--zero-stag", "3"],
            "--zero-stag: did you mean --zero-stage?",
        ),  # a prefix: no abbreviations
        (["config", "--zero-stgae", "3"], "--zero-stgae: did you mean --zero-stage?"),
        (["estimate", "--params", "7B", "--gpus-per-nod", "2"], "did you mean --gpus-per-node?"),
        (["estimate", "--params", "7B", "--hedroom=0.3"], "--hedroom: did you mean --headroom?"),
        (["launch", "--nproc", "2", "train.py"], "--nproc: did you mean --nproc-per-node?"),
        (["plot", "m.jsonl", "--ouput", "x.png"], "--ouput: did you mean --output?"),
        (["estimate", "--params", "7B", "--gpus", "8"], "--gpus: did you mean --gpus-per-node?"),
        (
            ["estimate", "--params", "7B", "--zero-stage", "3"],
            "--zero-stage is an option of `ds-engine config`, not of `ds-engine estimate`",
        ),  # not the look-alike --no-zero-init
    ],
)
def test_exact_flags_only_with_a_suggestion(
    argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ds-engine {argv[0]} "), err  # the subcommand's usage, not the top one
    last = err.strip().splitlines()[-1]
    assert last.startswith("ds-engine: error: unrecognized arguments: ") and suggestion in last, last


@pytest.mark.parametrize(
    ("typed", "meant"), [("confg", "config"), ("estmate", "estimate"), ("lanch", "launch")]
)
def test_a_misspelt_command_gets_a_suggestion(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([typed])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"; did you mean {meant}?")


def test_every_option_has_help_and_says_its_default() -> None:
    import argparse

    from ds_engine.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, sub in commands.items():
        if name == "consolidate":  # its options are maintained with the consolidation code
            continue
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            store_true = isinstance(action, argparse._StoreTrueAction)
            says_default = "default" in text or "is required" in text
            if not text or not (store_true or says_default):
                missing.append(f"{name} {action.option_strings[0]}: {text!r}")
    assert missing == []
