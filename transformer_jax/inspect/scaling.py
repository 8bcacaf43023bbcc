"""Section 3.2.1 as an experiment: attention entropy with and without the 1/sqrt(d_k) factor.

(a) Random q, k ~ N(0, I_{d_k}) as d_k grows: unscaled, q.k has variance d_k and the softmax saturates.
(b) The trained model's own sown q and k. In both, the weights are recomputed in float64 NumPy with and
without the factor; the scaled recomputation must reproduce the model's own weights (``sown_vs_recomputed``,
within ``SOWN_TOLERANCE`` of the compute dtype), or ``scaling_model_rows`` stops with one line: numbers
recomputed without a term the model has would describe another model.

Position schemes (``model/positions.py``): rotary positions rotate q and k before they are sown, so the
sown q.k already holds them. ALiBi and relative positions add a term to a self-attention's logits, which
``logit_bias`` takes from the model's own ``SelfAttentionPositions`` and its parameters, and the
recomputation adds: ALiBi's -m_h |i - j| is not a q.k product and is added as it is with and without the
factor; the relative key term q_i a^K_(j-i) is one, so "without the factor" drops the 1/sqrt(d_k) from it
too (Shaw et al. scale q (k + a^K) as one product).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer_jax.inspect import artifacts, forward
from transformer_jax.inspect.heads import HeadStatistics, entropy
from transformer_jax.model import positions
from transformer_jax.runtime import errors

DEFAULT_D_KS = (4, 8, 16, 32, 64, 128, 256, 512)
# Largest |sown - recomputed| weight the check allows, by compute dtype (``ModelConfig.dtype``): float32
# against float64 NumPy differs by rounding; bfloat16 logits carry 8 bits of mantissa.
SOWN_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


class RecomputationError(errors.UserError, RuntimeError):
    """The model's own attention weights are not softmax(q.k / sqrt(d_k)) of its sown q and k."""


def attention_weights_np(queries: np.ndarray, keys: np.ndarray, mask: np.ndarray | None = None, *,
                         scale_logits: bool = True, bias: np.ndarray | None = None) -> np.ndarray:
    """float64[batch, heads, q_len, kv_len]: softmax(q.k [/ sqrt(d_k)] + bias) in NumPy, masked entries
    exactly 0.

    An independent float64 reference of ``attention.dot_product_attention``'s weights (rows with no
    allowed key are all zero), used to recompute the model's maps with and without the scaling.

    Args:
      queries: float[batch, q_len, heads, d_k]; keys: float[batch, kv_len, heads, d_k].
      mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = may attend. None: all allowed.
      bias: float[batch|1, heads, q_len, kv_len] added to the (scaled or not) logits, or None.
    """
    q, k = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)  # [B, H, Q, K]
    if scale_logits:
        logits = logits / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(mask, logits.shape)
    row_max = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    unnormalized = np.where(allowed, np.exp(np.where(allowed, logits - row_max, 0.0)), 0.0)
    denom = unnormalized.sum(-1, keepdims=True)
    return unnormalized / np.where(denom > 0, denom, 1.0)


