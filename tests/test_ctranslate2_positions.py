"""The position schemes in the CTranslate2 export: each scheme passes the witness of
tests/test_ctranslate2.py (CTranslate2's greedy outputs equal ours token for token, with the same per-token
log probabilities), at beam 3 each engine scores both engines' outputs alike and ours are never less
probable, inputs longer than max_len decode alike, and a scheme the export does not know is refused in one
line before anything is written.

The models are tiny and untrained, with wide random weights (outputs run to their length limit, so every
position of every search is compared), and narrow ones for the beams (where the two searches differ). Each
planted export bug (rotary's dimensions interleaved, the relative distance's sign flipped, the relative tables
of two layers swapped or their key and value tables swapped, ``none`` without its zero table, ALiBi's encoder
slopes off by a factor, its decoder bias scaled by 1/sqrt(d_k), its encoder buckets too few for the source)
must fail the same comparison.
"""


import os

import jax
import numpy as np
import pytest
import test_ctranslate2 as witness_tests
from test_ctranslate2 import (
    MAX_EXTRA_LEN,
    MAX_WORDS,
    SCORE_TOLERANCE,
    _model_config,
    _padded,
    _reversal_batch,
    _witness,
)
from tiny import random_params

from transformer_jax.evaluation import ctranslate2_engine, ctranslate2_spec, translation
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import POSITION_ENCODINGS
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError, DataError

# Each exported scheme once. Rotary's d_k = d_v = 6 differs from d_model / h = 8 (CTranslate2's head_dim and
# rotary_dim both set); relative has 2 + 2 layers (one table per layer: a mix-up of layers changes the
# outputs) and k = 2, below the sources' and outputs' lengths (up to 8 and 11), so distances are clipped;
# ALiBi has 6 heads, not a power of two (the paper's rule for the slopes), and 2 + 2 layers.
SCHEMES = {
    "rotary": {"position_encoding": "rotary", "d_k": 6, "d_v": 6, "num_encoder_layers": 1,
               "num_decoder_layers": 1},
    "relative": {"position_encoding": "relative", "max_relative_position": 2},
    "none": {"position_encoding": "none", "num_encoder_layers": 1, "num_decoder_layers": 1},
    "alibi": {"position_encoding": "alibi", "num_heads": 6, "d_k": 6, "d_v": 6},
}
SENTENCES = 16
pieces = witness_tests.pieces  # the fixture: 44 word pieces


def _random_params(cfg):
    """Wide random weights; under ALiBi not the widest (unit embeddings), whose logits drown its small
    slopes' bias (a decoder bias scaled by 1/sqrt(d_k) then moved the log probabilities by 2e-4, not 2e-2)."""
    return random_params(cfg, seed=5, unit_embedding=cfg.position_encoding != "alibi")


def _config_and_params(pieces, scheme: str):
    cfg = _model_config(len(pieces), **SCHEMES[scheme])
    return cfg, _random_params(cfg)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_exported_scheme_greedy_outputs_and_scores_equal_ours(scheme, pieces, tmp_path):
    cfg, params = _config_and_params(pieces, scheme)
    differing, largest, outputs = _witness(params, cfg, pieces, str(tmp_path / "model"), sentences=SENTENCES)
    assert differing == 0
    assert largest <= SCORE_TOLERANCE
    assert sum(EOS_ID not in out for out in outputs) >= SENTENCES // 2  # long outputs: every position used


