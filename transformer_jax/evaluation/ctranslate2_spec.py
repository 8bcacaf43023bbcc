"""Our parameters as CTranslate2's ``TransformerSpec``: which models can be exported, how each weight maps.

CTranslate2 (https://github.com/OpenNMT/CTranslate2) is a C++ inference engine for encoder-decoder
Transformers. :func:`model_spec` writes our parameters into its ``TransformerSpec``; the layout facts it
relies on, each checked by tests/test_ctranslate2.py (positions: tests/test_ctranslate2_positions.py) against
our own decoder:

  * its linear weights are [out, in]; self-attention has one fused Q/K/V linear, encoder-decoder
    attention a Q linear and a fused K/V linear; our head-split kernels [d_model, h, d_k] are the
    [d_model, h * d_k] matrices transposed (head-major, as CTranslate2 splits heads);
  * positions (``POSITION_EXPORTS``): its built-in sinusoid puts sin and cos in halves where ours
    interleaves them, so our table (or the learned one) is passed as the position encodings, and ``none``
    passes a zero table; rotary is its ``rotary_dim`` = d_k (the whole head) with ``rotary_interleave``
    off (our "halves" pairs, i with i + d/2), base 10000, in every self-attention; relative is its
    Shaw et al. ``relative_position`` with each self-attention's tables as ``relative_position_keys`` and
    ``relative_position_values``, row ``clip(j - i, -k, k) + k`` as ours (CTranslate2 takes k from the
    table's 2k + 1 rows, and scales the key term by 1/sqrt(d_k) as we do); ALiBi is its decoder's
    ``alibi`` (the same slopes; its bias ``m_h (j - last)`` differs from our ``-m_h (i - j)`` by a constant
    per query row, which the softmax ignores) and, in its encoder, which has no ALiBi, T5's bucketed
    ``relative_attention_bias`` holding ``-m_h |j - i|`` (:func:`_alibi_buckets`: exact for distances
    below ``exported_positions``);
  * the feed-forward activation is CTranslate2's member of the same function (``ACTIVATION_EXPORTS``);
  * LayerNorm epsilon is Flax's 1e-6 (CTranslate2's default is 1e-5);
  * the shared embedding is the source and target embedding (times sqrt(d_model)) and the output
    projection, without bias;
  * the decoder starts with our BOS piece and stops at EOS; sources end with EOS, which the export's config
    has CTranslate2 append (``add_source_eos``), so pieces passed as its documentation shows decode right;
  * one head size: d_k != d_v cannot be expressed.

:func:`check_exportable` refuses, before anything is written, a model field this mapping does not know.
Writing the spec to a folder, and decoding with it, is ``ctranslate2_engine``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transformer_jax.model.special_ids import BOS_ID, EOS_ID, UNK_ID
from transformer_jax.runtime.errors import ConfigError

LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's default
INSTALL_HINT = 'pip install -e ".[serve]" (or: pip install ctranslate2)'


def import_ctranslate2():
    """The ``ctranslate2`` module, or a ConfigError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ConfigError(f"CTranslate2 is not installed; install it with: {INSTALL_HINT}") from None
    return ctranslate2


# How each position scheme reaches CTranslate2: "table" (a position table added to the embeddings), "rotary"
# (its rotary_dim), "relative" (its relative_position), "alibi" (the decoder's alibi, T5 buckets in the
# encoder); a scheme missing here is refused (_REFUSED_POSITIONS says why, when known).
POSITION_EXPORTS = {"sinusoidal": "table", "learned": "table", "none": "table", "rotary": "rotary",
                    "relative": "relative", "alibi": "alibi"}
_REFUSED_POSITIONS: dict[str, str] = {}
# Each feed-forward activation as CTranslate2's ``common_spec.Activation`` member.
ACTIVATION_EXPORTS = {"relu": "RELU", "gelu": "GELU", "gelu_tanh": "GELUTanh", "gelu_sigmoid": "GELUSigmoid",
                      "swish": "SWISH"}
