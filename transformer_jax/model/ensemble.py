"""Several trained models of one architecture predicting together.

    params = Ensemble((params_a, params_b))   # anywhere a decoder or eval_step takes params

The ensemble's next-token distribution is the mean of the members' distributions, as fairseq's and
Marian's ensembles decode: ``log p(y) = logsumexp_m(log p_m(y)) - log M``. Decoding (``kv_cache``'s
stepper: one encoder pass and one key/value cache per member) and the teacher-forced metrics
(``loss.eval_step``) both take it; the members must share the vocabulary, not the weights.

Members are computed with the first model's config; :func:`shape_differences` says which members cannot be:
those that differ in what shapes the parameters or what they mean, not in how they were trained or are
computed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class Ensemble(NamedTuple):
    """The parameters of M >= 1 models of one architecture (a pytree: jit traces every member)."""

    members: tuple[Any, ...]


def mean_log_probs(logits: list[Array]) -> Array:
    """float32[..., V] log of the mean of the members' softmax(logits_m), each float[..., V]."""
    log_probs = jnp.stack([jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in logits])
    return jax.nn.logsumexp(log_probs, axis=0) - math.log(len(logits))


def apply(params: Any, fn: Callable[[Any], Array]) -> Array:
    """``fn(params)`` (logits float[..., V]) for one model; for an :class:`Ensemble`, the members'
    :func:`mean_log_probs` (normalized log-probabilities, which serve as logits)."""
    if isinstance(params, Ensemble):
        return mean_log_probs([fn(member) for member in params.members])
    return fn(params)


def size(params: Any) -> int:
    """How many models ``params`` holds: M for an :class:`Ensemble`, else 1."""
    return len(params.members) if isinstance(params, Ensemble) else 1


# ModelConfig fields that say how a model was trained or is computed, not what its parameters are: members may
# differ in them (Table 3 row D's dropout, another attention implementation or dtype; parameters are always
# float32). Every other field, one added later included, must be equal.
HOW_FIELDS = ("dropout_rate", "attention_dropout_rate", "attention_impl", "attention_block_size",
              "attention_init", "dtype", "attention_witness", "deterministic", "decode")
# Fields that shape the parameters only under some position schemes: max_len is the learned table's size
# (for the other schemes, only decoding's default buffer); max_relative_position, the relative table's.
SCHEME_FIELDS = {"max_len": ("learned",), "max_relative_position": ("relative",)}


def shape_differences(first: Any, other: Any) -> list[str]:
    """``"field=<other's> (first: <first's>)"`` for each ModelConfig field in which ``other`` cannot join an
    ensemble computed with ``first``'s config: layers, widths, heads, d_k/d_v, the vocabulary, the position
    scheme and its table, the norm style, and any field not in ``HOW_FIELDS``; [] when it can."""
    differences = []
    for field in dataclasses.fields(first):
        mine, theirs = getattr(first, field.name), getattr(other, field.name, None)
        schemes = SCHEME_FIELDS.get(field.name)
        if field.name in HOW_FIELDS or mine == theirs or (
                schemes is not None and first.position_encoding not in schemes
                and other.position_encoding not in schemes):
            continue
        differences.append(f"{field.name}={theirs!r} (first: {mine!r})")
    return differences
