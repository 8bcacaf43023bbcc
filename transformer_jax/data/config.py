"""The `data_config` fields, their defaults and their validation.

The training and evaluation configs (configs/*.py) carry a `data` section with the fields
below, read into the frozen `DataConfig`; every public function of `transformer_jax.data`
validates the fields it reads up front, so a typo or a bad value fails before any data is read.

Fields (all read by attribute access):

    source                  'synthetic' | 'text' | 'tfds' (translation) or
                            'ptb' | 'synthetic_trees' (parsing, see data/treebank.py)
    dir                     text: folder holding {prefix}.{lang} files;
                            ptb: folder holding .mrg files (LDC's wsj/ folder, or a flat folder)
    train_prefix, dev_prefix, test_prefix
                            text: file prefixes, e.g. 'train', 'val', 'test' (Multi30k)
    src_lang, tgt_lang      language suffixes / TFDS feature keys, e.g. 'en', 'de'
    tfds_name               tfds: e.g. 'wmt14_translate/de-en' (either direction)
    tfds_data_dir           tfds: '' means the TFDS default (~/tensorflow_datasets)
    tfds_dev_split, tfds_test_split
                            tfds: e.g. 'validation', 'test'
    text_form               text, tfds: 'raw' (the files' text) or 'moses_lc' (lowercased, Moses
                            punctuation-normalized and tokenized, as the Multi30k literature trains;
                            outputs are detokenized but stay lowercase; see data/text_form.py)
    vocab_size              shared SentencePiece vocabulary size
    vocab_type              'bpe' | 'unigram'
    tokenizer_train_examples  cap on the train pairs used to train SentencePiece
    max_len                 max tokens per side incl. EOS; longer TRAIN pairs are dropped
    tokens_per_batch        token budget per side per global batch (padded positions count)
    length_buckets          increasing padded lengths; the largest must be >= max_len
    bucket_by_source        False: a train pair's bucket is that of its longer side, and a bucket's
                            sources are padded to the bucket of its longest source; True: pairs are
                            grouped by their source's bucket too, so every source is padded to its
                            own bucket (one program per source and target bucket pair; for parsing,
                            whose targets are ~3x their sources)
    synthetic_train_size, synthetic_dev_size, synthetic_test_size, synthetic_seed
                            synthetic, synthetic_trees: split sizes and generator seed
    synthetic_min_words, synthetic_max_words
                            synthetic: the source sentences' length in words (commas not counted),
                            default 3 to 40
    synthetic_test_min_words
                            synthetic: > synthetic_min_words makes the test split the stream's first
                            sentences of at least this many words (dev and train take the others):
                            a test set longer than the training pairs data.max_len keeps; 0: the same
                            lengths as the other splits
    ptb_train_files, ptb_dev_files, ptb_test_files
                            ptb: file-number ranges, WSJ sections ('02-21', '22', '23') or
                            4-digit file numbers ('0001-0159'); comma-separated parts combine
    keep_pos_tags           ptb, synthetic_trees: part-of-speech tags in the target (True) or
                            the placeholder XX (False, as Vinyals et al. and the paper)
    tree_leaves             ptb, synthetic_trees: 'tags' (the leaves are XX or the tags, see
                            keep_pos_tags; the paper's linearization) or 'words' (the leaves are
                            the input words and decoding copies them: see docs/parsing.md)
    tree_augment_copies     ptb, synthetic_trees: extra training trees per training tree, each
                            with one constituent swapped for another of the same label
                            (data/tree_augment.py); 0 trains on the treebank as it is

    cache_dir               text, tfds: the data cache, where the shared tokenizer and the encoded train
                            split are built once and mapped by every later run (data/corpus_cache.py);
                            '' means $TRANSFORMER_JAX_CACHE, else ~/.cache/transformer_jax

Optional (defaults apply when absent):

    character_coverage      SentencePiece character coverage, default 1.0 (every character);
                            e.g. 0.9999 for web-crawled WMT text
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from transformer_jax.data.text_form import TEXT_FORMS
from transformer_jax.data.trees import parse_file_ranges
from transformer_jax.runtime.errors import ConfigError

SOURCES = ("synthetic", "text", "tfds", "ptb", "synthetic_trees")
VOCAB_TYPES = ("bpe", "unigram")
TREE_LEAVES = ("tags", "words")

# Fields every source needs, and the extra fields each source needs.
_COMMON_FIELDS = (
    "source",
    "vocab_size",
    "vocab_type",
    "tokenizer_train_examples",
    "max_len",
    "tokens_per_batch",
    "length_buckets",
)
_SOURCE_FIELDS = {
    "synthetic": (
        "synthetic_train_size",
        "synthetic_dev_size",
        "synthetic_test_size",
        "synthetic_seed",
    ),
    "text": ("dir", "train_prefix", "dev_prefix", "test_prefix", "src_lang", "tgt_lang"),
    "tfds": (
        "tfds_name",
        "tfds_data_dir",
        "tfds_dev_split",
        "tfds_test_split",
        "src_lang",
        "tgt_lang",
    ),
    "ptb": ("dir", "ptb_train_files", "ptb_dev_files", "ptb_test_files", "keep_pos_tags"),
    "synthetic_trees": (
        "synthetic_train_size",
        "synthetic_dev_size",
        "synthetic_test_size",
        "synthetic_seed",
        "keep_pos_tags",
    ),
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data fields of a run config (documented in the module docstring), frozen and typed.

    Defaults are the embedded synthetic task at CPU size. Built from a run config's ``data`` section by
    ``DataConfig.from_mapping`` (``run_config.build_run_config``), or directly in tests and tools.
    """

    source: str = "synthetic"
    dir: str = ""
    train_prefix: str = "train"
    dev_prefix: str = "val"
    test_prefix: str = "test"
    src_lang: str = "en"
    tgt_lang: str = "de"
    tfds_name: str = "wmt14_translate/de-en"
    tfds_data_dir: str = ""
    tfds_dev_split: str = "validation"
    tfds_test_split: str = "test"
    text_form: str = "raw"
    vocab_size: int = 1000
    vocab_type: str = "bpe"
    tokenizer_train_examples: int = 1_000_000
    max_len: int = 64
    tokens_per_batch: int = 4096
    length_buckets: tuple[int, ...] = (8, 16, 24, 32, 48, 64)
    bucket_by_source: bool = False
    synthetic_train_size: int = 40_000
    synthetic_dev_size: int = 500
    synthetic_test_size: int = 500
    synthetic_seed: int = 0
    synthetic_min_words: int = 3
    synthetic_max_words: int = 40
    synthetic_test_min_words: int = 0  # 0: the test split has the other splits' lengths
    ptb_train_files: str = "02-21"  # the standard WSJ split (section numbers)
    ptb_dev_files: str = "22"
    ptb_test_files: str = "23"
    keep_pos_tags: bool = False
    tree_leaves: str = "tags"
    tree_augment_copies: int = 0
    character_coverage: float = 1.0
    cache_dir: str = ""

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> DataConfig:
        """A DataConfig from a config file's ``data`` section; unknown keys fail, absent ones take their
        defaults. (A checkpoint's saved config is read leniently: ``run_config.run_config_from_saved``.)"""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"config.data has unknown fields {unknown}; known: {sorted(known)}")
        values = dict(fields)
        if isinstance(values.get("length_buckets"), list | tuple):
            values["length_buckets"] = tuple(values["length_buckets"])
        return cls(**values)

    def replace(self, **changes: Any) -> DataConfig:
        return dataclasses.replace(self, **changes)


