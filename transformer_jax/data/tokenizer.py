"""A shared SentencePiece vocabulary (BPE or unigram) for source and target.

The paper uses a shared source-target byte-pair encoding of about 37k tokens (WMT14 en-de).
We train one SentencePiece model on the TRAIN split's source and target sentences and cache it
as `{workdir}/tokenizer/spm.model`, so resuming and evaluation reuse the exact same vocabulary.

The special ids are fixed (``transformer_jax/model/special_ids.py``): the model, the loss and decoding rely
on them, and a model file with other ids is refused.

Text is normalised by our sources (whitespace only) before it reaches SentencePiece, and the
SentencePiece normaliser is 'identity', so `decode(encode(s)) == s` for any normalised `s` whose
characters are in the vocabulary.

Parsing with the words as the target's leaves (`data_config.tree_leaves='words'`): every bracket
token of the training trees (`(NP`, `)NP`, ...) is a SentencePiece user-defined symbol, so it is
always one id, and target words are cut into exactly the pieces they have in the source (the
space SentencePiece puts before a symbol is dropped, see `Tokenizer.encode`). `bracket_ids` maps
those ids to their tokens; constrained decoding (`evaluation/tree_constraints.py`) relies on both.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from transformer_jax.data.sources import get_source
from transformer_jax.data.text_form import RAW, TextForm, text_form_of
from transformer_jax.data.trees import bracket_tokens, is_bracket
from transformer_jax.model.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.runtime.errors import ConfigError

# Share of character occurrences the vocabulary must cover; rarer characters map to UNK.
# SentencePiece's default 0.9995 would make digits and German quotes UNK on Multi30k, so we keep
# every character. For web-crawled corpora (WMT) an optional data_config.character_coverage
# (e.g. 0.9999) keeps stray symbols from taking vocabulary slots.
CHARACTER_COVERAGE = 1.0
# Seed for choosing which train pairs feed SentencePiece when the split exceeds the cap.
SAMPLE_SEED = 0
# Sentences put through the text form at a time while the vocabulary's corpus is gathered.
_PREPARE_CHUNK = 10_000

_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


class Tokenizer:
    """SentencePiece wrapper with the fixed special ids above.

    Attributes:
      vocab_size: number of ids, including the 4 special ids.
      num_threads: threads for `encode_batch` (-1: all cores).
      model_path: the .model file this tokenizer was loaded from (None if from bytes).
      model_proto: the serialized model (bytes).
      sha256: the hex SHA-256 of the serialized model; checkpoints record it (the ids depend on it).
      bracket_ids: {id: token} of the user-defined bracket symbols (`(NP`, `)NP`); empty unless the
        model was trained for parsing with the words as leaves.
      word_start_ids: frozenset of the ids whose piece begins a word (starts with U+2581).
      text_form: how raw text becomes the model's text and back (``data/text_form.py``): applied by
        ``encode_text`` and ``decode_batch``, not by ``encode``, ``encode_batch`` and ``decode``.
    """

    def __init__(self, model_proto: bytes, *, num_threads: int = -1, model_path: str | None = None,
                 text_form: TextForm = RAW):
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id(), self._sp.bos_id())
        if ids != (PAD_ID, EOS_ID, UNK_ID, BOS_ID):
            raise ValueError(
                f"SentencePiece model {model_path or '<bytes>'} has special ids (pad, eos, unk, bos)"
                f"={ids}, expected {(PAD_ID, EOS_ID, UNK_ID, BOS_ID)}; delete it to retrain"
            )
        self.vocab_size: int = self._sp.get_piece_size()
        self.model_proto = model_proto
        self.sha256 = hashlib.sha256(model_proto).hexdigest()
        self.num_threads = num_threads
        self.model_path = model_path
        self.bracket_ids = _bracket_ids(model_proto)
        self.word_start_ids = frozenset(
            i for i in range(self.vocab_size) if self._sp.id_to_piece(i).startswith(_SPACE))
        self._space_id = self._sp.piece_to_id(_SPACE)  # the bare word-start piece
        self.text_form = text_form

    def _drop_bracket_spaces(self, ids: list[int]) -> list[int]:
        """`ids` without the bare space piece SentencePiece emits before each bracket symbol."""
        if not self.bracket_ids:
            return ids
        return [i for k, i in enumerate(ids)
                if not (i == self._space_id and k + 1 < len(ids) and ids[k + 1] in self.bracket_ids)]

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> Tokenizer:
        return cls(Path(path).read_bytes(), model_path=str(path), **kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no EOS appended.

        With bracket symbols, the space piece before each bracket is dropped, so a target like
        `(S (NP The dog )NP ... )S` is the bracket ids and exactly the source's word pieces.
        """
        return self._drop_bracket_spaces(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no EOS), encoded with `num_threads` threads."""
        encoded = self._sp.encode(list(texts), num_threads=self.num_threads)
        return [self._drop_bracket_spaces(ids) for ids in encoded] if self.bracket_ids else encoded

    def encode_text(self, texts: Sequence[str], *, side: str) -> list[list[int]]:
        """Token ids (no EOS) of raw ``texts`` of ``side`` ('source' or 'target'), through ``text_form``."""
        return self.encode_batch(self.text_form.prepare(texts, side))

    def decode(self, ids: Iterable[int]) -> str:
        """The model's text of `ids` (no ``text_form.finish``): stops at the first EOS, ignores PAD and BOS.

        Args:
          ids: int[length], e.g. one row of a model output.
        """
        out = []
        for i in np.asarray(ids).reshape(-1).tolist():
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self._sp.decode(out)

    def decode_batch(self, ids_2d: Iterable[Iterable[int]]) -> list[str]:
        """The text of each row of int[batch, length] for the user: `decode`, then ``text_form.finish``."""
        return self.text_form.finish([self.decode(row) for row in ids_2d])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


_SPACE = "\u2581"  # SentencePiece's word-start mark


def _bracket_ids(model_proto: bytes) -> dict[int, str]:
    """{id: piece} of the model's user-defined symbols that are bracket tokens."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.Type.USER_DEFINED
    return {i: p.piece for i, p in enumerate(model.pieces)
            if p.type == user_defined and is_bracket(p.piece)}


