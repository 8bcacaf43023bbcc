"""Blockwise (FlashAttention-style) scaled dot-product attention in pure JAX.

Computes exactly what :func:`transformer_jax.model.attention.dot_product_attention` computes (same shapes,
same
mask convention: boolean, True = may attend; a query row with no allowed key gives a zero output with zero
gradients), without ever materialising the [q_len, kv_len] logits:

* Forward (FlashAttention, Dao et al. 2022): for each block of ``block_size`` queries, loop over blocks of
  keys keeping a running row max ``m``, running denominator ``l`` and running (unnormalised) output. When a
  new key block raises the max, the old ``l`` and output are rescaled by ``exp(m_old - m_new)``. The
  softmax statistics are float32 (float64 for float64 inputs) whatever the input dtype.
* Backward (FlashAttention-2, Dao 2023): a ``jax.custom_vjp`` whose forward saves only q, k, v, the output
  and the per-row logsumexp; the backward recomputes each [block, block] tile of probabilities from them.
  Memory is O(length) for the forward *and* the backward (checked by ``tests/test_blockwise_attention.py``
  with XLA's compiled memory analysis, and by ``python -m transformer_jax.benchmarks.attention``).

Masks:

* ``causal=True``: query i may attend key j <= i (the same as ``attention.causal_mask``, top-left aligned
  when q_len != kv_len). Computed per tile from indices; tiles entirely above the diagonal are skipped.
* ``mask``: bool[batch|1, num_heads|1, q_len|1, kv_len|1]. Padding masks [batch, 1, 1, kv_len] cost O(n)
  and are sliced per key block. A full [.., q_len, kv_len] mask works too (sliced per tile), but is itself
  O(n^2) memory; prefer ``causal=True`` plus a padding mask.
* Lengths that are not a multiple of ``block_size`` are padded internally with masked keys and discarded
  queries.

On GPU: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (cuDNN flash attention, the same
[batch, length, heads, head_dim] layout) is the fast path where it applies: float16/bfloat16 inputs, head
dims cuDNN supports, causal masking via ``is_causal`` and padding via ``query_seq_lengths`` /
``key_value_seq_lengths``. It does not apply to float32 inputs, and its masking semantics differ from this
package's: jax.nn fills masked logits with a large negative number, so a query row with no allowed key gets
a uniform average of the values, not zero (``implementation="xla"`` does this on CPU; we did not test
cuDNN's behaviour, no GPU was available). This module is the portable O(n)-memory path that keeps the exact
package semantics on every backend; choosing cuDNN where it applies is left to the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable, trace-time constants of one call (the custom_vjp's non-differentiable arguments)."""

    q_len: int  # true (unpadded) lengths
    kv_len: int
    block_q: int
    block_k: int
    causal: bool
    precision: lax.Precision | None


def blockwise_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    *,
    block_size: int = 512,
    causal: bool = False,
    scale_logits: bool = True,
    precision: lax.Precision | None = None,
) -> Array:
    """softmax(Q K^T / sqrt(d_k), masked) V in blocks, with O(length) memory forward and backward.

    Args:
      query: float[batch, q_len, num_heads, d_k].
      key: float[batch, kv_len, num_heads, d_k].
      value: float[batch, kv_len, num_heads, d_v].
      mask: bool[batch|1, num_heads|1, q_len|1, kv_len|1]; True = may attend. None = all allowed.
      block_size: queries and keys per tile (clipped to the sequence lengths).
      causal: also forbid key j for query i when j > i (no mask array is built).
      scale_logits: divide the logits by sqrt(d_k).
      precision: matmul precision of every einsum.

    Returns:
      float[batch, q_len, num_heads, d_v] in ``value``'s dtype.
    """
    batch, q_len, num_heads, d_k = query.shape
    if key.shape[-1] != d_k:
        raise ValueError(f"query and key need the same d_k, got {d_k} and {key.shape[-1]}")
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or key.shape[2] != num_heads:
        raise ValueError(
            f"expected key [batch, kv_len, heads, d_k] and value [batch, kv_len, heads, d_v] matching "
            f"query {query.shape}, got key {key.shape} and value {value.shape}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    kv_len = key.shape[1]
    if mask is not None:
        mask = _check_mask(mask, (batch, num_heads, q_len, kv_len))
    if scale_logits:
        query = query / jnp.asarray(math.sqrt(d_k), query.dtype)
    static = _Static(q_len, kv_len, min(block_size, q_len), min(block_size, kv_len), causal, precision)
    q_blocks = _to_blocks(query, static.block_q)  # [nq, B, H, bq, d_k]
    k_blocks = _to_blocks(key, static.block_k)  # [nk, B, H, bk, d_k]
    v_blocks = _to_blocks(value, static.block_k)  # [nk, B, H, bk, d_v]
    if mask is not None:
        mask = _pad_mask(mask, q_blocks.shape[0] * static.block_q, k_blocks.shape[0] * static.block_k)
    out_blocks = _flash(static, q_blocks, k_blocks, v_blocks, mask)  # [nq, B, H, bq, d_v]
    out = out_blocks.transpose(1, 0, 3, 2, 4).reshape(batch, -1, num_heads, value.shape[-1])
    return out[:, :q_len]


def _check_mask(mask: Array, full_shape: tuple[int, int, int, int]) -> Array:
    """Validates a rank-4 mask against [batch, heads, q_len, kv_len] (each axis full size or 1)."""
    if mask.ndim != 4 or any(m not in (1, n) for m, n in zip(mask.shape, full_shape, strict=True)):
        raise ValueError(
            f"mask must be broadcastable to [batch, heads, q_len, kv_len]={list(full_shape)} with the same "
            f"rank 4, got shape {mask.shape}"
        )
    return mask.astype(bool)


def _to_blocks(x: Array, block: int) -> Array:
    """float[B, T, H, D] -> float[ceil(T / block), B, H, block, D], zero-padding the length."""
    batch, length, heads, dim = x.shape
    num_blocks = -(-length // block)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * block - length), (0, 0), (0, 0)))
    return x.reshape(batch, num_blocks, block, heads, dim).transpose(1, 0, 3, 2, 4)


def _pad_mask(mask: Array, q_padded: int, kv_padded: int) -> Array:
    """Pads the full-size query/key axes of a mask with False (size-1 axes stay broadcast)."""
    pad_q = q_padded - mask.shape[2] if mask.shape[2] > 1 else 0
    pad_k = kv_padded - mask.shape[3] if mask.shape[3] > 1 else 0
    return jnp.pad(mask, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)), constant_values=False)


