"""The encoder-decoder Transformer of Vaswani et al. (2017), in Flax linen.

Names map to the paper as follows: ``d_model`` (model width), ``d_ff`` (inner size of the position-wise
feed-forward network), ``num_heads`` (h), ``d_k`` / ``d_v`` (per-head query-key and value sizes),
``num_encoder_layers`` / ``num_decoder_layers`` (N), ``dropout_rate`` (P_drop) and, in training,
``label_smoothing`` (epsilon_ls).

Faithful to the paper by default:
  * one embedding matrix shared by the source, the target and the pre-softmax projection, with
    embeddings multiplied by sqrt(d_model) (section 3.4);
  * sinusoidal positions (section 3.5), a learned table as the Table 3 (E) option, and beyond the paper
    rotary, ALiBi, relative (Shaw et al. 2018) or no positions (``positions.py``);
  * post-norm residuals LayerNorm(x + Dropout(Sublayer(x))) (section 3.1, 5.4), pre-norm as an option;
  * attention projections W^Q, W^K, W^V, W^O without biases (equation on page 5); FFN with biases.

Every parameter and activation carries logical axis names (``axes.py``) so that training can shard it
by rules from the config (``sharding.py``). Arrays are documented as ``dtype[dims]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import attention, blockwise_attention, fused_attention, positions
from transformer_jax.model.axes import BATCH, EMBED, HEADS, KV, LENGTH, MLP, VOCAB
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.decode_cache import DecodeCache, LayerCache
from transformer_jax.model.special_ids import BOS_ID

Array = jax.Array
# The length of the dummy sequences that initialize the parameters: no parameter's shape depends on it, and
# one position fits every model, a learned table of any max_len >= 1 too.
INIT_LENGTH = 1


def shift_right(targets: Array, bos_id: int = BOS_ID) -> Array:
    """Decoder input: int[batch, length] targets shifted one step right, starting with ``bos_id``."""
    start = jnp.full_like(targets[:, :1], bos_id)
    shifted = jnp.concatenate([start, targets[:, :-1]], axis=1)
    return shifted


def _dense_init(in_axis: int | tuple[int, ...] = -2, out_axis: int | tuple[int, ...] = -1):
    """Glorot (Xavier) uniform over the matrix a kernel stands for: the fans are its input and output axes.

    A head-split kernel names them: W^Q [d_model, h, d_k] draws as its d_model x (h * d_k) matrix."""
    return nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)


def _attention_init(config: ModelConfig, in_axis: int | tuple[int, ...], out_axis: int | tuple[int, ...]):
    """A head-split kernel's init: its matrix's fans, or flax's default axes (``config.attention_init``)."""
    return _dense_init() if config.attention_init == "narrow" else _dense_init(in_axis, out_axis)


def _constrain(x: Array, axes: tuple[str, ...]) -> Array:
    return nn.with_logical_constraint(x, axes)


