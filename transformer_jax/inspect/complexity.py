"""Table 1 measured: XLA's FLOPs and the wall time of one self-attention layer against the sequence length n.

Analytic counts (2 FLOPs per multiply-add): the projections W^Q, W^K, W^V, W^O cost 8 n d^2, the scores
Q K^T and the mixing (weights) V cost 4 n^2 d; Table 1 lists the latter as O(n^2 d). XLA's cost analysis
counts a loop body once, whatever its trip count, so for the blockwise implementation the XLA number
covers one tile, not the layer; it is reported as is, with the analytic count beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.inspect import artifacts
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import MultiHeadAttention

DEFAULT_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)


def _cost_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def self_attention_cost(lengths: Sequence[int], *, d_model: int, num_heads: int, impl: str = "dense",
                        block_size: int = 128, repeats: int = 3) -> list[dict[str, Any]]:
    """XLA FLOPs and median wall time of one MultiHeadAttention layer (forward, batch 1, float32).

    Returns:
      One row per n: {"impl", "n", "d_model", "flops_xla", "flops_attention" (4 n^2 d),
      "flops_projections" (8 n d^2), "seconds"}. For ``impl="blockwise"`` (``fori_loop`` over key blocks
      inside ``lax.map`` over query blocks) ``flops_xla`` covers one tile.
    """
    cfg = ModelConfig(vocab_size=1, d_model=d_model, d_ff=1, num_heads=num_heads, max_len=max(lengths),
                      attention_impl=impl, attention_block_size=block_size, deterministic=True)
    layer = MultiHeadAttention(cfg)
    x0 = jnp.zeros((1, 8, d_model))
    params = jax.jit(lambda rng: layer.init(rng, x0, x0, None))(jax.random.key(0))
    fn = jax.jit(lambda p, x: layer.apply(p, x, x, None))
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        x = jnp.asarray(rng.standard_normal((1, n, d_model)), jnp.float32)  # [B, n, d_model]
        compiled = fn.lower(params, x).compile()
        jax.block_until_ready(compiled(params, x))  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, x))
            times.append(time.perf_counter() - start)
        rows.append({"impl": impl, "n": int(n), "d_model": d_model, "flops_xla": _cost_flops(compiled),
                     "flops_attention": 4.0 * n * n * d_model, "flops_projections": 8.0 * n * d_model**2,
                     "seconds": statistics.median(times)})
    return rows


def fit_cost_model(rows: Sequence[dict[str, Any]]) -> tuple[float, float, float]:
    """Least-squares (a, b) in flops = a n^2 d + b n d^2 over ``rows``, and the max relative residual.

    Table 1's claim made numerical: for the dense layer a should be ~4 (Q K^T and weights V) and
    b ~8 (four d x d projections), 2 FLOPs per multiply-add.
    """
    n = np.asarray([r["n"] for r in rows], float)
    d = np.asarray([r["d_model"] for r in rows], float)
    y = np.asarray([r["flops_xla"] for r in rows], float)
    basis = np.stack([n * n * d, n * d * d], axis=1) / y[:, None]  # relative least squares
    (a, b), *_ = np.linalg.lstsq(basis, np.ones_like(y), rcond=None)
    residual = float(np.max(np.abs((a * n * n * d + b * n * d * d) / y - 1.0)))
    return float(a), float(b), residual


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (the empirical exponent)."""
    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def summary_line(impl: str, rows: Sequence[dict[str, Any]]) -> str:
    """One markdown line: FLOPs and time at the ends of the sweep, log-log slopes where n >= 2 d, the fit."""
    first, last = rows[0], rows[-1]
    big = [r for r in rows if r["n"] >= 2 * r["d_model"]]
    big = big if len(big) >= 2 else rows[-2:]
    n = [r["n"] for r in big]
    slopes = (f"log-log slope over n={n[0]}..{n[-1]}: FLOPs "
              f"{loglog_slope(n, [r['flops_xla'] for r in big]):.2f}, time "
              f"{loglog_slope(n, [r['seconds'] for r in big]):.2f}") if len(rows) >= 2 else "one length"
    analytic = last["flops_attention"] + last["flops_projections"]
    fit = ""
    if len(rows) >= 2 and impl == "dense":  # the blockwise XLA count is one tile, nothing to fit
        a, b, residual = fit_cost_model(rows)
        fit = f" Fit: XLA FLOPs = {a:.2f} n^2 d + {b:.2f} n d^2 (max relative residual {residual:.1%})."
    return (f"- {impl}: XLA FLOPs {first['flops_xla']:.3g} at n={first['n']} -> {last['flops_xla']:.3g} "
            f"at n={last['n']} (analytic {analytic:.3g}); {slopes}; {last['seconds'] * 1e3:.2f} ms at "
            f"n={last['n']}.{fit}")


def plot_complexity(rows: Sequence[dict[str, Any]], path: str) -> str:
    """FLOPs (XLA and analytic) and wall time against n, log-log; needs at least one dense row."""
    dense = [r for r in rows if r["impl"] == "dense"]
    fig = artifacts.figure(12, 4.4)
    ax = fig.add_subplot(1, 2, 1)
    n = np.asarray([r["n"] for r in dense], float)
    ax.loglog(n, [r["flops_xla"] for r in dense], "o-", label="XLA cost analysis, dense")
    blockwise = [r for r in rows if r["impl"] == "blockwise"]
    if blockwise:
        ax.loglog([r["n"] for r in blockwise], [r["flops_xla"] for r in blockwise], "x--",
                  label="XLA cost analysis, blockwise (loop body once)")
    ax.loglog(n, [r["flops_attention"] for r in dense], ":", label="4 n^2 d  (Q K^T, weights V)")
    ax.loglog(n, [r["flops_projections"] for r in dense], ":", label="8 n d^2  (W^Q, W^K, W^V, W^O)")
    ax.loglog(n, [r["flops_attention"] + r["flops_projections"] for r in dense], "k-", lw=0.8,
              label="sum")
    ax.axvline(2 * dense[0]["d_model"], color="gray", lw=0.6)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("FLOPs (forward, one layer)")
    ax.set_title(f"FLOPs, d_model={dense[0]['d_model']} (grey: n = 2d)", fontsize=10)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    for impl, marker in (("dense", "o-"), ("blockwise", "x--")):
        sel = [r for r in rows if r["impl"] == impl]
        if sel:
            ax.loglog([r["n"] for r in sel], [r["seconds"] for r in sel], marker, label=impl)
    last = dense[-1]
    for power, style in ((2, ":"), (1, "-.")):
        ax.loglog(n, last["seconds"] * (n / last["n"]) ** power, style, color="gray", lw=0.8,
                  label=f"~ n^{power} (through the last dense point)")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("median seconds (forward, one layer)")
    ax.set_title("wall time on this machine", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return artifacts.save(fig, path)
