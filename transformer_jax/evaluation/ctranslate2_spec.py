"""Our parameters as CTranslate2's ``TransformerSpec``: which models can be exported, how each weight maps.

CTranslate2 (https://github.com/OpenNMT/CTranslate2) is a C++ inference engine for encoder-decoder
Transformers. :func:`model_spec` writes our parameters into its ``TransformerSpec``; the layout facts it
relies on, each checked by tests/test_ctranslate2.py against our own decoder:

  * its linear weights are [out, in]; self-attention has one fused Q/K/V linear, encoder-decoder
    attention a Q linear and a fused K/V linear; our head-split kernels [d_model, h, d_k] are the
    [d_model, h * d_k] matrices transposed (head-major, as CTranslate2 splits heads);
  * its built-in sinusoid puts sin and cos in halves where ours interleaves them, so our table (or the
    learned one) is passed as the position encodings;
  * LayerNorm epsilon is Flax's 1e-6 (CTranslate2's default is 1e-5);
  * the shared embedding is the source and target embedding (times sqrt(d_model)) and the output
    projection, without bias;
  * the decoder starts with our BOS piece and stops at EOS;
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


# The ModelConfig fields the export maps, with the values it knows; any other field must be one that does not
# change a deterministic forward pass. A field added to the model later is refused until the export knows it.
_MAPPED_FIELDS = {"vocab_size": None, "d_model": None, "d_ff": None, "num_heads": None, "d_k": None,
                  "d_v": None, "num_encoder_layers": None, "num_decoder_layers": None, "max_len": None,
                  "position_encoding": ("sinusoidal", "learned"), "norm_style": ("post", "pre")}
_INFERENCE_NEUTRAL_FIELDS = ("dropout_rate", "attention_dropout_rate", "attention_impl",
                             "attention_block_size", "attention_init", "dtype", "attention_witness",
                             "deterministic", "decode")


def check_exportable(model_config) -> None:
    """Raises ConfigError, before anything is written, for a model CTranslate2 cannot express."""
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


def _set_cross_attention(spec, attention: Mapping[str, Any], norm: Mapping[str, Any]) -> None:
    spec.linear[0].weight = _head_matrix(attention["query"], heads_first=False)
    spec.linear[1].weight = np.concatenate(
        [_head_matrix(attention[name], heads_first=False) for name in ("key", "value")])
    spec.linear[2].weight = _head_matrix(attention["out"], heads_first=True)
    _set_norm(spec.layer_norm, norm)


def _position_table(params: Mapping[str, Any], stack: str, model_config) -> np.ndarray:
    if model_config.position_encoding == "learned":
        return _array(params[stack]["positions"]["position_embedding"])
    from transformer_jax.model.positions import sinusoidal_table

    return sinusoidal_table(model_config.max_len, model_config.d_model)


def model_spec(params: Mapping[str, Any], model_config, pieces: Sequence[str]):
    """CTranslate2's ``TransformerSpec`` holding ``params`` of ``Transformer(model_config)``.

    Args:
      params: the parameter tree (NumPy or JAX arrays).
      model_config: the model's ModelConfig.
      pieces: the vocabulary, one string a token id (``Tokenizer.id_to_piece``).
    """
    check_exportable(model_config)
    import_ctranslate2()
    from ctranslate2.specs import transformer_spec

    cfg = model_config
    pre_norm = cfg.norm_style == "pre"
    default_head_dim = cfg.d_model // cfg.num_heads
    head_dim = None if cfg.d_k == default_head_dim and cfg.d_model % cfg.num_heads == 0 else cfg.d_k
    encoder = transformer_spec.TransformerEncoderSpec(cfg.num_encoder_layers, cfg.num_heads,
                                                      pre_norm=pre_norm, head_dim=head_dim)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.num_decoder_layers, cfg.num_heads,
                                                      pre_norm=pre_norm, head_dim=head_dim)
    embedding = params["shared_embedding"]["embedding"]  # [vocab, d_model]
    encoder.embeddings[0].weight = _array(embedding)
    decoder.embeddings.weight = _array(embedding)
    decoder.projection.weight = _array(embedding)  # logits x E^T: [out=vocab, in=d_model]
    encoder.position_encodings.encodings = _position_table(params, "encoder", cfg)
    decoder.position_encodings.encodings = _position_table(params, "decoder", cfg)
    for i, layer in enumerate(encoder.layer):
        ours = params["encoder"][f"layer_{i}"]
        _set_self_attention(layer.self_attention, ours["self_attention"], ours["attention_block"]["norm"])
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