def logit_bias(params: Any, cfg: Any, kind: str, layer: int, record: forward.AttentionRecord
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """The term the model's position scheme adds to one attention's logits, computed by the model's own
    ``positions.SelfAttentionPositions`` with the layer's parameters: (the term as added to the scaled
    logits, the term without 1/sqrt(d_k)), each float64[batch|1, heads, q_len, kv_len]; None where the
    model adds none (encoder-decoder attention; the sinusoid, learned, rotary and no positions).

    Args:
      params: the model's parameters; cfg: its ModelConfig; kind, layer: the attention (``forward.KINDS``);
      record: its sown weights, queries and keys (the queries are what the relative key term reads).
    """
    if kind == "cross" or cfg.position_encoding not in ("alibi", "relative"):
        return None
    stack, module = forward.MODULES[kind]
    variables = {"params": params[stack][f"layer_{layer}"][module].get("positions", {})}
    q_len, kv_len = record.queries.shape[1], record.keys.shape[1]
    bias = positions.SelfAttentionPositions(cfg).apply(
        variables, jnp.asarray(record.queries, jnp.float32), jnp.arange(q_len), jnp.arange(kv_len),
        method=positions.SelfAttentionPositions.logit_bias)
    bias = np.asarray(bias, np.float64)
    if cfg.position_encoding == "relative":  # q_i a^K / sqrt(d_k): a q.k product, scaled with the rest
        return bias, bias * math.sqrt(record.queries.shape[-1])
    return bias, bias  # ALiBi: -m_h |i - j|, added after the scaling either way


def new_sums() -> dict[str, float]:
    """Empty running sums for ``add_scaling``."""
    return {"scaled": 0.0, "unscaled": 0.0, "rows": 0, "logit_sq": 0.0, "pairs": 0, "max_abs_diff": 0.0}


def add_scaling(sums: dict[str, float], record: forward.AttentionRecord, mask: np.ndarray,
                bias: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Recomputes one record's weights from its sown q and k with and without 1/sqrt(d_k), adding the
    scheme's logit term ``bias`` (``logit_bias``: with and without the factor) when the model has one; adds
    to ``sums``.

    ``sums`` (from ``new_sums``) gains the entropy sums over real rows ("scaled", "unscaled", "rows"), the
    sum of squared unscaled q.k over allowed pairs ("logit_sq", "pairs"), and the largest difference
    between the sown and the recomputed scaled weights ("max_abs_diff").

    Args:
      mask: bool[batch, 1, q_len, kv_len] (``forward.attention_mask``).
    """
    scaled_bias, unscaled_bias = (None, None) if bias is None else bias
    scaled = attention_weights_np(record.queries, record.keys, mask, bias=scaled_bias)
    unscaled = attention_weights_np(record.queries, record.keys, mask, scale_logits=False, bias=unscaled_bias)
    allowed = np.broadcast_to(mask, record.weights.shape)
    real = allowed.any(-1)  # [B, H, Q]
    sums["scaled"] += float(entropy(scaled)[real].sum())
    sums["unscaled"] += float(entropy(unscaled)[real].sum())
    sums["rows"] += int(real.sum())
    logits = np.einsum("bqhd,bkhd->bhqk", record.queries.astype(np.float64),
                       record.keys.astype(np.float64))  # [B, H, Q, K]
    sums["logit_sq"] += float(np.sum(np.where(allowed, logits, 0.0) ** 2))
    sums["pairs"] += int(allowed.sum())
    # Only real rows: the model gives padded encoder queries weights too (nothing reads them); we do not.
    diff = np.where(real[..., None], np.abs(scaled - record.weights), 0.0)
    sums["max_abs_diff"] = max(sums["max_abs_diff"], float(np.max(diff)))


def scaling_random(d_ks: Sequence[int] = DEFAULT_D_KS, *, num_keys: int = 64, num_queries: int = 256,
                   seed: int = 0) -> list[dict[str, float]]:
    """Mean attention entropy on random q, k ~ N(0, I_{d_k}) with and without the 1/sqrt(d_k) factor.

    Unscaled, q.k has variance d_k, so the softmax saturates (entropy -> 0) as d_k grows; scaled, the
    logits keep unit variance and the entropy stays put. ``log(num_keys)`` is the uniform maximum.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for d_k in d_ks:
        q = rng.standard_normal((1, num_queries, 1, d_k))  # [B, Q, H, d_k]
        k = rng.standard_normal((1, num_keys, 1, d_k))  # [B, K, H, d_k]
        row = {"d_k": int(d_k)}
        for name, scale in (("scaled", True), ("unscaled", False)):
            w = attention_weights_np(q, k, scale_logits=scale)
            row[f"entropy_{name}"] = float(entropy(w).mean())
            row[f"max_weight_{name}"] = float(w.max(-1).mean())
        row["logit_std_unscaled"] = float(np.std(np.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0])))
        row["uniform_entropy"] = float(np.log(num_keys))
        rows.append(row)
    return rows