# Positions the exported sinusoid (and the zero table of ``none``, and ALiBi's encoder buckets) cover when
# max_len is shorter: the JAX engine takes any length under these schemes, and CTranslate2 stops at the end
# of a table.
TABLE_POSITIONS = 1024
# The ModelConfig fields the export maps, with the values it knows; any other field must be one that does not
# change a deterministic forward pass. A field added to the model later is refused until the export knows it.
_MAPPED_FIELDS = {"vocab_size": None, "d_model": None, "d_ff": None, "num_heads": None, "d_k": None,
                  "d_v": None, "num_encoder_layers": None, "num_decoder_layers": None, "max_len": None,
                  "position_encoding": tuple(POSITION_EXPORTS), "norm_style": ("post", "pre"),
                  "ffn_activation": tuple(ACTIVATION_EXPORTS),
                  "max_relative_position": None}  # relative: the tables' 2k + 1 rows carry it
_INFERENCE_NEUTRAL_FIELDS = ("dropout_rate", "attention_dropout_rate", "attention_impl",
                             "attention_block_size", "attention_init", "dtype", "attention_witness",
                             "deterministic", "decode")


def check_exportable(model_config) -> None:
    """Raises ConfigError, before anything is written, for a model CTranslate2 cannot express."""
    scheme = model_config.position_encoding
    if scheme not in POSITION_EXPORTS:
        why = _REFUSED_POSITIONS.get(scheme, "the export does not know this scheme")
        raise ConfigError(
            f"position_encoding={scheme!r} cannot be exported to CTranslate2: {why}; translate with the JAX "
            f"engine (--engine=jax), or train with one of {', '.join(POSITION_EXPORTS)}")
    for field in dataclasses.fields(model_config):
        value = getattr(model_config, field.name)
        if field.name in _INFERENCE_NEUTRAL_FIELDS:
            continue
        if field.name not in _MAPPED_FIELDS:
            raise ConfigError(f"the export to CTranslate2 does not know the model field {field.name}="
                              f"{value!r}; it cannot be exported")
        allowed = _MAPPED_FIELDS[field.name]
        if allowed is not None and value not in allowed:
            raise ConfigError(f"the export to CTranslate2 knows {field.name} {' and '.join(allowed)}, "
                              f"not {value!r}")
    if model_config.d_k != model_config.d_v:
        raise ConfigError(
            f"CTranslate2 has one head size, but this model has d_k={model_config.d_k} and d_v="
            f"{model_config.d_v}; only models with d_k == d_v can be exported")


def _array(x) -> np.ndarray:
    """A writable float32 copy: CTranslate2 quantizes in place, and arrays read from JAX are read-only."""
    return np.array(x, np.float32)


def _head_matrix(kernel, *, heads_first: bool) -> np.ndarray:
    """float32[out, in] of a head-split kernel: [d_model, h, d] (``heads_first=False``: W^Q, W^K, W^V)
    -> [h * d, d_model]; [h, d, d_model] (W^O) -> [d_model, h * d]."""
    kernel = np.asarray(kernel, np.float32)
    if heads_first:
        return _array(kernel.reshape(-1, kernel.shape[-1]).T)
    return _array(kernel.reshape(kernel.shape[0], -1).T)


def _set_norm(spec, norm: Mapping[str, Any]) -> None:
    spec.gamma = _array(norm["scale"])
    spec.beta = _array(norm["bias"])


def _set_dense(spec, dense: Mapping[str, Any]) -> None:
    spec.weight = _array(np.asarray(dense["kernel"]).T)
    spec.bias = _array(dense["bias"])


def _set_self_attention(spec, attention: Mapping[str, Any], norm: Mapping[str, Any]) -> None:
    spec.linear[0].weight = np.concatenate(
        [_head_matrix(attention[name], heads_first=False) for name in ("query", "key", "value")])
    spec.linear[1].weight = _head_matrix(attention["out"], heads_first=True)
    _set_norm(spec.layer_norm, norm)
    if hasattr(spec, "relative_position_keys"):  # [2k + 1, d_k], row clip(j - i, -k, k) + k, as ours
        spec.relative_position_keys = _array(attention["positions"]["relative_key"])
        spec.relative_position_values = _array(attention["positions"]["relative_value"])


def _set_cross_attention(spec, attention: Mapping[str, Any], norm: Mapping[str, Any]) -> None:
    spec.linear[0].weight = _head_matrix(attention["query"], heads_first=False)
    spec.linear[1].weight = np.concatenate(
        [_head_matrix(attention[name], heads_first=False) for name in ("key", "value")])
    spec.linear[2].weight = _head_matrix(attention["out"], heads_first=True)
    _set_norm(spec.layer_norm, norm)