class Embed(nn.Module):
    """The shared token embedding, scaled by sqrt(d_model), and its use as the output projection."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        init = nn.initializers.normal(stddev=cfg.d_model**-0.5)  # unit variance after the sqrt scaling
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(init, (VOCAB, EMBED)),
            (cfg.vocab_size, cfg.d_model), jnp.float32)

    def __call__(self, tokens: Array) -> Array:
        """int[batch, length] -> float[batch, length, d_model], times sqrt(d_model)."""
        cfg = self.config
        x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.compute_dtype)
        return x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)

    def attend(self, x: Array) -> Array:
        """float[batch, length, d_model] -> float32[batch, length, vocab] logits (x E^T)."""
        cfg = self.config
        logits = jnp.einsum("bld,vd->blv", x, self.embedding.astype(cfg.compute_dtype))
        return _constrain(logits.astype(jnp.float32), (BATCH, LENGTH, VOCAB))


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    Projection kernels keep the heads as their own axis: W^Q is [d_model, h, d_k], W^O is
    [h, d_v, d_model]. ``__call__`` attends over whole sequences. Cached decoding (``Decoder``) projects
    keys and values with ``keys_values`` into its ``DecodeCache`` and attends one position to them with
    ``attend_cached``.
    """

    config: ModelConfig
    causal: bool = False  # decoder self-attention: position i attends to positions <= i
    self_attention: bool = False  # the position scheme acts here (positions.SelfAttentionPositions)

    def setup(self):
        cfg = self.config
        if self.self_attention:
            self.positions = positions.SelfAttentionPositions(cfg)
        # float32 parameters, created in this order (each draws the module's next "params" key)
        self.w_q = self._kernel("query", cfg.d_k)
        self.w_k = self._kernel("key", cfg.d_k)
        self.w_v = self._kernel("value", cfg.d_v)
        self.w_o = self.param(
            "out", nn.with_logical_partitioning(
                _attention_init(cfg, in_axis=(0, 1), out_axis=2), (HEADS, KV, EMBED)),
            (cfg.num_heads, cfg.d_v, cfg.d_model), jnp.float32)

    def _kernel(self, name: str, head_dim: int) -> Array:
        cfg = self.config
        return self.param(
            name, nn.with_logical_partitioning(
                _attention_init(cfg, in_axis=0, out_axis=(1, 2)), (EMBED, HEADS, KV)),
            (cfg.d_model, cfg.num_heads, head_dim), jnp.float32)

    def _project(self, x: Array, kernel: Array) -> Array:
        """float[batch, len, d_model] x [d_model, h, d] -> float[batch, len, h, d]."""
        out = jnp.einsum("bld,dhk->blhk", x, kernel.astype(self.config.compute_dtype))  # [B, L, H, K]
        return _constrain(out, (BATCH, LENGTH, HEADS, KV))

    def _output(self, heads: Array) -> Array:
        """Concat(head_1..head_h) W^O: float[batch, len, h, d_v] -> float[batch, len, d_model]."""
        out = jnp.einsum("blhk,hkd->bld", heads, self.w_o.astype(self.config.compute_dtype))
        return _constrain(out, (BATCH, LENGTH, EMBED))

    def keys_values(self, inputs_kv: Array, kv_positions: Array | None = None) -> tuple[Array, Array]:
        """float[batch, kv_len, d_model] -> keys float[batch, kv_len, h, d_k], values [.., d_v]; in
        self-attention the keys are at ``kv_positions`` int32[kv_len] (rotary rotates them)."""
        key = self._project(inputs_kv, self.w_k)
        if self.self_attention:
            key = self.positions.rotate(key, kv_positions)
        return key, self._project(inputs_kv, self.w_v)

    def _queries(self, inputs_q: Array, q_positions: Array | None) -> Array:
        """float[batch, q_len, d_model] -> float[batch, q_len, h, d_k] at ``q_positions`` int32[q_len]."""
        query = self._project(inputs_q, self.w_q)
        return self.positions.rotate(query, q_positions) if self.self_attention else query

    def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None) -> Array:
        """Attention from ``inputs_q`` to ``inputs_kv``.

        Args:
          inputs_q: float[batch, q_len, d_model].
          inputs_kv: float[batch, kv_len, d_model].
          mask: bool[batch|1, 1, q_len|1, kv_len], True = may attend, or None. With ``causal`` the
            causal mask is added here.

        Returns:
          float[batch, q_len, d_model].
        """
        cfg = self.config
        q_positions, kv_positions = jnp.arange(inputs_q.shape[1]), jnp.arange(inputs_kv.shape[1])
        query = self._queries(inputs_q, q_positions)
        key, value = self.keys_values(inputs_kv, kv_positions)
        if cfg.attention_impl == "blockwise":  # no logit terms (ModelConfig refuses those schemes)
            out = blockwise_attention.blockwise_attention(
                query, key, value, mask, causal=self.causal, block_size=cfg.attention_block_size)
            return self._output(out)
        if cfg.attention_impl == "fused":
            out = fused_attention.fused_attention(query, key, value, mask, causal=self.causal,
                                                  implementation=self._fused_implementation())
            return self._output(out)
        if self.causal:
            mask = attention.combine_masks(mask, attention.causal_mask(query.shape[1]))
        dropout_rng = None
        if not cfg.deterministic and cfg.attention_dropout_rate > 0:
            dropout_rng = self.make_rng("dropout")
        bias = self.positions.logit_bias(query, q_positions, kv_positions) if self.self_attention else None
        out, weights = attention.dot_product_attention(
            query, key, value, mask, bias=bias, return_weights=True,
            dropout_rate=0.0 if dropout_rng is None else cfg.attention_dropout_rate, rng=dropout_rng)
        if self.self_attention:
            out = self.positions.add_output_term(out, weights, q_positions, kv_positions)
        if cfg.attention_witness:
            attention.witness_in_jit(weights, mask)
        # Free unless "intermediates" is mutable: lets analysis read the maps, queries and keys.
        self.sow("intermediates", "attention_weights", weights)  # [B, H, Q, K]
        self.sow("intermediates", "queries", query)  # [B, Q, H, d_k]
        self.sow("intermediates", "keys", key)  # [B, K, H, d_k]
        return self._output(out)

    def attend_cached(self, inputs_q: Array, key: Array, value: Array, mask: Array,
                      q_position: Array | None = None, kv_positions: Array | None = None) -> Array:
        """One decoding step's attention to cached keys and values (``attention.decode_attention``).

        Args:
          inputs_q: float[batch * beams, 1, d_model].
          key: float[batch, h, keys, d_k], value: float[batch, h, keys, d_v], head-major, shared by the
            beams of an example (a ``LayerCache``'s).
          mask: bool[batch|1, 1, keys, beams|1], keys first: the source padding (cross-attention) or
            ``DecodeCache.self_attention_mask`` (self-attention).
          q_position: self-attention only: int32[1], the step's position; kv_positions: int32[keys], the
            cached keys' positions (``DecodeCache.key_positions``).

        Returns:
          float[batch * beams, 1, d_model].
        """
        query = self._queries(inputs_q, q_position)
        if self.config.attention_impl == "fused":
            return self._output(self._attend_cached_fused(query, key, value, mask))
        bias = self.positions.logit_bias(query, q_position, kv_positions) if self.self_attention else None
        out, weights = attention.decode_attention(query, key, value, mask, bias=bias)
        if self.config.attention_witness:
            attention.witness_in_jit(weights, jnp.swapaxes(mask, 2, 3))
        if self.self_attention:  # weights [B, H, beams, keys] -> [B * beams, H, 1, keys]
            rows_weights = jnp.swapaxes(weights, 1, 2).reshape(query.shape[0], -1, 1, weights.shape[-1])
            out = self.positions.add_output_term(out, rows_weights, q_position, kv_positions)
        return self._output(out)

    def _fused_implementation(self) -> str:
        cfg = self.config
        return fused_attention.implementation_for(cfg.dtype, cfg.d_k)

    def _attend_cached_fused(self, query: Array, key: Array, value: Array, mask: Array) -> Array:
        """``attend_cached`` through ``fused_attention``: an example's beams are its queries.

        query: float[batch * beams, 1, h, d_k]; key, value: float[batch, h, keys, d_k] (head-major);
        mask: bool[batch|1, 1, keys, beams|1] (keys first). Returns float[batch * beams, 1, h, d_k].
        """
        batch, heads, _, d_k = key.shape
        beams = query.shape[0] // batch
        out = fused_attention.fused_attention(
            query.reshape(batch, beams, heads, d_k),  # [B, beams, H, d_k]
            jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2),  # [B, keys, H, d_k]
            jnp.swapaxes(mask, 2, 3),  # [B|1, 1, beams|1, keys]
            implementation=self._fused_implementation())
        return out.reshape(batch * beams, 1, heads, d_k)


