"""The model in decode mode: the encoder, the key/value cache and one cached decoder step.

``decode.py``'s searches run on a ``Stepper``: a next-token function over n = batch * beams rows, with
its state (the cache and the sources) and the beam reorder. The cache is a ``model.decode_cache.DecodeCache``:
one copy of each example's encoder keys/values for all its beams, and self-attention keys/values in beam
slots that are never moved (a reorder gathers only its ancestry table). ``grow_cache`` pads it with more
positions (masked positions weigh exactly 0, so the logits do not change) and the stepper's ``select`` keeps
some examples only: ``decode``'s loop uses both between its phases.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.decode_cache import DecodeCache
from transformer_jax.model.ensemble import Ensemble, mean_log_probs
from transformer_jax.model.special_ids import BOS_ID
from transformer_jax.model.transformer import Transformer, shift_right

Array = jax.Array

# The first phase's cache holds the source length plus this many positions (decode.py's module docstring).
FIRST_CACHE_EXTRA = 16


def eval_config(model_config: ModelConfig) -> ModelConfig:
    return model_config.replace(decode=False, deterministic=True)


def encode(params: Any, model_config: ModelConfig, inputs: Array) -> Array:
    """int32[batch, src_len] source ids -> float[batch, src_len, d_model] encoder output (no dropout)."""
    return Transformer(eval_config(model_config)).apply(
        {"params": params}, inputs, method=Transformer.encode)


def init_cache(model_config: ModelConfig, params: Any, encoded: Array, cache_len: int,
               beams: int = 1) -> DecodeCache:
    """The decode cache of ``cache_len`` positions for ``beams`` rows per example of ``encoded``
    float[batch, src_len, d_model]: empty self-attention buffers and the projected encoder keys/values."""
    return Transformer(eval_config(model_config)).apply(
        {"params": params}, encoded, cache_len, beams, method=Transformer.init_cache)


def grow_cache(state: Any, cache_len: int) -> Any:
    """``state`` (a stepper's, any pytree) with every ``DecodeCache`` in it grown to ``cache_len``
    positions (``DecodeCache.grow``)."""
    is_cache = lambda x: isinstance(x, DecodeCache)
    return jax.tree.map(lambda x: x.grow(cache_len) if is_cache(x) else x, state, is_leaf=is_cache)


def first_cache_len_for(first_cache_len: int | None, src_len: int, max_len: int) -> int:
    if first_cache_len is None:
        first_cache_len = src_len + FIRST_CACHE_EXTRA
    if first_cache_len < 1:
        raise ValueError(f"first_cache_len must be >= 1, got {first_cache_len}")
    return min(int(first_cache_len), max_len)


def decode_step(params: Any, model_config: ModelConfig, cache: DecodeCache, inputs: Array,
                tokens: Array) -> tuple[Array, DecodeCache]:
    """One cached decoder step: logits for the next token after ``tokens``.

    Args:
      params: the model parameters.
      model_config: any mode; the decode mode is derived from it.
      cache: from :func:`init_cache` or an earlier step.
      inputs: int32[batch, src_len] source ids (for the source padding mask).
      tokens: int32[batch * beams] the previous output token of every row (BOS at the first step).

    Returns:
      float32[batch * beams, vocab] logits and the advanced cache.
    """
    cfg = model_config.replace(decode=True, deterministic=True)
    logits, cache = Transformer(cfg).apply({"params": params}, None, inputs, tokens[:, None], cache,
                                           method=Transformer.decode)
    return logits[:, 0], cache


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
    ``max_len``) positions; ``grow_cache`` lengthens it, and the step follows its shape. ``params`` may
    be an ``ensemble.Ensemble``: then each member has its own encoding and cache, and the step returns
    the log of the mean of their distributions.
    """
    if isinstance(params, Ensemble):
        return _ensemble_stepper([
            make_stepper(member, model_config, inputs, max_len, use_cache, beams, cache_len)
            for member in params.members])
    encoded = encode(params, model_config, inputs)  # [B, S, D]
    if not use_cache:
        encoded, inputs = (jnp.repeat(x, beams, axis=0) for x in (encoded, inputs))  # [B*K, ...]
        step = lambda state, seqs, t: (_full_step(params, model_config, encoded, inputs, seqs, t), state)
        return Stepper((), step, lambda state, rows: state)

    # The encoder keys/values are projected once per example and shared by its beams. The state holds
    # the sources (for the padding mask) beside the cache, so that `select` can drop examples.
    cache = init_cache(model_config, params, encoded, cache_len or max_len, beams)

    def step(state, seqs, t):
        cache, inputs = state
        previous = jax.lax.dynamic_index_in_dim(seqs, jnp.maximum(t - 1, 0), axis=1, keepdims=False)
        previous = jnp.where(t == 0, BOS_ID, previous)  # [n]
        logits, cache = decode_step(params, model_config, cache, inputs, previous)
        return logits, (cache, inputs)

    def reorder(state, rows):
        return state[0].reorder(rows), state[1]

    def select(state, examples):
        return state[0].select(examples), jnp.take(state[1], examples, axis=0)

    return Stepper((cache, inputs), step, reorder, select)


def _ensemble_stepper(members: list[Stepper]) -> Stepper:
    """One stepper over the members' (one state each): the next-token log-probabilities are the log of
    the mean of the members' distributions (``model.ensemble``); beam reorders and compaction apply to
    every member's state alike."""

    def step(state, seqs, t):
        outs = [m.step(s, seqs, t) for m, s in zip(members, state, strict=True)]
        return mean_log_probs([logits for logits, _ in outs]), tuple(s for _, s in outs)

    def reorder(state, rows):
        return tuple(m.reorder(s, rows) for m, s in zip(members, state, strict=True))

    select = None
    if all(m.select is not None for m in members):
        def select(state, examples):
            return tuple(m.select(s, examples) for m, s in zip(members, state, strict=True))

    return Stepper(tuple(m.state for m in members), step, reorder, select)
