"""Scores by source length: the task's corpus score (BLEU, or bracket F1 for parsing) per bucket of source
length, to see how a model does on sentences longer than it was trained on (``evaluate.py --by_length``).

A sentence's length is its source's tokens, EOS included (the SentencePiece pieces the encoder reads, as
``data.max_len`` counts them), so "beyond training" is exact: a run's training pairs have at most
``data.max_len`` tokens a side. Bucket edges are inclusive upper bounds and the last bucket is open:
edges ``10,20,30`` give the buckets 1-10, 11-20, 21-30 and 31+. Each bucket is scored as a corpus of its
own (corpus BLEU of its sentences, not a mean of sentence scores); an empty bucket has no score.

    rows = score_by_length(lengths, hypotheses, references, edges, scorer, train_max_len=64)
    print(length_table(rows, "sacreBLEU", train_max_len=64))
    plot_by_length({"sinusoidal": rows}, "test-6-by_length.png", "sacreBLEU", train_max_len=64)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.runtime.errors import ConfigError

DEFAULT_EDGES = (10, 20, 30, 40, 50, 60)
LENGTH_UNIT = "source tokens, EOS included"


def check_edges(edges: Sequence[Any], flag: str = "length_buckets") -> tuple[int, ...]:
    """``edges`` as a tuple of ints; ConfigError naming ``--flag`` unless they are strictly increasing
    positive integers."""
    try:
        values = tuple(int(str(e).strip()) for e in edges)
    except ValueError:
        values = ()
    increasing = all(a < b for a, b in zip(values, values[1:], strict=False))
    if not values or values[0] < 1 or not increasing:
        raise ConfigError(f"--{flag}={','.join(str(e) for e in edges)}: expected strictly increasing "
                          "positive integers (source tokens, EOS included), e.g. "
                          f"--{flag}=10,20,30,40")
    return values


def buckets(edges: Sequence[int]) -> list[tuple[int, int | None]]:
    """(shortest, longest) source length of each bucket, None for the open last one:
    ``(10, 20)`` -> ``[(1, 10), (11, 20), (21, None)]``."""
    lows = (1, *(e + 1 for e in edges))
    return list(zip(lows, (*edges, None), strict=True))


def bucket_label(low: int, high: int | None) -> str:
    return f"{low}+" if high is None else f"{low}-{high}"


def training_coverage(low: int, high: int | None, train_max_len: int | None) -> str:
    """"within" when every length of the bucket was trainable (at most ``train_max_len``), "beyond" when
    none was, "partly" otherwise; "" without a training length."""
    if train_max_len is None:
        return ""
    if high is not None and high <= train_max_len:
        return "within"
    return "beyond" if low > train_max_len else "partly"


def source_lengths(batches) -> list[int]:
    """Each real row's source length (non-PAD tokens, EOS included), in the split's order (``indices``)."""
    lengths: dict[int, int] = {}
    for batch in batches:
        counts = np.sum(np.asarray(batch.inputs)[:batch.num_real] != PAD_ID, axis=1)
        lengths.update(zip((int(i) for i in batch.indices), (int(c) for c in counts), strict=True))
    return [lengths[i] for i in sorted(lengths)]


def score_by_length(lengths: Sequence[int], hypotheses: Sequence[Any], references: Sequence[Any],
                    edges: Sequence[int], scorer: Callable[[list, list], float], *,
                    train_max_len: int | None = None) -> list[dict[str, Any]]:
    """One row per bucket of :func:`buckets`: ``bucket`` (its label), ``min_tokens``, ``max_tokens`` (None
    for the open one), ``sentences``, ``score`` (``scorer(hypotheses, references)`` of its sentences; None
    when empty), ``length_ratio`` (:func:`word_ratio`) and ``training`` (:func:`training_coverage`).

    ``lengths``, ``hypotheses`` and ``references`` are aligned, one per sentence.
    """
    if not len(lengths) == len(hypotheses) == len(references):
        raise ValueError(f"got {len(lengths)} lengths, {len(hypotheses)} hypotheses and {len(references)} "
                         "references; need one of each per sentence")
    rows = []
    for low, high in buckets(edges):
        members = [i for i, n in enumerate(lengths) if n >= low and (high is None or n <= high)]
        outputs, wanted = [hypotheses[i] for i in members], [references[i] for i in members]
        rows.append({"bucket": bucket_label(low, high), "min_tokens": low, "max_tokens": high,
                     "sentences": len(members), "score": float(scorer(outputs, wanted)) if members else None,
                     "length_ratio": word_ratio(outputs, wanted),
                     "training": training_coverage(low, high, train_max_len)})
    return rows


def word_ratio(outputs: Sequence[Any], references: Sequence[Any]) -> float | None:
    """The outputs' whitespace words over the references' (a model that stops early reads below 1); None
    without reference words, or when the references are not text (parsing's gold trees)."""
    if not all(isinstance(text, str) for text in (*outputs, *references)):
        return None
    reference_words = sum(len(text.split()) for text in references)
    return sum(len(text.split()) for text in outputs) / reference_words if reference_words else None


def length_table(rows: Sequence[Mapping[str, Any]], measure: str, *, train_max_len: int | None) -> str:
    """The rows as a plain-text table (bucket, sentences, score, out/ref where the rows have it, training),
    and last lines that say what "beyond" and out/ref mean."""
    ratios = any(row["length_ratio"] is not None for row in rows)
    lines = [f"{'source tokens':>13}  {'sentences':>9}  {measure:>9}  " + ("out/ref  " if ratios else "")
             + "training",
             f"{'-' * 13}  {'-' * 9}  {'-' * 9}  " + ("-" * 7 + "  " if ratios else "") + "-" * 8]
    for row in rows:
        score = "—" if row["score"] is None else f"{row['score']:.2f}"
        ratio = "—" if row["length_ratio"] is None else f"{row['length_ratio']:.2f}"
        lines.append(f"{row['bucket']:>13}  {row['sentences']:>9}  {score:>9}  "
                     + (f"{ratio:>7}  " if ratios else "") + row["training"])
    if train_max_len is not None:
        lines.append(f"training pairs had at most data.max_len={train_max_len} tokens a side (EOS included): "
                     "'beyond' buckets are longer than any of them, 'partly' ones straddle it")
    if ratios:
        lines.append("out/ref: the outputs' words over the references' words (below 1: outputs stop short)")
    return "\n".join(lines)


def plot_by_length(series: Mapping[str, Sequence[Mapping[str, Any]]], out: str, measure: str, *,
                   train_max_len: int | None = None,
                   bands: Mapping[str, tuple[Sequence[float | None], Sequence[float | None]]] | None = None,
                   title: str = "") -> str:
    """One line per series (label -> rows of :func:`score_by_length`, the same buckets each): the score
    against the bucket, a vertical line after the last bucket within ``train_max_len``, and a shaded
    (low, high) band per bucket for the series in ``bands`` (e.g. the seeds' spread). Writes a PNG at
    ``out``; returns the path."""
    # matplotlib is heavy and only this plot needs it: imported on use (as evaluation/curves.py).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    labels: list[str] = []
    for name, rows in series.items():
        labels = labels or [r["bucket"] for r in rows]
        x = np.arange(len(rows))
        y = np.asarray([np.nan if r["score"] is None else r["score"] for r in rows], float)
        line, = ax.plot(x, y, marker="o", label=name)
        if bands and name in bands:
            low, high = (np.asarray([np.nan if v is None else v for v in side], float)
                         for side in bands[name])
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
        if len(series) == 1:
            for i, r in enumerate(rows):
                if r["sentences"]:
                    ax.annotate(f"n={r['sentences']}", (i, 0 if np.isnan(y[i]) else y[i]), fontsize=7,
                                textcoords="offset points", xytext=(0, 6), ha="center")
    rows = next(iter(series.values()), [])
    if train_max_len is not None and rows:
        within = [i for i, r in enumerate(rows) if training_coverage(r["min_tokens"], r["max_tokens"],
                                                                     train_max_len) != "beyond"]
        edge = (within[-1] + 0.5) if within else -0.5
        ax.axvline(edge, color="grey", linestyle="--")
        ax.text(edge, 0.98, f" beyond training (> {train_max_len} tokens)", fontsize=8, va="top",
                color="grey", transform=ax.get_xaxis_transform())
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set_xlabel(f"source length ({LENGTH_UNIT})")
    ax.set_ylabel(measure)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = f"{out}.{os.getpid()}.partial"  # replaced whole: never a half-written plot
    try:
        figure.savefig(partial, dpi=110, format="png")
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return out
