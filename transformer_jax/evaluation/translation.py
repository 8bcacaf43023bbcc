"""Decoding sentences with a trained model: the one decoding path of translate, evaluate.py, dev BLEU
and parsing.

Sentences are token ids with EOS appended. They are sorted by length and packed into batches
(``data.eval_batches.plan_batches``, the one planner) within one cache budget (:func:`batch_rows`),
searched with ``decode.greedy_search`` (``beam_size=1``) or ``decode.beam_search``, optionally under a
constraint (parsing's ``tree_constraints.TreeConstraint``), and returned in the input order. A batch of
sources padded to length ``L`` holds ``tokens_per_batch // (beams * (L + max_extra_len))`` sentences (a
multiple of 8 when 8 fit): the search runs ``rows * beams`` decoder rows against a cache of
``L + max_extra_len`` positions, so the budget bounds the cache and gives short sentences many rows per
matrix product.

Outputs do not depend on the batching: example i may output ``src_len_i + max_extra_len`` tokens
(``decode``'s length limit), whatever its batch's padded length, and rows are independent, so
translations equal those of one batch holding every sentence.

Shapes are few so that compilation stays cheap: ``L`` is a multiple of 8 (of 32 for parsing's input +
300) up to 64, then grows by 1.25 (:func:`decode_buckets`), the last one cut to the longest sentence.
Sentences a length cannot fill a batch with move up to the next length, so only the last batch is
partial, and its rows are rounded up to four sizes an octave (``eval_batches.padded_rows``); its padding
rows repeat its first sentence.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transformer_jax.data import eval_batches
from transformer_jax.data.sources import normalize_whitespace
from transformer_jax.evaluation import decode, paper
from transformer_jax.model import ensemble
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError, DataError, MissingFileError

# The one decoding batch budget: decoder rows x cache positions whose self-attention keys and values
# take this much memory. 192k positions for the Multi30k model (4 KiB each: 4 layers x 4 heads x (32 +
# 32) float32), 32k for the base model. Against half the budget it compiles half the batch shapes for
# the same speed once compiled (docs/benchmarks.md).
CACHE_BYTES_PER_BATCH = 768 * 2**20
ENGINES = ("jax", "ctranslate2")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to decode: ``beam_size`` 1 is greedy search; ``alpha`` is the GNMT length penalty."""

    beam_size: int = paper.BEAM_SIZE
    alpha: float = paper.LENGTH_PENALTY_ALPHA
    max_extra_len: int = paper.MAX_EXTRA_LEN