def ffn_activation(name: str) -> Callable[[Array], Array]:
    """The function of ``ModelConfig.ffn_activation`` ``name`` (one of ``config.FFN_ACTIVATIONS``)."""
    return {"relu": nn.relu,
            "gelu": functools.partial(nn.gelu, approximate=False),
            "gelu_tanh": functools.partial(nn.gelu, approximate=True),
            "gelu_sigmoid": lambda x: x * nn.sigmoid(1.702 * x),
            "swish": nn.swish}[name]


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2: act is max(0, .) in the paper (equation 2); ``ffn_activation``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """float[batch, length, d_model] -> same shape."""
        cfg = self.config
        dense = functools.partial(nn.Dense, dtype=cfg.compute_dtype, param_dtype=jnp.float32)
        h = dense(cfg.d_ff, kernel_init=nn.with_logical_partitioning(_dense_init(), (EMBED, MLP)),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (MLP,)),
                  name="wi")(x)
        h = _constrain(ffn_activation(cfg.ffn_activation)(h), (BATCH, LENGTH, MLP))
        out = dense(cfg.d_model, kernel_init=nn.with_logical_partitioning(_dense_init(), (MLP, EMBED)),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)),
                    name="wo")(h)
        return _constrain(out, (BATCH, LENGTH, EMBED))


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=cfg.compute_dtype, param_dtype=jnp.float32, name=name,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, (EMBED,)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)))


