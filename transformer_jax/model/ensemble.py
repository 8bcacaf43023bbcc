"""Several trained models of one architecture predicting together.

    params = Ensemble((params_a, params_b))   # anywhere a decoder or eval_step takes params

The ensemble's next-token distribution is the mean of the members' distributions, as fairseq's and
Marian's ensembles decode: ``log p(y) = logsumexp_m(log p_m(y)) - log M``. Decoding (``kv_cache``'s
stepper: one encoder pass and one key/value cache per member) and the teacher-forced metrics
(``loss.eval_step``) both take it; the members must share the vocabulary, not the weights.
"""

from __future__ import annotations

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
