"""BLEU three ways: standard sacreBLEU, the paper's tokenized compound-split BLEU, and Multi30k's convention.

Evaluation calls ``score_all(hypotheses, references, lang)``, which returns all three, keyed by
``BLEU_PROTOCOLS``; each function below computes one of them.

The paper does not say how its BLEU was computed. Its code (tensor2tensor) shipped
``tensor2tensor/utils/get_ende_bleu.sh`` for EN-DE, which fairseq's scaling_nmt README says "was used
in the original AIAYN code". That script, which ``tokenized_bleu`` reproduces, does:

1. (added 2018-04, after the paper) ``replace-unicode-punctuation.perl`` on the hypotheses only;
2. ``tokenizer.perl -l de`` on the hypotheses (the reference is a file tokenized beforehand);
3. ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`` on both sides, which splits hyphenated
   compounds the way the Stanford NMT data and GNMT/ConvS2S did ("ATAT" format);
4. ``multi-bleu.perl`` (whitespace tokens, case-sensitive, no smoothing).

``sacrebleu_score`` is the number to quote for comparison with other work (Post, 2018): detokenized
output against the untouched reference, sacreBLEU's own 13a tokenizer, cased, exponential smoothing.
On the same outputs it reads lower than the compound-split number (by how much: docs/reference.md).

How ``tokenized_bleu`` follows the script, and why:

- Escaping. ``tokenizer.perl`` escapes XML characters by default (``&`` -> ``&amp;``, ``"`` ->
  ``&quot;``, ...) and the script did not pass ``-no-escape``, so we escape too. Escaping is a one-to-one
  map on tokens, so n-gram matches do not change; the only way it could change BLEU is through the
  compound split, whose regex consumes one character on each side of a hyphen ("a-'-b" splits once,
  "a-&apos;-b" twice). The Moses tokenizer surrounds every escapable character with spaces before that
  step, so in practice both choices give the same score; ``tests/test_bleu.py`` checks this.
- Punctuation normalization. The replace-unicode-punctuation step was added to the script in April
  2018, ten months after the paper, and it touches the hypotheses only (it rewrites a curly quote in the
  hypothesis to ``"`` while the reference keeps it, losing a match). It is off by default and available as
  ``normalize_hypotheses=True``, which applies exactly that step (sacremoses
  ``MosesPunctNormalizer.replace_unicode_punct``, not the fuller ``normalize-punctuation.perl``).
- References. Both sides are tokenized here with the same ``MosesTokenizer(lang)``; the script's
  reference file was tokenized beforehand with, as far as we know, the same tool.
- The compound split runs on UTF-8 bytes with a bytes regex: ``perl -ple`` without ``-C`` reads bytes, so
  its ``\\S`` matches one byte of a multi-byte character, and "a-ü-b" is split at both hyphens (the scan
  resumes inside "ü"), while a character-level regex would split only the first. Global substitution
  resumes after each match, so "a-b-c" becomes "a ##AT##-##AT## b-c", exactly as perl's ``s///g``.

``multi30k_bleu`` is the Multi30k literature's number: the dataset's ``scripts/task1-tokenize.sh`` makes
its tokenized references with ``lowercase.perl | normalize-punctuation.perl -l LANG | tokenizer.perl -l
LANG`` (no ``-a``, default escaping), and systems are scored against them with ``multi-bleu.perl``. We
put both the hypotheses and the raw reference through the same three steps with sacremoses, in that
order, so scoring needs only the raw reference. On test2016 the raw references through this pipeline
equal the dataset's ``test_2016_flickr.lc.norm.tok.{de,en}`` line for line (BLEU 100.00 both ways;
``tests/test_bleu.py`` checks it). Escaping does not change the score (it maps tokens one to one on
both sides), but without it the pipeline's text differs from the official files on every ``"`` and
``'`` (BLEU 99.70 for de, 99.43 for en against them), so we escape as ``tokenizer.perl`` does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import sacrebleu
from sacrebleu.metrics import BLEU

from transformer_jax.data.text_form import (
    lowercase_moses,
    moses_tokenizer,
    punct_normalizer,
    sacremoses_version,
)
from transformer_jax.protocols import BLEU_PROTOCOLS

# perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g', on bytes like perl without -C.
_COMPOUND_HYPHEN = re.compile(rb"(\S)-(\S)")
_COMPOUND_SPLIT = rb"\1 ##AT##-##AT## \2"


@dataclasses.dataclass(frozen=True)
class BleuResult:
    """A corpus BLEU score and the statistics behind it.

    ``score`` and ``precisions`` are percentages (0-100), as sacreBLEU and multi-bleu.perl print them.
    ``signature`` says how the number was computed, so that it is never quoted without its protocol.
    """

    score: float
    precisions: tuple[float, ...]  # modified 1..4-gram precisions, percent
    bp: float  # brevity penalty, exp(1 - ref_len / hyp_len) when hyp_len < ref_len, else 1
    ratio: float  # hyp_len / ref_len
    hyp_len: int  # tokens in the hypotheses, after this protocol's tokenization
    ref_len: int
    signature: str

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "precisions": list(self.precisions)}


def sacrebleu_score(hypotheses: Sequence[str], references: Sequence[str]) -> BleuResult:
    """Standard sacreBLEU: detokenized text, 13a tokenizer, cased, exponential smoothing, one reference.

    Scores against the references given in memory; nothing is downloaded.
    """
    hypotheses, references = _check_corpus(hypotheses, references)
    metric = BLEU()  # corpus_bleu's defaults: tokenize="13a", smooth_method="exp", lowercase=False
    score = metric.corpus_score(hypotheses, [references])
    return _result(score, metric.get_signature().format())


def tokenized_bleu(
    hypotheses: Sequence[str], references: Sequence[str], lang: str, *, normalize_hypotheses: bool = False
) -> BleuResult:
    """The paper's BLEU: Moses-tokenized, compound-split, multi-bleu.perl (see the module docstring).

    Args:
      hypotheses: detokenized system outputs, one per sentence.
      references: the untouched reference translations, one per sentence.
      lang: target language code for the Moses tokenizer ("de", "fr", ...).
      normalize_hypotheses: apply the script's later replace-unicode-punctuation step to the hypotheses
        (off by default: the paper's numbers predate it).
    """
    hypotheses, references = _check_corpus(hypotheses, references)
    if normalize_hypotheses:
        normalizer = punct_normalizer(lang)
        hypotheses = [normalizer.replace_unicode_punct(h) for h in hypotheses]
    hypotheses = [split_compounds(moses_tokenize(h, lang)) for h in hypotheses]
    references = [split_compounds(moses_tokenize(r, lang)) for r in references]
    # multi-bleu.perl: whitespace tokens, case-sensitive, a zero n-gram precision gives BLEU 0.
    score = sacrebleu.corpus_bleu(hypotheses, [references], smooth_method="none", tokenize="none", force=True)
    signature = (
        f"tok:moses-{lang}+escape|compound-split:atat|normalize-hyp:{'yes' if normalize_hypotheses else 'no'}"
        f"|case:mixed|smooth:none|nrefs:1|multi-bleu|sacremoses:{sacremoses_version()}"
        f"|sacrebleu:{sacrebleu.__version__}"
    )
    return _result(score, signature)


def multi30k_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> BleuResult:
    """Multi30k's BLEU: lowercased, punctuation-normalized, Moses-tokenized, multi-bleu.perl.

    Args:
      hypotheses: detokenized system outputs, one per sentence.
      references: the raw (cased, untokenized) reference translations, one per sentence; not the
        dataset's ``*.lc.norm.tok.*`` files, which this pipeline reproduces.
      lang: target language code ("de", "en", ...) for the normalizer and the tokenizer.
    """
    hypotheses, references = _check_corpus(hypotheses, references)
    hypotheses = [multi30k_tokenize(h, lang) for h in hypotheses]
    references = [multi30k_tokenize(r, lang) for r in references]
    score = sacrebleu.corpus_bleu(hypotheses, [references], smooth_method="none", tokenize="none", force=True)
    signature = (
        f"lc|norm-punct:moses-{lang}|tok:moses-{lang}+escape|case:lc|smooth:none|nrefs:1|multi-bleu"
        f"|sacremoses:{sacremoses_version()}|sacrebleu:{sacrebleu.__version__}"
    )
    return _result(score, signature)


def multi30k_tokenize(text: str, lang: str) -> str:
    """``lowercase.perl | normalize-punctuation.perl -l lang | tokenizer.perl -l lang``, as Multi30k does.

    'Er sagte „Ja“.' -> "er sagte &quot; ja &quot; ."; "A man's hat." -> "a man &apos;s hat ." (en).
    """
    return lowercase_moses(text, lang, escape=True)


def score_all(
    hypotheses: Sequence[str], references: Sequence[str], lang: str, *,
    protocols: Sequence[str] = BLEU_PROTOCOLS,
) -> dict[str, BleuResult]:
    """Corpus BLEU under each protocol in ``protocols`` (default: all of ``BLEU_PROTOCOLS``).

    Args:
      hypotheses: detokenized system outputs, one per sentence.
      references: the raw reference translations, one per sentence.
      lang: target language code ("de", "en", ...), used by the tokenized and multi30k protocols.
      protocols: a subset of ``BLEU_PROTOCOLS``, e.g. ``("multi30k",)`` for a quick dev score.

    Returns:
      ``{protocol: BleuResult}`` in the order of ``protocols``; ``result.to_dict()`` is JSON-ready.
    """
    if isinstance(protocols, str):
        protocols = (protocols,)
    unknown = [p for p in protocols if p not in BLEU_PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(
            f"unknown BLEU protocol(s) {unknown or list(protocols)}; choose from {list(BLEU_PROTOCOLS)}")
    scorers = {
        "sacrebleu": lambda: sacrebleu_score(hypotheses, references),
        "tokenized": lambda: tokenized_bleu(hypotheses, references, lang),
        "multi30k": lambda: multi30k_bleu(hypotheses, references, lang),
    }
    return {protocol: scorers[protocol]() for protocol in protocols}


def moses_tokenize(text: str, lang: str, *, escape: bool = True) -> str:
    """``tokenizer.perl -l lang`` with its default options (so XML characters are escaped).

    Returns the tokens joined by single spaces: "Hello, world!" -> "Hello , world !".
    """
    return moses_tokenizer(lang).tokenize(text, return_str=True, escape=escape)


def split_compounds(text: str) -> str:
    """Split hyphenated compounds as ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`` does.

    "state-of-the-art" -> "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art". Matches do not
    overlap: "a-b-c" -> "a ##AT##-##AT## b-c", as in perl.
    """
    return _COMPOUND_HYPHEN.sub(_COMPOUND_SPLIT, text.encode("utf-8")).decode("utf-8")


def _check_corpus(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[list[str], list[str]]:
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise ValueError("hypotheses and references must be sequences of sentences, got a single string")
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(
            f"got {len(hypotheses)} hypotheses but {len(references)} references; need one reference per "
            "hypothesis")
    if not hypotheses:
        raise ValueError("cannot score an empty corpus (0 sentences)")
    for name, sentences in (("hypotheses", hypotheses), ("references", references)):
        for i, sentence in enumerate(sentences):
            if not isinstance(sentence, str):
                raise ValueError(
                    f"{name}[{i}] is {type(sentence).__name__}, expected str (one reference per sentence)")
    return hypotheses, references


def _result(score: sacrebleu.metrics.bleu.BLEUScore, signature: str) -> BleuResult:
    return BleuResult(
        score=float(score.score), precisions=tuple(float(p) for p in score.precisions), bp=float(score.bp),
        ratio=float(score.ratio), hyp_len=int(score.sys_len), ref_len=int(score.ref_len), signature=signature)

