"""transformer_jax/inspect/scaling.py: the NumPy reference softmax and the 1/sqrt(d_k) experiment."""

import math
import types

import numpy as np
import pytest
from tiny import random_params

from transformer_jax.inspect import dev, forward, heads, scaling
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.positions import alibi_slopes


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


SCHEMES = ("sinusoidal", "learned", "rotary", "alibi", "relative", "none")


def _tiny_dev_pass(scheme: str, **overrides):
    """``dev.analyse_dev`` of a tiny random model of ``scheme`` on two padded batches of odd lengths."""
    cfg = ModelConfig(vocab_size=13, d_model=12, num_heads=3, d_ff=7, num_encoder_layers=2,
                      num_decoder_layers=1, max_len=16, position_encoding=scheme, max_relative_position=2,
                      deterministic=True, **overrides)
    rng = np.random.default_rng(3)
    inputs = rng.integers(4, 13, size=(2, 7)).astype(np.int32)
    targets = rng.integers(4, 13, size=(2, 5)).astype(np.int32)
    inputs[1, 5:], targets[1, 3:] = 0, 0  # padding
    batch = types.SimpleNamespace(inputs=inputs, targets=targets, num_real=2)
    restored = types.SimpleNamespace(model_config=cfg, params=random_params(cfg, seed=4))
    return cfg, restored, dev.analyse_dev(restored, [batch])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_recomputed_maps_are_the_models_own_under_every_position_scheme(scheme):
    """Rotary q and k are sown rotated; ALiBi's bias and the relative key term are taken from the model's
    own SelfAttentionPositions: every recomputed map equals the sown one to float32 rounding."""
    cfg, _, analysis = _tiny_dev_pass(scheme)
    rows = scaling.scaling_model_rows(analysis.scaling, analysis.stats, cfg.d_k)
    assert [(r["kind"], r["layer"]) for r in rows] == [
        ("encoder_self", 0), ("encoder_self", 1), ("decoder_self", 0), ("cross", 0)]
    assert max(r["sown_vs_recomputed"] for r in rows) < 1e-5, rows


@pytest.mark.parametrize("scheme", ["alibi", "relative"])
def test_maps_recomputed_without_the_schemes_logit_term_are_refused(scheme, monkeypatch):
    """Planted: the recomputation leaves the scheme's logit term out; the check stops the experiment."""
    monkeypatch.setattr(scaling, "logit_bias", lambda *args: None)
    cfg, _, analysis = _tiny_dev_pass(scheme)
    with pytest.raises(scaling.RecomputationError, match="in encoder_self layer 0 .*does not apply"):
        scaling.scaling_model_rows(analysis.scaling, analysis.stats, cfg.d_k)


def test_the_position_terms_with_and_without_the_factor():
    """ALiBi's bias is not a q.k product: the same with and without 1/sqrt(d_k), -m_h |i - j| by hand.
    The relative key term is q_i a^K_(j-i): without the factor it is sqrt(d_k) times larger."""
    cfg, restored, _ = _tiny_dev_pass("alibi")
    queries, keys = np.ones((2, 7, 3, 4), np.float32), np.ones((2, 7, 3, 4), np.float32)
    record = forward.AttentionRecord(np.zeros((2, 3, 7, 7)), queries, keys)
    scaled, unscaled = scaling.logit_bias(restored.params, cfg, "encoder_self", 1, record)
    np.testing.assert_array_equal(scaled, unscaled)
    np.testing.assert_allclose(scaled[0, :, 2, 5], -3 * alibi_slopes(3), rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(3), [2**-4, 2**-8, 2**-2])  # 3 heads: the paper's rule
    assert scaling.logit_bias(restored.params, cfg, "cross", 0, record) is None

    cfg, restored, _ = _tiny_dev_pass("relative")
    scaled, unscaled = scaling.logit_bias(restored.params, cfg, "decoder_self", 0, record)
    table = restored.params["decoder"]["layer_0"]["self_attention"]["positions"]["relative_key"]
    # query 1, key 6: distance +5 clipped to +2, row 2 + 2; every query entry is 1
    np.testing.assert_allclose(scaled[1, 2, 1, 6], table[4].sum() / 2.0, rtol=1e-5)
    np.testing.assert_allclose(unscaled, 2.0 * scaled, rtol=1e-12)
