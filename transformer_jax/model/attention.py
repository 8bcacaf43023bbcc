"""Scaled dot-product attention as pure functions (Vaswani et al., 2017, section 3.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V

Names follow the paper: ``d_k`` is the query/key size per head, ``d_v`` the value size per head and
``num_heads`` is h. Arrays use the layout ``[batch, length, num_heads, head_dim]`` so that heads stay a
separate axis that tensor parallelism can shard.

Mask convention, used everywhere in this package: a boolean mask where ``True`` means "may attend".
Masks are applied to the logits before the softmax. A query row whose every key is masked gets all-zero
weights (and so a zero output with zero gradients), never NaN and never a uniform distribution.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.special_ids import PAD_ID

Array = jax.Array


def causal_mask(length: int) -> Array:
    """Decoder self-attention mask: position i may attend to positions j <= i.

    Returns:
      bool[1, 1, length, length]
    """
    positions = jnp.arange(length)
    return (positions[None, :] <= positions[:, None])[None, None]


def padding_mask(query_tokens: Array | None, key_tokens: Array, pad_id: int = PAD_ID) -> Array:
    """Mask that hides padded keys (and, when ``query_tokens`` is given, padded queries).

    Args:
      query_tokens: int[batch, q_len] or None. With None the mask broadcasts over queries, which is all
        attention needs: a padded query's output is never read.
      key_tokens: int[batch, kv_len].
      pad_id: the padding id.

    Returns:
      bool[batch, 1, q_len or 1, kv_len]
    """
    key_ok = (key_tokens != pad_id)[:, None, None, :]  # [B, 1, 1, K]
    if query_tokens is None:
        return key_ok
    query_ok = (query_tokens != pad_id)[:, None, :, None]  # [B, 1, Q, 1]
    return query_ok & key_ok


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of boolean masks of equal rank; ``None`` entries are ignored."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    ranks = {m.ndim for m in present}
    if len(ranks) != 1:
        raise ValueError(f"masks must have the same rank, got ranks {sorted(ranks)}")
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def masked_softmax(logits: Array, mask: Array | None, axis: int = -1) -> Array:
    """Softmax over ``axis`` (default the last) that gives masked entries weight exactly 0.

    Rows with no allowed entry come out all zero, with zero gradient. Both ``jnp.where`` calls are
    needed: the inner one keeps ``exp`` away from -inf so no NaN reaches the gradient.

    Args:
      logits: float[..., kv_len] (kv_len on ``axis``).
      mask: bool, broadcastable to ``logits`` with the same rank, or None.
      axis: the axis the weights sum over.
    """
    if mask is None:
        return jax.nn.softmax(logits, axis=axis)
    mask = jnp.broadcast_to(mask, logits.shape)
    row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=axis, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalized = jnp.where(mask, jnp.exp(jnp.where(mask, logits - row_max, 0.0)), 0.0)
    denom = jnp.sum(unnormalized, axis=axis, keepdims=True)
    return unnormalized / jnp.where(denom > 0, denom, 1.0)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    *,
    bias: Array | None = None,
    dropout_rate: float = 0.0,
    rng: Array | None = None,
    scale_logits: bool = True,
    return_weights: bool = False,
    precision: jax.lax.Precision | None = None,
) -> Array | tuple[Array, Array]:
    """softmax(Q K^T / sqrt(d_k) + bias, masked) V, batched over heads.

    Args:
      query: float[batch, q_len, num_heads, d_k].
      key: float[batch, kv_len, num_heads, d_k].
      value: float[batch, kv_len, num_heads, d_v].
      mask: bool[batch|1, num_heads|1, q_len|1, kv_len]; True = may attend. Applied before the softmax.
      bias: float, broadcastable to [batch, num_heads, q_len, kv_len], added to the scaled logits.
      dropout_rate: dropout on the attention weights (the paper does not use it; default 0).
      rng: PRNG key, required when ``dropout_rate > 0``.
      scale_logits: divide the logits by sqrt(d_k) (False only for the scaling experiment).
      return_weights: also return the attention weights.
      precision: matmul precision for both einsums.

    Returns:
      float[batch, q_len, num_heads, d_v], and with ``return_weights`` also
      float32 (float64 for float64 inputs) [batch, num_heads, q_len, kv_len] weights, after masking
      and before dropout.
    """
    d_k = query.shape[-1]
    if key.shape[-1] != d_k:
        raise ValueError(f"query and key need the same d_k, got {d_k} and {key.shape[-1]}")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value need the same [batch, kv_len], got {key.shape[:2]} and {value.shape[:2]}"
        )
    if mask is not None and mask.ndim != 4:
        raise ValueError(f"mask must be rank 4 [batch, heads, q_len, kv_len], got shape {mask.shape}")
    if scale_logits:
        query = query / jnp.asarray(math.sqrt(d_k), query.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=precision)  # [B, H, Q, K]
    # Softmax in at least float32, also when computing in bfloat16.
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if bias is not None:
        logits = logits + bias
    weights = masked_softmax(logits, mask)
    mixing = weights
    if dropout_rate > 0.0:
        if rng is None:
            raise ValueError("dropout_rate > 0 needs an rng")
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, weights.shape)
        mixing = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", mixing.astype(value.dtype), value, precision=precision)
    return (out, weights) if return_weights else out


def decode_attention(query: Array, key: Array, value: Array, mask: Array | None, *,
                     bias: Array | None = None) -> tuple[Array, Array]:
    """One cached decoding step: ``batch * group`` single-position queries against head-major keys.

    The queries of one example (its ``group`` beams) share that example's keys, so each (example, head)
    is one product with the keys instead of ``group`` matrix-vector products over copies of them. The
    logits are laid out keys-first, [batch, heads, kv_len, group]: XLA:CPU runs ``keys x queries^T``
    several times faster than ``queries x keys^T`` at these shapes (a [kv_len, d_k] x [d_k, group]
    product per example and head; measured in docs/benchmarks.md). Equals :func:`dot_product_attention`
    on the keys repeated per row.

    Args:
      query: float[batch * group, 1, num_heads, d_k]; row ``b * group + g`` belongs to example b.
      key: float[batch, num_heads, kv_len, d_k].
      value: float[batch, num_heads, kv_len, d_v].
      mask: bool[batch|1, 1, kv_len, group|1] (keys first); True = may attend. Or None.
      bias: float[batch * group|1, num_heads, 1, kv_len] (the queries' rows), added to the scaled logits,
        or None.

    Returns:
      float[batch * group, 1, num_heads, d_v] and float32 weights [batch, num_heads, group, kv_len].
    """
    batch, num_heads, _, d_k = key.shape
    rows = query.shape[0]
    if rows % batch or query.shape[1:] != (1, num_heads, d_k):
        raise ValueError(f"query must be [batch * group, 1, {num_heads}, {d_k}] for keys of batch "
                         f"{batch}, got shape {query.shape}")
    group = rows // batch
    query = query.reshape(batch, group, num_heads, d_k).transpose(0, 2, 1, 3)  # [B, H, G, d_k]
    query = query / jnp.asarray(math.sqrt(d_k), query.dtype)
    logits = jnp.einsum("bhkd,bhgd->bhkg", key, query)  # [B, H, K, G]
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if bias is not None:  # [rows|1, H, 1, K] -> [B|1, H, K, G|1]
        bias = jnp.swapaxes(bias, 2, 3) if bias.shape[0] == 1 else (
            bias.reshape(batch, group, num_heads, -1).transpose(0, 2, 3, 1))
        logits = logits + bias
    weights = masked_softmax(logits, mask, axis=2)
    out = jnp.einsum("bhkg,bhkd->bhgd", weights.astype(value.dtype), value)  # [B, H, G, d_v]
    out = out.transpose(0, 2, 1, 3).reshape(rows, 1, num_heads, value.shape[-1])
    return out, jnp.swapaxes(weights, 2, 3)


# --------------------------------------------------------------------------------------------------
# The attention witness: a check that the weights are a real, correctly masked distribution.


class AttentionWitnessError(AssertionError):
    """Raised by :func:`check_attention` when the weights are not a masked distribution."""


@dataclasses.dataclass(frozen=True)
class WitnessReport:
    """Result of :func:`attention_witness`.

    Attributes:
      ok: True when every check passed.
      bad_row_sum: indices (tuple per row, over the leading axes + query axis) of rows that have at least
        one allowed entry but do not sum to 1.
      out_of_range: indices of rows with a weight outside [0, 1].
      leaked: indices of rows with a non-zero weight where the mask forbids attention.
      num_rows: number of rows checked.
    """

    ok: bool
    bad_row_sum: tuple[tuple[int, ...], ...]
    out_of_range: tuple[tuple[int, ...], ...]
    leaked: tuple[tuple[int, ...], ...]
    num_rows: int

    def __str__(self) -> str:
        if self.ok:
            return f"attention witness: all {self.num_rows} rows are masked distributions"
        parts = []
        for name, rows in (
            ("rows with allowed keys whose weights do not sum to 1", self.bad_row_sum),
            ("rows with a weight outside [0, 1]", self.out_of_range),
            ("rows with non-zero weight on a masked key", self.leaked),
        ):
            if rows:
                shown = ", ".join(str(r) for r in rows[:5])
                more = f" (+{len(rows) - 5} more)" if len(rows) > 5 else ""
                parts.append(f"{len(rows)} {name}: {shown}{more}")
        return f"attention witness FAILED on {self.num_rows} rows; " + "; ".join(parts)


def attention_witness(weights, mask=None, *, atol: float = 1e-5) -> WitnessReport:
    """Checks that attention weights are a correctly masked distribution, row by row.

    Verifies that (1) each row with at least one allowed key sums to 1 (within ``atol``), (2) every
    weight lies in [0, 1], and (3) every weight outside the mask is exactly 0. A row with no allowed key
    must be all zero. Runs on the host (NumPy), so it works in tests and from ``jax.debug.callback``.

    Args:
      weights: float[..., q_len, kv_len], e.g. [batch, num_heads, q_len, kv_len].
      mask: bool, broadcastable to ``weights``; True = may attend. None means all allowed.
      atol: tolerance on the row sums.

    Returns:
      A :class:`WitnessReport`; ``str(report)`` names the failing rows.
    """
    w = np.asarray(weights, dtype=np.float64)
    allowed = np.ones(w.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask), w.shape)
    has_allowed = allowed.any(axis=-1)
    row_sum = w.sum(axis=-1)
    bad_sum = has_allowed & (np.abs(row_sum - 1.0) > atol)
    bad_range = ((w < 0.0) | (w > 1.0 + atol)).any(axis=-1)
    leaked = ((w != 0.0) & ~allowed).any(axis=-1)

    def rows(flags):
        return tuple(tuple(int(i) for i in idx) for idx in zip(*np.nonzero(flags), strict=True))

    return WitnessReport(
        ok=not (bad_sum.any() or bad_range.any() or leaked.any()),
        bad_row_sum=rows(bad_sum),
        out_of_range=rows(bad_range),
        leaked=rows(leaked),
        num_rows=int(np.prod(w.shape[:-1])),
    )


def check_attention(weights, mask=None, *, atol: float = 1e-5) -> None:
    """Raises :class:`AttentionWitnessError` with the witness report if the weights fail it."""
    report = attention_witness(weights, mask, atol=atol)
    if not report.ok:
        raise AttentionWitnessError(str(report))


def witness_in_jit(weights: Array, mask: Array | None) -> None:
    """Runs :func:`check_attention` on the host from inside jit (debugging; costs a device sync)."""
    if mask is None:
        jax.debug.callback(check_attention, weights)
    else:
        jax.debug.callback(check_attention, weights, mask)
