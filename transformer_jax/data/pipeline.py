"""A run's data: its tokenizer and its train iterator, from the data cache or built in memory.

For the file-backed translation sources ('text', 'tfds') both come from the data cache
(``corpus_cache``: trained and encoded once per data and settings, then memory-mapped by every run,
process and sweep row); the generated and treebank sources are tokenized in memory at start-up
(``tokenizer.train_tokenizer``, ``batching.tokenize_pairs``). Either way the batches are the same.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from transformer_jax.data import corpus_cache
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data.batching import TrainIterator, check_sharding, tokenize_pairs
from transformer_jax.data.config import validate_data_config
from transformer_jax.data.sources import get_source
from transformer_jax.data.text_form import text_form_of
from transformer_jax.data.tokenizer import Tokenizer


def load_or_train_tokenizer(data_config: Any, workdir: str | None) -> Tokenizer:
    """Loads `{workdir}/tokenizer/spm.model`, or trains it and keeps it there.

    Trains a shared SentencePiece model (type `data_config.vocab_type`, size
    `data_config.vocab_size`) on the train split's source and target sentences, at most
    `data_config.tokenizer_train_examples` pairs. For the file-backed translation sources ('text',
    'tfds') the model comes from the data cache (`corpus_cache.shared_tokenizer`: trained once per data
    and settings, shared by every run on them) and the workdir keeps a copy, so that evaluation,
    translation and export need only the workdir. `workdir=None` uses a fresh temporary folder.

    With several processes sharing one workdir, let process 0 call this first (or give each
    process the same prepared model): the write is atomic, but the processes would train in
    parallel.

    Raises:
      ConfigError: vocab_size too large for the corpus (checked before training, then by SentencePiece;
        suggests a size), or too small for its characters.
      ValueError: a cached model whose vocab size differs from data_config.vocab_size.
    """
    validate_data_config(data_config)
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="transformer_jax_")
    path = tokenizer_lib.tokenizer_file(workdir)
    if path.exists():
        tokenizer = Tokenizer.from_file(path, text_form=text_form_of(data_config))
        if tokenizer.vocab_size != data_config.vocab_size:
            raise ValueError(
                f"cached tokenizer {path} has vocab_size={tokenizer.vocab_size} but"
                f" data_config.vocab_size={data_config.vocab_size}; delete it to retrain, or set"
                f" vocab_size={tokenizer.vocab_size}"
            )
        logging.info("Loaded tokenizer %s (vocab_size=%d)", path, tokenizer.vocab_size)
        return tokenizer
    if corpus_cache.is_cached(data_config):
        proto = corpus_cache.shared_tokenizer(data_config, fallback=workdir)
    else:
        logging.info("Training %s tokenizer, vocab_size=%d", data_config.vocab_type, data_config.vocab_size)
        sentences = list(tokenizer_lib.training_sentences(data_config))
        tokenizer_lib.check_vocab_size(data_config, sentences)
        proto = tokenizer_lib.train_tokenizer(
            sentences,
            vocab_size=data_config.vocab_size,
            vocab_type=data_config.vocab_type,
            character_coverage=data_config.character_coverage,
            user_defined_symbols=tokenizer_lib.user_symbols(data_config),
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"spm.model.tmp{os.getpid()}")
    tmp.write_bytes(proto)
    os.replace(tmp, path)  # atomic: a reader never sees half a model
    logging.info("Saved tokenizer %s", path)
    return Tokenizer(proto, model_path=str(path), text_form=text_form_of(data_config))


def describe_pairs(source: Any, split: str) -> Callable[[list[int]], str] | None:
    """For a text source: pair indices -> "train.en / train.de lines 3, 9" (its kept pairs' line numbers)."""
    lines = getattr(source, "line_numbers", {}).get(split)
    if lines is None or not hasattr(source, "paths"):
        return None
    src_path, tgt_path = source.paths(split)
    return lambda indices: f"{src_path} / {tgt_path} lines {', '.join(str(lines[i]) for i in indices)}"


def make_train_iterator(
    data_config: Any,
    tokenizer: Tokenizer,
    *,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    batch_multiple: int = 1,
    cache_fallback: str | None = None,
) -> TrainIterator:
    """An infinite `TrainIterator` over the train split, tokenized once.

    The file-backed translation sources ('text', 'tfds') are read from the data cache, encoded there once
    per content (`corpus_cache.open_train_split`; `cache_fallback`, e.g. the workdir, is used when the
    cache root cannot be written); the others are tokenized in memory. Pairs longer than
    data_config.max_len tokens on either side (EOS included) are dropped; the count is logged and kept as
    `num_dropped`.
    """
    validate_data_config(data_config)
    check_sharding(process_index, process_count, batch_multiple)
    if corpus_cache.is_cached(data_config):
        data = corpus_cache.open_train_split(data_config, tokenizer, fallback=cache_fallback)
    else:
        source = get_source(data_config)
        data = tokenize_pairs(source.pairs("train"), tokenizer, where=describe_pairs(source, "train"))
    fits = np.maximum(data.src_lengths, data.tgt_lengths) <= data_config.max_len
    num_dropped = int(len(data) - fits.sum())
    if num_dropped:  # a warning, not info: train.py shows warnings
        logging.warning(
            "Dropped %d of %d train pairs longer than max_len=%d",
            num_dropped,
            len(data),
            data_config.max_len,
        )
        data = data.select(fits)
    buckets = [b for b in data_config.length_buckets if b < data_config.max_len]
    buckets.append(min(b for b in data_config.length_buckets if b >= data_config.max_len))
    return TrainIterator(
        data,
        length_buckets=buckets,
        tokens_per_batch=data_config.tokens_per_batch,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        batch_multiple=batch_multiple,
        num_dropped=num_dropped,
        by_source=data_config.bucket_by_source,
    )
