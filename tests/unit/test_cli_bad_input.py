"""Hostile and faulty input to the `ds-engine` command line: one clear error line, exit 2.

The corpus below is what a hostile or unlucky user hands the CLI: model folders whose
config.json names a non-model callable, asks for a million layers, is a list, a FIFO, a link
to a system file or holds a key twice; DeepSpeed configs with duplicate keys; bad numbers;
bad environment variables. Every case must end with exit status 2 and exactly one
`ds-engine: error:` line that matches the case's pattern and carries a `HINT:`, with no
traceback, within a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ds_engine import memory
from ds_engine.cli import main


def _model(tmp: Path, config: Any, name: str = "model") -> Path:
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text, encoding="utf-8")
    return folder


def _raw(tmp: Path, data: bytes) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(data)
    return folder


def _linked(tmp: Path) -> Path:
    secret = tmp / "outside" / "secret.json"
    secret.parent.mkdir()
    secret.write_text('{"model_type": "gpt2"}', encoding="utf-8")
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to(secret)
    return folder


def _fifo(tmp: Path) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    return folder


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128,
        "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
DUPLICATE_ZERO = (
    '{"train_micro_batch_size_per_gpu": 1, '
    '"zero_optimization": {"stage": 3}, "zero_optimization": {"stage": 1}}'
)


@dataclass
class Case:
    """`argv(tmp_path)` run through `main` must exit 2 with one error line matching `match`."""

    id: str
    argv: Callable[[Path], list[str]]
    match: str
    env: dict[str, str] = field(default_factory=dict)


def _estimate(config: Any) -> Callable[[Path], list[str]]:
    return lambda t: ["estimate", "--model", str(_model(t, config))]


CASES: list[Case] = [
    # ---- estimate --model: config.json is untrusted -----------------------------------
    Case(
        "arch_pipeline",
        _estimate({**GPT2, "architectures": ["pipeline"]}),
        r"names 'pipeline', which is not a transformers model class",
    ),
    Case("arch_set_seed", _estimate({**GPT2, "architectures": ["set_seed"]}), r"names 'set_seed'"),
    Case(
        "arch_other_model_type",
        _estimate({**GPT2, "architectures": ["BertModel"]}),
        r"names 'BertModel'.*model_type 'gpt2'",
    ),
    Case(
        "arch_not_a_list",
        _estimate({**GPT2, "architectures": "GPT2Model"}),
        r"`architectures` = 'GPT2Model' is not a list",
    ),
    Case("million_layers", _estimate({**GPT2, "n_layer": 1_000_000}), r"`n_layer` = 1000000 .*0 to 1024"),
    Case(
        "nested_million_layers",
        _estimate({"model_type": "llava", "text_config": {"num_hidden_layers": 10**6}}),
        r"`num_hidden_layers` = 1000000",
    ),
    Case("layers_not_int", _estimate({**GPT2, "n_layer": "many"}), r"`n_layer` = 'many'"),
    Case("config_is_list", _estimate("[1, 2, 3]"), r"holds a JSON list, not an object"),
    Case("config_is_string", _estimate('"gpt2"'), r"holds a JSON str, not an object"),
    Case("config_not_json", _estimate("{model_type: gpt2}"), r"is not valid JSON: .* line 1"),
    Case(
        "config_duplicate_key",
        _estimate('{"model_type": "gpt2", "model_type": "bert"}'),
        r"writes the key 'model_type' twice",
    ),
    Case("config_too_deep", _estimate("[" * 100_000), r"nests too deeply"),
    Case(
        "config_too_big",
        _estimate('{"x": "' + "a" * (memory.MAX_CONFIG_BYTES + 1) + '"}'),
        r"bytes; allowed: at most 4194304",
    ),
    Case(
        "config_not_utf8", lambda t: ["estimate", "--model", str(_raw(t, b'{"a": "\xff"}'))], r"is not UTF-8"
    ),
    Case(
        "no_model_type",
        _estimate({"architectures": ["GPT2Model"]}),
        r"`model_type` = None is not a model type",
    ),
    Case(
        "custom_model_type",
        _estimate({"model_type": "evil", "auto_map": {"AutoModel": "evil.Model"}}),
        r"`model_type` = 'evil'",
    ),
    Case("bad_value_type", _estimate({**GPT2, "n_embd": "wide"}), r"config refuses it .*n_embd"),
    Case(
        "impossible_shape", _estimate({**GPT2, "n_embd": 65}), r"cannot be built from this config .*divisible"
    ),
    Case(
        "huge_storage",
        _estimate({**GPT2, "vocab_size": 10**14, "n_embd": 10**8}),
        r"cannot be built|went past a limit",
    ),
    Case(
        "config_symlink_outside",
        lambda t: ["estimate", "--model", str(_linked(t))],
        r"symbolic link to .*outside its folder",
    ),
    Case("config_fifo", lambda t: ["estimate", "--model", str(_fifo(t))], r"is not a regular file"),
    Case("model_folder_missing", lambda t: ["estimate", "--model", str(t / "nope")], r"does not exist"),
    Case(
        "validate_fifo",
        lambda t: ["config", "--validate", str(_fifo(t) / "config.json")],
        r"`.*config\.json` is not a regular file",
    ),
    Case(
        "validate_device",
        lambda t: ["config", "--validate", "/dev/zero"],
        r"`/dev/zero` is not a regular file",
    ),
    Case(
        "base_folder",
        lambda t: ["config", "--base", str(t), "--micro-batch-size", "1"],
        r"is not a regular file \(a folder",
    ),
    Case(
        "model_is_a_device",
        lambda t: ["estimate", "--model", "/dev/zero"],
        r"'/dev/zero' is not a regular file",
    ),
    Case(
        "config_json_is_a_folder",
        lambda t: ["estimate", "--model", str((t / "m" / "config.json").mkdir(parents=True) or t / "m")],
        r"config\.json' is not a regular file",
    ),
    Case(
        "model_folder_without_config",
        lambda t: ["estimate", "--model", str((t / "e").mkdir() or t / "e")],
        r"has no config.json",
    ),
    # ---- DeepSpeed JSON configs: a key written twice is an error naming key and file -----
    Case(
        "validate_duplicate_zero",
        lambda t: ["config", "--validate", str(_write(t / "ds.json", DUPLICATE_ZERO))],
        r"ds\.json.* writes the key 'zero_optimization' twice",
    ),
    Case(
        "base_duplicate_zero",
        lambda t: ["config", "--base", str(_write(t / "ds.json", DUPLICATE_ZERO)), "--micro-batch-size", "1"],
        r"ds\.json.* writes the key 'zero_optimization' twice",
    ),
    Case(
        "validate_duplicate_nested",
        lambda t: [
            "config",
            "--validate",
            str(_write(t / "ds.json", '{"zero_optimization": {"stage": 1, "stage": 3}}')),
        ],
        r"writes the key 'stage' twice",
    ),
    Case(
        "launch_duplicate_zero",
        lambda t: [
            "launch",
            "--config",
            str(_write(t / "ds.json", DUPLICATE_ZERO)),
            str(_write(t / "train.py", "pass")),
        ],
        r"`--config` .*ds\.json.* writes the key 'zero_optimization' twice",
    ),
    Case(
        "validate_too_deep",
        lambda t: ["config", "--validate", str(_write(t / "ds.json", "[" * 100_000))],
        r"nests too deeply",
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_exits_2_with_one_line(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    argv = case.argv(tmp_path)
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    took = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("ds-engine: error: "), err
    assert "HINT:" in lines[0], lines[0]
    assert re.search(case.match, lines[0]), lines[0]
    assert took < 30, f"{case.id} took {took:.1f} s"


def test_architectures_never_call_a_non_model_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    called: list[str] = []
    for name in ("pipeline", "set_seed"):
        monkeypatch.setattr(transformers, name, lambda *a, _n=name, **k: called.append(_n))
    for name in ("pipeline", "set_seed"):
        folder = _model(tmp_path, {**GPT2, "architectures": [name]}, name)
        with pytest.raises(ValueError, match=rf"names '{name}', which is not a transformers model class"):
            memory.resolve_num_params(folder)
    assert called == []


def test_model_is_built_on_the_meta_device_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    seen: list[str] = []
    real_init = transformers.GPT2LMHeadModel.__init__

    def spy(self: Any, config: Any) -> None:
        real_init(self, config)
        seen.extend({p.device.type for p in self.parameters()})

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "__init__", spy)
    folder = _model(tmp_path, {**GPT2, "architectures": ["GPT2LMHeadModel"]})
    assert memory.resolve_num_params(folder)[0] == 172_288
    assert seen == ["meta"]


def test_build_stops_at_the_module_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "MAX_MODULES", 20)
    folder = _model(tmp_path, {**GPT2, "n_layer": 50})
    with pytest.raises(
        ValueError, match=r"went past a limit: more than 20 modules .*HINT: pass the parameter count"
    ):
        memory.resolve_num_params(folder)


def test_build_stops_at_the_real_allocation_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GPT2Config

    monkeypatch.setattr(memory, "MAX_REAL_BYTES", 0)
    real_empty = __import__("torch").empty

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs["device"] = "cpu"
        return real_empty(*args, **kwargs)

    monkeypatch.setattr("torch.empty", on_cpu)  # a constructor that ignores the meta device
    with pytest.raises(ValueError, match=r"allocated off the meta device"):
        memory.resolve_num_params(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100))


def test_hugging_face_cache_symlinks_are_followed(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    blob = _write(repo / "blobs" / "0123abcd", json.dumps(GPT2))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    assert memory.resolve_num_params(snapshot)[0] > 0


def test_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    folder = _model(tmp_path, {**GPT2, "architectures": ["pipeline"]})
    script = Path(sys.executable).with_name("ds-engine")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ds_engine.cli"]
    done = subprocess.run(
        [*command, "estimate", "--model", str(folder)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("ds-engine: error:")]
    assert len(errors) == 1 and "'pipeline'" in errors[0], done.stderr


def test_engine_refuses_a_config_file_with_a_duplicate_key(tmp_path: Path) -> None:
    from ds_engine import Engine
    from ds_engine.config import ConfigError

    path = _write(tmp_path / "ds.json", DUPLICATE_ZERO)
    with pytest.raises(ConfigError, match=r"ds\.json` writes the key 'zero_optimization' twice.*HINT: merge"):
        Engine(config=str(path), backend="accelerate")


def test_a_plot_output_that_is_a_folder_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    metrics = _write(tmp_path / "metrics.jsonl", '{"step": 1, "loss": 1.0}\n')
    (tmp_path / "out.png").mkdir()
    assert main(["plot", str(metrics), "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-engine: error: ") and "out.png" in err and "Traceback" not in err


def test_an_internal_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ds_engine.plot

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a bug in ds_engine")

    monkeypatch.setattr(ds_engine.plot, "plot_metrics", broken)
    with pytest.raises(TypeError, match="a bug in ds_engine"):
        main(["plot", str(tmp_path / "metrics.jsonl")])


@pytest.mark.parametrize(
    ("name", "value", "minimum"),
    [("WORLD_SIZE", "abc", 1), ("LOCAL_RANK", "x", 0), ("WORLD_SIZE", "0", 1), ("LOCAL_RANK", "-1", 0)],
)
def test_env_int_names_the_variable_and_its_value(name: str, value: str, minimum: int) -> None:
    from ds_engine._values import env_int

    with pytest.raises(
        ValueError,
        match=rf"environment variable {name}='{value}' is not an integer >= {minimum}\. HINT: unset {name}",
    ):
        env_int(name, 1, minimum=minimum, environ={name: value})
    assert env_int(name, 7, minimum=minimum, environ={}) == 7
    assert env_int(name, 7, minimum=minimum, environ={name: " 3 "}) == 3


def test_the_command_line_prints_what_was_asked_and_nothing_else() -> None:
    """No DeepSpeed start-up chatter (accelerator detection) around a command's own output."""
    script = Path(sys.executable).with_name("ds-engine")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ds_engine.cli"]
    done = subprocess.run(
        [*command, "config", "--zero-stage", "2", "--micro-batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["zero_optimization"]["stage"] == 2
    assert done.stderr == "", done.stderr


def test_an_os_error_without_a_hint_gets_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "step_1" / "mp_rank_00_model_states.pt").mkdir(parents=True)  # a folder, not a file
    (checkpoint / "latest").write_text("step_1")
    meta = {"format": 1, "backend": "deepspeed", "zero_stage": 0, "precision": "fp32", "world_size": 1}
    (checkpoint / "step_1" / "ds_engine_meta.json").write_text(json.dumps({**meta, "saved_at": 1.0}))
    assert main(["consolidate", str(checkpoint), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ds-engine: error:") and "mp_rank_00_model_states.pt" in error, error
    assert "HINT: a folder stands where a file belongs" in error, error
    assert not (tmp_path / "out").exists()
