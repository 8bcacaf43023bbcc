"""The encoder-decoder Transformer of Vaswani et al. (2017), in Flax linen.

Names map to the paper as follows: ``d_model`` (model width), ``d_ff`` (inner size of the position-wise
feed-forward network), ``num_heads`` (h), ``d_k`` / ``d_v`` (per-head query-key and value sizes),
``num_encoder_layers`` / ``num_decoder_layers`` (N), ``dropout_rate`` (P_drop) and, in training,
``label_smoothing`` (epsilon_ls).

Faithful to the paper by default:
  * one embedding matrix shared by the source, the target and the pre-softmax projection, with
    embeddings multiplied by sqrt(d_model) (section 3.4);
  * sinusoidal positions (section 3.5), a learned table as the Table 3 (E) option;
  * post-norm residuals LayerNorm(x + Dropout(Sublayer(x))) (section 3.1, 5.4), pre-norm as an option;
  * attention projections W^Q, W^K, W^V, W^O without biases (equation on page 5); FFN with biases.

Every parameter and activation carries logical axis names (``axes.py``) so that training can shard it
by rules from the config (``sharding.py``). Arrays are documented as ``dtype[dims]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import attention, blockwise_attention
from transformer_jax.model.axes import BATCH, EMBED, HEADS, KV, LENGTH, MLP, VOCAB
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import BOS_ID

Array = jax.Array


def shift_right(targets: Array, bos_id: int = BOS_ID) -> Array:
    """Decoder input: int[batch, length] targets shifted one step right, starting with ``bos_id``."""
    start = jnp.full_like(targets[:, :1], bos_id)
    shifted = jnp.concatenate([start, targets[:, :-1]], axis=1)
    return shifted


def sinusoidal_table(max_len: int, d_model: int) -> np.ndarray:
    """float32[max_len, d_model]: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    positions = np.arange(max_len, dtype=np.float64)[:, None]  # [L, 1]
    rates = 1.0 / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # [D/2]
    angles = positions * rates[None, :]  # [L, D/2]
    table = np.zeros((max_len, d_model), np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(np.float32)


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


class AddPositions(nn.Module):
    """Adds sinusoidal or learned positions; in decode mode, the position of the cached step."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """float[batch, length, d_model] -> same shape, positions added."""
        cfg = self.config
        length = x.shape[1]
        if cfg.position_encoding == "learned":
            table = self.param(
                "position_embedding",
                nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.d_model**-0.5),
                                             (None, EMBED)),
                (cfg.max_len, cfg.d_model), jnp.float32)
        else:
            table = jnp.asarray(sinusoidal_table(cfg.max_len, cfg.d_model))
        if cfg.decode:
            is_initialized = self.has_variable("cache", "position_index")
            index = self.variable("cache", "position_index", lambda: jnp.zeros((), jnp.int32))
            if is_initialized:
                position = jax.lax.dynamic_slice_in_dim(table, index.value, 1)  # [1, D]
                index.value = index.value + 1
                return x + position[None].astype(x.dtype)
        if length > cfg.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={cfg.max_len} of the model")
        return x + table[None, :length].astype(x.dtype)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    Projection kernels keep the heads as their own axis: W^Q is [d_model, h, d_k], W^O is
    [h, d_v, d_model]. In decode mode (``config.decode``) the module keeps a "cache" collection:
      * ``kind="self"`` (decoder self-attention): keys and values of earlier steps, one new position a call;
      * ``kind="cross"`` (encoder-decoder attention): the projected encoder keys and values, computed once.
    The first decode-mode call only creates the cache (see ``evaluation.kv_cache.init_cache``).
    """

    config: ModelConfig
    kind: str = "self"  # "self" or "cross"; matters only in decode mode
    causal: bool = False  # decoder self-attention: position i attends to positions <= i

    def _kernel(self, name: str, head_dim: int) -> Array:
        cfg = self.config
        kernel = self.param(
            name, nn.with_logical_partitioning(
                _attention_init(cfg, in_axis=0, out_axis=(1, 2)), (EMBED, HEADS, KV)),
            (cfg.d_model, cfg.num_heads, head_dim), jnp.float32)
        return kernel.astype(cfg.compute_dtype)

    @staticmethod
    def _project(x: Array, kernel: Array) -> Array:
        out = jnp.einsum("bld,dhk->blhk", x, kernel)  # [B, L, H, K]
        return _constrain(out, (BATCH, LENGTH, HEADS, KV))

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array, mask: Array | None) -> Array:
        """Attention from ``inputs_q`` to ``inputs_kv``.

        Args:
          inputs_q: float[batch, q_len, d_model].
          inputs_kv: float[batch, kv_len, d_model].
          mask: bool[batch|1, 1, q_len|1, kv_len], True = may attend, or None. With ``causal`` the
            causal mask is added here. In decode mode, ``inputs_q`` is float[batch * beams, 1, d_model]
            and the mask is keys-first, [batch|1, 1, keys, beams|1], over this module's cache: the
            source padding (cross) or the ancestry mask of :class:`Decoder` (self).

        Returns:
          float[batch, q_len, d_model].
        """
        cfg = self.config
        query = self._project(inputs_q, self._kernel("query", cfg.d_k))
        key_kernel, value_kernel = self._kernel("key", cfg.d_k), self._kernel("value", cfg.d_v)
        if cfg.decode:
            if self.kind == "self":
                key, value = self._self_attention_cache(
                    self._project(inputs_kv, key_kernel), self._project(inputs_kv, value_kernel))
            else:
                key, value = self._cross_attention_cache(inputs_kv, key_kernel, value_kernel)
            out, weights = attention.decode_attention(query, key, value, mask)
            if cfg.attention_witness:
                attention.witness_in_jit(weights, jnp.swapaxes(mask, 2, 3))
        elif cfg.attention_impl == "blockwise":
            key, value = self._project(inputs_kv, key_kernel), self._project(inputs_kv, value_kernel)
            out = blockwise_attention.blockwise_attention(
                query, key, value, mask, causal=self.causal, block_size=cfg.attention_block_size)
        else:
            key, value = self._project(inputs_kv, key_kernel), self._project(inputs_kv, value_kernel)
            if self.causal:
                mask = attention.combine_masks(mask, attention.causal_mask(query.shape[1]))
            dropout_rng = None
            if not cfg.deterministic and cfg.attention_dropout_rate > 0:
                dropout_rng = self.make_rng("dropout")
            out, weights = attention.dot_product_attention(
                query, key, value, mask, return_weights=True,
                dropout_rate=0.0 if dropout_rng is None else cfg.attention_dropout_rate,
                rng=dropout_rng)
            if cfg.attention_witness:
                attention.witness_in_jit(weights, mask)
            # Free unless "intermediates" is mutable: lets analysis read the maps, queries and keys.
            self.sow("intermediates", "attention_weights", weights)  # [B, H, Q, K]
            self.sow("intermediates", "queries", query)  # [B, Q, H, d_k]
            self.sow("intermediates", "keys", key)  # [B, K, H, d_k]
        out_kernel = self.param(
            "out", nn.with_logical_partitioning(
                _attention_init(cfg, in_axis=(0, 1), out_axis=2), (HEADS, KV, EMBED)),
            (cfg.num_heads, cfg.d_v, cfg.d_model), jnp.float32)
        out = jnp.einsum("blhk,hkd->bld", out, out_kernel.astype(cfg.compute_dtype))
        return _constrain(out, (BATCH, LENGTH, EMBED))

    def _self_attention_cache(self, key: Array, value: Array) -> tuple[Array, Array]:
        """Writes one step's keys/values into the cache; returns the whole cache, head-major.

        Slot ``j`` of an example holds, at position t, what the hypothesis in beam row j wrote at step
        t; the cache is never reordered when beams are (``Decoder``'s ancestry mask picks each row's
        ancestors' slots instead). The buffers are position-major, [batch, heads, cache_len * beams,
        d]: a step's keys of all beams are one contiguous block, written by one dynamic-update-slice
        into the very array attention reads (no reshape between them). With a [.., beams, cache_len,
        ..] buffer viewed as [.., beams * cache_len, ..], XLA:CPU copied every cache buffer 4 times
        per step (measured in the compiled beam search).

        Args:
          key: float[batch * beams, 1, heads, d_k]; value: float[batch * beams, 1, heads, d_v].

        Returns:
          keys float[batch, heads, cache_len * beams, d_k] and values [batch, heads, cache_len *
          beams, d_v], position-major (index ``t * beams + j``).
        """
        cfg = self.config
        if key.shape[1] != 1:
            raise ValueError(f"cached decoding takes one position per call, got {key.shape[1]}")
        cache_len = cfg.decode_cache_len or cfg.max_len
        rows, _, heads, _ = key.shape
        beams = cfg.decode_beams
        batch = rows // beams
        is_initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros,
                                   (batch, heads, cache_len * beams, cfg.d_k), key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                     (batch, heads, cache_len * beams, cfg.d_v), value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        if is_initialized:
            index = cache_index.value
            for cached, new in ((cached_key, key), (cached_value, value)):
                new = new.reshape(batch, beams, heads, -1).transpose(0, 2, 1, 3)  # [B, H, beams, d]
                cached.value = jax.lax.dynamic_update_slice_in_dim(cached.value, new, index * beams, axis=2)
            cache_index.value = index + 1
        return cached_key.value, cached_value.value

    def _cross_attention_cache(self, encoded: Array, key_kernel: Array,
                               value_kernel: Array) -> tuple[Array, Array]:
        """The encoder keys/values float[batch, heads, src_len, d_k|d_v], projected once (when the
        cache is created) and shared by the beams of an example."""
        if self.has_variable("cache", "encoded_key"):
            return (self.get_variable("cache", "encoded_key"),
                    self.get_variable("cache", "encoded_value"))
        head_major = lambda kernel: jnp.transpose(self._project(encoded, kernel), (0, 2, 1, 3))
        key = self.variable("cache", "encoded_key", head_major, key_kernel)
        value = self.variable("cache", "encoded_value", head_major, value_kernel)
        return key.value, value.value


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (equation 2)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """float[batch, length, d_model] -> same shape."""
        cfg = self.config
        dense = functools.partial(nn.Dense, dtype=cfg.compute_dtype, param_dtype=jnp.float32)
        h = dense(cfg.d_ff, kernel_init=nn.with_logical_partitioning(_dense_init(), (EMBED, MLP)),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (MLP,)),
                  name="wi")(x)
        h = _constrain(nn.relu(h), (BATCH, LENGTH, MLP))
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
    def __call__(self, x: Array, sublayer, *args) -> Array:
        cfg = self.config
        norm = _layer_norm(cfg, "norm")
        dropout = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)
        if cfg.norm_style == "pre":
            return x + dropout(sublayer(norm(x), *args))
        return norm(x + dropout(sublayer(x, *args)))


class EncoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array) -> Array:
        """float[batch, src_len, d_model], bool[batch, 1, 1, src_len] -> float[batch, src_len, d_model]."""
        cfg = self.config
        self_attention = MultiHeadAttention(cfg, name="self_attention")
        x = Residual(cfg, name="attention_block")(x, lambda y: self_attention(y, y, mask))
        return Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"))


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, encoded: Array, cross_mask: Array, self_mask: Array | None) -> Array:
        """Masked self-attention, encoder-decoder attention, FFN.

        Args:
          x: float[batch, tgt_len, d_model] (decode mode: [batch * beams, 1, d_model]).
          encoded: float[batch, src_len, d_model].
          cross_mask: bool[batch, 1, 1, src_len] source padding mask.
          self_mask: None (the causal mask), or in decode mode the ancestry mask of :class:`Decoder`.
        """
        cfg = self.config
        self_attention = MultiHeadAttention(cfg, kind="self", causal=True, name="self_attention")
        cross_attention = MultiHeadAttention(cfg, kind="cross", name="cross_attention")
        x = Residual(cfg, name="self_attention_block")(x, lambda y: self_attention(y, y, self_mask))
        x = Residual(cfg, name="cross_attention_block")(
            x, lambda y: cross_attention(y, encoded, cross_mask))
        return Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"))