def default_data_config(**overrides: Any) -> DataConfig:
    """The embedded synthetic task with CPU-sized defaults; ``overrides`` replace fields."""
    try:
        return DataConfig(**overrides)
    except TypeError:
        known = sorted(f.name for f in dataclasses.fields(DataConfig))
        raise ConfigError(
            f"default_data_config: unknown field in {sorted(overrides)}; known: {known}") from None


def _field(cfg: Any, name: str) -> Any:
    try:
        return getattr(cfg, name)
    except (AttributeError, KeyError):
        raise ConfigError(
            f"data_config is missing field {name!r} (source={getattr(cfg, 'source', '?')!r})"
        ) from None


def _positive_int(cfg: Any, name: str) -> int:
    value = _field(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"data_config.{name} must be a positive int, got {value!r}")
    return value


def validate_data_config(cfg: Any) -> None:
    """Raises ConfigError (a ValueError) naming the field, the expected and the actual value."""
    source = _field(cfg, "source")
    if source not in SOURCES:
        raise ConfigError(f"data_config.source must be one of {SOURCES}, got {source!r}")
    for name in _COMMON_FIELDS + _SOURCE_FIELDS[source]:
        _field(cfg, name)
    vocab_type = cfg.vocab_type
    if vocab_type not in VOCAB_TYPES:
        raise ConfigError(f"data_config.vocab_type must be one of {VOCAB_TYPES}, got {vocab_type!r}")
    for name in ("vocab_size", "tokenizer_train_examples", "max_len", "tokens_per_batch"):
        _positive_int(cfg, name)
    if cfg.vocab_size < 8:
        raise ConfigError(f"data_config.vocab_size must be >= 8 (4 reserved ids), got {cfg.vocab_size}")
    if cfg.max_len < 2:
        raise ConfigError(f"data_config.max_len must be >= 2 (a token plus EOS), got {cfg.max_len}")
    buckets = tuple(cfg.length_buckets)
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in buckets):
        raise ConfigError(
            f"data_config.length_buckets must be a non-empty tuple of positive ints, got {buckets!r}"
        )
    if any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
        raise ConfigError(
            f"data_config.length_buckets must be strictly increasing, got {buckets!r}"
        )
    if buckets[-1] < cfg.max_len:
        raise ConfigError(
            f"data_config.length_buckets must cover max_len={cfg.max_len}: the largest bucket is "
            f"{buckets[-1]}; add a bucket >= {cfg.max_len} or lower max_len"
        )
    check_tokens_per_batch(cfg)
    coverage = getattr(cfg, "character_coverage", 1.0)
    if not isinstance(coverage, int | float) or not 0.9 <= coverage <= 1.0:
        raise ConfigError(f"data_config.character_coverage must be in [0.9, 1], got {coverage!r}")
    if not isinstance(getattr(cfg, "cache_dir", ""), str):
        raise ConfigError(f"data_config.cache_dir must be a folder path (str; '' for the default), got "
                          f"{cfg.cache_dir!r}")
    text_form = getattr(cfg, "text_form", "raw")
    if text_form not in TEXT_FORMS:
        raise ConfigError(f"data_config.text_form must be one of {TEXT_FORMS}, got {text_form!r}")
    if text_form != "raw" and source not in ("text", "tfds"):
        raise ConfigError(f"data_config.text_form={text_form!r} is for translation text (source 'text' or "
                          f"'tfds'), not source={source!r}; use 'raw'")
    if not isinstance(cfg.bucket_by_source, bool):
        raise ConfigError(f"data_config.bucket_by_source must be a bool, got {cfg.bucket_by_source!r}")
    if source in ("ptb", "synthetic_trees") and not isinstance(cfg.keep_pos_tags, bool):
        raise ConfigError(f"data_config.keep_pos_tags must be a bool, got {cfg.keep_pos_tags!r}")
    if source in ("ptb", "synthetic_trees") and cfg.tree_leaves not in TREE_LEAVES:
        raise ConfigError(
            f"data_config.tree_leaves must be one of {TREE_LEAVES}, got {cfg.tree_leaves!r}")
    if source in ("ptb", "synthetic_trees") and (
            isinstance(cfg.tree_augment_copies, bool) or not isinstance(cfg.tree_augment_copies, int)
            or cfg.tree_augment_copies < 0):
        raise ConfigError(
            f"data_config.tree_augment_copies must be an int >= 0 (0: no augmentation), got"
            f" {cfg.tree_augment_copies!r}")
    if source == "ptb":
        _validate_ptb(cfg)
    elif source in ("synthetic", "synthetic_trees"):
        for name in ("synthetic_train_size", "synthetic_dev_size", "synthetic_test_size"):
            _positive_int(cfg, name)
        if not isinstance(cfg.synthetic_seed, int):
            raise ConfigError(f"data_config.synthetic_seed must be an int, got {cfg.synthetic_seed!r}")
        if source == "synthetic":
            _validate_synthetic_words(cfg)
    else:
        for name in _SOURCE_FIELDS[source]:
            value = getattr(cfg, name)
            if name != "tfds_data_dir" and (not isinstance(value, str) or not value):
                raise ConfigError(f"data_config.{name} must be a non-empty str, got {value!r}")
        if cfg.src_lang == cfg.tgt_lang:
            raise ConfigError(
                f"data_config.src_lang and tgt_lang must differ, both are {cfg.src_lang!r}"
            )


