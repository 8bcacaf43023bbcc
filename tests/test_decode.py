"""Tests for transformer_jax.evaluation.decode: the cache, greedy and beam search, EOS, lengths, penalty."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.evaluation import decode, kv_cache
from transformer_jax.evaluation.decode import NEG_INF
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.model.transformer import Transformer

VOCAB, BATCH, SRC_LEN = 23, 5, 7
EXTRA = 3  # max_extra_len of every search on the tiny model (one output buffer, fewer compilations)
SMALL_VOCAB, ENUM_LEN = 6, 3  # a model whose outputs can be enumerated: 85 sequences of <= 3 tokens
MANY = 13 * BATCH  # sources of the compaction and grown-cache tests, compacted to 16 rows (_batch_sizes)


def _sequence_lengths(tokens) -> np.ndarray:
    """int[batch]: output tokens up to and including EOS (all non-PAD without one) in decode's convention."""
    return np.sum(np.asarray(tokens) != PAD_ID, axis=-1)


def _tiny(**overrides) -> ModelConfig:
    """One layer each: the searches do not depend on the depth (test_decode_cache and test_model run the
    cache through two decoder layers)."""
    fields = dict(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, d_k=5, d_v=7,
                  num_encoder_layers=1, num_decoder_layers=1, max_len=24)
    fields.update(overrides)
    return ModelConfig(**fields)


def _sources(seed, vocab=VOCAB) -> jax.Array:
    """int32[BATCH, SRC_LEN] with non-PAD lengths 7, 6, 5, 4, 3 (distinct per-example limits)."""
    tokens = np.random.default_rng(seed).integers(4, vocab, size=(BATCH, SRC_LEN))
    tokens[np.arange(SRC_LEN)[None, :] >= (SRC_LEN - np.arange(BATCH))[:, None]] = PAD_ID
    return jnp.asarray(tokens, jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg, inputs, targets) -> jax.Array:
    """float32[n, T, vocab]: the full teacher-forced forward pass without dropout, compiled."""
    return Transformer(cfg.replace(deterministic=True)).apply({"params": params}, inputs, targets)


def _sequence_logprobs(params, cfg, inputs, tokens) -> np.ndarray:
    """float64[n]: log P(tokens | inputs) by the full teacher-forced forward pass, PAD positions skipped."""
    logprobs = np.asarray(jax.nn.log_softmax(_logits(params, cfg, inputs, tokens), axis=-1), np.float64)
    picked = np.take_along_axis(logprobs, np.asarray(tokens)[..., None], axis=-1)[..., 0]
    return np.sum(np.where(np.asarray(tokens) != PAD_ID, picked, 0.0), axis=-1)


def _scores(params, cfg, inputs, tokens, alpha) -> np.ndarray:
    """float64[n] beam score log P(Y) / lp(|Y|) of output-convention tokens int32[n, T]."""
    lengths = np.asarray(_sequence_lengths(tokens))
    return _sequence_logprobs(params, cfg, inputs, tokens) / ((5.0 + lengths) / 6.0) ** alpha


def _assert_well_formed(tokens, limits):
    """Output convention: no PAD before the end; after the first EOS only PAD; at most `limits` tokens."""
    tokens = np.asarray(tokens)
    for row, limit in zip(tokens, np.asarray(limits), strict=True):
        length = int(np.sum(row != PAD_ID))
        assert length <= limit, (row, limit)
        assert np.all(row[:length] != PAD_ID) and np.all(row[length:] == PAD_ID), row
        eos = np.flatnonzero(row == EOS_ID)
        assert eos.size == 0 or (eos.size == 1 and eos[0] == length - 1), row


def _init(cfg, seed):
    """The model's own init (its outputs end early often enough, and depend on every sub-layer), with the
    "rbg" PRNG, whose program compiles much faster than threefry's."""
    return jax.jit(model_lib.init_params, static_argnums=0)(cfg, rng=jax.random.key(seed, impl="rbg"))


@pytest.fixture(scope="module")
def tiny():
    cfg = _tiny()
    return cfg, _init(cfg, 0)


@pytest.fixture(scope="module")
def small():
    """Vocabulary 6 (PAD, EOS, UNK, BOS, 4, 5) and every output sequence of <= 3 tokens with its
    log probability, float64[BATCH, 85], by the full forward pass."""
    cfg = _tiny(vocab_size=SMALL_VOCAB)
    params = _init(cfg, 2)
    inputs = _sources(1, SMALL_VOCAB)
    words = range(2, SMALL_VOCAB)  # every token but PAD (never generated) and EOS
    candidates = [[EOS_ID, PAD_ID, PAD_ID]] + [[a, EOS_ID, PAD_ID] for a in words]
    candidates += [[a, b, c] for a, b in itertools.product(words, words) for c in range(1, SMALL_VOCAB)]
    candidates = np.asarray(candidates, np.int32)  # [85, 3]
    n = len(candidates)
    logprobs = _sequence_logprobs(params, cfg, jnp.repeat(inputs, n, axis=0),
                                  jnp.asarray(np.tile(candidates, (BATCH, 1))))
    return cfg, params, inputs, candidates, logprobs.reshape(BATCH, n)


