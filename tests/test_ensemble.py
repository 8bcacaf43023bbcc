"""model.ensemble: models that predict together (the mean of their next-token distributions), checked
against the members' own teacher-forced distributions in greedy and beam search and in the metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_params

from transformer_jax.data import EvalBatch
from transformer_jax.evaluation import decode, scoring
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ensemble import Ensemble, mean_log_probs, shape_differences
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.model.transformer import Transformer

VOCAB, SRC_LEN, EXTRA = 19, 6, 5
CFG = ModelConfig(vocab_size=VOCAB, d_model=16, d_ff=24, num_heads=2, num_encoder_layers=1,
                  num_decoder_layers=2, max_len=16, dropout_rate=0.0)


def _sources() -> np.ndarray:
    """int32[4, SRC_LEN]: EOS-terminated sources of lengths 6, 5, 4, 3, PAD after them."""
    tokens = np.random.default_rng(0).integers(4, VOCAB, size=(4, SRC_LEN)).astype(np.int32)
    for row, length in enumerate((6, 5, 4, 3)):
        tokens[row, length - 1], tokens[row, length:] = EOS_ID, PAD_ID
    return tokens


@functools.partial(jax.jit, static_argnums=1)
def _log_probs(params, cfg, inputs, targets) -> jax.Array:
    """float32[n, T, V] the teacher-forced log-probabilities of one model (shift_right inside)."""
    logits = Transformer(cfg.replace(deterministic=True)).apply({"params": params}, inputs, targets)
    return jax.nn.log_softmax(logits, axis=-1)


def _reference_log_probs(members, inputs, tokens) -> np.ndarray:
    """float64[n, T, V] log of the mean of the members' distributions at every position of ``tokens``."""
    each = np.stack([np.asarray(_log_probs(p, CFG, inputs, tokens), np.float64) for p in members])
    return np.logaddexp.reduce(each, axis=0) - np.log(len(members))


def test_mean_log_probs_is_the_log_of_the_mean_distribution():
    a, b = np.array([0.0, 1.0, 2.0]), np.array([2.0, 0.0, -1.0])
    softmax = lambda x: np.exp(x) / np.exp(x).sum()
    expected = np.log((softmax(a) + softmax(b)) / 2)  # by hand: [-1.40, -1.44, -0.59]
    np.testing.assert_allclose(mean_log_probs([jnp.asarray(a), jnp.asarray(b)]), expected, rtol=1e-6)
    np.testing.assert_allclose(mean_log_probs([jnp.asarray(a)]), np.log(softmax(a)), rtol=1e-6)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_scores_are_the_ensembles_sequence_log_probs(use_cache):
    members = (random_params(CFG, 1), random_params(CFG, 2))
    inputs = _sources()
    seqs, scores = decode.beam_search(Ensemble(members), CFG, inputs, beam_size=3, alpha=0.6,
                                      max_extra_len=EXTRA, use_cache=use_cache, return_all_beams=True)
    seqs, scores = np.asarray(seqs), np.asarray(scores)  # [4, 3, T], [4, 3]
    flat = seqs.reshape(-1, seqs.shape[-1])
    log_probs = _reference_log_probs(members, np.repeat(inputs, 3, axis=0), flat)
    picked = np.take_along_axis(log_probs, flat[..., None], axis=-1)[..., 0]
    lengths = np.sum(flat != PAD_ID, axis=-1)
    expected = np.sum(np.where(flat != PAD_ID, picked, 0.0), axis=-1) / np.asarray(
        decode.length_penalty(lengths, 0.6))
    np.testing.assert_allclose(scores.reshape(-1), expected, rtol=1e-4, atol=1e-4)
    # Not either member's search: the ensemble found other hypotheses for at least one example.
    alone = [np.asarray(decode.beam_search(p, CFG, inputs, beam_size=3, alpha=0.6, max_extra_len=EXTRA)[0])
             for p in members]
    assert any(not np.array_equal(seqs[:, 0], a) for a in alone)


def test_greedy_search_takes_the_ensembles_argmax():
    members = (random_params(CFG, 3), random_params(CFG, 4))
    inputs = _sources()
    tokens = np.asarray(decode.greedy_search(Ensemble(members), CFG, inputs, max_extra_len=EXTRA))
    log_probs = _reference_log_probs(members, inputs, tokens)
    for row, out in enumerate(tokens):
        for t in range(int(np.sum(out != PAD_ID))):
            assert out[t] == np.argmax(log_probs[row, t]), (row, t)


def test_one_model_and_copies_of_it_decode_and_score_as_the_model():
    params = random_params(CFG, 5)
    inputs = _sources()
    single = np.asarray(decode.beam_search(params, CFG, inputs, beam_size=3, max_extra_len=EXTRA)[0])
    for copies in (1, 2):
        together = decode.beam_search(Ensemble((params,) * copies), CFG, inputs, beam_size=3,
                                      max_extra_len=EXTRA)[0]
        np.testing.assert_array_equal(np.asarray(together), single)
    targets = np.where(inputs == PAD_ID, PAD_ID, (inputs + 1) % VOCAB).astype(np.int32)
    batch = [EvalBatch(inputs=inputs, targets=targets, source_texts=[], target_texts=[],
                       indices=np.arange(4), num_real=4)]
    alone, twice = (scoring.perplexity(p, CFG, batch) for p in (params, Ensemble((params, params))))
    assert twice["ppl"] == pytest.approx(alone["ppl"], rel=1e-5)
    other = scoring.perplexity(Ensemble((params, random_params(CFG, 6))), CFG, batch)
    assert other["ppl"] != pytest.approx(alone["ppl"], rel=1e-3)


def test_members_may_differ_in_how_they_were_trained_not_in_their_shape():
    """Dropout (Table 3 row D), the attention implementation, dtype and, under sinusoids, max_len do not
    shape the parameters; widths, the position scheme and a learned table's size do."""
    trained_otherwise = CFG.replace(dropout_rate=0.3, attention_dropout_rate=0.1, attention_block_size=8,
                                    attention_init="narrow", dtype="bfloat16", max_len=40,
                                    attention_witness=True)
    assert shape_differences(CFG, trained_otherwise) == []
    assert shape_differences(CFG, CFG.replace(attention_impl="blockwise")) == []
    assert shape_differences(CFG, CFG.replace(d_ff=26)) == ["d_ff=26 (first: 24)"]
    assert shape_differences(CFG, CFG.replace(ffn_activation="swish")) == [
        "ffn_activation='swish' (first: 'relu')"]  # the same shapes, another function
    assert shape_differences(CFG, CFG.replace(num_decoder_layers=3, norm_style="pre")) == [
        "num_decoder_layers=3 (first: 2)", "norm_style='pre' (first: 'post')"]
    learned = CFG.replace(position_encoding="learned")
    assert shape_differences(CFG, learned) == ["position_encoding='learned' (first: 'sinusoidal')"]
    assert shape_differences(learned, learned.replace(max_len=40)) == ["max_len=40 (first: 16)"]