def _validate_synthetic_words(cfg: Any) -> None:
    """min_words >= 2 (a subject and a verb), max_words >= min_words, test_min_words 0 or in
    [min_words, max_words]."""
    low = getattr(cfg, "synthetic_min_words", 3)
    high = getattr(cfg, "synthetic_max_words", 40)
    test_low = getattr(cfg, "synthetic_test_min_words", 0)
    for name, value in (("synthetic_min_words", low), ("synthetic_max_words", high),
                        ("synthetic_test_min_words", test_low)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"data_config.{name} must be an int, got {value!r}")
    if low < 2:
        raise ConfigError(f"data_config.synthetic_min_words must be >= 2 (the shortest sentence is a subject "
                          f"and a verb), got {low}")
    if high < low:
        raise ConfigError(f"data_config.synthetic_max_words={high} must be >= synthetic_min_words={low}")
    if test_low != 0 and not low <= test_low <= high:
        raise ConfigError(
            f"data_config.synthetic_test_min_words={test_low} must be 0 (the test split as the others) or "
            f"in [synthetic_min_words, synthetic_max_words] = [{low}, {high}]; raise synthetic_max_words "
            "to draw longer test sentences")


def _validate_ptb(cfg: Any) -> None:
    """The folder is named and the three file ranges parse and do not overlap."""
    if not isinstance(cfg.dir, str) or not cfg.dir:
        raise ConfigError(
            f"data_config.dir must name the folder of .mrg files (LDC's treebank_3/parsed/mrg/wsj"
            f" or a flat folder of wsj_NNNN.mrg), got {cfg.dir!r}"
        )
    ranges = {}
    for split in ("train", "dev", "test"):
        name = f"ptb_{split}_files"
        try:
            ranges[split] = parse_file_ranges(getattr(cfg, name))
        except ValueError as e:
            raise ConfigError(f"data_config.{name}: {e}") from None
    splits = list(ranges)
    for i, a in enumerate(splits):
        for b in splits[i + 1 :]:
            for lo_a, hi_a in ranges[a]:
                for lo_b, hi_b in ranges[b]:
                    if max(lo_a, lo_b) <= min(hi_a, hi_b):
                        raise ConfigError(
                            f"data_config.ptb_{a}_files={getattr(cfg, f'ptb_{a}_files')!r} and"
                            f" ptb_{b}_files={getattr(cfg, f'ptb_{b}_files')!r} share files"
                            f" {max(lo_a, lo_b):04d}-{min(hi_a, hi_b):04d}; the splits must be"
                            " disjoint"
                        )


