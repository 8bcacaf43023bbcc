"""Head statistics over dev sentences, padding excluded: entropy, max weight, previous / same / next share.

Only real queries count, and only allowed keys. Entropy is in nats; ``uniform_entropy`` is the mean
log(number of allowed keys), the largest entropy a row can have. ``prev``/``self``/``next`` are the mass on
key position q-1 / q / q+1, averaged over the rows where that key exists and is allowed: there is no
``next`` in the decoder, and cross-attention has none of the three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.inspect import artifacts, forward

STATS = ("entropy", "uniform_entropy", "max_weight", "prev", "self", "next")


def entropy(weights: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of float[..., kv_len] weights (0 log 0 = 0): float64[...]."""
    w = np.asarray(weights, np.float64)
    return -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0), axis=-1)


class HeadStatistics:
    """Per-head running sums over real query rows, for one attention kind and layer.

    Each statistic is the mean over the rows where it is defined: ``prev`` (mass on key position q-1)
    over rows whose previous position is an allowed key, ``self`` (key q) and ``next`` (key q+1)
    likewise. ``uniform_entropy`` is the mean log(number of allowed keys): the entropy bound per row.
    """

    def __init__(self, kind: str, num_heads: int):
        self.kind = kind
        self.sums = {name: np.zeros(num_heads) for name in STATS}
        self.rows = {name: np.zeros(num_heads) for name in STATS}

    def add(self, weights: np.ndarray, mask: np.ndarray) -> None:
        """weights: float[batch, heads, q_len, kv_len]; mask: bool[batch, 1, q_len, kv_len]."""
        w = np.asarray(weights, np.float64)
        allowed = np.broadcast_to(mask, w.shape)
        real = allowed.any(-1)  # [B, H, Q]
        self._add("entropy", entropy(w), real)
        self._add("uniform_entropy", np.log(np.maximum(allowed.sum(-1), 1)), real)
        self._add("max_weight", w.max(-1), real)
        if self.kind == "cross":
            return
        for name, offset in (("prev", -1), ("self", 0), ("next", 1)):
            # diagonal(offset) of [Q, K] holds w[q, q + offset] for the rows where q + offset exists.
            diag = np.diagonal(w, offset=offset, axis1=2, axis2=3)  # [B, H, Q - |offset|]
            ok = np.diagonal(allowed, offset=offset, axis1=2, axis2=3)
            self._add(name, diag, ok)

    def _add(self, name: str, values: np.ndarray, where: np.ndarray) -> None:
        self.sums[name] += np.where(where, values, 0.0).sum(axis=(0, 2))
        self.rows[name] += where.sum(axis=(0, 2))

    def means(self) -> dict[str, np.ndarray]:
        """{statistic: float64[heads]}; NaN where a statistic is undefined (e.g. 'next' in the decoder)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            out = {name: self.sums[name] / self.rows[name] for name in STATS}
        out["rows"] = self.rows["entropy"]
        return out


def head_stats_rows(stats: dict[tuple[str, int], HeadStatistics],
                    ablation: dict | None = None) -> list[dict[str, Any]]:
    """One row per (kind, layer, head): the statistics, plus the ablation's change in dev NLL if given.

    Args:
      stats: {(kind, layer): HeadStatistics}.
      ablation: ``ablation.ablate_heads``'s result, or None.
    """
    rows = []
    for kind, layer in sorted(stats, key=forward.kind_layer_order):
        means = stats[(kind, layer)].means()
        for head in range(len(means["entropy"])):
            row = {"kind": kind, "layer": layer, "head": head}
            row.update({name: float(means[name][head]) for name in STATS})
            row["rows"] = int(means["rows"][head])
            if ablation is not None:
                row["delta_nll"] = ablation[(kind, layer, head)]["delta_nll"]
            rows.append(row)
    return rows


def plot_head_stats(rows: Sequence[dict[str, Any]], path: str) -> str:
    """A grid of [layers x heads] heatmaps: one row per statistic, one column per attention kind."""
    # matplotlib is an optional heavy dependency: imported only when a figure is drawn.
    import matplotlib

    kinds = forward.KINDS
    names = ("entropy", "max_weight", "prev", "self", "next")
    num_heads = max(r["head"] for r in rows) + 1
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="lightgray")  # undefined statistics: grey
    fig = artifacts.figure(3.2 * len(kinds), 2.4 * len(names))
    for j, kind in enumerate(kinds):
        kind_rows = [r for r in rows if r["kind"] == kind]
        num_layers = max(r["layer"] for r in kind_rows) + 1
        for i, name in enumerate(names):
            grid = np.full((num_layers, num_heads), np.nan)
            for r in kind_rows:
                grid[r["layer"], r["head"]] = r[name]
            ax = fig.add_subplot(len(names), len(kinds), i * len(kinds) + j + 1)
            vmax = max(np.nanmax([r["uniform_entropy"] for r in kind_rows]), 1e-6) if name == "entropy" else 1
            ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
            for (li, hi), v in np.ndenumerate(grid):
                ax.text(hi, li, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if np.isnan(v) or v >= 0.6 * vmax else "white")
            ax.set_xticks(range(num_heads))
            ax.set_yticks(range(num_layers))
            ax.set_xlabel("head", fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            unit = " (nats)" if name == "entropy" else " (share)" if name in ("prev", "self", "next") else ""
            title = f"{name}{unit}"
            ax.set_title(f"{forward.KIND_TITLES[kind]}\n{title}" if i == 0 else title, fontsize=8)
    fig.tight_layout()
    return artifacts.save(fig, path)