def exported_positions(model_config) -> int | None:
    """The longest sequence (source, or output with its EOS) that the export of ``model_config`` decodes:
    the learned table's ``max_len`` rows; ``max(max_len, TABLE_POSITIONS)`` for the sinusoid's and
    ``none``'s tables and for ALiBi's encoder buckets (past them CTranslate2 stops at the end of a table,
    but takes a longer source under ALiBi with a wrong, log-bucketed bias: callers must check); or None
    (any length) for rotary and relative positions, which have no table."""
    if POSITION_EXPORTS[model_config.position_encoding] not in ("table", "alibi"):
        return None
    if model_config.position_encoding == "learned":
        return model_config.max_len
    return max(model_config.max_len, TABLE_POSITIONS)


def exported_positions_holder(model_config) -> str:
    """What holds :func:`exported_positions` and how many, in words, for a scheme whose export has a bound:
    "learned position table has model.max_len=16 positions", "sinusoid table has 1024 positions, the larger
    of model.max_len=16 and 1024"."""
    n = exported_positions(model_config)
    if n is None:
        raise ValueError(f"position_encoding={model_config.position_encoding!r} is exported for any length")
    if model_config.position_encoding == "learned":
        return f"learned position table has model.max_len={n} positions"
    larger = f"the larger of model.max_len={model_config.max_len} and {TABLE_POSITIONS}"
    if model_config.position_encoding == "alibi":
        return f"ALiBi encoder buckets are exact for {n} positions, {larger}"
    table = "sinusoid table" if model_config.position_encoding == "sinusoidal" else "zero position table"
    return f"{table} has {n} positions, {larger}"


def _position_table(params: Mapping[str, Any], stack: str, model_config) -> np.ndarray:
    """float32[exported_positions, d_model] added to the embeddings: the learned table, our sinusoid, or
    zeros."""
    if model_config.position_encoding == "learned":
        return _array(params[stack]["positions"]["position_embedding"])
    rows = exported_positions(model_config)
    if model_config.position_encoding == "none":  # CTranslate2 adds its own sinusoid when given no table
        return np.zeros((rows, model_config.d_model), np.float32)
    from transformer_jax.model.positions import sinusoidal_table

    return sinusoidal_table(rows, model_config.d_model)


def _alibi_buckets(model_config) -> np.ndarray:
    """float32[4n, num_heads]: ALiBi's encoder bias ``-m_h |j - i|`` as T5's bidirectional buckets, with n =
    ``exported_positions``.

    CTranslate2 (as T5) halves 4n buckets by direction, 2n each: distance ``d = j - i`` goes to row ``|d|``
    when ``d <= 0``, ``2n + d`` when ``d > 0``, exactly while ``|d| < n`` (half of each direction's rows;
    longer distances share log-spaced rows, which hold the bias of distance n here).
    """
    from transformer_jax.model.positions import alibi_slopes

    n = exported_positions(model_config)
    distance = np.minimum(np.arange(2 * n), n)  # [2n]: exact below n
    bias = (-alibi_slopes(model_config.num_heads)[None, :] * distance[:, None]).astype(np.float32)  # [2n, H]
    return np.concatenate([bias, bias])  # d <= 0, then d > 0 (row 2n holds d = 0, never read)


def _position_options(model_config) -> tuple[dict[str, Any], dict[str, Any]]:
    """The encoder's and the decoder's spec arguments for the model's position scheme (none for a table)."""
    kind = POSITION_EXPORTS[model_config.position_encoding]
    if kind == "rotary":  # the whole head, pairs (i, i + d/2): CTranslate2's non-interleaved layout
        from transformer_jax.model.positions import ROTARY_BASE

        rotary = {"rotary_dim": model_config.d_k, "rotary_interleave": False, "rotary_base": ROTARY_BASE}
        return rotary, rotary
    if kind == "relative":
        return {"relative_position": True}, {"relative_position": True}
    if kind == "alibi":  # not scaled by 1/sqrt(d_k), as ours; slopes 2^(-8h/H) (and the paper's rule)
        return {"relative_attention_bias": True}, {"alibi": True, "scale_alibi": False}
    return {}, {}


