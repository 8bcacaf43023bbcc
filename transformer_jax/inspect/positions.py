"""Section 3.5 as an experiment: PE(pos + k) is one fixed linear map M_k of PE(pos), for every pos.

``pe_linear_offset_error`` fits M_k (one 2x2 block per (sin, cos) column pair) from the table itself, so it
tests the property the paper relies on, not the formula; ``pe_rotation`` builds the analytic rotation.
``model_positions_report`` analyses the positions a model has: the sinusoidal table, or its own learned
tables (Table 3 row E), which the same fit measures; for any other scheme it returns None (the section
does not apply).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.inspect import artifacts
from transformer_jax.model.positions import sinusoidal_table


def _check_table(table: np.ndarray) -> np.ndarray:
    table = np.asarray(table, np.float64)
    if table.ndim != 2 or table.shape[1] % 2:
        raise ValueError(f"expected a [max_len, d_model] table with even d_model, got shape {table.shape}")
    return table


def pe_rotation(d_model: int, k: int) -> np.ndarray:
    """float64[d_model, d_model]: the block-diagonal M_k with PE(pos + k) = M_k PE(pos) for every pos.

    Block i acts on (sin(w_i pos), cos(w_i pos)) with w_i = 10000^(-2i/d_model) as the rotation
    [[cos(w_i k), sin(w_i k)], [-sin(w_i k), cos(w_i k)]] (the angle-addition formulas).
    """
    rates = 1.0 / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    c, s = np.cos(rates * k), np.sin(rates * k)
    m = np.zeros((d_model, d_model))
    m[0::2, 0::2] = np.diag(c)
    m[0::2, 1::2] = np.diag(s)
    m[1::2, 0::2] = np.diag(-s)
    m[1::2, 1::2] = np.diag(c)
    return m


def fit_offset_map(table: np.ndarray, k: int) -> np.ndarray:
    """float64[d/2, 2, 2]: per (sin, cos) column pair, the least-squares 2x2 map from PE(pos) to PE(pos+k).

    Args:
      table: float[max_len, d_model], even d_model. k: the offset, 1 <= k <= max_len - 2.
    """
    table = _check_table(table)
    if not 1 <= k <= table.shape[0] - 2:
        raise ValueError(f"offset k must be in [1, max_len - 2] = [1, {table.shape[0] - 2}], got {k}")
    blocks = table.reshape(table.shape[0], -1, 2).transpose(1, 0, 2)  # [d/2, L, 2]
    x, y = blocks[:, :-k], blocks[:, k:]  # [d/2, L-k, 2]
    return np.swapaxes(np.linalg.pinv(x) @ y, 1, 2)  # y = x M^T  =>  M = (pinv(x) y)^T, [d/2, 2, 2]


def pe_linear_offset_error(table: np.ndarray, k: int) -> float:
    """max over pos and dims of |PE(pos + k) - M_k PE(pos)| for the best block-diagonal M_k.

    M_k is fitted (least squares, one 2x2 block per (sin, cos) column pair) from the table itself, so the
    check tests the property the paper relies on, not the formula: with a genuine sinusoidal table the
    error is float32 rounding (~1e-7); any table where one offset is not one linear map fails.

    Args:
      table: float[max_len, d_model], even d_model, columns interleaved as (sin, cos) pairs.
      k: the offset, 1 <= k <= max_len - 2.
    """
    table = _check_table(table)
    m = fit_offset_map(table, k)  # [d/2, 2, 2]
    blocks = table.reshape(table.shape[0], -1, 2)  # [L, d/2, 2]
    predicted = np.einsum("nij,lnj->lni", m, blocks[:-k])  # [L-k, d/2, 2]
    return float(np.max(np.abs(blocks[k:] - predicted)))


def position_cosine_similarity(table: np.ndarray) -> np.ndarray:
    """float64[max_len, max_len]: cosine similarity of every pair of rows of a float[max_len, d] table."""
    t = np.asarray(table, np.float64)
    t = t / np.linalg.norm(t, axis=1, keepdims=True)
    return t @ t.T


def positions_report(max_len: int, d_model: int, offsets: Sequence[int] | None = None) -> dict[str, Any]:
    """The linear-offset check for every offset (default 1..max_len-2), against the fitted and analytic M_k.

    Returns:
      {"table": float32[max_len, d_model], "rows": [{"k", "fit_error", "analytic_error",
      "fit_vs_analytic"}], "cosine": float64[max_len, max_len]}.
    """
    table = sinusoidal_table(max_len, d_model)
    offsets = list(range(1, max_len - 1)) if offsets is None else list(offsets)
    rows = []
    for k in offsets:
        analytic = pe_rotation(d_model, k)
        fitted = fit_offset_map(table, k)
        analytic_blocks = np.stack([analytic[2 * i:2 * i + 2, 2 * i:2 * i + 2] for i in range(d_model // 2)])
        rows.append({"k": k, "fit_error": pe_linear_offset_error(table, k),
                     "analytic_error": float(np.max(np.abs(
                         table[k:].astype(np.float64) - table[:-k].astype(np.float64) @ analytic.T))),
                     "fit_vs_analytic": float(np.max(np.abs(fitted - analytic_blocks)))})
    return {"table": table, "rows": rows, "cosine": position_cosine_similarity(table)}


def learned_positions_report(tables: dict[str, np.ndarray], offsets: Sequence[int] | None = None
                             ) -> dict[str, Any]:
    """The fitted linear-offset check on a model's learned position tables (no formula to compare with).

    Args:
      tables: {"encoder": float[max_len, d_model], "decoder": ...}, even d_model.

    Returns:
      {"kind": "learned", "table": the encoder's table, "rows": [{"k", "fit_error" (encoder),
      "decoder_fit_error"}], "cosine": of the encoder's table}.
    """
    encoder = np.asarray(tables["encoder"])
    offsets = list(range(1, encoder.shape[0] - 1)) if offsets is None else list(offsets)
    rows = [{"k": k, "fit_error": pe_linear_offset_error(encoder, k),
             **{f"{side}_fit_error": pe_linear_offset_error(np.asarray(table), k)
                for side, table in tables.items() if side != "encoder"}} for k in offsets]
    return {"kind": "learned", "table": encoder, "rows": rows, "cosine": position_cosine_similarity(encoder)}


def model_positions_report(cfg: Any, params: Any, offsets: Sequence[int] | None = None
                           ) -> dict[str, Any] | None:
    """The positions report of what the model ``cfg`` has: its sinusoidal table (``positions_report``), or
    its learned tables, read from ``params`` (``learned_positions_report``); None for any other scheme."""
    if cfg.position_encoding == "sinusoidal":
        return {"kind": "sinusoidal", **positions_report(cfg.max_len, cfg.d_model, offsets)}
    if cfg.position_encoding == "learned":
        tables = {side: params[side]["positions"]["position_embedding"] for side in ("encoder", "decoder")}
        return learned_positions_report(tables, offsets)
    return None


def plot_positions(report: dict[str, Any], path: str) -> str:
    """The table, the cosine similarity of positions and the offset errors of ``positions_report`` (or of
    ``learned_positions_report``: the fitted errors of each table)."""
    table, rows = report["table"], report["rows"]
    learned = report.get("kind") == "learned"
    fig = artifacts.figure(16, 4.6)
    ax = fig.add_subplot(1, 3, 1)
    image = ax.imshow(table, cmap="RdBu", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"{'learned encoder table' if learned else 'sinusoidal encoding'} "
                 f"[{table.shape[0]} x {table.shape[1]}]", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 2)
    image = ax.imshow(report["cosine"], cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("position")
    ax.set_ylabel("position")
    ax.set_title("cosine similarity of positions", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 3)
    ks = [r["k"] for r in rows]
    series = ([("fit_error", "encoder, fitted M_k"), ("decoder_fit_error", "decoder, fitted M_k")] if learned
              else [("fit_error", "fitted block-diagonal M_k"), ("analytic_error", "analytic rotation M_k")])
    for key, label in series:
        if rows and key in rows[0]:
            ax.semilogy(ks, [max(r[key], 1e-12) for r in rows], ".", label=label)
    ax.set_xlabel("offset k")
    ax.set_ylabel("max_pos |PE(pos+k) - M_k PE(pos)|")
    ax.set_title("is PE(pos+k) a linear function of PE(pos)?" if learned
                 else "PE(pos+k) is a linear function of PE(pos)", fontsize=10)
    ax.set_ylim(1e-9, max([1.0, *(r[key] for r in rows for key, _ in series if key in r)]))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return artifacts.save(fig, path)
