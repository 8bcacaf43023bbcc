"""Tests for transformer_jax.model.positions: each scheme's own math by hand, cached decoding equal to the
full forward pass for every scheme (logits at every step and beam scores with several beams), and lengths
past ``max_len`` for the schemes without a table. The whole forward pass of every scheme against a float64
NumPy reference is in test_reference_forward.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_decode import _scores, _sources
from tiny import random_params

from transformer_jax.evaluation import decode, kv_cache
from transformer_jax.model import positions
from transformer_jax.model.config import POSITION_ENCODINGS, ModelConfig, param_count
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer, init_params, shift_right
from transformer_jax.training import train_state

VOCAB, BATCH, SRC_LEN, BEAMS, STEPS = 23, 5, 7, 3, 7


def _config(scheme: str) -> ModelConfig:
    """Odd sizes, an even d_k for rotary, 3 heads (ALiBi's rule for a head count that is no power of two),
    relative distances clipped at 2 (so the clip acts within the 7 decoding steps)."""
    return ModelConfig(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, d_k=4, d_v=7, num_encoder_layers=1,
                       num_decoder_layers=1, max_len=24, position_encoding=scheme, max_relative_position=2,
                       deterministic=True)


@pytest.fixture(scope="module", params=POSITION_ENCODINGS)
def model(request):
    cfg = _config(request.param)
    return cfg, random_params(cfg, 3)


def test_alibi_slopes_by_hand():
    np.testing.assert_allclose(positions.alibi_slopes(8), [2.0 ** -k for k in range(1, 9)], rtol=1e-12)
    np.testing.assert_allclose(positions.alibi_slopes(4), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8],
                               rtol=1e-12)
    # 6 heads: the 4-head slopes, then slopes 1 and 3 of the 8-head list (Press et al.'s reference code).
    np.testing.assert_allclose(positions.alibi_slopes(6),
                               [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3], rtol=1e-12)


def test_relative_buckets_clip_key_minus_query():
    buckets = positions.relative_buckets(jnp.arange(4), jnp.arange(6), 2)
    expected = [[2, 3, 4, 4, 4, 4], [1, 2, 3, 4, 4, 4], [0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 3, 4]]
    np.testing.assert_array_equal(buckets, expected)


def test_rotary_logits_depend_only_on_the_offset():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 10)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 10)), jnp.float32)
    at = lambda x, position: positions.rotate(x, jnp.array([position]))
    logit = lambda m, n: float(jnp.sum(at(q, m) * at(k, n)))
    assert logit(7, 3) == pytest.approx(logit(104, 100), rel=1e-4)
    assert logit(7, 3) != pytest.approx(logit(7, 4), rel=1e-3)
    # a rotation keeps the norm, and position 0 is the identity
    np.testing.assert_allclose(positions.rotate(q, jnp.array([0])), q, rtol=1e-7)
    np.testing.assert_allclose(jnp.linalg.norm(positions.rotate(q, jnp.array([57]))), jnp.linalg.norm(q),
                               rtol=1e-5)


def test_param_count_counts_every_scheme(model):
    cfg, params = model
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(cfg)


def test_cached_steps_give_the_full_forward_logits_on_every_beam_row(model):
    """Three beam rows per example, each its own sequence: a step's position must be ``index`` (not the
    slot ``index * beams + j``), and the scheme's terms must act at the cached step as in the full pass."""
    cfg, params = model
    inputs = jnp.repeat(_sources(2), BEAMS, axis=0)[:: BEAMS]  # [B, S]
    targets = jnp.asarray(np.random.default_rng(4).integers(4, VOCAB, size=(BATCH * BEAMS, STEPS)), jnp.int32)
    full = Transformer(cfg).apply({"params": params}, jnp.repeat(inputs, BEAMS, axis=0), targets)
    encoded = kv_cache.encode(params, cfg, inputs)
    cache = kv_cache.init_cache(cfg, params, encoded, STEPS + 2, beams=BEAMS)
    step = jax.jit(lambda c, tok: kv_cache.decode_step(params, cfg, c, inputs, tok))
    decoder_inputs = shift_right(targets)
    cached = []
    for t in range(STEPS):
        logits, cache = step(cache, decoder_inputs[:, t])
        cached.append(logits)
    np.testing.assert_allclose(np.stack(cached, axis=1), full, atol=2e-5, rtol=2e-5)


