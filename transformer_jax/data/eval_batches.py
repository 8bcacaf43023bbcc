"""Evaluation batches: every example of a split exactly once, none truncated, bucketed like training.

:func:`plan_batches` is the one batch planner of evaluation: :func:`make_eval_batches` (perplexity, and
the pairs decoding reads) plans with the train rule of ``batching.py`` (``tokens_per_batch // L``, down
to a multiple of ``batch_multiple``), so evaluation compiles the same few shapes; decoding
(``evaluation.translation.decode_ids``) plans with its cache budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.data.batching import assign_buckets, bucket_batch_sizes, concat_with_eos, gather_padded
from transformer_jax.data.config import validate_data_config
from transformer_jax.data.sources import TextSource, get_source
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.runtime.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """One planned batch: examples ``indices`` int64[num_real] in row order, padded to ``length`` tokens
    and to ``rows`` rows (``rows - num_real`` padding rows)."""

    indices: np.ndarray
    length: int
    rows: int


@dataclasses.dataclass(frozen=True)
class EvalBatch:
    """One padded evaluation batch; rows at and beyond `num_real` are all PAD.

    Attributes:
      inputs: int32[B, L]; targets: int32[B, L]
      source_texts, target_texts: the num_real normalised texts of the real rows.
      indices: int64[num_real], each row's position in the split.
      num_real: number of real rows.
    """

    inputs: np.ndarray
    targets: np.ndarray
    source_texts: list[str]
    target_texts: list[str]
    indices: np.ndarray
    num_real: int


def _check_lengths(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_length: int | None,
                   max_source_length: int | None, split: str, locations: Sequence[str] | None) -> None:
    """DataError naming the first example over a limit of :func:`make_eval_batches` (the source's
    decoding limit first) and how many are."""
    for limit, lengths, over, fix in (
            (max_source_length, src_lengths, "more than the {} this model can decode",
             "lower --max_extra_len (config.final_max_extra_len in training)"),
            (max_length, np.maximum(src_lengths, tgt_lengths), "more than the model's max_len={}",
             "raise config.model.max_len")):
        too_long = np.flatnonzero(lengths > limit) if limit is not None else []
        if len(too_long):
            i = int(too_long[0])
            where = locations[i] if locations is not None else f"{split} example {i + 1}"
            side = "source" if src_lengths[i] == lengths[i] else "reference"
            raise DataError(f"{where}: the {side} has {int(lengths[i])} tokens (EOS included), "
                            f"{over.format(limit)} ({len(too_long)} such lines); shorten or split it, or "
                            f"{fix}")


def extended_buckets(length_buckets: Sequence[int], longest: int, growth: float = 1.25) -> list[int]:
    """``length_buckets``, then buckets growing by ``growth`` (multiples of 8) until one holds ``longest``.

    Evaluation never drops an example, so lengths beyond the training buckets need buckets too; a
    single one at ``longest`` would pad every long sentence to the longest (newstest2014 through
    the Multi30k model: 485 pairs over 64 tokens, the longest 153).
    """
    buckets = list(length_buckets)
    while longest > buckets[-1]:
        buckets.append(min(longest, 8 * math.ceil(buckets[-1] * growth / 8)))
    return buckets


def make_eval_batches(
    data_config: Any,
    tokenizer: Tokenizer,
    split: str,
    *,
    max_examples: int | None = None,
    batch_multiple: int = 1,
    pairs: Sequence[tuple[str, str]] | None = None,
    max_length: int | None = None,
    max_source_length: int | None = None,
    locations: Sequence[str] | None = None,
) -> list[EvalBatch]:
    """Every example of `split` (the first `max_examples`) exactly once, none truncated.

    `pairs`, if given (e.g. from `read_parallel`), replaces the split's pairs; `split` is then
    only a label.

    `max_length`, if given, is the longest example the model takes (its max_len), either side, EOS
    included; `max_source_length` the longest source it can decode (max_len minus the output
    allowance). An example over either raises DataError naming it by `locations[i]` (e.g.
    "newstest2014.en:17") or its 1-based number.

    Batches are bucketed by the longer side (:func:`plan_batches`, ordered by source length within a
    bucket), examples longer than the largest bucket in the buckets of ``extended_buckets``, and a
    batch's size follows the train rule (tokens_per_batch // L, down to a multiple of batch_multiple).
    """
    validate_data_config(data_config)
    source = None
    if pairs is None:
        if split not in ("dev", "test", "train"):
            raise ConfigError(f"split must be 'dev', 'test' or 'train', got {split!r}")
        source = get_source(data_config)
        pairs = source.pairs(split)
    if max_examples is not None:
        pairs = pairs[:max_examples]
    pairs = list(pairs)
    src_flat, src_offsets = concat_with_eos(tokenizer.encode_text([s for s, _ in pairs], side="source"))
    tgt_flat, tgt_offsets = concat_with_eos(tokenizer.encode_text([t for _, t in pairs], side="target"))
    src_lengths, tgt_lengths = np.diff(src_offsets), np.diff(tgt_offsets)
    lengths = np.maximum(src_lengths, tgt_lengths)
    if locations is None and isinstance(source, TextSource):  # name the file and line
        locations = [f"{source.paths(split)[0]}:{line}" for line in source.line_numbers[split]]
    _check_lengths(src_lengths, tgt_lengths, max_length, max_source_length, split, locations)
    buckets = extended_buckets(data_config.length_buckets, int(lengths.max()) if len(lengths) else 0)
    sizes = bucket_batch_sizes(buckets, data_config.tokens_per_batch, batch_multiple)
    batches = []
    for batch in plan_batches(lengths, buckets, sizes, sort_by=src_lengths):
        rows = np.full(batch.rows, -1, dtype=np.int64)
        rows[: len(batch.indices)] = batch.indices
        batches.append(
            EvalBatch(
                inputs=gather_padded(src_flat, src_offsets, rows, batch.length),
                targets=gather_padded(tgt_flat, tgt_offsets, rows, batch.length),
                source_texts=[pairs[i][0] for i in batch.indices],
                target_texts=[pairs[i][1] for i in batch.indices],
                indices=batch.indices,
                num_real=len(batch.indices),
            )
        )
    return batches


def plan_batches(lengths: Sequence[int], buckets: Sequence[int], sizes: Sequence[int], *,
                 sort_by: Sequence[int] | None = None, round_partial: bool = False) -> list[PlannedBatch]:
    """Batches covering every example exactly once, shortest bucket first: the one evaluation planner.

    Example i goes to the smallest bucket >= ``lengths[i]``; within a bucket, examples go by ``sort_by``
    (default ``lengths``), then by index, so that a batch's sources (and so its outputs) are of similar
    length and decoding stops early. A full batch of bucket b holds ``sizes[b]`` examples. The examples a
    bucket cannot fill a batch with move up to the next bucket (padded longer), so that only the very
    last batch is partial: a decoding step costs the same for a padding row as for a real one.

    Args:
      lengths: int[n] each example's length (what its padded length must hold).
      buckets: increasing padded lengths, the last >= every length.
      sizes: int[len(buckets)] rows of a full batch of each bucket, each >= 1.
      sort_by: int[n] the order within a bucket.
      round_partial: the last batch's rows are :func:`padded_rows` of its examples (at most its
        bucket's size) instead of the full size: fewer padding rows, still few shapes.

    Returns:
      Batches in increasing ``length``.
    """
    lengths = np.asarray(lengths, np.int64)
    sort_by = lengths if sort_by is None else np.asarray(sort_by)
    bucket_of = assign_buckets(lengths, buckets)
    batches = []
    carried = np.zeros(0, np.int64)  # the previous buckets' leftovers: too few for a batch of their own
    for b, (length, size) in enumerate(zip(buckets, sizes, strict=True)):
        members = np.flatnonzero(bucket_of == b)
        members = np.concatenate([carried, members[np.argsort(sort_by[members], kind="stable")]])
        last = b == len(buckets) - 1
        full = len(members) if last else len(members) - len(members) % size
        for start in range(0, full, size):
            real = members[start : min(start + size, full)]
            partial = len(real) < size
            rows = min(size, padded_rows(len(real))) if partial and round_partial else size
            batches.append(PlannedBatch(real, int(length), rows))
        carried = members[full:]
    return batches


def padded_rows(n: int) -> int:
    """Rows for a partial batch of n examples: 1, 2, 4 or 8 up to 8, then a multiple of 8 that is
    1, 1.25, 1.5 or 1.75 times a power of two (144 -> 160), so that a padding row costs at most a
    quarter more and few shapes are compiled. A padding row runs every step as an example does."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = max(8, 1 << ((n - 1).bit_length() - 3))
    return -(-n // step) * step