@pytest.mark.parametrize("weights", ["wide", "narrow"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_exported_scheme_beam_search_is_never_more_probable_than_ours(scheme, weights, pieces, tmp_path):
    """Beam 3 without a length penalty, on wide and on narrow random weights. Each engine scores both
    engines' outputs alike, token by token (the witness: the cached step's positions are read for every
    beam, not only the best). The searches differ in one way: CTranslate2 keeps a finished hypothesis only
    where it ends among the best ``beam_size`` of the ``2 * beam_size`` candidates of a step, ours wherever
    it ends among them, and both keep the same alive ones; so where the outputs differ, ours is at least as
    probable under either engine's scores."""
    cfg = _model_config(len(pieces), **SCHEMES[scheme])
    params = _random_params(cfg) if weights == "wide" else random_params(cfg, seed=5)
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    sources, _ = _reversal_batch(np.random.default_rng(9), SENTENCES, cfg.vocab_size)
    ids = [row[:list(row).index(EOS_ID) + 1] for row in sources]
    settings = translation.Settings(beam_size=3, alpha=0.0, max_extra_len=MAX_EXTRA_LEN)
    scores = {}  # (whose output, which engine scores it) -> float[sentences], log P of each output
    for whose, outputs in (("ours", translation.decode_ids(params, cfg, ids, settings)),
                           ("theirs", engine.decode_ids(ids, settings))):
        by_us, by_them = _token_log_probs(params, cfg, engine, ids, outputs)
        assert max(float(np.abs(a - b).max()) for a, b in zip(by_us, by_them, strict=True)) <= SCORE_TOLERANCE
        scores[whose, "jax"] = np.array([lp.sum() for lp in by_us])
        scores[whose, "ctranslate2"] = np.array([lp.sum() for lp in by_them])
    tolerance = SCORE_TOLERANCE * (MAX_WORDS + 1 + MAX_EXTRA_LEN)  # a sum of per-token differences
    for scorer in ("jax", "ctranslate2"):
        assert (scores["ours", scorer] >= scores["theirs", scorer] - tolerance).all(), scorer


def _interleaved_rotary(options):
    def planted(model_config):
        to_encoder, to_decoder = options(model_config)
        return {**to_encoder, "rotary_interleave": True}, {**to_decoder, "rotary_interleave": True}
    return planted


def _relative_tables(set_self_attention, change):
    def planted(spec, attention, norm):
        set_self_attention(spec, attention, norm)
        spec.relative_position_keys, spec.relative_position_values = change(
            spec.relative_position_keys, spec.relative_position_values)
    return planted


def _swap_first_layers(model_spec):
    """The relative tables of the encoder's two layers swapped."""
    def planted(params, model_config, pieces):
        spec = model_spec(params, model_config, pieces)
        first, second = (layer.self_attention for layer in spec.encoder.layer[:2])
        for name in ("relative_position_keys", "relative_position_values"):
            table = getattr(first, name)
            setattr(first, name, getattr(second, name))
            setattr(second, name, table)
        return spec
    return planted


def _scaled_alibi(options):
    def planted(model_config):
        to_encoder, to_decoder = options(model_config)
        return to_encoder, {**to_decoder, "scale_alibi": True}
    return planted


def _none_without_table(position_table):
    def planted(params, stack, model_config):
        table = position_table(params, stack, model_config)
        if model_config.position_encoding == "none":  # left unset: CTranslate2 adds its own sinusoid
            from ctranslate2.specs.model_spec import OPTIONAL

            return OPTIONAL
        return table
    return planted


# (scheme, the module and its function replaced, the replacement built from the original)
PLANTED = {
    "rotary interleaved": ("rotary", ctranslate2_spec, "_position_options", _interleaved_rotary),
    "relative sign flipped": ("relative", ctranslate2_spec, "_set_self_attention",
                              lambda f: _relative_tables(f, lambda k, v: (k[::-1].copy(), v[::-1].copy()))),
    "relative key and value swapped": ("relative", ctranslate2_spec, "_set_self_attention",
                                       lambda f: _relative_tables(f, lambda k, v: (v, k))),
    "relative layers swapped": ("relative", ctranslate2_engine, "model_spec", _swap_first_layers),
    "none without its table": ("none", ctranslate2_spec, "_position_table", _none_without_table),
    "alibi encoder slopes doubled": ("alibi", ctranslate2_spec, "_alibi_buckets",
                                     lambda f: lambda model_config: 2 * f(model_config)),
    "alibi decoder bias scaled": ("alibi", ctranslate2_spec, "_position_options", _scaled_alibi),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_wrong_position_export_fails_the_witness(bug, pieces, tmp_path, monkeypatch):
    scheme, module, name, plant = PLANTED[bug]
    monkeypatch.setattr(module, name, plant(getattr(module, name)))
    cfg, params = _config_and_params(pieces, scheme)
    _, largest, _ = _witness(params, cfg, pieces, str(tmp_path / "model"), sentences=SENTENCES)
    assert largest > 10 * SCORE_TOLERANCE  # the witness fails, well past its tolerance


def test_a_scheme_the_export_does_not_know_is_refused_in_one_line_before_writing(pieces, tmp_path):
    cfg = _model_config(len(pieces))
    params = random_params(cfg, seed=5)
    object.__setattr__(cfg, "position_encoding", "xpos")  # a scheme added to the model later
    with pytest.raises(ConfigError) as refused:
        ctranslate2_engine.write_model(params, cfg, str(tmp_path / "model"), quantization="float32",
                                       pieces=pieces, record={})
    assert str(refused.value) == (
        "position_encoding='xpos' cannot be exported to CTranslate2: the export does not know this scheme; "
        "translate with the JAX engine (--engine=jax), or train with one of sinusoidal, learned, none, "
        "rotary, relative, alibi")
    assert not os.listdir(tmp_path)


def test_every_model_scheme_is_exported():
    assert set(POSITION_ENCODINGS) == set(ctranslate2_spec.POSITION_EXPORTS)


def _token_log_probs(params, cfg, engine, ids, outputs) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ours, CTranslate2's): float[len_i] log probabilities of each output's tokens (EOS included where it
    has one; PAD left out), given its source."""
    outputs = [out[out != PAD_ID] for out in outputs]
    logits = model_lib.Transformer(cfg.replace(deterministic=True)).apply(
        {"params": params}, _padded(ids, max(map(len, ids))), _padded(outputs, max(map(len, outputs))))
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ours = [lp[np.arange(len(out)), out] for lp, out in zip(log_probs, outputs, strict=True)]
    # CTranslate2 scores EOS after an output that reached its limit without one: the tokens only.
    theirs = [scored[:len(out)] for scored, out in zip(engine.score(ids, outputs), outputs, strict=True)]
    return ours, theirs


def _largest_score_difference(params, cfg, engine, ids, outputs) -> float:
    """The largest difference between our and CTranslate2's log probabilities of ``outputs``' tokens."""
    ours, theirs = _token_log_probs(params, cfg, engine, ids, outputs)
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True))


def _sources(vocab_size: int, lengths) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [np.asarray([*rng.integers(4, vocab_size, n - 1), EOS_ID], np.int32) for n in lengths]


def _export_and_decode(params, cfg, pieces, out_dir, ids):
    """(CTranslate2's greedy outputs, ours, the largest log-probability difference on ours)."""
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    ours = translation.decode_ids(params, cfg, ids, settings)
    return engine.decode_ids(ids, settings), ours, _largest_score_difference(params, cfg, engine, ids, ours)


@pytest.mark.parametrize("scheme", ["sinusoidal", *SCHEMES])
def test_schemes_without_a_learned_table_decode_past_max_len(scheme, pieces, tmp_path):
    """model.max_len 8, sources of 12 and 15 tokens: rotary and relative have no table; the sinusoid's and
    none's tables, and ALiBi's encoder buckets, cover TABLE_POSITIONS. CTranslate2 gives our outputs and
    log probabilities. The learned table stops at max_len (``exported_positions``)."""
    cfg = _model_config(len(pieces), **{**SCHEMES.get(scheme, {}), "position_encoding": scheme,
                                        "num_encoder_layers": 1, "num_decoder_layers": 1, "max_len": 8})
    params = _random_params(cfg)
    theirs, ours, largest = _export_and_decode(params, cfg, pieces, str(tmp_path / "model"),
                                               _sources(len(pieces), (12, 15)))
    assert sum(not np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)) == 0
    assert largest <= SCORE_TOLERANCE
    assert ctranslate2_spec.exported_positions(cfg) == (
        None if scheme in ("rotary", "relative") else ctranslate2_spec.TABLE_POSITIONS)
    learned = _model_config(len(pieces), position_encoding="learned", max_len=8)
    assert ctranslate2_spec.exported_positions(learned) == 8


def test_translate_takes_a_source_longer_than_max_len_where_the_export_does(pieces, tmp_path):
    """translate's path (``translate_texts`` with the engine's ``decode_ids``) on a rotary model with
    max_len 16: a source of 31 tokens reaches the engine whole, with or without ``truncate`` (nothing needs
    cutting), and decodes as the JAX engine decodes it."""
    cfg = _model_config(len(pieces), **{**SCHEMES["rotary"], "max_len": 16})
    params = _random_params(cfg)
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    tokenizer = witness_tests.word_tokenizer()
    text = " ".join(f"w{i % witness_tests.NUM_WORDS}" for i in range(30))  # 30 words + EOS: 31 tokens
    assert len(tokenizer.encode_text([text], side="source")[0]) + 1 == 31
    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    given, returned = [], []

    def decode_fn(ids, settings, progress):  # the engine, recording what goes in and out
        given[:] = ids
        returned[:] = engine.decode_ids(ids, settings, progress=progress)
        return returned

    for truncate in (False, True):
        translation.translate_texts(None, cfg, tokenizer, [text], settings, truncate=truncate,
                                    decode_fn=decode_fn)
        assert [len(ids) for ids in given] == [31]
        np.testing.assert_array_equal(returned[0], translation.decode_ids(params, cfg, given, settings)[0])


def test_alibi_encoder_buckets_are_exact_up_to_exported_positions_only(pieces, tmp_path, monkeypatch):
    """With TABLE_POSITIONS 10 (and max_len 8): sources of 10 tokens, whose distances reach 9, score as ours;
    sources of 16 reach the log-spaced buckets and do not, so the engine refuses to decode them."""
    monkeypatch.setattr(ctranslate2_spec, "TABLE_POSITIONS", 10)
    cfg = _model_config(len(pieces), **{**SCHEMES["alibi"], "num_encoder_layers": 1, "num_decoder_layers": 1,
                                        "max_len": 8})
    params = _random_params(cfg)
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    assert engine.positions == ctranslate2_spec.exported_positions(cfg) == 10
    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    for length, exact in ((10, True), (16, False)):
        ids = _sources(len(pieces), (length, length))
        largest = _largest_score_difference(params, cfg, engine, ids, translation.decode_ids(
            params, cfg, ids, settings))
        assert (largest <= SCORE_TOLERANCE) == exact, (length, largest)
    with pytest.raises(DataError) as refused:
        engine.decode_ids(_sources(len(pieces), (4, 8)), settings)  # 8 + 3 > 10
    assert str(refused.value) == (
        "a source of 8 tokens (EOS included) and max_extra_len=3 need more than the 10 positions this export "
        "of position_encoding='alibi' holds; decode it with the JAX engine (--engine=jax), or pass a smaller "
        "--max_extra_len")
    engine.decode_ids(_sources(len(pieces), (4, 7)), settings)  # 7 + 3 = 10: decoded


def test_max_relative_position_is_a_field_the_export_knows(pieces):
    cfg = _model_config(len(pieces), position_encoding="relative", max_relative_position=5)
    ctranslate2_spec.check_exportable(cfg)  # no "does not know the model field max_relative_position=5"
