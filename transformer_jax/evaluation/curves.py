"""Learning curves of training runs: dev BLEU and dev loss against wall-clock minutes, as one PNG.

    python -m transformer_jax.evaluation.curves --workdirs=runs/m30k,runs/m30k_de_en \
        --out=docs/multi30k_curves.png
    python -m transformer_jax.evaluation.curves --workdirs=runs/ptb_sample --metrics=dev_f1,dev_loss \
        --out=docs/parsing_curves.png   # a parsing run's periodic dev F1

Reads each workdir's ``metrics.jsonl`` (written by ``train.py``): rows with ``dev_bleu`` or ``dev_loss``
are plotted against the minutes since the run's first row, so resumed runs show their real wall time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import app, flags

from transformer_jax.runtime.errors import MissingFileError, run_main

CURVES = ("dev_bleu", "dev_loss")  # the panels, left to right


def read_curves(workdir: str, metrics: Sequence[str] = CURVES) -> dict[str, list[tuple[float, float]]]:
    """{metric: [(minutes since the first row, value), ...]} for each of ``metrics``.

    Raises:
      MissingFileError: the workdir has no metrics.jsonl.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise MissingFileError(f"{path} does not exist; pass a workdir written by train.py")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return {name: [] for name in metrics}
    start = rows[0]["time"]
    return {name: [((r["time"] - start) / 60.0, r[name]) for r in rows if name in r] for name in metrics}


def plot_curves(workdirs: Sequence[str], labels: Sequence[str], out: str,
                metrics: Sequence[str] = CURVES) -> str:
    """Draws every workdir's curves into one PNG at ``out``; returns the path."""
    # matplotlib is heavy and only this plot needs it: imported on use.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for workdir, label in zip(workdirs, labels, strict=True):
        curves = read_curves(workdir, metrics)
        for ax, name in zip(axes, metrics, strict=True):
            if curves[name]:
                minutes, values = zip(*curves[name], strict=True)
                ax.plot(minutes, values, marker="o", markersize=3, label=label)
    for ax, name in zip(axes, metrics, strict=True):
        ax.set_xlabel("wall-clock minutes since the first logged step")
        ax.set_ylabel(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


_WORKDIRS = flags.DEFINE_list("workdirs", None, "Comma-separated train.py workdirs to plot.", required=True)
_LABELS = flags.DEFINE_list("labels", None, "One legend label per workdir (default: the workdir names).")
_OUT = flags.DEFINE_string("out", "curves.png", "Where to write the PNG.")
_METRICS = flags.DEFINE_list("metrics", list(CURVES), "metrics.jsonl keys to plot, one panel each "
                             "(e.g. dev_f1,dev_loss for a parsing run).")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    labels = _LABELS.value or [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
    if len(labels) != len(_WORKDIRS.value):
        raise app.UsageError(f"--labels has {len(labels)} entries for {len(_WORKDIRS.value)} workdirs")
    print(plot_curves(_WORKDIRS.value, labels, _OUT.value, _METRICS.value))


if __name__ == "__main__":
    run_main(main)
