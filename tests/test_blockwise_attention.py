"""Tests for transformer_jax.model.blockwise_attention against the dense reference in attention.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import attention, blockwise_attention
from transformer_jax.model.blockwise_attention import blockwise_attention as blockwise

# Distinct odd sizes so that a transposition cannot pass.
BATCH, HEADS, Q_LEN, KV_LEN, D_K, D_V = 3, 5, 37, 53, 7, 11
BLOCK = 8  # several blocks, and a ragged last block for both lengths
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(q_len=Q_LEN, kv_len=KV_LEN, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    query = spread * normal(BATCH, q_len, HEADS, D_K)
    key = normal(BATCH, kv_len, HEADS, D_K)
    value = normal(BATCH, kv_len, HEADS, D_V)
    d_out = normal(BATCH, q_len, HEADS, D_V)  # cotangent, so every output counts
    return query, key, value, d_out


def _value_and_grads(fn, query, key, value, mask, d_out):
    """Output and the vector-Jacobian product d_out^T d(out)/d(q, k, v)."""
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, mask), query, key, value)
    return out, pullback(d_out)


@jax.jit
def _dense_value_and_grads(query, key, value, mask, d_out):
    """The reference, given the mask broadcast to [batch, heads, q_len, kv_len]: one program per lengths."""
    return _value_and_grads(attention.dot_product_attention, query, key, value, mask, d_out)


@functools.partial(jax.jit, static_argnames=("causal", "block_size"))
def _blockwise_value_and_grads(query, key, value, mask, d_out, *, causal, block_size):
    block = functools.partial(blockwise, block_size=block_size, causal=causal)
    return _value_and_grads(block, query, key, value, mask, d_out)


def _compare(dense_mask, block_mask=None, *, causal=False, block_size=BLOCK, q_len=Q_LEN, kv_len=KV_LEN,
             spread=1.0, tol=TOL, blockwise_vjp=_blockwise_value_and_grads):
    """Asserts blockwise == dense for values and gradients; returns (out, grads) of blockwise.

    The masks are arguments, not constants, so cases with the same shapes share a compiled program.
    """
    query, key, value, d_out = _inputs(q_len, kv_len, spread=spread)
    full = (BATCH, HEADS, q_len, kv_len)
    dense_mask = np.broadcast_to(True if dense_mask is None else dense_mask, full)
    want_out, want_grads = _dense_value_and_grads(query, key, value, dense_mask, d_out)
    got_out, got_grads = blockwise_vjp(query, key, value, block_mask, d_out, causal=causal,
                                       block_size=block_size)
    np.testing.assert_allclose(got_out, want_out, **tol)
    for name, got, want in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, err_msg=f"d{name}", **tol)
    return got_out, got_grads


def _causal(q_len=Q_LEN, kv_len=KV_LEN):
    """Dense causal mask for q_len != kv_len: query i sees key j <= i (bool[1, 1, q_len, kv_len])."""
    return np.asarray(attention.causal_mask(max(q_len, kv_len))[:, :, :q_len, :kv_len])


def _random_mask(shape, seed=1, p=0.6):
    return np.random.default_rng(seed).random(shape) < p


def test_no_mask():
    _compare(None)


@pytest.mark.parametrize("q_len,kv_len,block_size", [
    (Q_LEN, KV_LEN, BLOCK),
    (KV_LEN, Q_LEN, 5),  # more queries than keys: the last rows see every key
    (Q_LEN, Q_LEN, 13),  # equal lengths, block_q=13, the last block ragged at 11
    (Q_LEN, KV_LEN, 40),  # block_q=37 != block_k=40 on the diagonal
])
def test_causal(q_len, kv_len, block_size):
    _compare(_causal(q_len, kv_len), causal=True, block_size=block_size, q_len=q_len, kv_len=kv_len)


def test_padding_mask():
    key_ok = _random_mask((BATCH, 1, 1, KV_LEN))
    _compare(key_ok, key_ok)


def test_padding_mask_with_causal():
    key_ok = _random_mask((BATCH, 1, 1, KV_LEN))
    key_ok[:, :, :, 0] = True
    _compare(key_ok & _causal(), key_ok, causal=True)


@pytest.mark.parametrize("shape", [
    (BATCH, 1, Q_LEN, KV_LEN),
    (1, HEADS, Q_LEN, KV_LEN),
    (BATCH, 1, Q_LEN, 1),  # per-query mask, broadcast over keys
])
def test_general_mask(shape):
    mask = _random_mask(shape)
    _compare(mask, mask)


def test_all_masked_rows_give_zero_output_and_zero_gradients():
    mask = _random_mask((BATCH, 1, Q_LEN, KV_LEN))
    dead_rows = [0, 3, 17, 36]  # the first row, rows inside blocks, the ragged last row
    mask[:, :, dead_rows, :] = False
    mask[1] = False  # a whole batch element with nothing to attend to
    out, (d_query, d_key, d_value) = _compare(mask, mask)
    for grad in (d_query, d_key, d_value):
        assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(out[:, dead_rows], 0.0)
    np.testing.assert_array_equal(d_query[:, dead_rows], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(d_key[1], 0.0)
    np.testing.assert_array_equal(d_value[1], 0.0)


def test_all_keys_padded_in_one_batch_element():
    key_ok = _random_mask((BATCH, 1, 1, KV_LEN))
    key_ok[2] = False
    out, grads = _compare(key_ok & _causal(), key_ok, causal=True, block_size=5)
    np.testing.assert_array_equal(out[2], 0.0)
    for grad in grads:
        np.testing.assert_array_equal(grad[2], 0.0)


def test_block_larger_than_sequence():
    _compare(_causal(), causal=True, block_size=1000)


def test_large_logit_spread_is_stable():
    # Logits up to ~100 (exp overflows float32 at 89) need the running max. Gradients scale with the
    # logits too, so the absolute tolerance scales with them (float32 rounding, in both implementations).
    _compare(_causal(), causal=True, spread=30.0, tol=dict(rtol=1e-5, atol=30 * 1e-5))


def test_bfloat16_close_to_dense():
    query, key, value, _ = (x.astype(jnp.bfloat16) for x in _inputs())
    want = jax.jit(attention.dot_product_attention)(query, key, value, _causal())
    got = jax.jit(functools.partial(blockwise, causal=True, block_size=BLOCK))(query, key, value)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_bad_mask_shape_raises():
    query, key, value, _ = _inputs()
    with pytest.raises(ValueError, match="mask must be broadcastable"):
        blockwise(query, key, value, jnp.ones((BATCH, KV_LEN), bool))
    with pytest.raises(ValueError, match="mask must be broadcastable"):
        blockwise(query, key, value, jnp.ones((BATCH, 1, 2, KV_LEN), bool))


def test_planted_bug_without_running_max_correction_is_caught(monkeypatch):
    """Dropping the rescale by exp(m_old - m_new) must make the comparison fail."""

    def no_correction(carry, logits, v_block, precision):
        m_old, l_old, acc = carry
        m_new = jnp.maximum(m_old, jnp.max(logits, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - m_safe[..., None])
        pv = jnp.einsum("bhqk,bhkd->bhqd", p, v_block, precision=precision)
        return m_new, l_old + jnp.sum(p, axis=-1), acc + pv  # BUG: old l and acc not rescaled

    monkeypatch.setattr(blockwise_attention, "_online_update", no_correction)
    planted = jax.jit(lambda *args, **kwargs: _blockwise_value_and_grads.__wrapped__(*args, **kwargs),
                      static_argnames=("causal", "block_size"))  # a new function: traced with the bug
    with pytest.raises(AssertionError):  # the same comparison that test_no_mask passes, traced afresh
        _compare(None, blockwise_vjp=planted)


def _grad_temp_bytes(fn, length):
    """XLA's compiled temp buffer size of d/d(q, k, v) sum(fn(q, k, v)) for self-attention."""
    spec = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, length)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def test_backward_memory_is_linear_in_length():
    dense = lambda q, k, v, n: attention.dot_product_attention(q, k, v, attention.causal_mask(n))
    block = lambda q, k, v, n: blockwise(q, k, v, causal=True, block_size=128)
    dense_growth = _grad_temp_bytes(dense, 2048) / _grad_temp_bytes(dense, 1024)
    block_growth = _grad_temp_bytes(block, 2048) / _grad_temp_bytes(block, 1024)
    assert dense_growth > 3.5, dense_growth  # the [Q, K] matrices: quadratic
    assert block_growth < 2.2, block_growth  # only O(n) buffers plus a fixed [block, block] tile
