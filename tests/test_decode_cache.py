"""Tests for transformer_jax.model.decode_cache: the typed cache's shapes, grow, select and reorder, each
checked on its fields and by what the decoder computes with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_params

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.decode_cache import DecodeCache
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer

VOCAB, BATCH, SRC_LEN, BEAMS = 23, 5, 7, 3
ROWS = BATCH * BEAMS
CONFIG = ModelConfig(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, d_k=5, d_v=7, num_encoder_layers=1,
                     num_decoder_layers=2, max_len=24, deterministic=True)


@pytest.fixture(scope="module")
def tiny():
    cfg = CONFIG
    params = random_params(cfg, 0)
    rng = np.random.default_rng(1)
    inputs = rng.integers(4, VOCAB, size=(BATCH, SRC_LEN))
    inputs[np.arange(SRC_LEN)[None, :] >= (SRC_LEN - np.arange(BATCH))[:, None]] = PAD_ID
    inputs = jnp.asarray(inputs, jnp.int32)
    encoded = Transformer(cfg).apply({"params": params}, inputs, method=Transformer.encode)
    tokens = jnp.asarray(rng.integers(4, VOCAB, size=(8, ROWS)), jnp.int32)  # [steps, rows]
    # Beam selection: every row continues from some row of its own example.
    parents = rng.integers(0, BEAMS, size=(8, ROWS)) + np.repeat(np.arange(BATCH) * BEAMS, BEAMS)[None, :]
    return cfg, params, inputs, encoded, tokens, jnp.asarray(parents, jnp.int32)


def _init(tiny, cache_len: int) -> DecodeCache:
    cfg, params, _, encoded, _, _ = tiny
    return Transformer(cfg).apply({"params": params}, encoded, cache_len, BEAMS,
                                  method=Transformer.init_cache)


@jax.jit
def _step(params, cache, inputs, tokens):
    """float32[rows, vocab] logits after int32[rows] tokens, and the advanced cache."""
    model = Transformer(CONFIG.replace(decode=True))
    logits, cache = model.apply({"params": params}, None, inputs, tokens[:, None], cache,
                                method=Transformer.decode)
    return logits[:, 0], cache


def _run(tiny, cache: DecodeCache, steps: range) -> tuple[list, DecodeCache]:
    """Logits of ``steps`` (each step's tokens, then the beam reorder), and the cache after them."""
    _, params, inputs, _, tokens, parents = tiny
    logits = []
    for t in steps:
        step_logits, cache = _step(params, cache, inputs, tokens[t])
        logits.append(step_logits)
        cache = cache.reorder(parents[t])
    return logits, cache


def test_the_cache_has_its_documented_shapes(tiny):
    cfg, _, _, _, _, _ = tiny
    cache = _init(tiny, 11)
    assert (cache.batch, cache.beams, cache.cache_len) == (BATCH, BEAMS, 11)
    assert len(cache.layers) == cfg.num_decoder_layers
    for layer in cache.layers:
        assert layer.self_key.shape == (BATCH, cfg.num_heads, 11 * BEAMS, cfg.d_k)
        assert layer.self_value.shape == (BATCH, cfg.num_heads, 11 * BEAMS, cfg.d_v)
        assert layer.cross_key.shape == (BATCH, cfg.num_heads, SRC_LEN, cfg.d_k)
        assert layer.cross_value.shape == (BATCH, cfg.num_heads, SRC_LEN, cfg.d_v)
        assert not np.any(np.asarray(layer.self_key)) and not np.any(np.asarray(layer.self_value))
    assert cache.ancestry.shape == (ROWS, 11) and cache.ancestry.dtype == jnp.int32
    assert cache.index.shape == () and int(cache.index) == 0
    with pytest.raises(ValueError, match="cache_len"):
        _init(tiny, 0)


def test_grow_then_decode_equals_decoding_with_the_larger_cache_from_the_start(tiny):
    small_logits, small = _run(tiny, _init(tiny, 3), range(3))
    grown = small.grow(8)
    assert (grown.batch, grown.beams, grown.cache_len, int(grown.index)) == (BATCH, BEAMS, 8, 3)
    for old, new in zip(small.layers, grown.layers, strict=True):
        for old_buffer, new_buffer in ((old.self_key, new.self_key), (old.self_value, new.self_value)):
            np.testing.assert_array_equal(new_buffer[:, :, :3 * BEAMS], old_buffer)  # position-major
            assert not np.any(np.asarray(new_buffer[:, :, 3 * BEAMS:]))
        np.testing.assert_array_equal(new.cross_key, old.cross_key)
        np.testing.assert_array_equal(new.cross_value, old.cross_value)
    np.testing.assert_array_equal(grown.ancestry[:, :3], small.ancestry)
    grown_logits, _ = _run(tiny, grown, range(3, 8))

    large_logits, _ = _run(tiny, _init(tiny, 8), range(8))
    np.testing.assert_allclose(np.stack(small_logits + grown_logits), np.stack(large_logits), atol=1e-6)


def test_select_keeps_exactly_those_examples_rows(tiny):
    _, params, inputs, _, tokens, _ = tiny
    _, cache = _run(tiny, _init(tiny, 8), range(2))
    examples = jnp.asarray([3, 0], jnp.int32)
    rows = np.asarray([9, 10, 11, 0, 1, 2])  # example 3's beams, then example 0's
    kept = cache.select(examples)
    assert (kept.batch, kept.beams, kept.cache_len) == (2, BEAMS, 8)
    for old, new in zip(cache.layers, kept.layers, strict=True):
        for old_array, new_array in zip(old, new, strict=True):
            np.testing.assert_array_equal(new_array, np.asarray(old_array)[[3, 0]])
    np.testing.assert_array_equal(kept.ancestry, np.asarray(cache.ancestry)[rows])
    assert int(kept.index) == int(cache.index) == 2

    full_logits, _ = _step(params, cache, inputs, tokens[2])
    kept_logits, _ = _step(params, kept, inputs[examples], tokens[2][rows])
    np.testing.assert_allclose(kept_logits, np.asarray(full_logits)[rows], atol=1e-6)


def test_reorder_moves_only_the_ancestry_and_a_row_continues_from_its_parent(tiny):
    _, params, inputs, _, tokens, parents = tiny
    _, cache = _run(tiny, _init(tiny, 8), range(2))
    rows = parents[2]
    moved = cache.reorder(rows)
    np.testing.assert_array_equal(moved.ancestry, np.asarray(cache.ancestry)[np.asarray(rows)])
    for old, new in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(moved.layers), strict=True):
        assert new is old
    # Row i of the reordered cache, fed its parent's token, computes what its parent would have.
    logits, _ = _step(params, cache, inputs, tokens[2])
    moved_logits, _ = _step(params, moved, inputs, tokens[2][rows])
    np.testing.assert_allclose(moved_logits, np.asarray(logits)[np.asarray(rows)], atol=1e-6)
