"""transformer_jax/inspect/scaling.py: the NumPy reference softmax and the 1/sqrt(d_k) experiment."""

import math

import numpy as np
import pytest

from transformer_jax.inspect import forward, heads, scaling


def test_reference_weights_by_hand_and_masked_entries_are_exactly_zero():
    # q.k = [2, 1, 0] * sqrt(d_k) with d_k = 4 (unit q; keys scaled), so the scaled logits are [2, 1, 0].
    q = np.array([1.0, 0.0, 0.0, 0.0]).reshape(1, 1, 1, 4)  # [B, Q, H, d_k]
    k = (2.0 * np.array([[2.0, 0, 0, 0], [1.0, 0, 0, 0], [0.0, 0, 0, 0]])).reshape(1, 3, 1, 4)
    w = scaling.attention_weights_np(q, k)
    np.testing.assert_allclose(w[0, 0, 0], [0.665241, 0.244728, 0.090031], atol=1e-6)
    unscaled = scaling.attention_weights_np(q, k, scale_logits=False)  # logits [4, 2, 0]
    np.testing.assert_allclose(unscaled[0, 0, 0], np.exp([4, 2, 0]) / np.exp([4, 2, 0]).sum(), rtol=1e-12)
    masked = scaling.attention_weights_np(q, k, np.array([True, False, True]))
    assert masked[0, 0, 0, 1] == 0.0
    np.testing.assert_allclose(masked[0, 0, 0], [1 / (1 + math.exp(-2)), 0.0, 1 / (1 + math.exp(2))],
                               rtol=1e-12)
    assert np.all(scaling.attention_weights_np(q, k, np.zeros(3, bool)) == 0.0)  # no key: all zero


def test_add_scaling_reproduces_recorded_weights_and_counts_real_rows():
    rng = np.random.default_rng(5)
    queries = rng.normal(size=(2, 3, 5, 7))  # [B, Q, H, d_k]
    keys = rng.normal(size=(2, 3, 5, 7))
    tokens = np.array([[4, 5, 6], [4, 5, 0]])
    mask = forward.attention_mask("encoder_self", tokens, tokens)
    weights = scaling.attention_weights_np(queries, keys, mask)
    sums = scaling.new_sums()
    scaling.add_scaling(sums, forward.AttentionRecord(weights, queries, keys), mask)
    assert sums["rows"] == (3 + 2) * 5 and sums["pairs"] == (9 + 4) * 5
    assert sums["max_abs_diff"] < 1e-12
    assert sums["unscaled"] < sums["scaled"]  # d_k = 7: unscaled logits are sharper
    wrong = forward.AttentionRecord(scaling.attention_weights_np(queries, keys, mask, scale_logits=False),
                                    queries, keys)
    planted = scaling.new_sums()
    scaling.add_scaling(planted, wrong, mask)
    assert planted["max_abs_diff"] > 1e-2  # the check notices weights computed without the factor


def test_random_scaling_experiment():
    rows = scaling.scaling_random((4, 64, 512), num_keys=33, num_queries=65)
    unscaled = [r["entropy_unscaled"] for r in rows]
    scaled = [r["entropy_scaled"] for r in rows]
    assert unscaled[0] > unscaled[1] > unscaled[2] and unscaled[2] < 0.5  # saturates as d_k grows
    assert max(scaled) - min(scaled) < 0.3 and min(scaled) > 0.7 * math.log(33)  # stays put
    np.testing.assert_allclose([r["logit_std_unscaled"] for r in rows], np.sqrt([4, 64, 512]), rtol=0.2)
    assert all(r["uniform_entropy"] == math.log(33) for r in rows)


def _model_rows(weights_of, dtype="float32"):
    """``scaling_model_rows`` on one encoder layer whose recorded weights are ``weights_of(q, k, mask)``."""
    rng = np.random.default_rng(7)
    queries, keys = rng.normal(size=(2, 3, 5, 7)), rng.normal(size=(2, 3, 5, 7))  # [B, L, H, d_k]
    tokens = np.array([[4, 5, 6], [4, 5, 0]])
    mask = forward.attention_mask("encoder_self", tokens, tokens)
    record = forward.AttentionRecord(weights_of(queries, keys, mask), queries, keys)
    sums, stats = scaling.new_sums(), heads.HeadStatistics("encoder_self", 5)
    scaling.add_scaling(sums, record, mask)
    stats.add(record.weights, mask)
    key = ("encoder_self", 0)
    return scaling.scaling_model_rows({key: sums}, {key: stats}, 7, dtype=dtype)


def test_the_model_rows_stop_when_the_recomputation_misses_the_sown_weights():
    (row,) = _model_rows(scaling.attention_weights_np)
    assert row["sown_vs_recomputed"] < 1e-12
    # Weights with a term the recomputation lacks (here: a bias on the logits, as ALiBi adds).
    biased = lambda q, k, mask: scaling.attention_weights_np(q + 0.3, k, mask)  # noqa: E731
    with pytest.raises(scaling.RecomputationError, match=r"in encoder_self layer 0 that differs from the "
                       r"model's own weights by 0\.\d+ \(tolerance 0\.001\).*does not apply") as caught:
        _model_rows(biased)
    assert "\n" not in str(caught.value)
    # bfloat16 logits round: a difference of 1e-2 passes there, not in float32.
    nudged = lambda q, k, mask: np.clip(scaling.attention_weights_np(q, k, mask) + 0.01 * mask, 0, 1)  # noqa: E731
    assert _model_rows(nudged, dtype="bfloat16")[0]["sown_vs_recomputed"] == pytest.approx(0.01)
    with pytest.raises(scaling.RecomputationError):
        _model_rows(nudged)
