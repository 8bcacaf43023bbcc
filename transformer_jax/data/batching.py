"""Token-budget bucketed batches, a checkpointable train iterator, process sharding.

Conventions (both sides): the token ids followed by EOS, right-padded with PAD=0, int32.
A pair's bucket length L is the smallest of `data_config.length_buckets` >=
max(len(source)+1, len(target)+1); targets are padded to L. In training, sources are padded to
S <= L: by default the bucket length of the longest source of any pair in L's bucket (fixed for
the run, so one program per bucket; for translation it is L in every bucket of Multi30k and of
the synthetic task), or with `data_config.bucket_by_source` the pair's own source bucket, the
pairs being grouped by (S, L) (one program per pair of lengths). A parsing target is about 3x
its source, so padding its source to L would triple the encoder's work.

Token budget (the paper's ~25k source + ~25k target tokens per step): a batch of length L has
the FIXED global batch size B_L = (tokens_per_batch // L) rounded down to a multiple of
`batch_multiple` (and at least `batch_multiple`), so B_L * L <= tokens_per_batch on each side
whenever tokens_per_batch >= batch_multiple * L (a warning is logged otherwise), and jit
compiles one program per bucket.

Epoch plan (deterministic from seed and epoch): shuffle all train examples, deal them into
their buckets in shuffled order, cut each bucket into batches of B_L; the last batch of a
bucket is completed with all-PAD rows (loss weight 0 downstream), so every example appears
exactly once per epoch and the number of batches per epoch is constant. Then the batches are
shuffled. The iterator state is {seed, epoch, step}: the plan is recomputed from it.

Processes: every process computes the same global plan (same bucket at the same step, so
multi-host jit never deadlocks) and gathers only its contiguous slice of B_L / process_count
rows, so the shards are disjoint and together complete. The plan needs every pair's length, so
each process holds the whole train split's: for the 'text' and 'tfds' sources it maps the data cache's
encoded split (``corpus_cache``: built once, by one process, and shared through the page cache), for
the others it tokenizes the split in memory. Only batch assembly is sharded. batch_multiple must be a
multiple of process_count.

Why not grain: grain (0.2.18) has no token-budget bucketing, and its index shuffle runs per element in
Python (docs/benchmarks.md); a NumPy permutation of the whole epoch is one vectorised call and keeps
the state three integers. Batch assembly is vectorised NumPy, so the
pipeline needs neither worker processes nor prefetching.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from transformer_jax.model.special_ids import EOS_ID, PAD_ID, UNK_ID
from transformer_jax.runtime.errors import ConfigError, DataError

if TYPE_CHECKING:  # only annotated: the tokenizer module imports this one's callers
    from transformer_jax.data.tokenizer import Tokenizer

# Pairs are tokenized this many at a time (bounds the memory of lazily read TFDS splits).
_ENCODE_CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """A split's token ids, EOS appended, concatenated per side; optionally a subset of its examples.

    Stored example j's source ids are `src_ids[src_offsets[j]:src_offsets[j+1]]`; example i of the split
    is stored example `kept[i]` (or i when `kept` is None), so `select` leaves the ids where they are
    (they may be a memory map of the data cache, `corpus_cache`).

    Attributes:
      src_ids, tgt_ids: int32 or uint16[total_tokens]
      src_offsets, tgt_offsets: int64[num_stored + 1]
      num_empty: pairs left out because a side had no tokens.
      kept: int64[num_examples], the stored examples of this split in order, or None for all of them.
    """

    src_ids: np.ndarray
    src_offsets: np.ndarray
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray
    num_empty: int = 0
    kept: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.src_offsets) - 1 if self.kept is None else len(self.kept)

    def _lengths(self, offsets: np.ndarray) -> np.ndarray:
        lengths = np.diff(offsets)
        return lengths if self.kept is None else lengths[self.kept]

    @property
    def src_lengths(self) -> np.ndarray:
        """int64[num_examples], EOS included."""
        return self._lengths(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return self._lengths(self.tgt_offsets)

    def select(self, keep: np.ndarray) -> TokenizedSplit:
        """The examples where bool[num_examples] `keep` is True (the ids are shared, not copied)."""
        chosen = np.flatnonzero(keep)
        return dataclasses.replace(self, kept=chosen if self.kept is None else self.kept[chosen])

    def gather(self, side: str, rows: np.ndarray, length: int) -> np.ndarray:
        """int32[len(rows), length]: examples `rows` (-1: an all-PAD row) of `side` ('src', 'tgt'), padded."""
        if self.kept is not None:
            rows = np.where(rows >= 0, self.kept[np.maximum(rows, 0)], -1)
        return gather_padded(getattr(self, f"{side}_ids"), getattr(self, f"{side}_offsets"), rows, length)


def concat_with_eos(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists -> (int32[total] ids each followed by EOS, int64[n + 1] start offsets)."""
    lengths = np.fromiter((len(s) + 1 for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.full(offsets[-1], EOS_ID, dtype=np.int32)
    body = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32)  # all but the EOS
    mask = np.ones(offsets[-1], dtype=bool)
    mask[offsets[1:] - 1] = False
    ids[mask] = body
    return ids, offsets


def mostly_unknown(ids: list[int]) -> bool:
    """Whether at least half of ``ids`` are <unk> (a run of unknown characters is one <unk>)."""
    return len(ids) > 0 and 2 * ids.count(UNK_ID) >= len(ids)


def unknown_pairs_warning(unknown: Sequence[int], num_pairs: int, named: str) -> str:
    """The warning for ``unknown`` pairs of ``num_pairs`` that are mostly <unk>; ``named`` names the first."""
    return (f"{len(unknown)} of {num_pairs} pairs are mostly <unk> pieces on a side ({named}"
            f"{', ...' if len(unknown) > 5 else ''}): characters the tokenizer does not know (binary data, "
            "another script, NUL bytes, a line too long to train on)")


def empty_pairs_warning(num_empty: int, num_pairs: int) -> str:
    """The warning for ``num_empty`` of ``num_pairs`` pairs left out with no tokens on a side."""
    return f"Left out {num_empty} of {num_pairs} pairs with no tokens on one side"


def tokenize_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, *,
                   where: Callable[[list[int]], str] | None = None) -> TokenizedSplit:
    """Encodes every pair (chunked; `pairs` may be a lazy sequence); drops empty sides.

    Pairs with a side that is mostly <unk> pieces are kept and counted in a warning; ``where`` turns
    the first few of their indices into text naming them (e.g. the file and lines).
    """
    src_parts, tgt_parts = [], []
    num_empty = 0
    unknown: list[int] = []
    for start in range(0, len(pairs), _ENCODE_CHUNK):
        chunk = pairs[start : start + _ENCODE_CHUNK]
        src = tokenizer.encode_text([s for s, _ in chunk], side="source")
        tgt = tokenizer.encode_text([t for _, t in chunk], side="target")
        unknown += [start + i for i, (s, t) in enumerate(zip(src, tgt, strict=True))
                    if mostly_unknown(s) or mostly_unknown(t)]
        keep = [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]
        if len(keep) < len(src):
            num_empty += len(src) - len(keep)
            src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
        src_parts.append(concat_with_eos(src))
        tgt_parts.append(concat_with_eos(tgt))
    if num_empty:  # a warning, not info: train.py shows warnings
        logging.warning("%s", empty_pairs_warning(num_empty, len(pairs)))
    if unknown:
        named = where(unknown[:5]) if where else "pairs " + ", ".join(str(i) for i in unknown[:5])
        logging.warning("%s", unknown_pairs_warning(unknown, len(pairs), named))
    return TokenizedSplit(*_join(src_parts), *_join(tgt_parts), num_empty=num_empty)