def test_length_penalty_by_hand_and_its_direction():
    np.testing.assert_allclose(decode.length_penalty(5, 0.6), (10 / 6) ** 0.6, rtol=1e-6)
    np.testing.assert_allclose(decode.length_penalty(5, 0.6), 1.35866, atol=1e-5)
    np.testing.assert_array_equal(decode.length_penalty(jnp.arange(1, 9), 0.0), np.ones(8))
    assert np.all(np.diff(np.asarray(decode.length_penalty(jnp.arange(1, 30), 0.6))) > 0)
    # A short and a long hypothesis, log P = -3 with 2 tokens vs -5 with 9 tokens.
    prefers_long = lambda alpha: -5 / decode.length_penalty(9, alpha) > -3 / decode.length_penalty(2, alpha)
    assert not prefers_long(0.0) and not prefers_long(0.6) and prefers_long(1.0) and prefers_long(2.0)


def test_cached_steps_match_the_full_causal_forward(tiny):
    cfg, params = tiny
    inputs = _sources(2)
    targets = jnp.asarray(np.random.default_rng(3).integers(4, VOCAB, size=(BATCH, 9)), jnp.int32)
    full = _logits(params, cfg, inputs, targets)
    encoded = jax.jit(kv_cache.encode, static_argnums=1)(params, cfg, inputs)
    cache = jax.jit(kv_cache.init_cache, static_argnums=(0, 3))(cfg, params, encoded, 11)  # > 9 steps
    step = jax.jit(lambda c, tok: kv_cache.decode_step(params, cfg, c, inputs, tok))
    decoder_inputs = model_lib.shift_right(targets)
    steps = []
    for t in range(targets.shape[1]):
        logits, cache = step(cache, decoder_inputs[:, t])
        steps.append(logits)
    np.testing.assert_allclose(np.stack(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_with_cache_equals_greedy_without(tiny):
    cfg, params = tiny
    inputs = _sources(4)
    cached = decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA)
    uncached = decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA, use_cache=False)
    assert cached.shape == (BATCH, SRC_LEN + EXTRA) and cached.dtype == jnp.int32
    np.testing.assert_array_equal(cached, uncached)
    _assert_well_formed(cached, np.sum(np.asarray(inputs) != PAD_ID, axis=1) + EXTRA)


def test_beam_search_with_cache_equals_beam_search_without(tiny):
    cfg, params = tiny
    inputs = _sources(5)
    cached = decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA, return_all_beams=True)
    uncached = decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA, use_cache=False,
                                  return_all_beams=True)
    np.testing.assert_array_equal(cached[0], uncached[0])
    np.testing.assert_allclose(cached[1], uncached[1], atol=1e-5)
    assert cached[0].shape == (BATCH, 4, SRC_LEN + EXTRA) and cached[1].shape == (BATCH, 4)
    assert np.all(np.diff(np.asarray(cached[1]), axis=1) <= 0)  # best first
    # The reported scores are the full forward pass's log P(Y) / lp(|Y|) of every returned beam.
    seqs = cached[0].reshape(BATCH * 4, -1)
    expected = _scores(params, cfg, jnp.repeat(inputs, 4, axis=0), seqs, 0.6).reshape(BATCH, 4)
    np.testing.assert_allclose(cached[1], expected, atol=1e-5)


def test_a_cache_grown_midway_gives_the_one_phase_outputs(tiny):
    """The first phase's cache (``first`` positions, then grown to max_len) changes no token or score:
    greedy exactly, beam search the same hypotheses with scores to float tolerance. The MANY sources all
    have SRC_LEN tokens and EOS is banned, so every row runs to the same limit and none leaves the loop
    early: the compaction test's programs, with the growth alone at work."""
    cfg, params = tiny
    first = 4  # as in the compaction test below: grown midway through the outputs
    inputs = jnp.asarray(np.random.default_rng(6).integers(4, VOCAB, size=(MANY, SRC_LEN)), jnp.int32)
    search = dict(max_extra_len=EXTRA, min_len=20)
    one_phase = decode.greedy_search(params, cfg, inputs, first_cache_len=SRC_LEN + EXTRA, compact=False,
                                     **search)
    two_phase, steps = decode.greedy_search(params, cfg, inputs, first_cache_len=first, return_num_steps=True,
                                            **search)
    assert int(steps) > first  # the second phase ran
    np.testing.assert_array_equal(_sequence_lengths(two_phase), SRC_LEN + EXTRA)  # every row to the end
    np.testing.assert_array_equal(two_phase, one_phase)
    uncached = [decode.greedy_search(params, cfg, inputs[i:i + BATCH], use_cache=False, **search)
                for i in range(0, MANY, BATCH)]  # a row's outputs do not depend on the others
    np.testing.assert_array_equal(two_phase, np.concatenate(uncached))
    beams_one = decode.beam_search(params, cfg, inputs, return_all_beams=True, compact=False,
                                   first_cache_len=SRC_LEN + EXTRA, **search)
    beams_two = decode.beam_search(params, cfg, inputs, return_all_beams=True, first_cache_len=first,
                                   **search)
    np.testing.assert_array_equal(beams_two[0], beams_one[0])
    np.testing.assert_allclose(beams_two[1], beams_one[1], atol=1e-6)


