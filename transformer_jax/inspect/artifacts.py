"""Writing figures and tables: matplotlib's Agg canvas (no pyplot, no global backend), CSV and markdown."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from typing import Any


def figure(width: float, height: float):
    """A matplotlib Figure (inches) on its own Agg canvas, so plotting never touches pyplot's state."""
    # matplotlib is an optional heavy dependency: imported only when a figure is drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: str) -> str:
    """Writes ``fig`` as a PNG at ``path``; returns ``path``."""
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats with ``digits`` decimals, NaN (an undefined statistic) as '-'."""
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], *, digits: int = 3) -> str:
    """``rows`` (dicts with the same keys) as a markdown table, columns in the first row's key order."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c], digits) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_table(rows: Sequence[dict[str, Any]], stem: str, *, digits: int = 3) -> tuple[str, str]:
    """Writes ``rows`` as ``stem.csv`` and a markdown ``stem.md``; returns both paths."""
    columns = list(rows[0])
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_table(rows, digits=digits) + "\n")
    return stem + ".csv", stem + ".md"
