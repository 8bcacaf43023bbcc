"""Tests for transformer_jax.model.attention: reference implementations, hand values and properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from transformer_jax.model import attention

# Distinct odd sizes, so that a transposed axis cannot pass.
BATCH, Q_LEN, KV_LEN, HEADS, D_K, D_V = 3, 5, 7, 11, 13, 9


def _qkv(seed=0, q_len=Q_LEN, kv_len=KV_LEN):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, q_len, HEADS, D_K)).astype(np.float32)
    k = rng.normal(size=(BATCH, kv_len, HEADS, D_K)).astype(np.float32)
    v = rng.normal(size=(BATCH, kv_len, HEADS, D_V)).astype(np.float32)
    return q, k, v


def _reference(q, k, v, mask=None, scale=True):
    """Per-batch, per-head NumPy loop: softmax(q k^T / sqrt(d_k) masked) v, in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, ql, h, dk = q.shape
    out = np.zeros((b, ql, h, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            logits = q[bi, :, hi] @ k[bi, :, hi].T
            if scale:
                logits = logits / np.sqrt(dk)
            allowed = np.ones_like(logits, bool)
            if mask is not None:
                allowed = np.broadcast_to(mask, (b, h) + logits.shape)[bi, hi]
            for qi in range(ql):
                row = logits[qi][allowed[qi]]
                if row.size == 0:
                    continue
                w = np.exp(row - row.max())
                w /= w.sum()
                out[bi, qi, hi] = w @ v[bi, :, hi][allowed[qi]]
    return out


def test_worked_example_softmax_and_mixing():
    # One query, three keys with logits [2, 1, 0] (scale off), values [1, 3, 5].
    q = jnp.ones((1, 1, 1, 1))
    k = jnp.array([2.0, 1.0, 0.0]).reshape(1, 3, 1, 1)
    v = jnp.array([1.0, 3.0, 5.0]).reshape(1, 3, 1, 1)
    out, weights = attention.dot_product_attention(q, k, v, scale_logits=False, return_weights=True)
    np.testing.assert_allclose(weights[0, 0, 0], [0.665241, 0.244728, 0.090031], atol=1e-6)
    np.testing.assert_allclose(out[0, 0, 0, 0], 1.849579, atol=1e-6)


def test_matches_per_head_reference_with_and_without_scale():
    q, k, v = _qkv()
    for scale in (True, False):
        out = attention.dot_product_attention(q, k, v, scale_logits=scale)
        np.testing.assert_allclose(out, _reference(q, k, v, scale=scale), rtol=1e-5, atol=1e-5)


def test_padding_mask_matches_reference_and_witness_passes():
    q, k, v = _qkv(1)
    key_tokens = np.ones((BATCH, KV_LEN), np.int32)
    key_tokens[0, 4:] = 0
    key_tokens[2, 6:] = 0
    mask = attention.padding_mask(None, key_tokens)
    out, weights = attention.dot_product_attention(q, k, v, mask, return_weights=True)
    np.testing.assert_allclose(out, _reference(q, k, v, np.asarray(mask)), rtol=1e-5, atol=1e-5)
    assert attention.attention_witness(weights, mask).ok
    assert np.all(np.asarray(weights)[0, :, :, 4:] == 0.0)


def test_rows_sum_to_one_and_causal_zeros_are_exact():
    q, k, v = _qkv(2, q_len=KV_LEN)
    mask = attention.causal_mask(KV_LEN)
    _, weights = attention.dot_product_attention(q, k, v, mask, return_weights=True)
    weights = np.asarray(weights)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    upper = np.triu(np.ones((KV_LEN, KV_LEN), bool), k=1)
    assert np.all(weights[..., upper] == 0.0)


def test_future_perturbation_leaves_earlier_outputs_bit_identical():
    q, k, v = _qkv(3, q_len=KV_LEN)
    mask = attention.causal_mask(KV_LEN)
    base = np.asarray(attention.dot_product_attention(q, k, v, mask))
    t = 4
    k2, v2 = k.copy(), v.copy()
    k2[:, t:] += 100.0
    v2[:, t:] -= 50.0
    moved = np.asarray(attention.dot_product_attention(q, k2, v2, mask))
    np.testing.assert_array_equal(moved[:, :t], base[:, :t])
    assert not np.allclose(moved[:, t:], base[:, t:])


def test_permutation_equivariance_of_self_attention():
    q, _, _ = _qkv(4, q_len=KV_LEN)
    x = q  # self-attention without positions: q = k = v
    perm = np.array([3, 0, 6, 1, 5, 2, 4])
    out = np.asarray(attention.dot_product_attention(x, x, x))
    out_perm = np.asarray(attention.dot_product_attention(x[:, perm], x[:, perm], x[:, perm]))
    np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-6, atol=1e-6)


def test_finite_difference_gradients():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(1, 3, 2, 5)))
    k = jnp.asarray(rng.normal(size=(1, 7, 2, 5)))
    v = jnp.asarray(rng.normal(size=(1, 7, 2, 3)))
    mask = attention.padding_mask(None, jnp.array([[1, 1, 1, 1, 1, 0, 0]]))
    with jax.enable_x64(True):
        q, k, v = (a.astype(jnp.float64) for a in (q, k, v))
        f = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v, mask))
        check_grads(f, (q, k, v), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_all_masked_row_gives_zeros_and_zero_gradients_without_nan():
    q, k, v = _qkv(6)
    mask = np.ones((BATCH, 1, Q_LEN, KV_LEN), bool)
    mask[1, 0, 2, :] = False  # one query row sees nothing
    mask = jnp.asarray(mask)

    def loss(q, k, v):
        return jnp.sum(attention.dot_product_attention(q, k, v, mask) ** 2)

    out, weights = attention.dot_product_attention(q, k, v, mask, return_weights=True)
    assert np.all(np.asarray(out)[1, 2] == 0.0)
    assert np.all(np.asarray(weights)[1, :, 2] == 0.0)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[1, 2] == 0.0)
    assert attention.attention_witness(weights, mask).ok