def _tile_mask(static: _Static, mask: Array | None, i: Array, j: Array, kv_padded: bool) -> Array | None:
    """bool[B|1, H|1, bq, bk] for tile (query block i, key block j), or None if nothing is masked.

    Combines the user mask (sliced along its full-size axes), causality and the padded keys.
    """
    bq, bk = static.block_q, static.block_k
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)  # [bq, bk]
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)  # [bq, bk]
    allowed = None
    if kv_padded:
        allowed = k_pos < static.kv_len
    if static.causal:
        allowed = k_pos <= q_pos if allowed is None else allowed & (k_pos <= q_pos)
    if allowed is not None:
        allowed = allowed[None, None]  # [1, 1, bq, bk]
    if mask is not None:
        tile = mask
        if mask.shape[2] > 1:
            tile = lax.dynamic_slice_in_dim(tile, i * bq, bq, axis=2)
        if mask.shape[3] > 1:
            tile = lax.dynamic_slice_in_dim(tile, j * bk, bk, axis=3)
        allowed = tile if allowed is None else allowed & tile  # [B|1, H|1, bq|1, bk|1] -> [.., bq, bk]
    return allowed


def _kv_blocks_for(static: _Static, i: Array, num_kv_blocks: int) -> Array | int:
    """Number of key blocks query block i needs: all of them, or up to the diagonal when causal."""
    if not static.causal:
        return num_kv_blocks
    last_query = (i + 1) * static.block_q - 1
    return jnp.minimum(num_kv_blocks, last_query // static.block_k + 1)


def _first_q_block_for(static: _Static, j: Array) -> Array | int:
    """First query block that sees key block j: 0, or the block holding the diagonal when causal."""
    return (j * static.block_k) // static.block_q if static.causal else 0


def _stat_dtype(dtype) -> jnp.dtype:
    """Softmax statistics in at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def _online_update(carry, logits: Array, v_block: Array, precision):
    """One FlashAttention step: folds a tile of (masked to -inf) logits into the running statistics.

    Args:
      carry: (m float[B, H, bq] running max, l float[B, H, bq] running denominator,
        acc float[B, H, bq, d_v] running unnormalised output).
      logits: float[B, H, bq, bk], -inf where masked.
      v_block: float[B, H, bk, d_v].
    """
    m_old, l_old, acc = carry
    m_new = jnp.maximum(m_old, jnp.max(logits, axis=-1))
    # m_new is -inf only while every key seen so far is masked; any finite stand-in keeps exp() at 0.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])  # [B, H, bq, bk]; exp(-inf) = 0 on masked keys
    correction = jnp.exp(m_old - m_safe)  # rescales the old statistics to the new max; 0 when m_old=-inf
    l_new = correction * l_old + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v_block.dtype), v_block, precision=precision,
                    preferred_element_type=acc.dtype)
    return m_new, l_new, correction[..., None] * acc + pv


def _forward(static: _Static, q_blocks, k_blocks, v_blocks, mask):
    """Returns out [nq, B, H, bq, d_v] and logsumexp [nq, B, H, bq] (0 for rows with no allowed key)."""
    num_kv_blocks = k_blocks.shape[0]
    kv_padded = num_kv_blocks * static.block_k != static.kv_len
    stat = _stat_dtype(q_blocks.dtype)
    _, batch, heads, bq, _ = q_blocks.shape
    d_v = v_blocks.shape[-1]

    def query_block(i, q_i):
        def key_block(j, carry):
            logits = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_blocks[j], precision=static.precision,
                                preferred_element_type=stat)  # [B, H, bq, bk]
            allowed = _tile_mask(static, mask, i, j, kv_padded)
            if allowed is not None:
                logits = jnp.where(allowed, logits, -jnp.inf)
            return _online_update(carry, logits, v_blocks[j], static.precision)

        init = (jnp.full((batch, heads, bq), -jnp.inf, stat), jnp.zeros((batch, heads, bq), stat),
                jnp.zeros((batch, heads, bq, d_v), stat))
        row_max, denom, acc = lax.fori_loop(0, _kv_blocks_for(static, i, num_kv_blocks), key_block, init)
        has_key = denom > 0  # False exactly for rows whose every key is masked
        safe_denom = jnp.where(has_key, denom, 1.0)
        out = acc / safe_denom[..., None]  # all-masked rows: acc = 0 -> out = 0
        lse = jnp.where(has_key, row_max + jnp.log(safe_denom), 0.0)
        return out.astype(v_blocks.dtype), lse

    indices = jnp.arange(q_blocks.shape[0])
    return lax.map(lambda args: query_block(*args), (indices, q_blocks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, q_blocks, k_blocks, v_blocks, mask):
    return _forward(static, q_blocks, k_blocks, v_blocks, mask)[0]


def _flash_fwd(static, q_blocks, k_blocks, v_blocks, mask):
    out, lse = _forward(static, q_blocks, k_blocks, v_blocks, mask)
    return out, (q_blocks, k_blocks, v_blocks, mask, out, lse)


def _flash_bwd(static: _Static, residuals, d_out):
    """FlashAttention-2 backward: recompute each probability tile from the saved logsumexp.

    With P = exp(S - lse) and D = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K, dK = dS^T Q.
    Outer loop over key blocks (accumulating dK_j, dV_j), inner loop over query blocks (adding into dQ).
    """
    q_blocks, k_blocks, v_blocks, mask, out, lse = residuals
    num_q_blocks, num_kv_blocks = q_blocks.shape[0], k_blocks.shape[0]
    kv_padded = num_kv_blocks * static.block_k != static.kv_len
    stat = _stat_dtype(q_blocks.dtype)
    prec = static.precision
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1)  # [nq, B, H, bq]

    def key_block(d_q, args):
        j, k_j, v_j = args

        def query_block(i, carry):
            d_k, d_v, d_q = carry
            q_i, d_out_i = q_blocks[i], d_out[i]
            logits = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, precision=prec,
                                preferred_element_type=stat)  # [B, H, bq, bk]
            shifted = logits - lse[i][..., None]
            allowed = _tile_mask(static, mask, i, j, kv_padded)
            if allowed is not None:
                shifted = jnp.where(allowed, shifted, -jnp.inf)
            p = jnp.exp(shifted)  # the forward's probabilities; exactly 0 where masked
            d_v = d_v + jnp.einsum("bhqk,bhqd->bhkd", p.astype(d_out_i.dtype), d_out_i, precision=prec,
                                   preferred_element_type=stat)
            d_p = jnp.einsum("bhqd,bhkd->bhqk", d_out_i, v_j, precision=prec, preferred_element_type=stat)
            d_s = (p * (d_p - delta[i][..., None])).astype(q_i.dtype)  # [B, H, bq, bk]
            d_k = d_k + jnp.einsum("bhqk,bhqd->bhkd", d_s, q_i, precision=prec, preferred_element_type=stat)
            d_q_i = jnp.einsum("bhqk,bhkd->bhqd", d_s, k_j, precision=prec, preferred_element_type=stat)
            return d_k, d_v, d_q.at[i].add(d_q_i)

        init = (jnp.zeros(k_j.shape, stat), jnp.zeros(v_j.shape, stat), d_q)
        d_k, d_v, d_q = lax.fori_loop(_first_q_block_for(static, j), num_q_blocks, query_block, init)
        return d_q, (d_k.astype(k_j.dtype), d_v.astype(v_j.dtype))

    d_q0 = jnp.zeros(q_blocks.shape, stat)
    d_q, (d_k, d_v) = lax.scan(key_block, d_q0, (jnp.arange(num_kv_blocks), k_blocks, v_blocks))
    return d_q.astype(q_blocks.dtype), d_k, d_v, None


_flash.defvjp(_flash_fwd, _flash_bwd)
