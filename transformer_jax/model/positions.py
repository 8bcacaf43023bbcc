"""Position schemes: how the Transformer knows where each token is, one interface for all of them.

Attention itself is blind to order, so every scheme tells it positions in one or more of four places:

  scheme      embeddings              queries and keys  attention logits             output
  sinusoidal  + PE(pos) (paper 3.5)   -                 -                            -
  learned     + P[pos] (Table 3 E)    -                 -                            -
  rotary      -                       rotated by pos    -                            -
  alibi       -                       -                 - m_h |i - j|                -
  relative    -                       -                 + q_i a^K_c(j-i) / sqrt(d_k)  + sum_j w_ij a^V_c(j-i)
  none        -                       -                 -                            -

(rotary: Su et al. 2021; alibi: Press et al. 2021; relative: Shaw, Uszkoreit and Vaswani 2018), with
``c(d) = clip(d, -k, k)``, ``k = max_relative_position``. Query/key, logit and output terms act in
self-attention only (encoder and decoder), never in encoder-decoder attention. The decoder's causal mask
still gives it order under ``none``; the encoder is then a bag of words.

The model asks this module only: :class:`AddPositions` for the embeddings, and a
:class:`SelfAttentionPositions` inside each self-attention for the rest. Both take positions as int32
arrays, so a cached decoding step passes its one position ``index`` and the positions of the cached keys
(``DecodeCache.key_positions``) and computes exactly what the full forward pass computes at that row.

Only the learned table bounds the length (its ``max_len`` rows); every other scheme takes any length.

Conventions:
  * rotary pairs dimension ``i`` with ``i + d/2`` (the "halves" layout of GPT-NeoX and LLaMA, not the
    interleaved pairs (2i, 2i+1) of the RoFormer paper), angle ``pos * 10000^(-2i/d)``;
  * ALiBi slopes are ``2^(-8h/H)`` for h = 1..H when H is a power of two; otherwise the paper's rule: the
    slopes of the nearest smaller power of two n, then every other slope of 2n;
  * relative tables ``a^K [2k+1, d_k]`` and ``a^V [2k+1, d_v]`` are per layer and shared by its heads; row
    ``d + k`` holds distance ``d = j - i`` (key position minus query position).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.axes import EMBED, KV
from transformer_jax.model.config import ModelConfig

Array = jax.Array
ROTARY_BASE = 10000.0


def sinusoidal_table(max_len: int, d_model: int) -> np.ndarray:
    """float32[max_len, d_model]: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    positions = np.arange(max_len, dtype=np.float64)[:, None]  # [L, 1]
    rates = 1.0 / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # [D/2]
    angles = positions * rates[None, :]  # [L, D/2]
    table = np.zeros((max_len, d_model), np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(np.float32)


def check_length(config: ModelConfig, length: int, what: str = "a sequence") -> None:
    """Raises a one-line ValueError if ``length`` positions exceed the learned table (no other scheme has
    a bound)."""
    limit = config.position_limit
    if limit is not None and length > limit:
        raise ValueError(
            f"{what} of {length} positions is longer than the learned position table "
            f"(model.max_len={limit}); position_encoding='learned' has no row for position {limit} or "
            "beyond: use a shorter input, or a scheme without a table (sinusoidal, rotary, alibi, relative)")


class AddPositions(nn.Module):
    """What a scheme adds to the token embeddings: the sinusoid, the learned table's rows, or nothing."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, num_positions: int) -> Array:
        """x float[batch, length, d_model] plus the encodings of ``positions`` int32[length].

        ``num_positions`` (static) bounds the positions: the length of the sequence, or a decode cache's
        positions at a cached step (``length`` 1, ``positions`` ``[index]``).
        """
        cfg = self.config
        if cfg.position_encoding == "learned":
            check_length(cfg, num_positions)
            table = self.param(
                "position_embedding",
                nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model**-0.5),
                                             (None, EMBED)),
                (cfg.max_len, cfg.d_model), jnp.float32)
        elif cfg.position_encoding == "sinusoidal":
            table = jnp.asarray(sinusoidal_table(num_positions, cfg.d_model))
        else:
            return x
        return x + jnp.take(table, positions, axis=0)[None].astype(x.dtype)  # [1, L, D]


def rotary_angles(positions: Array, head_dim: int) -> Array:
    """float32[length, head_dim / 2]: position times ``10000^(-2i/head_dim)``."""
    rates = ROTARY_BASE ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [d/2]
    return positions.astype(jnp.float32)[:, None] * rates[None, :]


def rotate(x: Array, positions: Array) -> Array:
    """RoPE: x float[rows, length, heads, d] with dimension i paired with i + d/2 ("halves"), each pair
    rotated by the angle of its position ``positions`` int32[length] -> x's shape and dtype."""
    half = x.shape[-1] // 2
    angles = rotary_angles(positions, x.shape[-1])[None, :, None, :]  # [1, L, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float64[num_heads]: ALiBi's head slopes m_h (Press et al. 2021, their reference code's rule)."""
    def powers_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    nearest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = powers_of_two(nearest)
    if nearest < num_heads:
        slopes += powers_of_two(2 * nearest)[0::2][: num_heads - nearest]
    return np.asarray(slopes)


def relative_buckets(q_positions: Array, k_positions: Array, max_distance: int) -> Array:
    """int32[q_len, k_len]: row of the relative tables for each pair, ``clip(j - i, -k, k) + k``."""
    distance = k_positions[None, :] - q_positions[:, None]  # [Q, K], key minus query
    return jnp.clip(distance, -max_distance, max_distance) + max_distance


class SelfAttentionPositions(nn.Module):
    """What a scheme does inside one self-attention: to queries and keys, to the logits, to the output.

    Every method takes the query and key positions as int32 arrays and is the identity (or None) for a
    scheme that does nothing there.
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        if cfg.position_encoding == "relative":
            rows = 2 * cfg.max_relative_position + 1
            init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
            self.relative_key = self.param(
                "relative_key", nn.with_logical_partitioning(init, (None, KV)), (rows, cfg.d_k), jnp.float32)
            self.relative_value = self.param(
                "relative_value", nn.with_logical_partitioning(init, (None, KV)), (rows, cfg.d_v),
                jnp.float32)

    def rotate(self, x: Array, positions: Array) -> Array:
        """Queries or keys float[rows, length, heads, d] at ``positions`` int32[length]: rotated (rotary)."""
        return rotate(x, positions) if self.config.position_encoding == "rotary" else x

    def logit_bias(self, query: Array, q_positions: Array, k_positions: Array) -> Array | None:
        """float32[rows|1, heads, q_len, k_len] added to the scaled logits, or None.

        Args:
          query: float[rows, q_len, heads, d_k], the projected queries (the relative key term reads them).
          q_positions: int32[q_len]; k_positions: int32[k_len].
        """
        cfg = self.config
        if cfg.position_encoding == "alibi":
            distance = jnp.abs(q_positions[:, None] - k_positions[None, :]).astype(jnp.float32)  # [Q, K]
            slopes = jnp.asarray(alibi_slopes(cfg.num_heads), jnp.float32)  # [H]
            return -slopes[None, :, None, None] * distance[None, None]  # [1, H, Q, K]
        if cfg.position_encoding == "relative":
            buckets = relative_buckets(q_positions, k_positions, cfg.max_relative_position)
            keys = jnp.take(self.relative_key, buckets, axis=0).astype(query.dtype)  # [Q, K, d_k]
            logits = jnp.einsum("bqhd,qkd->bhqk", query, keys)  # [B, H, Q, K]
            return logits.astype(jnp.float32) / jnp.float32(math.sqrt(cfg.d_k))
        return None

    def add_output_term(self, out: Array, weights: Array, q_positions: Array, k_positions: Array) -> Array:
        """The attention output out float[rows, q_len, heads, d_v] plus the scheme's term (relative: the
        weighted a^V rows), from the attention weights float32[rows, heads, q_len, k_len]."""
        cfg = self.config
        if cfg.position_encoding != "relative":
            return out
        buckets = relative_buckets(q_positions, k_positions, cfg.max_relative_position)
        values = jnp.take(self.relative_value, buckets, axis=0).astype(out.dtype)  # [Q, K, d_v]
        return out + jnp.einsum("bhqk,qkd->bqhd", weights.astype(out.dtype), values)  # [B, Q, H, d_v]