def check_tokens_per_batch(cfg: Any, batch_multiple: int = 1) -> None:
    """The token budget holds a whole sentence of the longest bucket for each of ``batch_multiple`` rows.

    ``batch_multiple`` is the number of rows a batch must divide into (data-parallel devices times
    gradient-accumulation micro-batches). A smaller budget would make a step process less than one
    sentence, and the batching would quietly round each bucket up past the budget.
    """
    buckets = sorted(cfg.length_buckets)
    longest = min(b for b in buckets if b >= cfg.max_len)  # the largest bucket a train pair can use
    need = batch_multiple * longest
    if cfg.tokens_per_batch >= need:
        return
    if cfg.tokens_per_batch < buckets[0]:
        what = f"smaller than one row of the smallest length bucket ({buckets[0]} tokens)"
    else:
        what = (f"smaller than one row of the longest length bucket used ({longest} tokens, for "
                f"max_len={cfg.max_len})")
    if batch_multiple > 1:
        what += (f" times the {batch_multiple} rows a batch divides into (data-parallel devices x "
                 "grad_accum_steps)")
    raise ConfigError(
        f"config.data.tokens_per_batch={cfg.tokens_per_batch} is {what}: a step would hold less than one "
        f"sentence. Set it to at least {need} (the paper: ~25000), or lower data.max_len")