def default_tokens_per_batch(model_config: ModelConfig) -> int:
    """The budget of :func:`batch_rows` whose self-attention cache takes ``CACHE_BYTES_PER_BATCH``."""
    cfg = model_config
    position_bytes = (cfg.num_decoder_layers * cfg.num_heads * (cfg.d_k + cfg.d_v)
                      * np.dtype(cfg.compute_dtype).itemsize)
    return max(1, CACHE_BYTES_PER_BATCH // position_bytes)


def batch_rows(tokens_per_batch: int, beams: int, cache_len: int) -> int:
    """Sentences in a full batch: ``beams * rows * cache_len <= tokens_per_batch``, rows a multiple of 8
    when 8 fit, else as many as fit (at least 1; a big model's beam 21 over input + 300)."""
    rows = tokens_per_batch // (beams * cache_len)
    return rows // 8 * 8 if rows >= 8 else max(1, rows)


def decode_buckets(longest: int, settings: Settings, tokens_per_batch: int,
                   max_src_len: int | None = None) -> tuple[list[int], list[int]]:
    """(padded source lengths, rows of a full batch of each) of decoding, for ``eval_batches.plan_batches``.

    Lengths: multiples of ``step`` up to 64, then growing by 1.25 (``eval_batches.extended_buckets``),
    none beyond the one that holds ``longest``, the last cut to it and none beyond ``max_src_len`` (the
    model's position table). ``step`` is 8, or for a long output allowance the multiple of 8 at most an
    eighth of the shortest cache ``8 + max_extra_len`` (32 for parsing's input + 300): a source is then
    padded by at most about an eighth of its cache, in fewer shapes. Rows: :func:`batch_rows` of the
    cache ``length + max_extra_len``.
    """
    extra, longest = settings.max_extra_len, int(longest)
    step = max(8, (8 + extra) // 64 * 8)
    buckets = eval_batches.extended_buckets(range(step, 65, step), longest)
    buckets = buckets[:int(np.searchsorted(buckets, longest)) + 1]
    if max_src_len is not None and buckets[-1] > max_src_len:
        buckets = [b for b in buckets if b < max_src_len] + [max_src_len]
    return buckets, [batch_rows(tokens_per_batch, settings.beam_size, b + extra) for b in buckets]


def _padded(ids: Sequence[np.ndarray], indices: np.ndarray, rows: int, length: int) -> np.ndarray:
    """int32[rows, length]: the sentences ``indices`` right-padded with PAD, then copies of the first
    (a padding row then ends with a real one, and is a valid input for any constraint)."""
    out = np.full((rows, length), PAD_ID, np.int32)
    for r in range(rows):
        i = indices[r] if r < len(indices) else indices[0]
        out[r, :len(ids[i])] = ids[i]
    return out


def decode_ids(params: Any, model_config: ModelConfig, ids: Sequence[np.ndarray], settings: Settings,
               *, tokens_per_batch: int | None = None, constraint: Any = None,
               progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Searches every sentence; returns the outputs in the input order.

    Args:
      params: the model parameters, or an ``ensemble.Ensemble`` decoded together.
      model_config: the model (decoded deterministically; every member's).
      ids: int32[len_i] source ids, EOS included; with a learned position table, each
        ``len_i + max_extra_len <= model max_len`` (other schemes take any length).
      settings: the search.
      tokens_per_batch: the batch budget of :func:`batch_rows`; None: the model's
        :func:`default_tokens_per_batch`.
      constraint: ``decode``'s logit mask with its own state (parsing's ``TreeConstraint``), or None.
      progress: called with the number of sentences each batch finished.

    Returns:
      Each output int32[len_i + max_extra_len] in ``decode``'s convention (tokens, then EOS, then PAD),
      whatever the batch it was decoded in.
    """
    extra, limit = settings.max_extra_len, model_config.position_limit
    if limit is not None and any(len(s) + extra > limit for s in ids):
        raise ValueError(f"a source longer than the learned positions' model max_len={limit} - max_extra_len="
                         f"{extra} tokens; check lengths first (translate_texts does)")
    if tokens_per_batch is None:  # an ensemble holds one cache per member in the same budget
        tokens_per_batch = max(1, default_tokens_per_batch(model_config) // ensemble.size(params))
    outputs: list[np.ndarray | None] = [None] * len(ids)

    def collect(batch: eval_batches.PlannedBatch, tokens) -> None:
        tokens = np.asarray(tokens)  # waits for the search
        for r, i in enumerate(batch.indices):  # each to its own limit: PAD beyond it in any batch
            outputs[i] = tokens[r, :len(ids[i]) + extra]
        if progress is not None:
            progress(len(batch.indices))

    # A search runs while the next batch is traced and compiled (dispatch is asynchronous), so each
    # batch is collected only after the next one has been dispatched.
    pending = None
    lengths = [len(s) for s in ids]
    buckets, sizes = decode_buckets(max(lengths, default=0), settings, tokens_per_batch,
                                    None if limit is None else limit - extra)
    for batch in eval_batches.plan_batches(lengths, buckets, sizes, round_partial=True):
        inputs = _padded(ids, batch.indices, batch.rows, batch.length)
        max_len = batch.length + extra if limit is None else min(batch.length + extra, limit)
        if settings.beam_size == 1:
            tokens = decode.greedy_search(params, model_config, inputs, max_len=max_len,
                                          max_extra_len=extra, constraint=constraint)
        else:
            tokens, _ = decode.beam_search(params, model_config, inputs, beam_size=settings.beam_size,
                                           alpha=settings.alpha, max_len=max_len, max_extra_len=extra,
                                           constraint=constraint)
        if pending is not None:
            collect(*pending)
        pending = (batch, tokens)
    if pending is not None:
        collect(*pending)
    return outputs


def source_ids(tokenizer, texts: Sequence[str], *, max_length: int | None, truncate: bool = False,
               locations: Sequence[str] | None = None, why: str = "") -> list[np.ndarray]:
    """int32 token ids of each text (whitespace normalized) with EOS appended.

    A text of more than ``max_length`` tokens (EOS included; None: no limit) is cut to that length when
    ``truncate`` (EOS kept last); otherwise it raises DataError naming it by ``locations[i]`` or its line
    number, and the limit's reason ``why``.
    """
    encoded = tokenizer.encode_text([normalize_whitespace(t) for t in texts], side="source")
    ids = []
    for i, pieces in enumerate(encoded):
        if max_length is not None and len(pieces) + 1 > max_length:
            if not truncate:
                where = locations[i] if locations is not None else f"line {i + 1}"
                raise DataError(
                    f"{where}: {len(pieces) + 1} tokens (EOS included), more than the {max_length} this "
                    f"model can decode{f' ({why})' if why else ''}; shorten or split the line, pass "
                    "--truncate to cut it, or decode with a smaller --max_extra_len")
            pieces = pieces[:max_length - 1]
        ids.append(np.asarray([*pieces, EOS_ID], np.int32))
    return ids


def decodable_positions(model_config: ModelConfig, engine: str = "jax") -> int | None:
    """The longest source or output (EOS included) that ``engine`` decodes, or None for any length.

    Only a learned position table bounds the JAX engine (``ModelConfig.position_limit``: its max_len rows
    hold the source and the output alike). CTranslate2 decodes what its export holds
    (``ctranslate2_spec.exported_positions``, which the export records): any length under rotary and
    relative positions, ``max(max_len, 1024)`` for the sinusoid's and ``none``'s tables and for ALiBi,
    ``max_len`` for the learned table.
    """
    if engine == "jax":
        return model_config.position_limit
    from transformer_jax.evaluation.ctranslate2_spec import exported_positions

    return exported_positions(model_config)


def source_limit(model_config: ModelConfig, max_extra_len: int, engine: str = "jax") -> int | None:
    """The longest source (EOS included) that ``engine`` decodes with ``max_extra_len`` output positions
    to spare (:func:`decodable_positions` less ``max_extra_len``), or None for any length."""
    limit = decodable_positions(model_config, engine)
    return None if limit is None else limit - max_extra_len


def limit_holder(model_config: ModelConfig, engine: str = "jax") -> str:
    """What holds :func:`decodable_positions` and how many, in words: "its learned position table has
    model.max_len=12 positions" (for a model whose ``engine`` bounds its lengths)."""
    if engine == "jax":
        return f"its learned position table has model.max_len={model_config.max_len} positions"
    from transformer_jax.evaluation.ctranslate2_spec import exported_positions_holder

    return f"the CTranslate2 export's {exported_positions_holder(model_config)}"


def limit_reason(model_config: ModelConfig, max_extra_len: int, engine: str = "jax") -> str:
    """Why :func:`source_limit` bounds a source, in words, for the one-line errors."""
    return f"{limit_holder(model_config, engine)}, less the output allowance max_extra_len={max_extra_len}"


def translate_texts(params: Any, model_config: ModelConfig, tokenizer, texts: Sequence[str],
                    settings: Settings, *, truncate: bool = False,
                    tokens_per_batch: int | None = None,
                    locations: Sequence[str] | None = None,
                    progress: Callable[[int], None] | None = None,
                    decode_fn: Callable[..., list[np.ndarray]] | None = None) -> list[str]:
    """Detokenized translations of ``texts``, in their order; an empty (or blank) text gives "".

    A text too long for the engine (:func:`source_limit`: only a learned position table bounds the
    JAX engine; CTranslate2 what its export holds) raises DataError naming it (see :func:`source_ids`)
    unless ``truncate``, which cuts only such a text.
    ``decode_fn(ids, settings, progress=...)`` replaces :func:`decode_ids` (then
    ``params`` is unused), e.g. ``ctranslate2_engine.Engine.decode_ids``.
    """
    keep = [i for i, t in enumerate(texts) if normalize_whitespace(t)]
    engine = "jax" if decode_fn is None else "ctranslate2"
    max_length = source_limit(model_config, settings.max_extra_len, engine)
    why = "" if max_length is None else limit_reason(model_config, settings.max_extra_len, engine)
    if max_length is not None and max_length < 1:
        raise DataError(f"max_extra_len={settings.max_extra_len} leaves no room for a source: {why}; pass a "
                        "smaller --max_extra_len")
    ids = source_ids(tokenizer, [texts[i] for i in keep], max_length=max_length, truncate=truncate,
                     locations=[locations[i] if locations else f"line {i + 1}" for i in keep], why=why)
    if decode_fn is None:
        outputs = decode_ids(params, model_config, ids, settings, tokens_per_batch=tokens_per_batch,
                             progress=progress)
    else:
        outputs = decode_fn(ids, settings, progress=progress)
    translations = [""] * len(texts)
    for i, text in zip(keep, tokenizer.decode_batch(outputs), strict=True):
        translations[i] = text
    if progress is not None and len(keep) < len(texts):
        progress(len(texts) - len(keep))
    return translations


def progress_bar(total: int, enabled: bool):
    """A tqdm bar over ``total`` sentences on stderr (a no-op object when not ``enabled``)."""
    import tqdm

    return tqdm.tqdm(total=total, unit="sent", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                     mininterval=0.5, delay=1.0)  # delay: an error found at once prints no bar first


def read_lines(path: str | None, *, flag: str = "--input") -> list[str]:
    """The lines of ``path`` (stdin when None; a named pipe or ``/dev/stdin`` reads too), without their
    line ends.

    Raises DataError naming the line for bytes that are not UTF-8 and for a NUL byte (a binary file);
    errors about the path name it as ``flag``.
    """
    if path is None:
        data, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        if os.path.isdir(path):
            raise ConfigError(f"{flag}={path} is a folder; expected a text file, one sentence a line")
        try:  # any file that reads: a regular file, a named pipe, /dev/stdin
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise MissingFileError(f"{flag}={path}: no such file") from None
        except OSError as e:
            raise ConfigError(f"{flag}={path}: cannot read it ({e.strerror or e})") from None
        name = path
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":  # the final line end, not an empty last line
        lines.pop()
    texts = []
    for number, line in enumerate(lines, 1):
        if b"\0" in line:
            raise DataError(f"{name}:{number}: a NUL byte; expected UTF-8 text, one sentence a line (is "
                            "it a binary file?)")
        try:
            texts.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as e:
            raise DataError(f"{name}:{number}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not "
                            "UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    return texts