def test_dropout_needs_rng_and_is_inverted_dropout_on_the_weights():
    q, k, _ = _qkv(7)
    with pytest.raises(ValueError, match="rng"):
        attention.dot_product_attention(q, k, k, dropout_rate=0.5)
    # One-hot values make the output the (dropped) weight matrix itself: [B, K, H, K] -> out [B, Q, H, K].
    eye = np.broadcast_to(np.eye(KV_LEN, dtype=np.float32)[None, :, None, :], (BATCH, KV_LEN, HEADS, KV_LEN))
    rate = 0.25
    weights = np.asarray(attention.dot_product_attention(q, k, eye))  # [B, Q, H, K]
    drop = jax.jit(lambda seed: attention.dot_product_attention(q, k, eye, dropout_rate=rate,
                                                                rng=jax.random.key(seed)))  # 401 calls
    dropped = np.asarray(drop(0))
    kept = dropped != 0.0
    # Every weight is either dropped (0) or kept and scaled by 1 / (1 - rate), so expectations are unchanged.
    np.testing.assert_allclose(dropped[kept], weights[kept] / (1.0 - rate), rtol=1e-6)
    assert 0.6 < kept.mean() < 0.9  # about 1 - rate of the weights survive
    mean = np.mean([np.asarray(drop(seed)) for seed in range(400)], axis=0)
    np.testing.assert_allclose(mean, weights, atol=0.05)


def test_combine_masks():
    causal = attention.causal_mask(KV_LEN)
    pad = attention.padding_mask(None, jnp.array([[1, 1, 1, 0, 0, 0, 0]]))
    both = attention.combine_masks(causal, None, pad)
    assert both.shape == (1, 1, KV_LEN, KV_LEN)
    assert bool(both[0, 0, 5, 2]) and not bool(both[0, 0, 5, 3]) and not bool(both[0, 0, 1, 2])
    assert attention.combine_masks(None) is None
    with pytest.raises(ValueError, match="rank"):
        attention.combine_masks(causal, jnp.ones((KV_LEN,), bool))


def test_shape_errors_are_clear():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="d_k"):
        attention.dot_product_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="rank 4"):
        attention.dot_product_attention(q, k, v, jnp.ones((Q_LEN, KV_LEN), bool))


# ---- The witness catches planted bugs. ------------------------------------------------------------


