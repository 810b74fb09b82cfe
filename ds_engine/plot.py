"""Draw a run's `metrics.jsonl` as one small PNG (`ds-engine plot`).

Four panels: training loss (with the validation loss per evaluation), learning rate, gradient
norm (skipped optimizer steps marked with a red x), and the validation accuracy and/or perplexity
per evaluation, whichever the file holds. matplotlib is an optional extra, imported only here, on
its Agg canvas (no pyplot, no global backend switch), so a notebook's own backend is untouched.

Train-step records are the lines with a numeric `step` and `loss` (and no `eval_*` key);
evaluation records are the lines with `eval_accuracy`, `eval_perplexity` or `eval_loss`. Lines
that are neither (or are not UTF-8 JSON, or longer than `MAX_LINE_BYTES`) are skipped; a step
is an integer from 0 to `MAX_STEP`; a value beyond +-`MAX_ABS_VALUE` is drawn as missing, as NaN
and inf are, and a perplexity <= 0 is left off its log axis. A resumed run appends to the file:
the last record of a step wins.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_engine._io import write_file_atomic

INSTALL_HINT = 'pip install "ds-engine[matplotlib]"  (or: pip install "matplotlib>=3.7")'

#: Evaluation metrics drawn in the last panel, with their labels.
EVAL_METRICS = {"eval_accuracy": "validation accuracy", "eval_perplexity": "validation perplexity"}


#: Largest magnitude drawn; beyond it a value counts as no number (an axis spanning +-1e308 cannot
#: be ticked), as NaN and inf do.
MAX_ABS_VALUE = 1e100
#: Largest step drawn (a trillion optimizer steps).
MAX_STEP = 10**12


def _number(value: Any) -> float | None:
    """`value` as a float of at most `MAX_ABS_VALUE`, or None (bools, strings, null, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return value if math.isfinite(value) and abs(value) <= MAX_ABS_VALUE else None


def _step(record: dict) -> int | None:
    """The record's `step` as an int in 0..MAX_STEP, or None."""
    step = _number(record.get("step"))
    return int(step) if step is not None and 0 <= step <= MAX_STEP and step == int(step) else None


#: Longest line read (a metrics record is a few hundred bytes); longer lines are skipped unread.
MAX_LINE_BYTES = 2**20


def _lines(f: Any) -> Iterator[bytes]:
    """The lines of binary file `f`, without any longer than `MAX_LINE_BYTES` (read past, in chunks)."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES:
            yield line
            continue
        while line and not line.endswith(b"\n"):  # skip the rest of the over-long line
            line = f.readline(MAX_LINE_BYTES)


def read_metrics(metrics_path: str | os.PathLike[str]) -> tuple[list[dict], list[dict]]:
    """The train-step and evaluation records of a metrics file, each sorted by step.

    Raises FileNotFoundError (naming the path) when there is no such file and ValueError when it
    holds no train-step record.
    """
    path = Path(metrics_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no metrics file at {path} (expected a run's metrics.jsonl, a regular file). "
            "HINT: pass the metrics.jsonl your run wrote"
        )
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path, "rb") as f:
        for raw in _lines(f):
            try:  # a junk line (not UTF-8, not JSON, nested past the recursion limit) is skipped
                record = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):
                continue
            step = _step(record) if isinstance(record, dict) else None
            if step is None:
                continue
            record["step"] = step
            if any(key.startswith("eval_") for key in record):
                if any(_number(record.get(k)) is not None for k in (*EVAL_METRICS, "eval_loss")):
                    evals[step] = record
            elif _number(record.get("loss")) is not None:
                train[step] = record
    if not train:
        raise ValueError(
            f"{path} holds no train-step records (JSON lines with a numeric 'step' and 'loss'); "
            "is it a ds_engine run's metrics.jsonl, and did the run log at least one step? "
            "HINT: pass the metrics.jsonl of a run that logged a step"
        )
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = _number(record.get(key))
        if value is not None:
            steps.append(int(record["step"]))
            values.append(value)
    return steps, values


#: From this many logged steps on, the raw loss is drawn faint with its moving average over it.
SMOOTH_FROM = 10


def smoothed(values: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing), `weight` from the length.

    The default weight averages over about a tenth of the run (at least 2 points), so the
    curve reads the same at 20 and at 2,000 logged steps.
    """
    if weight is None:
        weight = 1.0 - 1.0 / max(2.0, len(values) / 10)
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


def plot_metrics(
    metrics_path: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None
) -> Path:
    """Draw `metrics_path` (a run's metrics.jsonl) as a PNG; returns the path written.

    `out_path` defaults to the metrics file with a `.png` suffix (`metrics.png` beside it). The
    PNG is written under a temporary name in the same folder and renamed into place, so a reader
    never sees half a file. Raises ImportError (saying how to install it) without matplotlib.
    """
    path = Path(metrics_path)
    train, evals = read_metrics(path)
    out = Path(out_path) if out_path is not None else path.with_suffix(".png")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.transforms import blended_transform_factory
    except ImportError as exc:
        raise ImportError(f"drawing {path} needs matplotlib ({exc}). HINT: {INSTALL_HINT}") from None

    fig = Figure(figsize=(10, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_lr), (ax_grad, ax_eval) = fig.subplots(2, 2, sharex=True)
    title = path.parent.name or str(path)
    fig.suptitle(f"{title}: {len(train)} logged steps, {len(evals)} evaluations", fontsize=11)

    loss_steps, losses = _series(train, "loss")
    if len(losses) >= SMOOTH_FROM:
        ax_loss.plot(loss_steps, losses, "-", color="tab:blue", alpha=0.3, lw=0.8, label="training loss")
        ax_loss.plot(loss_steps, smoothed(losses), "-", color="tab:blue", lw=1.8, label="smoothed (EMA)")
    else:
        ax_loss.plot(loss_steps, losses, ".-", color="tab:blue", label="training loss")
    eval_steps, eval_losses = _series(evals, "eval_loss")
    if eval_steps:
        ax_loss.plot(eval_steps, eval_losses, "o--", color="tab:orange", label="validation loss")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)

    ax_lr.plot(*_series(train, "lr"), color="tab:green")
    ax_lr.set_title("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    grad_steps, grad_norms = _series(train, "grad_norm")
    ax_grad.plot(grad_steps, grad_norms, color="tab:purple", label="gradient norm")
    skipped = [r for r in train if r.get("step_was_skipped") is True]
    counts = _series(train, "skipped_steps")[1]  # the engine's running count, logged or not
    total_skipped = int(max(counts)) if counts else len(skipped)
    if skipped:
        # at the step's norm when it is finite, else at the bottom edge of the panel
        edge = blended_transform_factory(ax_grad.transData, ax_grad.transAxes)
        for record in skipped:
            norm = _number(record.get("grad_norm"))
            if norm is not None:
                ax_grad.plot(record["step"], norm, "x", color="red", markersize=9, mew=2)
            else:
                ax_grad.plot(record["step"], 0.03, "x", color="red", markersize=9, mew=2, transform=edge)
        ax_grad.plot([], [], "x", color="red", mew=2, label=f"skipped step ({len(skipped)} logged)")
    ax_grad.set_title(f"gradient norm (skipped steps: {total_skipped})")
    if grad_steps or skipped:
        ax_grad.legend(fontsize=8)
    ax_grad.set_xlabel("optimizer step")

    _draw_evals(ax_eval, evals)
    ax_eval.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_lr, ax_grad, ax_eval):
        ax.margins(x=0.06)  # room for the value labels at the first and last evaluation

    out.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(out, lambda tmp: fig.savefig(tmp, format="png"))
    return out


def _draw_evals(ax: Any, evals: list[dict]) -> None:
    """Accuracy and/or perplexity per evaluation (perplexity on a log scale, its own axis if both)."""
    acc = _series(evals, "eval_accuracy")
    ppl_steps, ppl_values = _series(evals, "eval_perplexity")
    kept = [(step, value) for step, value in zip(ppl_steps, ppl_values) if value > 0]  # a log axis
    ppl = ([step for step, _ in kept], [value for _, value in kept])
    ax.set_title("validation")
    if not acc[0] and not ppl[0]:
        ax.text(
            0.5, 0.5, "no accuracy / perplexity records", ha="center", va="center", transform=ax.transAxes
        )
        return
    lines = []
    if acc[0]:
        lines += ax.plot(*acc, "o-", color="tab:red", label="accuracy")
        ax.set_ylabel("accuracy")
        ax.margins(y=0.15)
        for step, value in zip(*acc):
            ax.annotate(
                f"{value:.3f}",
                (step, value),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    if ppl[0]:
        ppl_ax = ax.twinx() if acc[0] else ax
        lines += ppl_ax.plot(*ppl, "s-", color="tab:brown", label="perplexity")
        ppl_ax.set_yscale("log")
        ppl_ax.margins(y=0.15)
        ppl_ax.set_ylabel("perplexity (log scale)")
        for step, value in zip(*ppl):
            ppl_ax.annotate(
                f"{value:,.0f}" if value >= 100 else f"{value:.2f}",
                (step, value),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="best")
