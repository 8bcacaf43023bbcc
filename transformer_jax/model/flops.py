"""Analytic FLOP counts of the Transformer (matmuls only, 2 FLOPs per multiply-add).

Counts padded positions, since those are computed too, so the numbers compare with XLA's cost analysis
of the same compiled program. A training step costs three forward passes (forward, and a backward that
takes gradients with respect to both activations and weights).
"""

from __future__ import annotations

from transformer_jax.model.config import ModelConfig


def _per_position(cfg: ModelConfig) -> tuple[int, int]:
    """(attention projections Q, K, V, O; feed-forward) FLOPs per position and layer."""
    d, h, dk, dv, dff = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v, cfg.d_ff
    return 2 * d * h * (2 * dk + dv) + 2 * h * dv * d, 4 * d * dff


def encoder_flops(cfg: ModelConfig, batch: int, src_len: int) -> float:
    """The encoder stack over int[batch, src_len], plus every decoder layer's cross-attention K, V."""
    h, dk, dv = cfg.num_heads, cfg.d_k, cfg.d_v
    projections, ffn = _per_position(cfg)
    layer = src_len * (projections + ffn + 2 * src_len * h * (dk + dv))  # + Q K^T and weights @ V
    cross_kv = src_len * 2 * cfg.d_model * h * (dk + dv)
    return float(batch * (cfg.num_encoder_layers * layer + cfg.num_decoder_layers * cross_kv))


def decoder_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int, kv_len: int) -> float:
    """The decoder stack and output logits for ``tgt_len`` positions attending to ``kv_len`` keys
    (``kv_len = tgt_len`` in training; the cache length when decoding one step)."""
    d, h, dk, dv = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
    projections, ffn = _per_position(cfg)
    position = (projections + 2 * kv_len * h * (dk + dv)  # masked self-attention, computed in full
                + 2 * d * h * dk + 2 * h * dv * d + 2 * src_len * h * (dk + dv)  # cross-attention
                + ffn)
    return float(batch * tgt_len * (cfg.num_decoder_layers * position + 2 * d * cfg.vocab_size))


def forward_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one teacher-forced forward pass over int[batch, src_len] and int[batch, tgt_len]."""
    return encoder_flops(cfg, batch, src_len) + decoder_flops(cfg, batch, src_len, tgt_len, tgt_len)


def train_step_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Forward plus backward: 3x the forward matmul FLOPs."""
    return 3.0 * forward_flops(cfg, batch, src_len, tgt_len)


def decode_flops(cfg: ModelConfig, batch: int, src_len: int, new_tokens: int, *, beam_size: int = 1,
                 cache_len: int) -> float:
    """Cached decoding: the encoder once, then ``new_tokens`` one-position steps for every beam, each
    attending to the whole ``cache_len`` buffer (positions not yet written are masked, not skipped)."""
    rows = batch * beam_size
    return (encoder_flops(cfg, batch, src_len)
            + new_tokens * decoder_flops(cfg, rows, src_len, 1, cache_len))