def model_spec(params: Mapping[str, Any], model_config, pieces: Sequence[str]):
    """CTranslate2's ``TransformerSpec`` holding ``params`` of ``Transformer(model_config)``.

    Args:
      params: the parameter tree (NumPy or JAX arrays).
      model_config: the model's ModelConfig.
      pieces: the vocabulary, one string a token id (``Tokenizer.id_to_piece``).
    """
    check_exportable(model_config)
    import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model_config
    pre_norm = cfg.norm_style == "pre"
    activation = getattr(common_spec.Activation, ACTIVATION_EXPORTS[cfg.ffn_activation])
    default_head_dim = cfg.d_model // cfg.num_heads
    head_dim = None if cfg.d_k == default_head_dim and cfg.d_model % cfg.num_heads == 0 else cfg.d_k
    to_encoder, to_decoder = _position_options(cfg)
    encoder = transformer_spec.TransformerEncoderSpec(cfg.num_encoder_layers, cfg.num_heads,
                                                      pre_norm=pre_norm, head_dim=head_dim,
                                                      activation=activation, **to_encoder)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.num_decoder_layers, cfg.num_heads,
                                                      pre_norm=pre_norm, head_dim=head_dim,
                                                      activation=activation, **to_decoder)
    embedding = params["shared_embedding"]["embedding"]  # [vocab, d_model]
    encoder.embeddings[0].weight = _array(embedding)
    decoder.embeddings.weight = _array(embedding)
    decoder.projection.weight = _array(embedding)  # logits x E^T: [out=vocab, in=d_model]
    if POSITION_EXPORTS[cfg.position_encoding] == "table":
        encoder.position_encodings.encodings = _position_table(params, "encoder", cfg)
        decoder.position_encodings.encodings = _position_table(params, "decoder", cfg)
    for i, layer in enumerate(encoder.layer):
        ours = params["encoder"][f"layer_{i}"]
        _set_self_attention(layer.self_attention, ours["self_attention"], ours["attention_block"]["norm"])
        if POSITION_EXPORTS[cfg.position_encoding] == "alibi":
            layer.self_attention.relative_attention_bias = _alibi_buckets(cfg)
            # Only log-spaced rows (distances of n and more) depend on it; any value above n does.
            layer.self_attention.relative_attention_max_distance = np.int32(4 * exported_positions(cfg))
        _set_dense(layer.ffn.linear_0, ours["ffn"]["wi"])
        _set_dense(layer.ffn.linear_1, ours["ffn"]["wo"])
        _set_norm(layer.ffn.layer_norm, ours["ffn_block"]["norm"])
    for i, layer in enumerate(decoder.layer):
        ours = params["decoder"][f"layer_{i}"]
        _set_self_attention(layer.self_attention, ours["self_attention"],
                            ours["self_attention_block"]["norm"])
        _set_cross_attention(layer.attention, ours["cross_attention"], ours["cross_attention_block"]["norm"])
        _set_dense(layer.ffn.linear_0, ours["ffn"]["wi"])
        _set_dense(layer.ffn.linear_1, ours["ffn"]["wo"])
        _set_norm(layer.ffn.layer_norm, ours["ffn_block"]["norm"])
    if pre_norm:
        _set_norm(encoder.layer_norm, params["encoder"]["final_norm"])
        _set_norm(decoder.layer_norm, params["decoder"]["final_norm"])
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    spec.config.unk_token = pieces[UNK_ID]
    spec.config.bos_token = pieces[BOS_ID]
    spec.config.eos_token = pieces[EOS_ID]
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_eos = True  # our sources end with EOS: CTranslate2's own API appends it
    spec.register_source_vocabulary(list(pieces))
    spec.register_target_vocabulary(list(pieces))
    return spec


def to_bfloat16(spec) -> None:
    """Casts the spec's float32 arrays to bfloat16 with ml_dtypes (a JAX dependency): CTranslate2's own cast
    needs PyTorch."""
    import ml_dtypes
    from ctranslate2.specs import model_spec as ct2_model_spec

    def cast(layer, scoped_name: str, value) -> None:
        if isinstance(value, np.ndarray) and value.dtype == np.float32:
            setattr(layer, scoped_name.split("/")[-1], value.astype(ml_dtypes.bfloat16))

    ct2_model_spec.visit_spec(spec, cast)
