"""The model in decode mode: the encoder, the key/value cache and one cached decoder step.

``decode.py``'s searches run on a ``Stepper``: a next-token function over n = batch * beams rows, with
its state (the cache) and the beam reorder. The cache holds one copy of each example's encoder
keys/values for all its beams, and self-attention keys/values in beam slots that are never moved: a
reorder gathers only the ``ancestry`` table, int32[n, cache_len], which says which slot holds each
row's ancestors (``model.transformer.Decoder``). ``grow_cache`` pads the self-attention cache with more
positions (masked positions weigh exactly 0, so the logits do not change) and ``select_examples`` keeps
some examples only: ``decode``'s loop uses both between its phases.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import BOS_ID
from transformer_jax.model.transformer import Transformer, shift_right

Array = jax.Array

# The cache leaves that grow with the output, and their position axis: the self-attention buffers
# [batch, heads, cache_len * beams, d_k|d_v] (position-major, so padding the axis adds positions) and
# the ancestry table [batch * beams, cache_len].
_POSITION_AXIS = {"cached_key": 2, "cached_value": 2, "ancestry": 1}
# The first phase's cache holds the source length plus this many positions (see the module docstring).
FIRST_CACHE_EXTRA = 16


def eval_config(model_config: ModelConfig) -> ModelConfig:
    return model_config.replace(decode=False, deterministic=True)


def encode(params: Any, model_config: ModelConfig, inputs: Array) -> Array:
    """int32[batch, src_len] source ids -> float[batch, src_len, d_model] encoder output (no dropout)."""
    return Transformer(eval_config(model_config)).apply(
        {"params": params}, inputs, method=Transformer.encode)


def _decode_config(model_config: ModelConfig, cache_len: int, beams: int) -> ModelConfig:
    return model_config.replace(decode=True, decode_cache_len=cache_len, decode_beams=beams,
                                deterministic=True)


def init_cache(model_config: ModelConfig, params: Any, encoded: Array, inputs: Array,
               cache_len: int, beams: int = 1) -> Any:
    """Creates the decode cache: empty self-attention buffers and the projected encoder keys/values.

    Runs the model's first decode-mode call, which only builds the cache (its logits are discarded).

    Args:
      model_config: any mode; decode mode with ``decode_cache_len=cache_len`` is derived from it.
      params: the model parameters.
      encoded: float[batch, src_len, d_model] encoder output.
      inputs: int32[batch, src_len] source ids.
      cache_len: positions the self-attention cache holds (the longest output).
      beams: decoder rows per example (``batch * beams`` rows in all).

    Returns:
      The "cache" collection, per decoder layer: self-attention keys/values [batch, heads, cache_len
      * beams, d_k|d_v] (zeros), cross-attention keys/values [batch, heads, src_len, d_k|d_v];
      the ancestry table int32[batch * beams, cache_len] (zeros) and scalar int32 indices (0).
    """
    cfg = _decode_config(model_config, cache_len, beams)
    start = jnp.full((inputs.shape[0] * beams, 1), BOS_ID, jnp.int32)  # [B*K, 1]
    _, state = Transformer(cfg).apply({"params": params}, encoded, inputs, start,
                                      method=Transformer.decode, mutable=["cache"])
    return state["cache"]


def _leaf_name(path) -> str | None:
    return getattr(path[-1], "key", None)


def _cache_shape(cache: Any) -> tuple[int, int]:
    """(cache_len, beams) of a cache built by :func:`init_cache`."""
    shapes = {_leaf_name(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]}
    if "cached_key" not in shapes or "ancestry" not in shapes:
        raise ValueError("the cache holds no 'cached_key' or 'ancestry' leaf; build it with init_cache")
    batch = shapes["cached_key"][0]  # [batch, heads, cache_len * beams, d_k]
    rows, cache_len = shapes["ancestry"]  # [batch * beams, cache_len]
    return cache_len, rows // batch


def grow_cache(cache: Any, cache_len: int) -> Any:
    """The cache with its self-attention buffers and ancestry zero-padded to ``cache_len`` positions
    (indices and encoder keys/values kept)."""
    old_len, beams = _cache_shape(cache)

    def pad(path, x):
        name = _leaf_name(path)
        if name not in _POSITION_AXIS:
            return x
        widths = [(0, 0)] * x.ndim
        widths[_POSITION_AXIS[name]] = (0, (cache_len - old_len) * (1 if name == "ancestry" else beams))
        return jnp.pad(x, widths)
    return jax.tree_util.tree_map_with_path(pad, cache)


def first_cache_len_for(first_cache_len: int | None, src_len: int, max_len: int) -> int:
    if first_cache_len is None:
        first_cache_len = src_len + FIRST_CACHE_EXTRA
    if first_cache_len < 1:
        raise ValueError(f"first_cache_len must be >= 1, got {first_cache_len}")
    return min(int(first_cache_len), max_len)


def select_examples(cache: Any, examples: Array) -> Any:
    """The cache of ``examples`` int32[m] only (in that order): every leaf with a batch axis keeps those
    examples' entries; the ancestry table keeps their beams' rows. Indices are kept."""
    _, beams = _cache_shape(cache)
    rows = (examples[:, None] * beams + jnp.arange(beams)[None, :]).reshape(-1)  # [m * beams]

    def take(path, x):
        if x.ndim == 0:
            return x
        return jnp.take(x, rows if _leaf_name(path) == "ancestry" else examples, axis=0)
    return jax.tree_util.tree_map_with_path(take, cache)


def decode_step(params: Any, model_config: ModelConfig, cache: Any, encoded: Array, inputs: Array,
                tokens: Array) -> tuple[Array, Any]:
    """One cached decoder step: logits for the next token after ``tokens``.

    Args:
      params: the model parameters.
      model_config: any mode; the decode mode is derived from it and the cache.
      cache: from :func:`init_cache` or an earlier step.
      encoded: float[batch, src_len, d_model] (only its shape matters once the cache exists).
      inputs: int32[batch, src_len] source ids (for the source padding mask).
      tokens: int32[batch * beams] the previous output token of every row (BOS at the first step).

    Returns:
      float32[batch * beams, vocab] logits and the advanced cache.
    """
    cfg = _decode_config(model_config, *_cache_shape(cache))
    logits, state = Transformer(cfg).apply({"params": params, "cache": cache}, encoded, inputs,
                                           tokens[:, None], method=Transformer.decode, mutable=["cache"])
    return logits[:, 0], state["cache"]


def _full_step(params: Any, model_config: ModelConfig, encoded: Array, inputs: Array, seqs: Array,
               t: Array) -> Array:
    """Uncached step: the full decoder over shift_right(seqs); float32[n, vocab] logits at position t.

    ``seqs`` is int32[n, max_len] with the t tokens output so far and PAD after them; the causal mask
    keeps the PAD positions out of position t.
    """
    logits = Transformer(eval_config(model_config)).apply(
        {"params": params}, encoded, inputs, shift_right(seqs), method=Transformer.decode)  # [n, T, V]
    return jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)


class Stepper(NamedTuple):
    """A next-token function over n = batch * beams rows, cached or not.

    ``step(state, seqs int32[n, max_len], t) -> (float32[n, vocab] logits, state)``: ``seqs`` holds the
    tokens output before position t. ``state`` is the cache and the sources (or ``()`` uncached);
    ``reorder(state, rows int32[n])`` makes row i continue from row ``rows[i]`` (beam selection).
    ``select(state, examples int32[m])``, where not None, keeps the state of ``examples`` only, so the
    search can go on with fewer rows (``decode``'s compaction).
    """

    state: Any
    step: Any
    reorder: Any
    select: Any = None


def make_stepper(params: Any, model_config: ModelConfig, inputs: Array, max_len: int,
                  use_cache: bool, beams: int = 1, cache_len: int | None = None) -> Stepper:
    """Encodes ``inputs`` int32[batch, src_len] once and returns a stepper over batch * beams rows.

    Row ``b * beams + k`` is beam k of example b. The cache starts with ``cache_len`` (default
    ``max_len``) positions; ``grow_cache`` lengthens it, and the step follows its shape.
    """
    encoded = encode(params, model_config, inputs)  # [B, S, D]
    if not use_cache:
        encoded, inputs = (jnp.repeat(x, beams, axis=0) for x in (encoded, inputs))  # [B*K, ...]
        step = lambda state, seqs, t: (_full_step(params, model_config, encoded, inputs, seqs, t), state)
        return Stepper((), step, lambda state, rows: state)

    # The encoder keys/values are projected once per example and shared by its beams. The state holds
    # the sources (for the padding mask) beside the cache, so that `select` can drop examples.
    cache = init_cache(model_config, params, encoded, inputs, cache_len or max_len, beams)

    def step(state, seqs, t):
        cache, inputs = state
        previous = jax.lax.dynamic_index_in_dim(seqs, jnp.maximum(t - 1, 0), axis=1, keepdims=False)
        previous = jnp.where(t == 0, BOS_ID, previous)  # [n]
        # Once the cache exists the decoder reads only the shape of the encoder output.
        encoded_shape = jnp.zeros(inputs.shape + encoded.shape[2:], encoded.dtype)
        logits, cache = decode_step(params, model_config, cache, encoded_shape, inputs, previous)
        return logits, (cache, inputs)

    def reorder(state, rows):
        # Rows stay within their example, so only the ancestry table moves (see the module docstring).
        def take(path, x):
            return jnp.take(x, rows, axis=0, mode="clip") if _leaf_name(path) == "ancestry" else x
        return jax.tree_util.tree_map_with_path(take, state[0]), state[1]

    def select(state, examples):
        return select_examples(state[0], examples), jnp.take(state[1], examples, axis=0)

    return Stepper((cache, inputs), step, reorder, select)