class Residual(nn.Module):
    """One sub-layer with its residual path: post-norm LN(x + Drop(f(x))) or pre-norm x + Drop(f(LN(x)))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, sublayer, *args, has_aux: bool = False) -> Array | tuple[Array, Any]:
        """x float[batch, len, d_model] -> same shape. ``sublayer(y, *args)`` returns f(y), or with
        ``has_aux`` a pair (f(y), aux), and then so does this call: (the output, aux)."""
        cfg = self.config
        norm = _layer_norm(cfg, "norm")
        dropout = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)
        out = sublayer(norm(x) if cfg.norm_style == "pre" else x, *args)
        y, aux = out if has_aux else (out, None)
        x = x + dropout(y) if cfg.norm_style == "pre" else norm(x + dropout(y))
        return (x, aux) if has_aux else x


class EncoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array) -> Array:
        """float[batch, src_len, d_model], bool[batch, 1, 1, src_len] -> float[batch, src_len, d_model]."""
        cfg = self.config
        self_attention = MultiHeadAttention(cfg, self_attention=True, name="self_attention")
        x = Residual(cfg, name="attention_block")(x, lambda y: self_attention(y, y, mask))
        return Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN; over whole sequences or one cached step."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.self_attention = MultiHeadAttention(cfg, causal=True, self_attention=True)
        self.cross_attention = MultiHeadAttention(cfg)
        self.self_attention_block = Residual(cfg)
        self.cross_attention_block = Residual(cfg)
        self.ffn_block = Residual(cfg)
        self.ffn = FeedForward(cfg)

    def __call__(self, x: Array, encoded: Array, cross_mask: Array) -> Array:
        """x float[batch, tgt_len, d_model] (position i sees positions <= i), the encoder output
        float[batch, src_len, d_model] and its padding mask bool[batch, 1, 1, src_len] -> x's shape."""
        x = self.self_attention_block(x, lambda y: self.self_attention(y, y, None))
        x = self.cross_attention_block(x, lambda y: self.cross_attention(y, encoded, cross_mask))
        return self.ffn_block(x, self.ffn)

    def decode_step(self, x: Array, cross_mask: Array, self_mask: Array, cache: LayerCache,
                    index: Array, key_positions: Array) -> tuple[Array, LayerCache]:
        """One cached step: this position's keys/values are written at ``index``, then attended with the
        cached ones.

        Args:
          x: float[batch * beams, 1, d_model].
          cross_mask: bool[batch, 1, src_len, 1] source padding mask, keys first.
          self_mask: bool[batch, 1, cache_len * beams, beams], ``DecodeCache.self_attention_mask``.
          cache: this layer's cache; index: int32 scalar, the position.
          key_positions: int32[cache_len * beams], the position of each cached key
            (``DecodeCache.key_positions``).

        Returns:
          float[batch * beams, 1, d_model] and the cache with this step written.
        """
        position = index[None]  # [1]

        def self_attend(y):
            written = cache.write(*self.self_attention.keys_values(y, position), index)
            out = self.self_attention.attend_cached(y, written.self_key, written.self_value, self_mask,
                                                    position, key_positions)
            return out, written

        def cross_attend(y):
            return self.cross_attention.attend_cached(y, cache.cross_key, cache.cross_value, cross_mask)

        x, cache = self.self_attention_block(x, self_attend, has_aux=True)
        x = self.cross_attention_block(x, cross_attend)
        return self.ffn_block(x, self.ffn), cache


