"""`ds_engine.plot.plot_metrics` and `ds-engine plot`: a run's metrics.jsonl drawn as one PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ds_engine.cli import main as cli_main
from ds_engine.plot import plot_metrics, read_metrics

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train(step: int, *, skipped: bool = False, grad_norm: float | None = 1.0) -> dict:
    return {
        "step": step,
        "epoch": 0,
        "loss": 1.0 / step,
        "lr": 1e-3 * (1 - step / 40),
        "grad_norm": grad_norm,
        "step_was_skipped": skipped,
        "skipped_steps": 1 if step >= 20 else 0,
        "loss_scale": 1024.0,
        "samples_per_s": 20.0,
        "elapsed_s": step * 1.5,
    }


def write_metrics(path: Path, *, perplexity: bool = False) -> Path:
    metric = "eval_perplexity" if perplexity else "eval_accuracy"
    lines = [
        json.dumps({"step": 0, "eval_loss": 0.69, metric: 0.5 if not perplexity else 3000.0}),
        json.dumps(_train(10)),
        json.dumps(_train(20, skipped=True, grad_norm=None)),  # an fp16 overflow: no norm
        json.dumps(_train(30, grad_norm=2.5)),
        "",
        "not json at all",
        json.dumps(["a", "list"]),
        json.dumps({"note": "a record without a step"}),
        json.dumps({"step": 40, "eval_loss": 0.2, metric: 0.9 if not perplexity else 40.0}),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.shape[0] == 600 and image.shape[1] == 1000, image.shape  # 10 x 6 in at dpi 100
    assert image.shape[2] in (3, 4)
    assert path.stat().st_size < 150_000


def test_read_metrics_keeps_train_and_eval_records_and_skips_the_rest(tmp_path):
    train, evals = read_metrics(write_metrics(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in train] == [10, 20, 30]
    assert [r["step"] for r in evals] == [0, 40]


def test_a_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    path = write_metrics(tmp_path / "metrics.jsonl")
    with open(path, "a", encoding="utf-8") as f:  # resumed from step 20: steps 30.. again
        f.write(json.dumps({**_train(30), "loss": 0.123}) + "\n")
    train, _ = read_metrics(path)
    assert [r["step"] for r in train] == [10, 20, 30]
    assert train[-1]["loss"] == 0.123


@pytest.mark.parametrize("perplexity", [False, True])
def test_plot_metrics_writes_a_png_beside_the_metrics(tmp_path, perplexity):
    out = plot_metrics(write_metrics(tmp_path / "metrics.jsonl", perplexity=perplexity))
    assert out == tmp_path / "metrics.png"
    assert_png(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.png"]  # no temp left


def test_plot_metrics_with_both_eval_metrics_and_an_output_path(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps(_train(5))
        + "\n"
        + json.dumps({"step": 5, "eval_accuracy": 0.7, "eval_perplexity": 12.0})
        + "\n",
        encoding="utf-8",
    )
    out = plot_metrics(path, tmp_path / "figs" / "run.png")
    assert out == tmp_path / "figs" / "run.png"
    assert_png(out)


def test_plot_metrics_without_any_evaluation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_train(1)) + "\n", encoding="utf-8")
    assert_png(plot_metrics(path))


def test_cli_plot_prints_the_path_written(tmp_path, capsys):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    assert cli_main(["plot", str(metrics)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'metrics.png'}"
    out = tmp_path / "other.png"
    assert cli_main(["plot", str(metrics), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert_png(out)


def test_a_missing_file_is_one_error_line_naming_it(tmp_path, capsys):
    missing = tmp_path / "nope" / "metrics.jsonl"
    with pytest.raises(FileNotFoundError, match="nope"):
        plot_metrics(missing)
    assert cli_main(["plot", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds-engine: error: ") and str(missing) in err and "\n" not in err
    assert not (tmp_path / "nope").exists()


def test_a_file_without_train_records_is_an_error_naming_it(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "eval_loss": 0.7, "eval_accuracy": 0.5}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no train-step records"):
        plot_metrics(path)
    assert cli_main(["plot", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds-engine: error: ") and str(path) in err and "no train-step records" in err
    assert not (tmp_path / "metrics.png").exists()


def test_without_matplotlib_the_message_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install "ds-engine\[matplotlib\]"'):
        plot_metrics(metrics)
    assert cli_main(["plot", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert 'pip install "ds-engine[matplotlib]"' in err
    assert not (tmp_path / "metrics.png").exists()


# Junk a metrics file can hold (a crashed writer, a diverged run, another program's output):
# the line (or the value) is skipped and the plot is still drawn, never a traceback.
JUNK_LINES = {
    "step_1e308": '{"step": 1e308, "loss": 2.0}',
    "step_negative": '{"step": -5, "loss": 2.0}',
    "step_fraction": '{"step": 2.5, "loss": 2.0}',
    "step_huge_int": '{"step": ' + "9" * 400 + ', "loss": 2.0}',
    "loss_1e308_both_signs": '{"step": 7, "loss": 1e308}\n{"step": 8, "loss": -1e308}',
    "lr_and_norm_extremes": '{"step": 9, "loss": 1.0, "lr": 1e300, "grad_norm": 1e308}',
    "perplexity_not_positive": '{"step": 11, "eval_perplexity": -5}\n{"step": 12, "eval_perplexity": 0}',
    "accuracy_nan_string": '{"step": 13, "eval_accuracy": "NaN"}',
    "not_utf8": b'{"step": 14, "loss": "\xff\xfe"}'.decode("latin-1"),
    "nested_too_deep": "[" * 100_000,
    "over_long_line": "x" * (2**20 + 10),
    "not_an_object": '[1, 2]\n"text"\nnull',
    "skipped_steps_huge": '{"step": 15, "loss": 1.0, "skipped_steps": 1e308}',
}


@pytest.mark.parametrize("junk", list(JUNK_LINES.values()), ids=list(JUNK_LINES))
def test_junk_lines_are_skipped_and_the_plot_is_drawn(tmp_path, capsys, junk):
    (tmp_path / "run").mkdir()
    path = write_metrics(tmp_path / "run" / "metrics.jsonl")
    with open(path, "ab") as f:
        f.write(junk.encode("latin-1" if "\xff" in junk else "utf-8") + b"\n")
        f.write(json.dumps(_train(40)).encode() + b"\n")
    assert cli_main(["plot", str(path)]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert (tmp_path / "run" / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    train, _ = read_metrics(path)
    assert [r["step"] for r in train][-1] == 40
    assert all(isinstance(r["step"], int) and 0 <= r["step"] <= 10**12 for r in train)


def test_only_out_of_range_steps_is_an_error_with_a_hint(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": -1e18, "loss": 1.0}\n{"step": 1e18, "loss": 1.0}\n')
    assert cli_main(["plot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-engine: error: ") and "holds no train-step records" in err and "HINT:" in err


def test_smoothed_loss_is_a_debiased_moving_average() -> None:
    from ds_engine.plot import smoothed

    assert smoothed([2.0] * 30) == pytest.approx([2.0] * 30)  # no bias towards 0 at the start
    step = smoothed([1.0] * 20 + [0.0] * 20)
    assert step[0] == 1.0 and step[19] == pytest.approx(1.0)
    assert 0.0 < step[25] < step[21] < 1.0 and step[-1] < 0.2  # follows the change, lagging a little
    assert smoothed([3.0, 1.0], weight=0.5) == pytest.approx([3.0, (0.5 * 1.5 + 0.5) / 0.75])
