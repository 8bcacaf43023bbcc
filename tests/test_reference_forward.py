"""The whole Transformer forward pass against an independent float64 NumPy reference.

The reference below re-derives the model from the paper (Vaswani et al., 2017) and reads only the Flax
parameter tree of the real model; it calls no function of ``transformer_jax``. It covers one encoder and one
decoder layer in each norm style and with every position scheme:

  * shared token embedding E, times sqrt(d_model) (section 3.4), also the output projection x E^T;
  * positions: sinusoidal PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (section 3.5),
    or a learned table per stack (Table 3 row E); and beyond the paper, in every self-attention: rotary
    (each query and key's dimension pair (i, i + d/2) rotated by pos / 10000^(2i/d)), ALiBi (the logit of
    query i and key j minus m_h |i - j|, m_h = 2^(-8h/H)), relative (Shaw et al. 2018: q_i . a^K_c(j-i) /
    sqrt(d_k) added to the logits and sum_j w_ij a^V_c(j-i) to the output, c = clip to [-k, k]), none;
  * multi-head attention softmax(Q K^T / sqrt(d_k)) V with the source padding mask (encoder
    self-attention, encoder-decoder attention) and the causal mask (decoder self-attention);
  * FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, and with each other ``ffn_activation`` in place of max(0, .)
    (the erf GELU, its tanh and sigmoid approximations, swish);
  * LayerNorm with epsilon 1e-6 (Flax's default), post-norm LN(x + f(x)) and pre-norm x + f(LN(x)) with
    the final LayerNorm of a pre-norm stack.

The parameters are random (LayerNorm scales and offsets, FFN biases too), so a LayerNorm applied where it
should not be, or left out, cannot hide behind an init of scale 1 and offset 0.
"""

import math

import jax
import numpy as np
import pytest
import scipy.special
from tiny import random_params

from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import BOS_ID, PAD_ID

# Distinct sizes, so that no transposition or swapped axis can pass.
BATCH, SRC_LEN, TGT_LEN = 3, 7, 5
VOCAB, D_MODEL, D_FF, NUM_HEADS, D_K, D_V, MAX_LEN = 13, 20, 11, 2, 9, 17, 19
EPSILON = 1e-6  # flax.linen.LayerNorm's default
RTOL = ATOL = 1e-5  # float32 model (highest matmul precision, conftest.py) vs float64 reference
SCHEMES = ("sinusoidal", "learned", "rotary", "alibi", "relative", "none")
# Rotary needs an even d_k; ALiBi's slopes take the non-power-of-two rule at 3 heads; clipping at 2 acts on
# the 7-token sources.
SCHEME_FIELDS = {"rotary": {"d_k": 10}, "alibi": {"num_heads": 3}, "relative": {"max_relative_position": 2}}


def _config(norm_style: str, position_encoding: str, ffn_activation: str = "relu") -> ModelConfig:
    fields = dict(vocab_size=VOCAB, d_model=D_MODEL, d_ff=D_FF, num_heads=NUM_HEADS, d_k=D_K, d_v=D_V,
                  num_encoder_layers=1, num_decoder_layers=1, max_len=MAX_LEN, dropout_rate=0.1,
                  norm_style=norm_style, position_encoding=position_encoding,
                  ffn_activation=ffn_activation, deterministic=True)
    return ModelConfig(**{**fields, **SCHEME_FIELDS.get(position_encoding, {})})


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """int32[batch, src_len] sources, rows 1 and 2 padded; int32[batch, tgt_len] targets, row 2 padded."""
    rng = np.random.default_rng(seed)
    src = rng.integers(PAD_ID + 1, VOCAB, size=(BATCH, SRC_LEN)).astype(np.int32)
    tgt = rng.integers(PAD_ID + 1, VOCAB, size=(BATCH, TGT_LEN)).astype(np.int32)
    src[1, -2:] = PAD_ID
    src[2, -4:] = PAD_ID
    tgt[2, -2:] = PAD_ID
    return src, tgt


# ----------------------------------------------------------------------------------------------------------
# The reference, float64 NumPy.


def _np(tree):
    return jax.tree.map(lambda p: np.asarray(p, np.float64), tree)