def test_beam_size_one_equals_greedy(tiny):
    cfg, params = tiny
    inputs = _sources(6)
    # EOS banned: beam 1 keeps exactly the greedy path (with EOS allowed, beam 1 may also keep the
    # greedy prefix + EOS that scores better, so the two can differ by design).
    greedy = decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA, min_len=20)
    beam, _ = decode.beam_search(params, cfg, inputs, beam_size=1, max_extra_len=EXTRA, min_len=20)
    np.testing.assert_array_equal(beam, greedy)
    assert not np.any(np.asarray(greedy) == EOS_ID)


def test_beam_search_finds_the_best_of_all_sequences(small):
    cfg, params, inputs, candidates, logprobs = small
    lengths = np.asarray(_sequence_lengths(jnp.asarray(candidates)))  # [85]
    best_lengths = {}
    for alpha in (0.0, 0.6, 2.0):
        scores = logprobs / ((5.0 + lengths) / 6.0) ** alpha  # [B, 85]
        best = np.argmax(scores, axis=1)
        # 16 alive beams hold every prefix of 2 tokens, so the search is exhaustive.
        tokens, beam_scores = decode.beam_search(params, cfg, inputs, beam_size=16, alpha=alpha,
                                                 max_len=ENUM_LEN)
        np.testing.assert_array_equal(tokens, candidates[best])
        np.testing.assert_allclose(beam_scores, scores[np.arange(BATCH), best], atol=1e-5)
        best_lengths[alpha] = lengths[best]
    # Larger alpha favours longer outputs: never shorter, and here strictly longer somewhere.
    assert np.all(best_lengths[0.0] <= best_lengths[0.6]) and np.all(best_lengths[0.6] <= best_lengths[2.0])
    assert np.any(best_lengths[0.0] < best_lengths[2.0])


def _small_searches(small):
    """Greedy and beam search (beam 4, alpha 0.6, every beam) outputs of the small model, sources + 2."""
    cfg, params, inputs, _, _ = small
    greedy = decode.greedy_search(params, cfg, inputs, max_extra_len=2)
    return greedy, decode.beam_search(params, cfg, inputs, max_extra_len=2, return_all_beams=True)


def test_beam_search_beats_greedy(small):
    cfg, params, inputs, _, _ = small
    greedy, (beams, all_scores) = _small_searches(small)
    beam, beam_scores = beams[:, 0], all_scores[:, 0]
    greedy_scores = _scores(params, cfg, inputs, greedy, 0.6)
    np.testing.assert_allclose(beam_scores, _scores(params, cfg, inputs, beam, 0.6), atol=1e-5)
    assert np.all(beam_scores >= greedy_scores - 1e-5)
    assert np.any(beam_scores > greedy_scores + 1e-3)


def _always_eos(params):
    """Parameters whose decoder output is the same vector b for every position, with E[EOS] along b."""
    params = jax.tree.map(np.array, params)
    last = params["decoder"][f"layer_{_tiny().num_decoder_layers - 1}"]["ffn_block"]["norm"]
    last["scale"][:] = 0.0  # post-norm: the decoder output is the LayerNorm bias b
    last["bias"][:] = 1.0
    params["shared_embedding"]["embedding"][EOS_ID] = 3.0  # logit 45 against ~N(0, 1) for the others
    return params


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_a_sequence_that_emits_eos_first_has_length_one_and_the_loop_stops_early(tiny, search):
    cfg, params = tiny
    params, inputs = _always_eos(params), _sources(7)
    if search == "greedy":
        tokens, num_steps = decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA,
                                                 return_num_steps=True)
        assert int(num_steps) == 1
    else:
        tokens, _, num_steps = decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA,
                                                  return_num_steps=True)
        assert int(num_steps) < 4  # the other beams cannot beat [EOS]
    expected = np.zeros((BATCH, SRC_LEN + EXTRA), np.int32)
    expected[:, 0] = EOS_ID
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(_sequence_lengths(tokens), np.ones(BATCH))