def _logits_and_mask():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(BATCH, HEADS, KV_LEN, KV_LEN))
    mask = np.broadcast_to(np.asarray(attention.causal_mask(KV_LEN)), logits.shape)
    return logits, mask


def test_witness_accepts_correct_weights():
    logits, mask = _logits_and_mask()
    weights = attention.masked_softmax(jnp.asarray(logits), jnp.asarray(mask))
    report = attention.attention_witness(weights, mask)
    assert report.ok, str(report)
    attention.check_attention(weights, mask)


def test_witness_catches_unnormalized_softmax():
    logits, mask = _logits_and_mask()
    planted = np.where(mask, np.exp(logits), 0.0)  # exp without dividing by the row sum
    report = attention.attention_witness(planted, mask)
    assert not report.ok and report.bad_row_sum
    with pytest.raises(attention.AttentionWitnessError, match="do not sum to 1"):
        attention.check_attention(planted, mask)


def test_witness_catches_masking_after_softmax_without_renormalizing():
    logits, mask = _logits_and_mask()
    planted = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1)) * mask
    report = attention.attention_witness(planted, mask)
    assert not report.ok and report.bad_row_sum and not report.leaked


def test_witness_catches_leak_into_masked_keys_and_out_of_range():
    logits, mask = _logits_and_mask()
    planted = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))  # ignores the mask
    report = attention.attention_witness(planted, mask)
    assert not report.ok and report.leaked
    assert "masked key" in str(report)
    negative = np.asarray(attention.masked_softmax(jnp.asarray(logits), jnp.asarray(mask))).copy()
    negative[0, 0, 3, 0] -= 0.5
    negative[0, 0, 3, 1] += 0.5
    assert attention.attention_witness(negative, mask).out_of_range == ((0, 0, 3),)


def test_witness_runs_inside_jit():
    logits, mask = _logits_and_mask()

    @jax.jit
    def good(logits):
        weights = attention.masked_softmax(logits, jnp.asarray(mask))
        attention.witness_in_jit(weights, jnp.asarray(mask))
        return weights

    @jax.jit
    def bad(logits):
        weights = jnp.exp(logits)
        attention.witness_in_jit(weights, jnp.asarray(mask))
        return weights

    good(jnp.asarray(logits)).block_until_ready()
    with pytest.raises(Exception, match="witness"):
        bad(jnp.asarray(logits)).block_until_ready()


def test_single_query_fast_path_matches_reference():
    q, k, v = _qkv(9, q_len=1)
    mask = attention.padding_mask(None, jnp.array([[1] * 7, [1] * 3 + [0] * 4, [0] * 7]))
    out, weights = attention.dot_product_attention(q, k, v, mask, return_weights=True)
    np.testing.assert_allclose(out, _reference(q, k, v, np.asarray(mask)), rtol=1e-5, atol=1e-5)
    assert weights.shape == (BATCH, HEADS, 1, KV_LEN) and attention.attention_witness(weights, mask).ok


def test_decode_attention_equals_the_reference_per_row():
    """Beams of one example share its head-major keys; each row's output is its own attention."""
    group = 4
    rng = np.random.default_rng(5)
    q = rng.normal(size=(BATCH * group, 1, HEADS, D_K)).astype(np.float32)
    k = rng.normal(size=(BATCH, HEADS, KV_LEN, D_K)).astype(np.float32)
    v = rng.normal(size=(BATCH, HEADS, KV_LEN, D_V)).astype(np.float32)
    mask = rng.random((BATCH, 1, group, KV_LEN)) < 0.6
    mask[0, 0, 1] = False  # a row with no allowed key: zero output, not NaN
    out, weights = attention.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                              jnp.asarray(mask.transpose(0, 1, 3, 2)))  # keys first
    assert out.shape == (BATCH * group, 1, HEADS, D_V) and weights.shape == (BATCH, HEADS, group, KV_LEN)
    for row in range(BATCH * group):
        b, g = divmod(row, group)
        want = _reference(q[row:row + 1], k[b:b + 1].transpose(0, 2, 1, 3), v[b:b + 1].transpose(0, 2, 1, 3),
                          mask[b:b + 1, :, g:g + 1])
        np.testing.assert_allclose(out[row:row + 1], want, atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(out[1]))
    attention.check_attention(weights, mask)