def scaling_model_rows(sums: dict[tuple[str, int], dict], stats: dict[tuple[str, int], HeadStatistics],
                       d_k: int, *, dtype: str = "float32") -> list[dict[str, Any]]:
    """Per (kind, layer): mean entropy of the model's maps with (as trained) and without 1/sqrt(d_k).

    Args:
      sums: {(kind, layer): ``add_scaling`` sums}; stats: {(kind, layer): HeadStatistics} (for the
        uniform entropy); d_k: the model's d_k (reported); dtype: its compute dtype (the check's tolerance).

    Raises:
      RecomputationError: a layer's ``sown_vs_recomputed`` exceeds ``SOWN_TOLERANCE[dtype]``.
    """
    rows = []
    for kind, layer in sorted(sums, key=forward.kind_layer_order):
        acc = sums[(kind, layer)]
        uniform = float(np.mean(stats[(kind, layer)].means()["uniform_entropy"]))
        rows.append({"kind": kind, "layer": layer, "d_k": d_k,
                     "entropy_scaled": acc["scaled"] / acc["rows"],
                     "entropy_unscaled": acc["unscaled"] / acc["rows"],
                     "uniform_entropy": uniform,
                     "logit_std_unscaled": math.sqrt(acc["logit_sq"] / acc["pairs"]),
                     "sown_vs_recomputed": acc["max_abs_diff"]})
    check_recomputed(rows, SOWN_TOLERANCE[dtype])
    return rows


def check_recomputed(rows: Sequence[dict[str, Any]], tolerance: float) -> None:
    """Raises RecomputationError (one line) for the first row whose recomputed weights miss the sown ones."""
    for r in rows:
        if not r["sown_vs_recomputed"] <= tolerance:  # NaN fails too
            raise RecomputationError(
                f"the scaling experiment recomputes softmax(q.k / sqrt(d_k)) from the model's sown q and k, "
                f"but in {r['kind']} layer {r['layer']} that differs from the model's own weights by "
                f"{r['sown_vs_recomputed']:.3g} (tolerance {tolerance:g}): the model's attention has a term "
                "the experiment leaves out (such as a position bias in the logits), so the experiment does "
                "not apply to this model")


def plot_scaling(random_rows: Sequence[dict], model_rows: Sequence[dict], path: str) -> str:
    """Entropy against d_k on random q, k (left); the model's per-layer entropy with and without (right)."""
    fig = artifacts.figure(12, 4.2)
    ax = fig.add_subplot(1, 2, 1)
    d_ks = [r["d_k"] for r in random_rows]
    ax.plot(d_ks, [r["entropy_scaled"] for r in random_rows], "o-", label="softmax(q.k / sqrt(d_k))")
    ax.plot(d_ks, [r["entropy_unscaled"] for r in random_rows], "s-", label="softmax(q.k)")
    ax.axhline(random_rows[0]["uniform_entropy"], color="gray", ls=":", label="uniform, log(#keys)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k")
    ax.set_ylabel("mean entropy (nats)")
    ax.set_title("random unit-variance q, k", fontsize=10)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    labels = [f"{r['kind'].replace('_self', '')}\nL{r['layer']}" for r in model_rows]
    x = np.arange(len(model_rows))
    ax.bar(x - 0.27, [r["uniform_entropy"] for r in model_rows], 0.27, label="uniform", color="lightgray")
    ax.bar(x, [r["entropy_scaled"] for r in model_rows], 0.27, label="with 1/sqrt(d_k) (as trained)")
    ax.bar(x + 0.27, [r["entropy_unscaled"] for r in model_rows], 0.27, label="without")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("mean entropy (nats)")
    ax.set_title(f"the trained model's own q, k (d_k={model_rows[0]['d_k']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return artifacts.save(fig, path)