def _layer_norm(x: np.ndarray, p) -> np.ndarray:
    """float[..., d_model] normalized over the last axis, then scaled and shifted."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPSILON) * p["scale"] + p["bias"]


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _rotate(x: np.ndarray) -> np.ndarray:
    """float[batch, length, d] with the pair (i, i + d/2) at position pos rotated by pos / 10000^(2i/d)."""
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for pos in range(x.shape[1]):
        for i in range(half):
            angle = pos / 10000.0 ** (2 * i / x.shape[-1])
            a, b = x[:, pos, i], x[:, pos, i + half]
            out[:, pos, i] = a * math.cos(angle) - b * math.sin(angle)
            out[:, pos, i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def _alibi_slope(head: int, num_heads: int) -> float:
    """m_h for 0-based ``head``: 2^(-8(h+1)/n) for a power of two n; otherwise the nearest smaller power of
    two's slopes, then the odd-numbered slopes of twice that (Press et al.'s reference code)."""
    nearest = 1 << (num_heads.bit_length() - 1)
    if head < nearest:
        return 2.0 ** (-8.0 * (head + 1) / nearest)
    return 2.0 ** (-8.0 * (2 * (head - nearest) + 1) / (2 * nearest))


def _attention(x_q: np.ndarray, x_kv: np.ndarray, mask: np.ndarray, p, cfg: ModelConfig | None = None
               ) -> np.ndarray:
    """Multi-head attention, one head at a time; with ``cfg`` a self-attention, where its scheme acts.

    Args:
      x_q: float[batch, q_len, d_model]; x_kv: float[batch, kv_len, d_model].
      mask: bool[batch, q_len, kv_len], True = may attend.
      p: query/key [d_model, h, d_k], value [d_model, h, d_v], out [h, d_v, d_model]; for relative
        positions positions/relative_key [2k+1, d_k] and positions/relative_value [2k+1, d_v].
      cfg: the model's config in a self-attention, None in encoder-decoder attention.

    Returns:
      float[batch, q_len, d_model]: Concat(head_1..head_h) W^O.
    """
    scheme = cfg.position_encoding if cfg is not None else None
    q_len, kv_len = x_q.shape[1], x_kv.shape[1]
    heads = []
    for h in range(p["query"].shape[1]):
        q = x_q @ p["query"][:, h]  # [B, Q, d_k]
        k = x_kv @ p["key"][:, h]  # [B, K, d_k]
        v = x_kv @ p["value"][:, h]  # [B, K, d_v]
        if scheme == "rotary":
            q, k = _rotate(q), _rotate(k)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])  # [B, Q, K]
        if scheme == "alibi":
            for i in range(q_len):
                for j in range(kv_len):
                    scores[:, i, j] -= _alibi_slope(h, cfg.num_heads) * abs(i - j)
        if scheme == "relative":
            row = lambda i, j, k_max=cfg.max_relative_position: min(max(j - i, -k_max), k_max) + k_max
            rel_k, rel_v = p["positions"]["relative_key"], p["positions"]["relative_value"]
            for i in range(q_len):
                for j in range(kv_len):
                    scores[:, i, j] += q[:, i] @ rel_k[row(i, j)] / math.sqrt(q.shape[-1])
        weights = _softmax(np.where(mask, scores, -np.inf))  # [B, Q, K]
        out = weights @ v  # [B, Q, d_v]
        if scheme == "relative":
            for i in range(q_len):
                for j in range(kv_len):
                    out[:, i] += weights[:, i, j, None] * rel_v[row(i, j)][None]
        heads.append(out)
    w_o = p["out"].reshape(-1, p["out"].shape[-1])  # [h * d_v, d_model], head-major like the concat
    return np.concatenate(heads, axis=-1) @ w_o


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# Each ModelConfig.ffn_activation, written out from its formula.
ACTIVATIONS = {
    "relu": lambda x: np.maximum(0.0, x),
    "gelu": lambda x: 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))),
    "gelu_sigmoid": lambda x: x * _sigmoid(1.702 * x),
    "swish": lambda x: x * _sigmoid(x),
}


def _ffn(x: np.ndarray, p, activation: str) -> np.ndarray:
    """float[batch, length, d_model] -> same: act(x W_1 + b_1) W_2 + b_2 (the paper's act: max(0, .))."""
    hidden = ACTIVATIONS[activation](x @ p["wi"]["kernel"] + p["wi"]["bias"])  # [B, L, d_ff]
    return hidden @ p["wo"]["kernel"] + p["wo"]["bias"]


def _sublayer(x: np.ndarray, f, norm, norm_style: str) -> np.ndarray:
    """Post-norm LN(x + f(x)) (the paper) or pre-norm x + f(LN(x)); no dropout (deterministic)."""
    if norm_style == "pre":
        return x + f(_layer_norm(x, norm))
    return _layer_norm(x + f(x), norm)


def _sinusoids(length: int, d_model: int) -> np.ndarray:
    """float[length, d_model]: column 2i is sin(pos / 10000^(2i/d)), column 2i+1 is cos of the same angle."""
    table = np.zeros((length, d_model))
    for pos in range(length):
        for col in range(d_model):
            angle = pos / 10000.0 ** ((col - col % 2) / d_model)
            table[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return table


def _embed(tokens: np.ndarray, params, stack: str, cfg: ModelConfig) -> np.ndarray:
    """int[batch, length] -> float[batch, length, d_model]: E[token] * sqrt(d_model) + position."""
    length = tokens.shape[1]
    if cfg.position_encoding == "learned":
        positions = params[stack]["positions"]["position_embedding"][:length]
    elif cfg.position_encoding == "sinusoidal":
        positions = _sinusoids(length, cfg.d_model)
    else:  # the other schemes act in self-attention only
        positions = np.zeros((length, cfg.d_model))
    return params["shared_embedding"]["embedding"][tokens] * math.sqrt(cfg.d_model) + positions[None]


def _encoder_layer(x: np.ndarray, mask: np.ndarray, p, cfg: ModelConfig) -> np.ndarray:
    """float[batch, src_len, d_model], bool[batch, src_len, src_len] -> float[batch, src_len, d_model]."""
    norm_style = cfg.norm_style
    x = _sublayer(x, lambda y: _attention(y, y, mask, p["self_attention"], cfg), p["attention_block"]["norm"],
                  norm_style)
    return _sublayer(x, lambda y: _ffn(y, p["ffn"], cfg.ffn_activation), p["ffn_block"]["norm"], norm_style)


def _decoder_layer(x: np.ndarray, encoded: np.ndarray, self_mask: np.ndarray, cross_mask: np.ndarray, p,
                   cfg: ModelConfig) -> np.ndarray:
    """Masked self-attention, encoder-decoder attention, FFN, each in its residual sub-layer.

    Args:
      x: float[batch, tgt_len, d_model]; encoded: float[batch, src_len, d_model].
      self_mask: bool[batch, tgt_len, tgt_len] (causal); cross_mask: bool[batch, tgt_len, src_len] (padding).
    """
    norm_style = cfg.norm_style
    x = _sublayer(x, lambda y: _attention(y, y, self_mask, p["self_attention"], cfg),
                  p["self_attention_block"]["norm"], norm_style)
    x = _sublayer(x, lambda y: _attention(y, encoded, cross_mask, p["cross_attention"]),
                  p["cross_attention_block"]["norm"], norm_style)
    return _sublayer(x, lambda y: _ffn(y, p["ffn"], cfg.ffn_activation), p["ffn_block"]["norm"], norm_style)


def reference_encode(params, src: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """float64[batch, src_len, d_model] encoder output of int[batch, src_len] sources."""
    p = params["encoder"]
    mask = np.broadcast_to((src != PAD_ID)[:, None, :], (src.shape[0], src.shape[1], src.shape[1]))
    x = _embed(src, params, "encoder", cfg)
    for i in range(cfg.num_encoder_layers):
        x = _encoder_layer(x, mask, p[f"layer_{i}"], cfg)
    return _layer_norm(x, p["final_norm"]) if cfg.norm_style == "pre" else x


def reference_logits(params, src: np.ndarray, tgt: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """float64[batch, tgt_len, vocab] teacher-forced logits; the decoder reads [BOS, tgt[:-1]]."""
    p = params["decoder"]
    encoded = reference_encode(params, src, cfg)
    batch, tgt_len = tgt.shape
    decoder_input = np.concatenate([np.full((batch, 1), BOS_ID), tgt[:, :-1]], axis=1)  # [B, T]
    causal = np.tril(np.ones((tgt_len, tgt_len), bool))  # [T, T], position i sees j <= i
    self_mask = np.broadcast_to(causal[None], (batch, tgt_len, tgt_len))
    cross_mask = np.broadcast_to((src != PAD_ID)[:, None, :], (batch, tgt_len, src.shape[1]))
    x = _embed(decoder_input, params, "decoder", cfg)
    for i in range(cfg.num_decoder_layers):
        x = _decoder_layer(x, encoded, self_mask, cross_mask, p[f"layer_{i}"], cfg)
    if cfg.norm_style == "pre":
        x = _layer_norm(x, p["final_norm"])
    return x @ params["shared_embedding"]["embedding"].T  # [B, T, vocab]


# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", SCHEMES)
@pytest.mark.parametrize("norm_style", ["post", "pre"])
def test_forward_matches_numpy_reference(norm_style, position_encoding):
    cfg = _config(norm_style, position_encoding)
    params = random_params(cfg, seed=7)
    src, tgt = _batch(seed=11)
    assert (src == PAD_ID).any(axis=1).tolist() == [False, True, True]  # the padding mask is exercised
    model = model_lib.Transformer(cfg)

    encoded = model.apply({"params": params}, src, method=model_lib.Transformer.encode)
    assert encoded.shape == (BATCH, SRC_LEN, D_MODEL)
    np.testing.assert_allclose(np.asarray(encoded), reference_encode(_np(params), src, cfg),
                               rtol=RTOL, atol=ATOL, err_msg="encoder output")

    logits = model.apply({"params": params}, src, tgt)
    assert logits.shape == (BATCH, TGT_LEN, VOCAB)
    np.testing.assert_allclose(np.asarray(logits), reference_logits(_np(params), src, tgt, cfg),
                               rtol=RTOL, atol=ATOL, err_msg="logits")


@pytest.mark.parametrize("ffn_activation", [a for a in ACTIVATIONS if a != "relu"])
def test_each_ffn_activation_matches_numpy_reference(ffn_activation):
    """Pre-norm, so the FFN's output reaches the logits without a LayerNorm between: the tanh GELU in place of
    the erf one moved the logits by 3.7e-4, far above the tolerance."""
    cfg = _config("pre", "sinusoidal", ffn_activation)
    params = random_params(cfg, seed=7)
    src, tgt = _batch(seed=11)
    logits = model_lib.Transformer(cfg).apply({"params": params}, src, tgt)
    np.testing.assert_allclose(np.asarray(logits), reference_logits(_np(params), src, tgt, cfg),
                               rtol=RTOL, atol=ATOL, err_msg=ffn_activation)
