"""The position schemes in the CTranslate2 export: each exported scheme passes the witness of
tests/test_ctranslate2.py (CTranslate2's greedy outputs equal ours token for token, with the same per-token
log probabilities), beam search gives our beams' outputs, and a scheme CTranslate2 cannot express is refused
in one line before anything is written.

The models are tiny and untrained, with wide random weights (outputs run to their length limit, so every
position of every search is compared). Each planted export bug (rotary's dimensions interleaved, the relative
distance's sign flipped, the relative tables of two layers swapped or their key and value tables swapped,
``none`` without its zero table) must fail the same comparison.
"""

import os

import numpy as np
import pytest
import test_ctranslate2 as witness_tests
from test_ctranslate2 import MAX_EXTRA_LEN, SCORE_TOLERANCE, _model_config, _reversal_batch, _witness
from tiny import random_params

from transformer_jax.evaluation import ctranslate2_engine, ctranslate2_spec, translation
from transformer_jax.model.special_ids import EOS_ID
from transformer_jax.runtime.errors import ConfigError

# Each exported scheme once. Rotary's d_k = d_v = 6 differs from d_model / h = 8 (CTranslate2's head_dim and
# rotary_dim both set); relative has 2 + 2 layers (one table per layer: a mix-up of layers changes the
# outputs) and k = 2, below the sources' and outputs' lengths (up to 8 and 11), so distances are clipped.
SCHEMES = {
    "rotary": {"position_encoding": "rotary", "d_k": 6, "d_v": 6, "num_encoder_layers": 1,
               "num_decoder_layers": 1},
    "relative": {"position_encoding": "relative", "max_relative_position": 2},
    "none": {"position_encoding": "none", "num_encoder_layers": 1, "num_decoder_layers": 1},
}
SENTENCES = 16
pieces = witness_tests.pieces  # the fixture: 44 word pieces


def _config_and_params(pieces, scheme: str):
    cfg = _model_config(len(pieces), **SCHEMES[scheme])
    return cfg, random_params(cfg, seed=5, unit_embedding=True)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_exported_scheme_greedy_outputs_and_scores_equal_ours(scheme, pieces, tmp_path):
    cfg, params = _config_and_params(pieces, scheme)
    differing, largest, outputs = _witness(params, cfg, pieces, str(tmp_path / "model"), sentences=SENTENCES)
    assert differing == 0
    assert largest <= SCORE_TOLERANCE
    assert sum(EOS_ID not in out for out in outputs) >= SENTENCES // 2  # long outputs: every position used


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_exported_scheme_beam_outputs_equal_ours(scheme, pieces, tmp_path):
    """Beam 3 without a length penalty: CTranslate2's best beam is ours (the cached step's positions are
    read for every beam, not only the best)."""
    cfg, params = _config_and_params(pieces, scheme)
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    sources, _ = _reversal_batch(np.random.default_rng(9), SENTENCES, cfg.vocab_size)
    ids = [row[:list(row).index(EOS_ID) + 1] for row in sources]
    settings = translation.Settings(beam_size=3, alpha=0.0, max_extra_len=MAX_EXTRA_LEN)
    ours = translation.decode_ids(params, cfg, ids, settings)
    theirs = ctranslate2_engine.Engine(out_dir, threads=1).decode_ids(ids, settings)
    assert sum(not np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)) == 0


def _interleaved_rotary(options):
    def planted(model_config):
        return {**options(model_config), "rotary_interleave": True}
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
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_wrong_position_export_fails_the_witness(bug, pieces, tmp_path, monkeypatch):
    scheme, module, name, plant = PLANTED[bug]
    monkeypatch.setattr(module, name, plant(getattr(module, name)))
    cfg, params = _config_and_params(pieces, scheme)
    _, largest, _ = _witness(params, cfg, pieces, str(tmp_path / "model"), sentences=SENTENCES)
    assert largest > 100 * SCORE_TOLERANCE


def test_alibi_is_refused_in_one_line_before_writing(pieces, tmp_path):
    cfg = _model_config(len(pieces), position_encoding="alibi")
    params = random_params(cfg, seed=5)
    with pytest.raises(ConfigError) as refused:
        ctranslate2_engine.write_model(params, cfg, str(tmp_path / "model"), quantization="float32",
                                       pieces=pieces, record={})
    assert str(refused.value) == (
        "position_encoding='alibi' cannot be exported to CTranslate2: its encoder has no ALiBi (only its "
        "decoder has); translate with the JAX engine (--engine=jax), or train with one of sinusoidal, "
        "learned, none, rotary, relative")
    assert not os.listdir(tmp_path)


def test_a_scheme_the_export_does_not_know_is_refused_naming_it(pieces):
    cfg = _model_config(len(pieces))
    object.__setattr__(cfg, "position_encoding", "xpos")  # a scheme added to the model later
    with pytest.raises(ConfigError, match=r"^position_encoding='xpos' cannot be exported to CTranslate2: the "
                                          r"export does not know this scheme; "):
        ctranslate2_spec.check_exportable(cfg)


def test_every_model_scheme_is_exported_or_refused_with_its_reason():
    from transformer_jax.model.config import POSITION_ENCODINGS

    assert set(POSITION_ENCODINGS) == set(ctranslate2_spec.POSITION_EXPORTS) | {"alibi"}


def test_schemes_without_a_learned_table_decode_past_max_len(pieces, tmp_path):
    """model.max_len 8, sources of 12 and 15 tokens: rotary and relative have no table, the sinusoid's
    and none's tables cover TABLE_POSITIONS; CTranslate2 gives our outputs. The learned table stops at
    max_len (``exported_positions``)."""
    rng = np.random.default_rng(3)
    ids = [np.asarray([*rng.integers(4, len(pieces), n - 1), EOS_ID], np.int32) for n in (12, 15)]
    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    for scheme in ("sinusoidal", *SCHEMES):
        cfg = _model_config(len(pieces), **{**SCHEMES.get(scheme, {}), "position_encoding": scheme,
                                            "num_encoder_layers": 1, "num_decoder_layers": 1, "max_len": 8})
        params = random_params(cfg, seed=5, unit_embedding=True)
        out_dir = str(tmp_path / scheme)
        ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
        theirs = ctranslate2_engine.Engine(out_dir, threads=1).decode_ids(ids, settings)
        ours = translation.decode_ids(params, cfg, ids, settings)
        assert sum(not np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)) == 0, scheme
        assert ctranslate2_spec.exported_positions(cfg) == (
            ctranslate2_spec.TABLE_POSITIONS if scheme in ("sinusoidal", "none") else None)
    learned = _model_config(len(pieces), position_encoding="learned", max_len=8)
    assert ctranslate2_spec.exported_positions(learned) == 8


def test_max_relative_position_is_a_field_the_export_knows(pieces):
    cfg = _model_config(len(pieces), position_encoding="relative", max_relative_position=5)
    ctranslate2_spec.check_exportable(cfg)  # no "does not know the model field max_relative_position=5"