def _join(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    ids = np.concatenate([p[0] for p in parts])
    shifts = np.cumsum([0] + [p[1][-1] for p in parts[:-1]])
    offsets = np.concatenate([[0]] + [p[1][1:] + s for p, s in zip(parts, shifts, strict=True)])
    return ids, offsets.astype(np.int64)


def gather_padded(ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray, length: int):
    """int32[len(rows), length]: the sequences `rows` right-padded with PAD; row -1 is all PAD.

    Args:
      ids: int32[total_tokens]; offsets: int64[num_examples + 1]
      rows: int[batch], example indices or -1.
    """
    rows = np.asarray(rows)
    real = rows >= 0
    safe = np.where(real, rows, 0)
    starts = offsets[safe]
    lengths = np.where(real, offsets[safe + 1] - starts, 0)
    if lengths.size and lengths.max() > length:
        raise ValueError(f"a sequence of length {lengths.max()} does not fit length {length}")
    positions = np.arange(length)  # [L]
    index = starts[:, None] + positions[None, :]  # [B, L]
    inside = positions[None, :] < lengths[:, None]  # [B, L]
    np.minimum(index, max(len(ids) - 1, 0), out=index)
    return np.where(inside, ids[index], PAD_ID).astype(np.int32)


# ----------------------------------------------------------------------------- buckets


def bucket_batch_sizes(
    length_buckets: Sequence[int], tokens_per_batch: int, batch_multiple: int
) -> list[int]:
    """Global batch size of each bucket: tokens_per_batch // L, down to a batch_multiple."""
    sizes = []
    for length in length_buckets:
        size = max(batch_multiple, tokens_per_batch // length // batch_multiple * batch_multiple)
        if size * length > tokens_per_batch:
            logging.warning(
                "bucket %d: %d rows x %d = %d tokens exceeds tokens_per_batch=%d (batch_multiple"
                " rows is the minimum)",
                length,
                size,
                length,
                size * length,
                tokens_per_batch,
            )
        sizes.append(size)
    return sizes


def assign_buckets(lengths: np.ndarray, length_buckets: Sequence[int]) -> np.ndarray:
    """Index of the smallest bucket >= each length (len(length_buckets) if none fits)."""
    return np.searchsorted(np.asarray(length_buckets), lengths, side="left")


def check_sharding(process_index: int, process_count: int, batch_multiple: int) -> None:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"expected 0 <= process_index < process_count, got process_index={process_index},"
            f" process_count={process_count}"
        )
    if batch_multiple < 1 or batch_multiple % process_count:
        raise ValueError(
            f"batch_multiple={batch_multiple} must be a positive multiple of process_count="
            f"{process_count} so every process gets the same number of rows (pass the global"
            " device count, or a multiple of it)"
        )


class TrainIterator:
    """Infinite iterator of process-local train batches; see the module docstring.

    `__next__` returns {"inputs": int32[B_L / process_count, S],
    "targets": int32[B_L / process_count, L]} where L is the step's bucket length and S <= L
    its source length (module docstring).

    Attributes:
      num_examples: train pairs kept; num_dropped: pairs longer than max_len (either side,
      EOS included); num_empty: pairs with an empty side; batches_per_epoch; shapes: the
      process-local (rows, S, L) of each group of pairs batched together.
    """

    def __init__(
        self,
        data: TokenizedSplit,
        *,
        length_buckets: Sequence[int],
        tokens_per_batch: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        batch_multiple: int = 1,
        num_dropped: int = 0,
        by_source: bool = False,
    ):
        check_sharding(process_index, process_count, batch_multiple)
        if len(data) == 0:
            raise ConfigError(f"no train pair is left: {num_dropped} are longer than data.max_len (either "
                              f"side, EOS included) and {data.num_empty} have an empty side; raise "
                              "data.max_len")
        self._data = data
        self.seed = int(seed)
        self.process_index, self.process_count = process_index, process_count
        self.num_examples = len(data)
        self.num_dropped = num_dropped
        self.num_empty = data.num_empty
        lengths = np.maximum(data.src_lengths, data.tgt_lengths)
        self._bucket_of = assign_buckets(lengths, length_buckets)
        if self._bucket_of.max() >= len(length_buckets):
            raise ValueError(f"a pair of length {lengths.max()} exceeds the largest bucket")
        self.bucket_lengths = list(length_buckets)
        self.batch_sizes = bucket_batch_sizes(length_buckets, tokens_per_batch, batch_multiple)
        # Pairs batched together share a group: (the pair's bucket, its source's padding bucket) as one int.
        source_bucket = assign_buckets(data.src_lengths, length_buckets)  # <= the pair's bucket
        if not by_source:  # the bucket's longest source
            longest = np.zeros(len(length_buckets), np.int64)
            np.maximum.at(longest, self._bucket_of, source_bucket)
            source_bucket = longest[self._bucket_of]
        self._group_of = self._bucket_of * len(length_buckets) + source_bucket
        self._groups = np.unique(self._group_of)  # ascending: by target bucket, then source bucket
        counts = np.bincount(self._group_of)[self._groups]
        self.batches_per_epoch = int(sum(
            math.ceil(c / self._shape(g)[0]) for c, g in zip(counts, self._groups, strict=True)))
        self.shapes = sorted({self._shape(g, process_count) for g in self._groups})
        self._epoch, self._step = 0, 0
        self._plan: list[tuple[int, np.ndarray]] | None = None

    def _shape(self, group: int, process_count: int = 1) -> tuple[int, int, int]:
        """(rows, source length, target length) of a group's batches."""
        bucket, source_bucket = divmod(int(group), len(self.bucket_lengths))
        return (self.batch_sizes[bucket] // process_count, self.bucket_lengths[source_bucket],
                self.bucket_lengths[bucket])

    def epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """The global batches of `epoch`: (group, int64[B_L] example indices or -1)."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_examples)
        groups = self._group_of[order]
        batches = []
        for g in self._groups:
            members = order[groups == g]  # shuffled order kept
            size = self._shape(g)[0]
            num = math.ceil(len(members) / size)
            padded = np.full(num * size, -1, dtype=np.int64)
            padded[: len(members)] = members
            batches += [(g, row) for row in padded.reshape(num, size)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._plan is None:
            self._plan = self.epoch_plan(self._epoch)
        group, rows = self._plan[self._step]
        local = len(rows) // self.process_count
        rows = rows[self.process_index * local : (self.process_index + 1) * local]
        _, source_length, length = self._shape(group)
        batch = {
            "inputs": self._data.gather("src", rows, source_length),
            "targets": self._data.gather("tgt", rows, length),
        }
        self._step += 1
        if self._step == len(self._plan):
            self._epoch, self._step, self._plan = self._epoch + 1, 0, None
        return batch

    def get_state(self) -> dict[str, int]:
        """JSON-serialisable position: the next batch is step `step` of epoch `epoch`."""
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "step": self._step,
            "num_examples": self.num_examples,
            "batches_per_epoch": self.batches_per_epoch,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues the identical sequence from `state` (from `get_state`).

        Raises:
          DataError: the state was saved for different data or batching (seed, number of
            examples or batches per epoch differ); one line saying what may have changed.
        """
        for key in ("seed", "num_examples", "batches_per_epoch"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"iterator state has {key}={state[key]} but this iterator has"
                    f" {key}={getattr(self, key)}: the checkpoint's position in the train data does not fit"
                    " the data now (the train files, the tokenizer, or a data setting such as data.max_len"
                    " or the batch settings changed since it was saved). Resume with the run's own data"
                    " and settings, or train in a new --workdir"
                )
        step = int(state["step"])
        if not 0 <= step < self.batches_per_epoch:
            raise ValueError(f"iterator state step={step} outside [0, {self.batches_per_epoch})")
        if int(state["epoch"]) != self._epoch:
            self._plan = None
        self._epoch, self._step = int(state["epoch"]), step
