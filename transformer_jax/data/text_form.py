"""The form of the text a model is trained on: raw, or lowercased and Moses-tokenized.

``data_config.text_form`` (translation sources only):

    'raw'       the text as the files hold it (whitespace normalized); outputs are returned as decoded
    'moses_lc'  lowercased, Moses punctuation-normalized and Moses-tokenized per language, as the Multi30k
                literature trains (the dataset's own ``*.lc.norm.tok`` files are this form); outputs are
                Moses-detokenized, so they read as text again, but stay lowercase

The form applies wherever raw text meets the tokenizer: training SentencePiece, the train pairs, the
evaluation batches, translate's inputs, and every decoded output (``Tokenizer.decode_batch``). References
stay raw: BLEU scores the detokenized outputs against the files' own text, so a 'moses_lc' model's cased
sacreBLEU is low by construction and its lowercased (Multi30k) BLEU is the comparable number.

On Multi30k val, preparing a reference and detokenizing it again changes none of its 1,014 sentences
under the Multi30k BLEU tokenization, in either language (tests/test_text_form.py pins a few cases).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sacremoses

TEXT_FORMS = ("raw", "moses_lc")
SIDES = ("source", "target")


@dataclasses.dataclass(frozen=True)
class TextForm:
    """How raw text becomes the model's text (``prepare``) and back (``finish``).

    Attributes:
      name: one of ``TEXT_FORMS``.
      src_lang, tgt_lang: the languages of the source and target side (Moses rules are per language).
    """

    name: str = "raw"
    src_lang: str = ""
    tgt_lang: str = ""

    def __post_init__(self):
        if self.name not in TEXT_FORMS:
            raise ValueError(f"text_form must be one of {TEXT_FORMS}, got {self.name!r}")

    @property
    def is_raw(self) -> bool:
        return self.name == "raw"

    def prepare(self, texts: Sequence[str], side: str) -> list[str]:
        """The model's form of raw ``texts`` of ``side`` ('source' or 'target')."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if self.is_raw:
            return list(texts)
        lang = self.src_lang if side == "source" else self.tgt_lang
        return [lowercase_moses(t, lang, escape=False) for t in texts]

    def finish(self, texts: Sequence[str]) -> list[str]:
        """Text for the user from the model's target-side ``texts`` (detokenized for 'moses_lc')."""
        if self.is_raw:
            return list(texts)
        detokenizer = _detokenizer(self.tgt_lang)
        return [detokenizer.detokenize(t.split(), return_str=True) for t in texts]


RAW = TextForm()


def text_form_of(data_config: Any) -> TextForm:
    """The ``TextForm`` of a ``DataConfig``."""
    if data_config.text_form == "raw":
        return RAW
    return TextForm(data_config.text_form, data_config.src_lang, data_config.tgt_lang)


def lowercase_moses(text: str, lang: str, *, escape: bool) -> str:
    """``lowercase.perl | normalize-punctuation.perl -l lang | tokenizer.perl -l lang``, joined by spaces.

    ``escape`` writes XML characters as entities (``&apos;``), as ``tokenizer.perl`` does by default.
    """
    return moses_tokenizer(lang).tokenize(punct_normalizer(lang).normalize(text.lower()), escape=escape,
                                          return_str=True)


@functools.cache
def punct_normalizer(lang: str) -> sacremoses.MosesPunctNormalizer:
    return _sacremoses().MosesPunctNormalizer(lang=lang)


@functools.cache
def moses_tokenizer(lang: str) -> sacremoses.MosesTokenizer:
    return _sacremoses().MosesTokenizer(lang=lang)


@functools.cache
def _detokenizer(lang: str) -> sacremoses.MosesDetokenizer:
    return _sacremoses().MosesDetokenizer(lang=lang)


def _sacremoses():
    """sacremoses, imported where text is first normalized or tokenized: its import compiles its regular
    expressions, a cost the runs and tools that never tokenize text need not pay."""
    import sacremoses

    return sacremoses


def sacremoses_version() -> str:
    """The version of sacremoses, for a BLEU signature."""
    return getattr(_sacremoses(), "__version__", "unknown")
