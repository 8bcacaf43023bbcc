"""The data pipeline: sources (synthetic, text, tfds; ptb, synthetic_trees) -> SentencePiece -> batches.

    source = get_source(data_config)                  # .pairs('train' | 'dev' | 'test')
    tokenizer = load_or_train_tokenizer(data_config, workdir)
    train_iter = make_train_iterator(data_config, tokenizer, seed=0)   # next(train_iter)
    eval_batches = make_eval_batches(data_config, tokenizer, 'dev')

For the file-backed translation sources ('text', 'tfds') the tokenizer and the encoded train split come
from the data cache (`corpus_cache`, stored by `disk_cache`): built once per data and settings, then
memory-mapped by every run, process and sweep row.

Parsing sources (`is_parsing(data_config)`) are `TreebankSource`s: `source.trees(split)` gives the
gold trees aligned with `pairs(split)`, for `transformer_jax.evaluation.evalb`.
"""

from transformer_jax.data.batching import TokenizedSplit, TrainIterator, tokenize_pairs
from transformer_jax.data.config import (
    check_tokens_per_batch,
    default_data_config,
    validate_data_config,
)
from transformer_jax.data.eval_batches import EvalBatch, make_eval_batches
from transformer_jax.data.pipeline import load_or_train_tokenizer, make_train_iterator
from transformer_jax.data.sources import (
    Source,
    TextSource,
    TfdsSource,
    get_source,
    normalize_whitespace,
    read_parallel,
)
from transformer_jax.data.synthetic import (
    SyntheticSource,
    copy_baseline,
    lexicon_baseline,
)
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.data.treebank import TreebankSource, is_parsing

__all__ = [
    "EvalBatch",
    "Source",
    "SyntheticSource",
    "TextSource",
    "TfdsSource",
    "TokenizedSplit",
    "Tokenizer",
    "TrainIterator",
    "TreebankSource",
    "check_tokens_per_batch",
    "copy_baseline",
    "default_data_config",
    "get_source",
    "is_parsing",
    "lexicon_baseline",
    "load_or_train_tokenizer",
    "make_eval_batches",
    "make_train_iterator",
    "normalize_whitespace",
    "read_parallel",
    "tokenize_pairs",
    "validate_data_config",
]