def user_symbols(data_config: Any) -> list[str]:
    """The bracket tokens of the train trees when the target's leaves are the words, else []."""
    if getattr(data_config, "source", None) not in ("ptb", "synthetic_trees"):
        return []
    if data_config.tree_leaves != "words":
        return []
    return bracket_tokens(get_source(data_config).trees("train"))


def training_sentences(data_config: Any) -> Iterable[str]:
    """Source and target sentences of (a seeded subset of) the train split."""
    pairs = get_source(data_config).pairs("train")
    n = len(pairs)
    cap = data_config.tokenizer_train_examples
    if n > cap:
        rng = np.random.default_rng(SAMPLE_SEED)
        indices = np.sort(rng.choice(n, size=cap, replace=False)).tolist()
    else:
        indices = range(n)
    form = text_form_of(data_config)
    for start in range(0, len(indices), _PREPARE_CHUNK):  # chunks: `pairs` may be a lazy sequence
        chunk = [pairs[i] for i in indices[start:start + _PREPARE_CHUNK]]
        sources = form.prepare([src for src, _ in chunk], "source")
        targets = form.prepare([tgt for _, tgt in chunk], "target")
        for src, tgt in zip(sources, targets, strict=True):
            yield src
            yield tgt


# SentencePiece's default max_piece_length: a unigram piece is at most this many characters.
_MAX_PIECE_LENGTH = 16


def max_vocab_size(sentences: Iterable[str], vocab_type: str) -> int:
    """An upper bound on the vocabulary SentencePiece can build from ``sentences`` (4 special ids included).

    SentencePiece splits at whitespace and marks each word's start with U+2581, so a piece lies inside
    one marked word. BPE: the distinct characters, plus at most one merge per symbol boundary of each
    distinct word (a merge joins two symbols of a word). Unigram: the characters plus every substring of
    2 to ``_MAX_PIECE_LENGTH`` characters of each distinct word. Splitting at scripts and digits, which
    SentencePiece also does, only lowers the real limit. A cheap check before training, not the limit.
    """
    words = {word for sentence in sentences for word in sentence.split()}
    chars = {"\u2581"} | {c for word in words for c in word}
    if vocab_type == "bpe":
        pieces = sum(len(word) for word in words)  # "\u2581" + word has len(word) symbol boundaries
    else:
        pieces = sum(n - k + 1 for n in (len(word) + 1 for word in words)
                     for k in range(2, min(n, _MAX_PIECE_LENGTH) + 1))
    return 4 + len(chars) + pieces


def check_vocab_size(data_config: Any, sentences: Sequence[str]) -> None:
    """Raises ConfigError when ``data_config.vocab_size`` exceeds what the corpus can fill (before training).

    Checked with ``max_vocab_size``; a size below that bound that SentencePiece still cannot fill fails in
    ``train_tokenizer`` with the exact limit."""
    bound = max_vocab_size(sentences, data_config.vocab_type)
    if data_config.vocab_size > bound:
        raise ConfigError(
            f"config.data.vocab_size={data_config.vocab_size} is too large for this training corpus: its "
            f"{len(sentences)} train sentences (both sides) give SentencePiece ({data_config.vocab_type}) at "
            f"most {bound} pieces; set data.vocab_size well below {bound} (the paper: a shared BPE of 37000 "
            "on WMT14's 4.5M pairs)")


def train_tokenizer(
    sentences: Iterable[str],
    *,
    vocab_size: int,
    vocab_type: str,
    character_coverage: float = CHARACTER_COVERAGE,
    num_threads: int = -1,
    user_defined_symbols: Sequence[str] = (),
) -> bytes:
    """Trains SentencePiece on `sentences` and returns the serialized model.

    `user_defined_symbols` (e.g. bracket tokens) are always one piece each.

    Raises:
      ValueError: if `vocab_size` is too large (or too small) for the corpus, suggesting a size.
    """
    model = tempfile.SpooledTemporaryFile()  # noqa: SIM115 (model_writer needs a file object)
    kwargs = dict(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=vocab_type,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        # Long WMT sentences are kept for training the vocabulary (the default cap is 4192 bytes).
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    if num_threads > 0:
        kwargs["num_threads"] = num_threads
    if user_defined_symbols:
        kwargs["user_defined_symbols"] = list(user_defined_symbols)
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as e:
        msg = str(e)
        if m := _TOO_HIGH.search(msg):
            raise ConfigError(
                f"config.data.vocab_size={vocab_size} is too large for this training corpus:"
                f" SentencePiece can build at most {m.group(2)} pieces from it; set data.vocab_size <="
                f" {m.group(2)} (e.g. {int(m.group(2))})"
            ) from e
        if m := _TOO_SMALL.search(msg):
            raise ConfigError(
                f"config.data.vocab_size={vocab_size} is too small for this training corpus: it has"
                f" {m.group(2)} distinct characters; set data.vocab_size > {m.group(2)}"
            ) from e
        raise
    model.seek(0)
    return model.read()


def tokenizer_file(workdir: str | os.PathLike) -> Path:
    """Where a workdir keeps its tokenizer: ``<workdir>/tokenizer/spm.model``."""
    return Path(workdir) / "tokenizer" / "spm.model"
