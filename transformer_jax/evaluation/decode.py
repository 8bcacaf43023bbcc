"""Greedy and beam search over ``Transformer.decode`` with a key/value cache (Vaswani et al., 2017, 6.1).

The paper decodes with "beam search with a beam size of 4 and length penalty alpha = 0.6", setting "the
maximum output length during inference to input length + 50, but terminate early when possible".
This module does exactly that, batched and compiled: one ``jax.lax.while_loop`` per call whose body runs
the decoder for a single position against the cache (``config.decode=True``), and which stops as soon as
every example is finished.

Shapes: ``batch`` examples, ``src_len`` padded source length, ``max_len`` the static output buffer
(default ``src_len + max_extra_len``), ``beam_size`` beams per example, ``vocab`` the shared vocabulary.

Output convention (both searches): ``int32[batch, max_len]`` holds the generated tokens (never BOS),
then EOS, then PAD up to ``max_len``. A sequence that reaches its length limit without emitting EOS has
no EOS. The limit of example ``i`` is ``min(max_len, src_len_i + max_extra_len)`` tokens, EOS included,
where ``src_len_i`` counts its non-PAD source tokens. PAD is never generated.

Scores: the GNMT length penalty ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` (Wu et al., 2016), with |Y| the
number of output tokens including EOS, and ``score(Y) = log P(Y | X) / lp(Y)``. See
:func:`length_penalty` for the direction of its effect.

The cache grows in two phases: the loop first runs against a self-attention cache of
``first_cache_len`` positions (default ``src_len + 16``: most outputs end near the source length) and,
only if some example is still going at that length, pads the cache to ``max_len`` and goes on. The
cache is what every step reads and what beam search reorders, so a cache of ``src_len + 50`` positions
for outputs of about ``src_len`` would make each step several times dearer; masked positions weigh
exactly 0, so the logits do not change (up to the order of float sums).

The batch also shrinks (``compact``): a batch of sentences runs until its last one is done, and most are
done long before (test2016 through the Multi30k model, beam 5: batches of 296 sentences ran 47-82 steps
while their median sentence was done after 21-46). Whenever at most a quarter of the rows (rounded down
to a multiple of 8, at least ``MIN_COMPACT_ROWS``) are still going, those rows move to a batch of that
size and the finished ones leave the loop with their outputs; a row's outputs do not depend on the others.

``constraint`` (both searches, optional): an object whose ``wrap(stepper, inputs, limits)`` masks each
step's logits and carries its own per-row state, e.g. ``tree_constraints.TreeConstraint`` (every output a
tree over the input's words). Its rows follow beam selection like the cache.

``use_cache=False`` gives the reference (and benchmark baseline) path: every step reruns the full
decoder over the prefix, padded to ``max_len``, without a cache; the causal mask makes its logits equal.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.evaluation import kv_cache, paper, top_k
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID

Array = jax.Array
NEG_INF = -1.0e7  # log(0) stand-in: finite, so sums, divisions and comparisons never make NaN
_INVALID = 0.5 * NEG_INF  # log probabilities below this belong to impossible hypotheses

def length_penalty(length: Array | int, alpha: Array | float) -> Array:
    """GNMT length penalty lp(|Y|) = ((5 + |Y|) / 6) ** alpha; beam scores are log P(Y) / lp(|Y|).

    Direction: log P(Y) <= 0 and for alpha > 0 lp grows with |Y|, so longer hypotheses are divided by
    more and lose less score; larger alpha therefore favours longer outputs. alpha = 0 gives lp = 1, the
    raw log probability, which favours short outputs (every token adds a negative log probability).

    Args:
      length: int[...] number of output tokens, EOS included.
      alpha: the penalty strength (the paper uses 0.6).

    Returns:
      float32[...] lp.
    """
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _ban_tokens(scores: Array, t: Array, min_len: Array | int) -> Array:
    """float32[n, vocab] scores with PAD banned always and EOS banned while t < min_len (set to NEG_INF)."""
    vocab_ids = jnp.arange(scores.shape[-1])
    banned = (vocab_ids == PAD_ID) | ((vocab_ids == EOS_ID) & (t < min_len))  # [V]
    return jnp.where(banned[None, :], NEG_INF, scores)


def _argmax(x: Array) -> Array:
    """int32[n]: first index of the maximum of float32[n, vocab] (as jnp.argmax, which is slower on CPU)."""
    is_max = x == jnp.max(x, axis=-1, keepdims=True)  # [n, V]
    return jnp.min(jnp.where(is_max, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _length_limits(inputs: Array, max_len: int, max_extra_len: Array | int) -> Array:
    """int32[batch]: min(max_len, non-PAD source length + max_extra_len)."""
    return jnp.minimum(max_len, jnp.sum(inputs != PAD_ID, axis=1) + max_extra_len).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------
# The loop: a cache grown once, and fewer rows as examples finish.

# Compaction quarters the rows (down to a multiple of 8) while at least this many remain.
MIN_COMPACT_ROWS = 16


def _batch_sizes(batch: int, compact: bool) -> tuple[int, ...]:
    """The row counts the loop runs at: ``batch``, then quarters, e.g. 296 -> (296, 72, 16).

    Each size is one more copy of the loop body to compile: halving (296, 144, 72, 32, 16) decodes a
    little faster once compiled but compiles for almost twice as long (docs/benchmarks.md).
    """
    sizes = [batch]
    while compact and (quarter := sizes[-1] // 4 // 8 * 8) >= MIN_COMPACT_ROWS:
        sizes.append(quarter)
    return tuple(sizes)


def _run(state, step, *, done, results, select_model_state, first: int, max_len: int, compact: bool):
    """Runs ``step`` until every example is done (or ``t == max_len``), in phases; returns (t, results).

    Phase 1 runs against the cache as built (``first`` positions) while ``t < first``; the cache is then
    padded to ``max_len`` positions (``kv_cache.grow_cache``). From then on, whenever no more than the
    next of ``_batch_sizes`` examples are still going, their rows are moved to a batch of that size
    (``select``) and the rest leave the loop: a step costs about its rows (docs/benchmarks.md), and in a
    batch of sentences sorted by length most finish long before the last. The done ones are written to
    the results first.

    Args:
      state: a NamedTuple with ``t`` (int32 scalar), ``model_state`` (the stepper's) and any other
        fields [rows, ...], one entry per example.
      step: state -> state, one decoding step over every row.
      done: state -> bool[rows], rows that no further step can change (monotone in t).
      results: state -> a pytree of [rows, ...] arrays, the outputs.
      select_model_state: the stepper's ``select``; None (uncached, constrained) runs without compaction.
      first: phase 1's cache positions (>= max_len: one phase).
      max_len: the output buffer.
      compact: whether to move the unfinished examples to smaller batches (``_batch_sizes``).

    Returns:
      The number of steps run (int32 scalar) and the results over the batch, in its order.
    """
    sizes = _batch_sizes(len(done(state)), compact and select_model_state is not None)
    carry = (state, jnp.arange(sizes[0]), results(state))  # state, the example of each row, results

    def select(state, keep):
        rows = {name: jnp.take(value, keep, axis=0) for name, value in state._asdict().items()
                if name not in ("t", "model_state")}
        return state._replace(model_state=select_model_state(state.model_state, keep), **rows)

    def not_done(more_than: int):
        return lambda c: (c[0].t < max_len) & (jnp.sum(~done(c[0])) > more_than)

    def body(c):
        return step(c[0]), c[1], c[2]

    def written(c):
        return jax.tree.map(lambda out, rows: out.at[c[1]].set(rows), c[2], results(c[0]))

    if first < max_len and jax.tree.leaves(state.model_state):
        next_size = sizes[1] if len(sizes) > 1 else 0
        carry = jax.lax.while_loop(lambda c: not_done(next_size)(c) & (c[0].t < first), body, carry)
        carry = (carry[0]._replace(model_state=kv_cache.grow_cache(carry[0].model_state, max_len)),
                 *carry[1:])
    for i in range(len(sizes)):
        next_size = sizes[i + 1] if i + 1 < len(sizes) else 0
        carry = jax.lax.while_loop(not_done(next_size), body, carry)
        if next_size:  # the unfinished first (a stable sort keeps their order), then done ones as padding
            keep = jnp.argsort(done(carry[0]), stable=True)[:next_size]
            carry = (select(carry[0], keep), carry[1][keep], written(carry))
    return carry[0].t, written(carry)


# --------------------------------------------------------------------------------------------------
# Greedy search.


class _GreedyState(NamedTuple):
    """The greedy loop carry over the rows it still holds; ``t`` is the next output position."""

    t: Array  # int32 scalar
    tokens: Array  # int32[rows, max_len]; PAD after position t - 1
    finished: Array  # bool[rows]
    limits: Array  # int32[rows] each row's output length limit
    model_state: Any  # the stepper's state (cache and sources), or () uncached


# Only shapes and modes are static; max_extra_len, min_len and alpha are traced, so changing them does
# not recompile.
@functools.partial(jax.jit, static_argnames=("model_config", "max_len", "use_cache", "first_cache_len",
                                             "constraint", "compact"))
def _greedy_search(params, inputs, max_extra_len, min_len, *, model_config, max_len, use_cache,
                   first_cache_len, constraint=None, compact=True):
    batch = inputs.shape[0]
    limits = _length_limits(inputs, max_len, max_extra_len)  # [B]
    stepper = kv_cache.make_stepper(params, model_config, inputs, max_len, use_cache,
                                    cache_len=first_cache_len)
    if constraint is not None:
        stepper = constraint.wrap(stepper, inputs, limits)

    def step(state):
        t = state.t
        logits, model_state = stepper.step(state.model_state, state.tokens, t)  # [B, V]
        next_token = _argmax(_ban_tokens(logits, t, min_len))  # the log-softmax would not change it
        next_token = jnp.where(state.finished, PAD_ID, next_token)  # [B]
        tokens = jax.lax.dynamic_update_index_in_dim(state.tokens, next_token, t, axis=1)
        finished = state.finished | (next_token == EOS_ID) | (t + 1 >= state.limits)
        return _GreedyState(t + 1, tokens, finished, state.limits, model_state)

    state = _GreedyState(jnp.zeros((), jnp.int32), jnp.full((batch, max_len), PAD_ID, jnp.int32),
                         jnp.zeros((batch,), bool), limits, stepper.state)
    num_steps, tokens = _run(state, step, done=lambda s: s.finished, results=lambda s: s.tokens,
                             select_model_state=stepper.select, first=first_cache_len, max_len=max_len,
                             compact=compact)
    return tokens, num_steps


def greedy_search(params: Any, model_config: ModelConfig, inputs: Array, *, max_len: int | None = None,
                  max_extra_len: int = paper.MAX_EXTRA_LEN, min_len: int = 0, use_cache: bool = True,
                  return_num_steps: bool = False, first_cache_len: int | None = None,
                  constraint: Any = None, compact: bool = True) -> Array | tuple[Array, Array]:
    """Greedy decoding: the most likely next token at every step, until EOS or the length limit.

    Args:
      params: the model parameters.
      model_config: the model's config (any mode; decoding is deterministic).
      inputs: int32[batch, src_len] source ids, PAD-padded.
      max_len: the output buffer length; default ``src_len + max_extra_len``.
      max_extra_len: example i may output ``min(max_len, src_len_i + max_extra_len)`` tokens, EOS
        included, with ``src_len_i`` its non-PAD source length (the paper's "input length + 50").
      min_len: EOS is banned as any of the first ``min_len`` output tokens (for fixed-length benchmarks).
      use_cache: False reruns the full decoder over the prefix every step (the reference path).
      return_num_steps: also return how many decoder steps ran (the loop stops once all have finished).
      first_cache_len: positions of the first phase's cache (module docstring); default ``src_len +
        kv_cache.FIRST_CACHE_EXTRA``; ``max_len`` or more runs in one phase. Does not change the outputs.
      constraint: optional logit mask with its own state (see the module docstring); hashable.
      compact: move the unfinished examples to smaller batches as the others finish (the module
        docstring); False runs every row to the end. Does not change the outputs.

    Returns:
      int32[batch, max_len] tokens (then EOS, then PAD; see the module docstring), and with
      ``return_num_steps`` an int32 scalar step count.
    """
    inputs = jnp.asarray(inputs, jnp.int32)
    max_len = _check_args(model_config, inputs, max_len, max_extra_len, min_len)
    tokens, num_steps = _greedy_search(
        params, inputs, max_extra_len, min_len, model_config=kv_cache.eval_config(model_config),
        max_len=max_len, use_cache=use_cache, constraint=constraint, compact=compact,
        first_cache_len=kv_cache.first_cache_len_for(first_cache_len, inputs.shape[1], max_len))
    return (tokens, num_steps) if return_num_steps else tokens


def _check_args(model_config: ModelConfig, inputs: Array, max_len: int | None, max_extra_len: int,
                min_len: int) -> int:
    """Validates the arguments shared by both searches; returns the static output buffer length."""
    if inputs.ndim != 2:
        raise ValueError(f"inputs must be int32[batch, src_len], got shape {inputs.shape}")
    if max_extra_len < 0 or min_len < 0:
        raise ValueError(f"max_extra_len and min_len must be >= 0, got {max_extra_len} and {min_len}")
    max_len = inputs.shape[1] + max_extra_len if max_len is None else max_len
    limit = model_config.position_limit  # the learned table's rows; None: any length
    if max_len < 1 or (limit is not None and max_len > limit):
        raise ValueError(
            f"output length {max_len} must be in [1, the learned position table's max_len={limit}]; pass a "
            f"smaller max_len or max_extra_len, or build the model with a larger max_len")
    return int(max_len)


# --------------------------------------------------------------------------------------------------
# Beam search.


class _BeamState(NamedTuple):
    """The beam search loop carry. ``t`` is the number of tokens output so far (the next position).

    Alive hypotheses can still grow; finished ones ended with EOS or at the length limit. Both sets are
    kept sorted best first.
    """

    t: Array  # int32 scalar
    alive_seqs: Array  # int32[batch, beam, max_len]; PAD after position t - 1
    alive_logprobs: Array  # float32[batch, beam] log P(prefix); NEG_INF for unused beams
    finished_seqs: Array  # int32[batch, beam, max_len]
    finished_scores: Array  # float32[batch, beam] log P(Y) / lp(|Y|); NEG_INF for empty slots
    finished_flags: Array  # bool[batch, beam] True where the slot holds a real hypothesis
    limits: Array  # int32[batch] each example's output length limit
    model_state: Any  # the stepper's state with batch * beam rows (row b * beam + k), or () uncached


def _top(values: Array, k: int, *arrays: Array) -> tuple[Array, ...]:
    """The k largest ``values`` float32[batch, m] (sorted) and ``arrays`` [batch, m, ...] at their places."""
    top_values, index = jax.lax.top_k(values, k)  # [B, k]
    gathered = tuple(
        jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1) for a in arrays)
    return (top_values, *gathered)


def _beam_step(state: _BeamState, stepper: kv_cache.Stepper, *, beam_size: int, alpha: Array,
               min_len: Array) -> _BeamState:
    """Extends every alive beam by every token, then keeps the best ``beam_size`` alive and finished."""
    batch, _, max_len = state.alive_seqs.shape
    t = state.t
    logits, model_state = stepper.step(
        state.model_state, state.alive_seqs.reshape(batch * beam_size, max_len), t)  # [B*K, V]
    # 2K candidates are enough: at most K of them end here, so K still go on. The best 2K of an
    # example's K * V extensions are among the best 2K tokens of each beam, so each row keeps its top
    # 2K before the beams meet: log_softmax(x)_i = (x_i - max x) - log(sum(exp(x - max x))) is never
    # formed over the whole vocabulary, only its normalizer.
    row_k = min(2 * beam_size, logits.shape[-1])
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)  # [B*K, V]
    log_normalizer = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))  # [B*K, 1]
    row_top, row_token = top_k.top_k(_ban_tokens(shifted, t, min_len), row_k)  # [B*K, row_k]
    row_logprobs = jnp.maximum(row_top - log_normalizer, NEG_INF)  # banned stay NEG_INF
    candidates = (state.alive_logprobs[:, :, None]
                  + row_logprobs.reshape(batch, beam_size, row_k))  # [B, K, row_k]
    top_logprobs, top_index = jax.lax.top_k(candidates.reshape(batch, -1), 2 * beam_size)  # [B, 2K]
    parent = top_index // row_k  # [B, 2K]
    token = jnp.take_along_axis(row_token.reshape(batch, -1), top_index, axis=1).astype(jnp.int32)
    top_seqs = jnp.take_along_axis(state.alive_seqs, parent[:, :, None], axis=1)  # [B, 2K, T]
    top_seqs = jax.lax.dynamic_update_slice_in_dim(top_seqs, token[:, :, None], t, axis=2)
    ended = (token == EOS_ID) | (t + 1 >= state.limits[:, None])  # [B, 2K]

    # Alive: the best K that did not end; the cache follows its parent beam.
    alive_logprobs, alive_seqs, alive_parent = _top(
        jnp.where(ended, NEG_INF, top_logprobs), beam_size, top_seqs, parent)  # [B, K]
    rows = (jnp.arange(batch)[:, None] * beam_size + alive_parent).reshape(-1)  # [B*K]
    model_state = stepper.reorder(model_state, rows)

    # Finished: the best K of the old finished and the ones that ended now.
    new_flags = ended & (top_logprobs > _INVALID)  # [B, 2K]
    new_scores = jnp.where(new_flags, top_logprobs / length_penalty(t + 1, alpha), NEG_INF)
    finished_scores, finished_seqs, finished_flags = _top(
        jnp.concatenate([state.finished_scores, new_scores], axis=1), beam_size,
        jnp.concatenate([state.finished_seqs, top_seqs], axis=1),
        jnp.concatenate([state.finished_flags, new_flags], axis=1))
    return _BeamState(t + 1, alive_seqs, alive_logprobs, finished_seqs, finished_scores,
                      finished_flags, state.limits, model_state)


def _beam_search_done(state: _BeamState, *, alpha: Array) -> Array:
    """bool[batch]: no alive beam can still enter the K finished ones.

    An alive prefix's log probability only falls as it grows, and for alpha >= 0 lp is largest at the
    length limit, so ``alive_logprob / lp(limit)`` bounds any score it can still reach.
    """
    best_possible = state.alive_logprobs[:, 0] / length_penalty(state.limits, alpha)  # [B]
    worst_finished = jnp.where(jnp.all(state.finished_flags, axis=1),
                               jnp.min(state.finished_scores, axis=1), NEG_INF)  # [B]
    return (state.t >= state.limits) | (worst_finished > best_possible)


@functools.partial(jax.jit, static_argnames=("model_config", "beam_size", "max_len", "use_cache",
                                             "first_cache_len", "constraint", "compact"))
def _beam_search(params, inputs, alpha, max_extra_len, min_len, *, model_config, beam_size, max_len,
                 use_cache, first_cache_len, constraint=None, compact=True):
    batch = inputs.shape[0]
    limits = _length_limits(inputs, max_len, max_extra_len)  # [B]
    stepper = kv_cache.make_stepper(params, model_config, inputs, max_len, use_cache, beams=beam_size,
                                    cache_len=first_cache_len)
    if constraint is not None:  # row b * beam + k is beam k of example b
        stepper = constraint.wrap(stepper, jnp.repeat(inputs, beam_size, axis=0),
                                  jnp.repeat(limits, beam_size))
    empty_seqs = jnp.full((batch, beam_size, max_len), PAD_ID, jnp.int32)
    # Only beam 0 starts alive, so the first step does not pick K copies of the same token.
    alive_logprobs = jnp.where(jnp.arange(beam_size) == 0, 0.0, NEG_INF)[None, :]
    state = _BeamState(
        t=jnp.zeros((), jnp.int32), alive_seqs=empty_seqs,
        alive_logprobs=jnp.broadcast_to(alive_logprobs, (batch, beam_size)).astype(jnp.float32),
        finished_seqs=empty_seqs, finished_scores=jnp.full((batch, beam_size), NEG_INF, jnp.float32),
        finished_flags=jnp.zeros((batch, beam_size), bool), limits=limits, model_state=stepper.state)
    step = functools.partial(_beam_step, stepper=stepper, beam_size=beam_size, alpha=alpha,
                             min_len=min_len)

    # Every example finishes by its limit (<= max_len), where all of its candidates end.
    num_steps, (seqs, scores) = _run(
        state, step, done=functools.partial(_beam_search_done, alpha=alpha),
        results=lambda s: (s.finished_seqs, s.finished_scores), select_model_state=stepper.select,
        first=first_cache_len, max_len=max_len, compact=compact)
    return seqs, scores, num_steps


def beam_search(params: Any, model_config: ModelConfig, inputs: Array, *, beam_size: int = paper.BEAM_SIZE,
                alpha: float = paper.LENGTH_PENALTY_ALPHA, max_len: int | None = None,
                max_extra_len: int = paper.MAX_EXTRA_LEN, min_len: int = 0,
                use_cache: bool = True, return_all_beams: bool = False,
                return_num_steps: bool = False, first_cache_len: int | None = None,
                constraint: Any = None, compact: bool = True) -> tuple[Array, ...]:
    """Beam search with the GNMT length penalty, as in the paper (beam 4, alpha 0.6).

    The Flax WMT example's algorithm: each step extends the ``beam_size`` alive hypotheses by every
    token, takes the best ``2 * beam_size`` by log probability, keeps the best ``beam_size`` that did not
    end as alive and merges those that ended (EOS, or the length limit) into the ``beam_size`` finished
    ones by score ``log P(Y) / lp(|Y|)``. An example is done when no alive hypothesis can still beat its
    worst finished one; the loop stops once every example is done.

    Args:
      params: the model parameters.
      model_config: the model's config (any mode; decoding is deterministic).
      inputs: int32[batch, src_len] source ids, PAD-padded.
      beam_size: hypotheses kept per example (K).
      alpha: length penalty strength, >= 0; larger favours longer outputs (see :func:`length_penalty`).
      max_len, max_extra_len, min_len, use_cache, return_num_steps, first_cache_len, constraint,
        compact: as in :func:`greedy_search`.
      return_all_beams: return every finished beam, best first, instead of the best one.

    Returns:
      tokens int32[batch, max_len] and scores float32[batch] of the best hypothesis, or with
      ``return_all_beams`` int32[batch, beam_size, max_len] and float32[batch, beam_size] (NEG_INF for
      an empty slot); with ``return_num_steps`` also the int32 scalar step count.
    """
    inputs = jnp.asarray(inputs, jnp.int32)
    max_len = _check_args(model_config, inputs, max_len, max_extra_len, min_len)
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (larger favours longer outputs), got {alpha}")
    seqs, scores, num_steps = _beam_search(
        params, inputs, jnp.float32(alpha), max_extra_len, min_len,
        model_config=kv_cache.eval_config(model_config), beam_size=beam_size, max_len=max_len,
        use_cache=use_cache, constraint=constraint, compact=compact,
        first_cache_len=kv_cache.first_cache_len_for(first_cache_len, inputs.shape[1], max_len))
    out = (seqs, scores) if return_all_beams else (seqs[:, 0], scores[:, 0])
    return (*out, num_steps) if return_num_steps else out
