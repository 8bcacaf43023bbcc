"""flops.py: the analytic matmul count, by hand on a tiny model and against XLA's cost analysis."""

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import flops
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Transformer, init_params

# Odd, distinct sizes, and d_k != d_v, so that a swapped dimension changes the count.
HAND = ModelConfig(vocab_size=11, d_model=6, d_ff=10, num_heads=3, d_k=5, d_v=7, num_encoder_layers=1,
                   num_decoder_layers=1)
BATCH, SRC, TGT = 2, 3, 5


def _mm(m, k, n):
    """FLOPs of float[m, k] @ float[k, n]: one multiply and one add per term."""
    return 2 * m * k * n


def test_forward_flops_hand_counted():
    # One example; h = 3 heads, h * d_k = 15, h * d_v = 21. Encoder layer over S = 3 positions:
    enc = (2 * _mm(3, 6, 15)  # Q, K: 540 each
           + _mm(3, 6, 21)  # V: 756
           + 3 * _mm(3, 5, 3)  # Q K^T per head: 270
           + 3 * _mm(3, 3, 7)  # weights @ V per head: 378
           + _mm(3, 21, 6)  # W^O: 756
           + _mm(3, 6, 10) + _mm(3, 10, 6))  # FFN: 720
    assert enc == 3960
    # Decoder layer over T = 5 positions: masked self-attention (computed in full), cross-attention over
    # the 3 encoder positions, FFN.
    self_attn = 2 * _mm(5, 6, 15) + _mm(5, 6, 21) + 3 * _mm(5, 5, 5) + 3 * _mm(5, 5, 7) + _mm(5, 21, 6)
    cross = (_mm(5, 6, 15) + _mm(3, 6, 15) + _mm(3, 6, 21)  # Q from the decoder; K, V from the encoder
             + 3 * _mm(5, 5, 3) + 3 * _mm(5, 3, 7) + _mm(5, 21, 6))
    ffn = _mm(5, 6, 10) + _mm(5, 10, 6)
    logits = _mm(5, 6, 11)
    assert (self_attn, cross, ffn, logits) == (6120, 4536, 1200, 660)
    per_example = enc + self_attn + cross + ffn + logits  # 16476
    assert flops.forward_flops(HAND, BATCH, SRC, TGT) == BATCH * per_example == 32952
    assert flops.train_step_flops(HAND, BATCH, SRC, TGT) == 3 * 32952


def test_decode_flops_hand_counted():
    # Encoder once (with every decoder layer's cross-attention K, V), then 2 steps of 1 position per
    # row (batch 2 x beam 3 = 6 rows), each attending to the full cache of 4 positions.
    encoder = BATCH * (3960 + _mm(3, 6, 15) + _mm(3, 6, 21))
    step_row = (2 * _mm(1, 6, 15) + _mm(1, 6, 21) + 3 * _mm(1, 5, 4) + 3 * _mm(1, 4, 7) + _mm(1, 21, 6)
                + _mm(1, 6, 15) + 3 * _mm(1, 5, 3) + 3 * _mm(1, 3, 7) + _mm(1, 21, 6)
                + _mm(1, 6, 10) + _mm(1, 10, 6) + _mm(1, 6, 11))
    expected = encoder + 2 * 6 * step_row
    assert flops.decode_flops(HAND, BATCH, SRC, 2, beam_size=3, cache_len=4) == expected


# Large enough for the matmuls to dominate the elementwise work XLA also counts (layer norms, softmax,
# the loss), small enough to compile in seconds.
XLA = ModelConfig(vocab_size=257, d_model=96, d_ff=384, num_heads=3, d_k=40, d_v=24, num_encoder_layers=2,
                  num_decoder_layers=1, deterministic=True)


def _xla_flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def _param_shapes():
    """The parameters' shapes and dtypes: lowering needs no values, so nothing is initialized."""
    return jax.eval_shape(lambda key: init_params(XLA, rng=key), jax.random.key(0))


def _random_batch(seed: int, batch: int, src_len: int, tgt_len: int):
    """int32[batch, src_len] inputs and int32[batch, tgt_len] targets of non-special ids."""
    rng = np.random.default_rng(seed)
    inputs = jnp.asarray(rng.integers(4, XLA.vocab_size, (batch, src_len)), jnp.int32)
    targets = jnp.asarray(rng.integers(4, XLA.vocab_size, (batch, tgt_len)), jnp.int32)
    return inputs, targets


def test_forward_flops_match_xla():
    batch, src_len, tgt_len = 3, 13, 11
    params = _param_shapes()
    inputs, targets = _random_batch(0, batch, src_len, tgt_len)
    model = Transformer(XLA)
    xla = _xla_flops(lambda p, x, y: model.apply({"params": p}, x, y), params, inputs, targets)
    analytic = flops.forward_flops(XLA, batch, src_len, tgt_len)
    # XLA also counts the elementwise work, so it may only exceed the matmul count, and by little.
    assert 1.0 <= xla / analytic < 1.03, (xla, analytic)  # measured 1.016


def test_train_step_flops_match_xla():
    batch, src_len, tgt_len = 3, 13, 11
    params = _param_shapes()
    inputs, targets = _random_batch(1, batch, src_len, tgt_len)
    model = Transformer(XLA)

    def loss(p):
        logits = model.apply({"params": p}, inputs, targets)  # [B, T, V]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    xla = _xla_flops(jax.grad(loss), params)
    analytic = flops.train_step_flops(XLA, batch, src_len, tgt_len)
    assert 1.0 <= xla / analytic < 1.03, (xla, analytic)  # measured 1.014