def test_beam_search_with_and_without_the_cache_scores_the_full_forward(model):
    cfg, params = model
    inputs = _sources(5)
    extra = 4
    cached = decode.beam_search(params, cfg, inputs, beam_size=BEAMS, max_extra_len=extra,
                                return_all_beams=True)
    uncached = decode.beam_search(params, cfg, inputs, beam_size=BEAMS, max_extra_len=extra, use_cache=False,
                                  return_all_beams=True)
    np.testing.assert_array_equal(cached[0], uncached[0])
    np.testing.assert_allclose(cached[1], uncached[1], atol=1e-5)
    seqs = cached[0].reshape(BATCH * BEAMS, -1)
    expected = _scores(params, cfg, jnp.repeat(inputs, BEAMS, axis=0), seqs, 0.6).reshape(BATCH, BEAMS)
    np.testing.assert_allclose(cached[1], expected, atol=1e-5)


@pytest.mark.parametrize("scheme", [s for s in POSITION_ENCODINGS if s != "learned"])
def test_schemes_without_a_table_take_any_length(scheme):
    cfg = _config(scheme).replace(max_len=4)
    params = random_params(cfg, 0)  # drawn by NumPy: no initializer to compile
    inputs = _sources(1)  # 7 > max_len positions
    logits = Transformer(cfg).apply({"params": params}, inputs, inputs)
    assert logits.shape == (BATCH, SRC_LEN, VOCAB) and np.all(np.isfinite(logits))
    tokens = decode.greedy_search(params, cfg, inputs, max_extra_len=3)
    assert tokens.shape == (BATCH, SRC_LEN + 3)


@pytest.mark.parametrize("max_len", [1, 7])
def test_a_learned_table_shorter_than_eight_rows_initializes(max_len):
    """Both initializations (``init_params``, the train state's) trace sequences no longer than any table."""
    cfg = _config("learned").replace(max_len=max_len)

    def table_shapes(tree) -> list[tuple[int, ...]]:
        return [leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if "position_embedding" in jax.tree_util.keystr(path)]

    params = jax.eval_shape(lambda key: init_params(cfg, rng=key), jax.random.key(0))
    state = jax.eval_shape(train_state._init_state_fn(cfg, optax.adam(1e-3)), jax.random.key(0))
    assert table_shapes(params) == table_shapes(state.params) == [(max_len, cfg.d_model)] * 2  # dec, enc


def test_the_learned_table_refuses_a_longer_input_in_one_line():
    cfg = _config("learned").replace(max_len=6)
    # compiled whole, with the "rbg" PRNG, whose program compiles much faster than threefry's
    params = jax.jit(init_params, static_argnums=0, static_argnames=("src_len", "tgt_len"))(
        cfg, rng=jax.random.key(0, impl="rbg"), src_len=4, tgt_len=4)
    inputs = _sources(1)
    assert int(jnp.max(jnp.sum(inputs != PAD_ID, axis=1))) == 7
    with pytest.raises(ValueError, match=r"7 positions is longer than the learned position table "
                                         r"\(model.max_len=6\)"):
        Transformer(cfg).apply({"params": params}, inputs, inputs)
    with pytest.raises(ValueError, match=r"output length 8 must be in \[1, the learned position table"):
        decode.greedy_search(params, cfg, inputs[:, :5], max_extra_len=3)


@pytest.mark.parametrize("attention_impl", ["blockwise", "fused"])
def test_rotary_through_the_blockwise_and_fused_kernels_equals_dense(attention_impl):
    cfg = _config("rotary").replace(d_v=4)  # the fused kernel has one head size
    params = random_params(cfg, 5)
    inputs = _sources(3)
    dense = Transformer(cfg).apply({"params": params}, inputs, inputs)
    other_cfg = cfg.replace(attention_impl=attention_impl, attention_block_size=3)
    other = Transformer(other_cfg).apply({"params": params}, inputs, inputs)
    np.testing.assert_allclose(other, dense, atol=1e-5, rtol=1e-5)
    cached = decode.beam_search(params, other_cfg, inputs, beam_size=BEAMS, max_extra_len=3)
    reference = decode.beam_search(params, cfg, inputs, beam_size=BEAMS, max_extra_len=3)
    np.testing.assert_array_equal(cached[0], reference[0])
    np.testing.assert_allclose(cached[1], reference[1], atol=1e-5)