class Encoder(nn.Module):
    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """int[batch, src_len] source ids -> float[batch, src_len, d_model]."""
        cfg = self.config
        mask = attention.padding_mask(None, inputs)  # [B, 1, 1, S]
        x = positions.AddPositions(cfg, name="positions")(
            self.embed(inputs), jnp.arange(inputs.shape[1]), inputs.shape[1])
        x = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(x)
        x = _constrain(x, (BATCH, LENGTH, EMBED))
        for i in range(cfg.num_encoder_layers):
            x = EncoderLayer(cfg, name=f"layer_{i}")(x, mask)
        if cfg.norm_style == "pre":
            x = _layer_norm(cfg, "final_norm")(x)
        return x


class Decoder(nn.Module):
    config: ModelConfig
    embed: Embed

    def setup(self):
        # The layers here (not in __call__) so that init_cache reaches their encoder-decoder attention.
        self.layers = tuple(DecoderLayer(self.config, name=f"layer_{i}")
                            for i in range(self.config.num_decoder_layers))

    @nn.compact
    def __call__(self, encoded: Array | None, inputs: Array, decoder_input_tokens: Array,
                 cache: DecodeCache | None = None, *,
                 hidden_only: bool = False) -> Array | tuple[Array, DecodeCache]:
        """Logits for the next token at every decoder position, or in decode mode for one cached step.

        Args:
          encoded: float[batch, src_len, d_model], the encoder output (unused in decode mode: the cache
            holds its keys and values).
          inputs: int[batch, src_len] source ids (for the padding mask).
          decoder_input_tokens: int[batch, tgt_len], targets shifted right. In decode mode
            int[batch * beams, 1]: one position of every beam (row ``b * beams + k``).
          cache: decode mode only (``config.decode``): from :meth:`init_cache` or the previous step.
          hidden_only: return the last layer's output float[batch, tgt_len, d_model], before the output
            projection (``Embed.attend``); not in decode mode.

        Returns:
          float32[batch, tgt_len, vocab_size] logits; in decode mode float32[batch * beams, 1, vocab]
          logits and the cache advanced by this step.
        """
        cfg = self.config
        if cfg.decode != (cache is not None):
            raise ValueError(f"a cache is needed in decode mode and only there (decode={cfg.decode})")
        cross_mask = attention.padding_mask(None, inputs)  # [B, 1, 1, S]
        if cache is not None:
            cache = cache.start_step()
        length = decoder_input_tokens.shape[1]
        where = (jnp.arange(length), length) if cache is None else (cache.index[None], cache.cache_len)
        x = positions.AddPositions(cfg, name="positions")(self.embed(decoder_input_tokens), *where)
        x = self.perturb("embedded", x)  # identity; lets tests take gradients w.r.t. the inputs
        x = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(x)
        x = _constrain(x, (BATCH, LENGTH, EMBED))
        if cache is None:
            for layer in self.layers:
                x = layer(x, encoded, cross_mask)
        else:  # keys first (attention.decode_attention)
            cross_mask, self_mask = jnp.swapaxes(cross_mask, 2, 3), cache.self_attention_mask()
            key_positions = cache.key_positions()
            written = []
            for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
                x, layer_cache = layer.decode_step(x, cross_mask, self_mask, layer_cache, cache.index,
                                                   key_positions)
                written.append(layer_cache)
            cache = cache._replace(layers=tuple(written), index=cache.index + 1)
        if cfg.norm_style == "pre":
            x = _layer_norm(cfg, "final_norm")(x)
        if hidden_only and cache is None:  # the chunked training loss projects it a chunk at a time
            return x
        logits = self.embed.attend(x)
        return logits if cache is None else (logits, cache)

    def init_cache(self, encoded: Array, cache_len: int, beams: int) -> DecodeCache:
        """An empty cache of ``cache_len`` positions for ``beams`` rows per example of ``encoded``
        float[batch, src_len, d_model], with its projected keys and values (computed once)."""
        if cache_len < 1 or beams < 1:
            raise ValueError(f"a decode cache needs cache_len >= 1 and beams >= 1, got {cache_len}, {beams}")
        positions.check_length(self.config, cache_len, "a decode cache")
        head_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, S, H, d] -> [B, H, S, d]
        cross = [tuple(map(head_major, layer.cross_attention.keys_values(encoded))) for layer in self.layers]
        return DecodeCache.create(cross, cache_len, beams)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with ``encode``, ``decode`` and ``__call__`` (teacher forcing); in
    decode mode ``decode`` runs one step against a cache from ``init_cache``."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.shared_embedding = Embed(cfg)
        self.encoder = Encoder(cfg, embed=self.shared_embedding)
        self.decoder = Decoder(cfg, embed=self.shared_embedding)

    def encode(self, inputs: Array) -> Array:
        """int[batch, src_len] -> float[batch, src_len, d_model]."""
        return self.encoder(inputs)

    def init_cache(self, encoded: Array, cache_len: int, beams: int = 1) -> DecodeCache:
        """The decode cache for ``encoded`` float[batch, src_len, d_model]: see :class:`DecodeCache`."""
        return self.decoder.init_cache(encoded, cache_len, beams)

    def decode(self, encoded: Array | None, inputs: Array, decoder_input_tokens: Array,
               cache: DecodeCache | None = None) -> Array | tuple[Array, DecodeCache]:
        """See :class:`Decoder`: float32[batch, tgt_len, vocab_size] logits, or in decode mode one step
        against ``cache``: (logits float32[batch * beams, 1, vocab], the advanced cache)."""
        return self.decoder(encoded, inputs, decoder_input_tokens, cache)

    def __call__(self, inputs: Array, targets: Array) -> Array:
        """Teacher-forced logits float32[batch, tgt_len, vocab] for int[batch, src_len] inputs and
        int[batch, tgt_len] targets (the decoder sees ``shift_right(targets)``)."""
        return self.decode(self.encode(inputs), inputs, shift_right(targets))

    def hidden(self, inputs: Array, targets: Array) -> Array:
        """``__call__`` without the output projection: float[batch, tgt_len, d_model], same dropout;
        ``logits(hidden(inputs, targets)) == __call__(inputs, targets)``."""
        return self.decoder(self.encode(inputs), inputs, shift_right(targets), hidden_only=True)

    def logits(self, hidden: Array) -> Array:
        """The output projection x E^T: float[batch, n, d_model] -> float32[batch, n, vocab]."""
        return self.shared_embedding.attend(hidden)


def init_params(config: ModelConfig, *, rng: Array, src_len: int = INIT_LENGTH,
                tgt_len: int = INIT_LENGTH) -> Any:
    """Initial (unboxed) parameters for ``Transformer(config)``, traced on int32[1, src_len] sources and
    int32[1, tgt_len] targets."""
    model = Transformer(config.replace(deterministic=True, decode=False))
    inputs = jnp.ones((1, src_len), jnp.int32)
    targets = jnp.ones((1, tgt_len), jnp.int32)
    variables = model.init(rng, inputs, targets)
    return nn.meta.unbox(variables["params"])