def test_eos_then_only_pad_and_per_example_limits(small):
    inputs = small[2]  # P(EOS) ~ 1/5 per step: some end early, some at the limit
    limits = np.sum(np.asarray(inputs) != PAD_ID, axis=1) + 2  # 9, 8, 7, 6, 5
    greedy, (beam, _) = _small_searches(small)
    _assert_well_formed(greedy, limits)
    _assert_well_formed(beam.reshape(BATCH * 4, -1), np.repeat(limits, 4))
    lengths = np.asarray(_sequence_lengths(beam.reshape(BATCH * 4, -1)))
    assert np.any(lengths < np.repeat(limits, 4)) and np.any(np.asarray(beam) == EOS_ID)


def test_output_length_is_source_length_plus_max_extra_len(tiny):
    cfg, params = tiny
    inputs = _sources(8)
    limits = np.sum(np.asarray(inputs) != PAD_ID, axis=1) + EXTRA  # 10, 9, 8, 7, 6
    tokens, num_steps = decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA, min_len=20,
                                             return_num_steps=True)  # EOS banned
    np.testing.assert_array_equal(_sequence_lengths(tokens), limits)
    assert int(num_steps) == limits.max() == SRC_LEN + EXTRA
    beam, _ = decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA, min_len=20)
    np.testing.assert_array_equal(_sequence_lengths(beam), limits)


def test_bfloat16_model_decodes(tiny):
    cfg, params = tiny
    cfg, inputs = cfg.replace(dtype="bfloat16"), _sources(9)
    limits = np.sum(np.asarray(inputs) != PAD_ID, axis=1) + EXTRA
    _assert_well_formed(decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA), limits)
    tokens, scores = decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA)
    _assert_well_formed(tokens, limits)
    assert scores.dtype == jnp.float32 and np.all(np.isfinite(scores)) and np.all(scores > NEG_INF / 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_len=0), r"output length 0 must be in \[1, "),
    (dict(beam_size=0), "beam_size must be >= 1, got 0"),
    (dict(alpha=-0.5), "alpha must be >= 0"),
    (dict(min_len=-1), "max_extra_len and min_len must be >= 0"),
])
def test_argument_errors(tiny, kwargs, message):
    cfg, params = tiny
    with pytest.raises(ValueError, match=message):
        decode.beam_search(params, cfg, _sources(0), **{"max_extra_len": EXTRA, **kwargs})


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_compaction_changes_no_output(tiny, search):
    """MANY sources of 1 to 7 tokens: most finish early, so the loop moves the rest to 16 rows (after
    growing the cache, as in the test above). The outputs equal those of the batch run to the end in one
    phase: greedy exactly, beam search the same hypotheses with scores to float tolerance."""
    cfg, params = tiny
    rng = np.random.default_rng(8)
    tokens = rng.integers(4, VOCAB, size=(MANY, SRC_LEN))
    tokens[np.arange(SRC_LEN)[None, :] >= rng.integers(1, SRC_LEN + 1, size=MANY)[:, None]] = PAD_ID
    inputs = jnp.asarray(tokens, jnp.int32)
    assert decode._batch_sizes(MANY, True) == (MANY, 16) and decode._batch_sizes(MANY, False) == (MANY,)
    # The grown-cache test's programs: compacted with first_cache_len=4, and the reference in one phase.
    first_cache_len = {True: 4, False: SRC_LEN + EXTRA}
    if search == "greedy":
        run = lambda compact: decode.greedy_search(params, cfg, inputs, max_extra_len=EXTRA, compact=compact,
                                                   first_cache_len=first_cache_len[compact],
                                                   return_num_steps=True)
        (compacted, steps), (full, _) = run(True), run(False)
        np.testing.assert_array_equal(compacted, full)
        lengths = np.asarray(_sequence_lengths(full))
    else:
        run = lambda compact: decode.beam_search(params, cfg, inputs, max_extra_len=EXTRA, compact=compact,
                                                 first_cache_len=first_cache_len[compact],
                                                 return_all_beams=True, return_num_steps=True)
        (seqs, scores, steps), (full_seqs, full_scores, _) = run(True), run(False)
        np.testing.assert_array_equal(seqs, full_seqs)
        np.testing.assert_allclose(scores, full_scores, atol=1e-6)
        lengths = np.asarray(_sequence_lengths(full_seqs[:, 0]))
    # Not a vacuous check: outputs end at different steps, so rows left the loop before its end.
    assert lengths.min() < int(steps) and np.sum(lengths < int(steps)) > 48