class Encoder(nn.Module):
    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """int[batch, src_len] source ids -> float[batch, src_len, d_model]."""
        cfg = self.config
        mask = attention.padding_mask(None, inputs)  # [B, 1, 1, S]
        x = AddPositions(cfg, name="positions")(self.embed(inputs))
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

    @nn.compact
    def __call__(self, encoded: Array, inputs: Array, decoder_input_tokens: Array) -> Array:
        """Logits for the next token at every decoder position.

        Args:
          encoded: float[batch, src_len, d_model], the encoder output.
          inputs: int[batch, src_len] source ids (for the padding mask).
          decoder_input_tokens: int[batch, tgt_len], targets shifted right. In decode mode
            int[batch * decode_beams, 1]: one position of every beam (row ``b * beams + k``).

        Returns:
          float32[batch, tgt_len, vocab_size] logits ([batch * beams, 1, vocab] in decode mode).
        """
        cfg = self.config
        cross_mask = attention.padding_mask(None, inputs)  # [B, 1, 1, S]
        self_mask = None
        if cfg.decode:  # keys first (attention.decode_attention)
            cross_mask = jnp.swapaxes(cross_mask, 2, 3)  # [B, 1, S, 1]
            self_mask = self._ancestry_mask(decoder_input_tokens.shape[0])
        x = AddPositions(cfg, name="positions")(self.embed(decoder_input_tokens))
        x = self.perturb("embedded", x)  # identity; lets tests take gradients w.r.t. the inputs
        x = nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(x)
        x = _constrain(x, (BATCH, LENGTH, EMBED))
        for i in range(cfg.num_decoder_layers):
            x = DecoderLayer(cfg, name=f"layer_{i}")(x, encoded, cross_mask, self_mask)
        if cfg.norm_style == "pre":
            x = _layer_norm(cfg, "final_norm")(x)
        return self.embed.attend(x)

    def _ancestry_mask(self, rows: int) -> Array:
        """Decode mode: which cached positions each beam row attends to, as its self-attention mask.

        The "cache" variable ``ancestry`` int32[batch * beams, cache_len] holds, for row r and position
        t, the beam slot whose self-attention cache holds r's ancestor's key at t. Each step sets
        position t to the row's own slot (it writes there); beam search reorders only this table
        (``evaluation.kv_cache``), never the keys and values.

        Returns:
          bool[batch, 1, cache_len * beams, beams]: position t, slot j (index ``t * beams + j``, the
          cache's order) is allowed for beam k iff t <= the step and ``ancestry[b * beams + k, t] == j``.
        """
        cfg = self.config
        beams, cache_len = cfg.decode_beams, cfg.decode_cache_len or cfg.max_len
        is_initialized = self.has_variable("cache", "ancestry")
        ancestry = self.variable("cache", "ancestry", jnp.zeros, (rows, cache_len), jnp.int32)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        index = cache_index.value
        if is_initialized:
            own_slot = (jnp.arange(rows, dtype=jnp.int32) % beams)[:, None]  # [rows, 1]
            ancestry.value = jax.lax.dynamic_update_slice_in_dim(ancestry.value, own_slot, index, 1)
            cache_index.value = index + 1
        slots = jnp.swapaxes(ancestry.value.reshape(rows // beams, beams, cache_len), 1, 2)  # [B, T, K]
        written = (jnp.arange(cache_len) <= index)[None, :, None, None]  # [1, T, 1, 1]
        mask = (slots[:, :, None] == jnp.arange(beams)[None, None, :, None]) & written  # [B, T, J, K]
        return mask.reshape(rows // beams, 1, cache_len * beams, beams)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with ``encode``, ``decode`` and ``__call__`` (teacher forcing)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.shared_embedding = Embed(cfg)
        self.encoder = Encoder(cfg, embed=self.shared_embedding)
        self.decoder = Decoder(cfg, embed=self.shared_embedding)

    def encode(self, inputs: Array) -> Array:
        """int[batch, src_len] -> float[batch, src_len, d_model]."""
        return self.encoder(inputs)

    def decode(self, encoded: Array, inputs: Array, decoder_input_tokens: Array) -> Array:
        """See :class:`Decoder`. Returns float32[batch, tgt_len, vocab_size] logits."""
        return self.decoder(encoded, inputs, decoder_input_tokens)

    def __call__(self, inputs: Array, targets: Array) -> Array:
        """Teacher-forced logits float32[batch, tgt_len, vocab] for int[batch, src_len] inputs and
        int[batch, tgt_len] targets (the decoder sees ``shift_right(targets)``)."""
        return self.decode(self.encode(inputs), inputs, shift_right(targets))


def init_params(config: ModelConfig, *, rng: Array, src_len: int = 8, tgt_len: int = 8) -> Any:
    """Initial (unboxed) parameters for ``Transformer(config)``."""
    model = Transformer(config.replace(deterministic=True, decode=False))
    inputs = jnp.ones((1, src_len), jnp.int32)
    targets = jnp.ones((1, tgt_len), jnp.int32)
    variables = model.init(rng, inputs, targets)
    return nn.meta.unbox(variables["params"])

