"""Scoring given translations: the log-probability of each (source, reference) pair under a model.

``translate --score`` prints one line a pair: the sum, a tab, then the log-probability (natural log) of
each of the reference's SentencePiece tokens and of the EOS after them, given the source and the tokens
before it (teacher forcing). It is what ``fairseq-generate --score-reference``, Marian's scorer and
CTranslate2's ``score_batch`` give, for filtering and reranking.

:func:`pair_ids` tokenizes the pairs as translate tokenizes its sources; :func:`score_ids` scores them
with the JAX model in length buckets (the CTranslate2 engine has its own ``Engine.score``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transformer_jax.data import eval_batches
from transformer_jax.data.sources import normalize_whitespace
from transformer_jax.model import ensemble, loss
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import DataError

# The float32[rows, length, vocab] log-probabilities of one batch take at most this much by default.
LOG_PROB_BYTES_PER_BATCH = 256 << 20


def default_tokens_per_batch(model_config: ModelConfig) -> int:
    """Padded target positions of one batch whose log-probabilities take ``LOG_PROB_BYTES_PER_BATCH``."""
    return max(8, LOG_PROB_BYTES_PER_BATCH // (4 * model_config.vocab_size))


def pair_ids(tokenizer, sources: Sequence[str], references: Sequence[str], *, max_length: int | None,
             locations: Sequence[str], why: str = "") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(sources, references): int32 ids of each source with EOS appended, and of each reference without
    its EOS (whitespace normalized, each through its side of the tokenizer's text form).

    A source or reference of more than ``max_length`` tokens (EOS included; None: no limit) raises
    DataError naming it by ``locations[i]`` and the limit's reason ``why``: a cut pair would score
    another sentence.
    """
    encoded = {side: tokenizer.encode_text([normalize_whitespace(t) for t in texts], side=side)
               for side, texts in (("source", sources), ("target", references))}
    if max_length is not None:
        for side, name in (("source", "the source"), ("target", "the reference")):
            for i, pieces in enumerate(encoded[side]):
                if len(pieces) + 1 > max_length:
                    because = f" ({why})" if why else ""
                    raise DataError(
                        f"{locations[i]}: {name} has {len(pieces) + 1} tokens (EOS included), more than the "
                        f"{max_length} this model takes{because}; shorten or split the pair")
    return ([np.asarray([*pieces, EOS_ID], np.int32) for pieces in encoded["source"]],
            [np.asarray(pieces, np.int32) for pieces in encoded["target"]])


def _padded(rows_ids: Sequence[np.ndarray], rows: int, length: int) -> np.ndarray:
    """int32[rows, length]: each of ``rows_ids`` right-padded with PAD; the rows beyond them all PAD."""
    out = np.full((rows, length), PAD_ID, np.int32)
    for r, ids in enumerate(rows_ids):
        out[r, :len(ids)] = ids
    return out


def score_ids(params: Any, model_config: ModelConfig, sources: Sequence[np.ndarray],
              references: Sequence[np.ndarray], *, tokens_per_batch: int | None = None,
              progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """float32[len(reference_i) + 1] per pair: the log-probability of each reference token, then of EOS.

    Args:
      params: the model parameters, or an ``ensemble.Ensemble`` (its mean distribution).
      model_config: the model (run deterministically).
      sources: int32[len_i] source ids, EOS included (:func:`pair_ids`).
      references: int32[m_i] reference ids, without EOS.
      tokens_per_batch: padded positions of one batch (rows x length); None:
        :func:`default_tokens_per_batch`, shared by an ensemble's members.
      progress: called with the number of pairs each batch scored.

    A pair goes to the shortest length bucket (``eval_batches.extended_buckets`` from 8) holding both
    sides, so a pair's scores do not depend on the others beyond float rounding.
    """
    targets = [np.append(r, EOS_ID).astype(np.int32) for r in references]
    if tokens_per_batch is None:
        tokens_per_batch = max(8, default_tokens_per_batch(model_config) // ensemble.size(params))
    lengths = [max(len(s), len(t)) for s, t in zip(sources, targets, strict=True)]
    buckets = eval_batches.extended_buckets([8], max(lengths, default=0))
    sizes = [max(1, tokens_per_batch // b) for b in buckets]
    fn = loss.make_token_log_probs(model_config)
    scores: list[np.ndarray | None] = [None] * len(targets)
    for batch in eval_batches.plan_batches(lengths, buckets, sizes, round_partial=True):
        inputs = _padded([sources[i] for i in batch.indices], batch.rows, batch.length)
        log_probs = np.asarray(fn(params, inputs,
                                  _padded([targets[i] for i in batch.indices], batch.rows, batch.length)))
        for r, i in enumerate(batch.indices):
            scores[i] = log_probs[r, :len(targets[i])]
        if progress is not None:
            progress(len(batch.indices))
    return scores


def format_scores(scores: Sequence[np.ndarray]) -> str:
    """One line a pair: the sum, a tab, then each token's log-probability, space-separated (6 decimals)."""
    return "".join(f"{float(np.sum(s, dtype=np.float64)):.6f}\t{' '.join(f'{float(x):.6f}' for x in s)}\n"
                   for s in scores)
