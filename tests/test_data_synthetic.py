"""The embedded synthetic translation task (transformer_jax/data/synthetic.py)."""

import re

import pytest
import sacrebleu

from transformer_jax.data import synthetic
from transformer_jax.data.synthetic import (
    SyntheticSource,
    base_translations,
    copy_baseline,
    lexicon_baseline,
)


def _words(text: str) -> list[str]:
    return re.findall(r"[^\s,.!]+", text)


def test_generator_is_deterministic_and_seeded():
    a, b, c = synthetic._Stream(7), synthetic._Stream(7), synthetic._Stream(11)
    for stream in (a, b, c):
        stream.extend_to(53)
    assert a.pairs == b.pairs
    assert len(set(a.pairs) & set(c.pairs)) < 5  # another seed is another language and corpus
    assert synthetic.build_lexicon(7) != synthetic.build_lexicon(11)


def test_splits_have_their_sizes_and_never_share_a_source_sentence():
    source = SyntheticSource(train_size=3001, dev_size=101, test_size=103, seed=5)
    splits = {s: source.pairs(s) for s in ("train", "dev", "test")}
    assert {s: len(p) for s, p in splits.items()} == {"train": 3001, "dev": 101, "test": 103}
    sources = {s: {src for src, _ in p} for s, p in splits.items()}
    assert len(sources["train"]) == 3001  # unique within a split, too
    assert not sources["train"] & sources["dev"]
    assert not sources["train"] & sources["test"]
    assert not sources["dev"] & sources["test"]
    # The test set does not depend on the train size.
    other = SyntheticSource(train_size=17, dev_size=101, test_size=103, seed=5)
    assert other.pairs("test") == splits["test"]


def test_lengths_span_3_to_40_words_with_punctuation_and_capitals():
    pairs = SyntheticSource(train_size=3001, dev_size=1, test_size=1, seed=0).pairs("train")
    lengths = [len(_words(src)) for src, _ in pairs]
    assert min(lengths) >= 3 and max(lengths) <= 40
    assert min(lengths) <= 4 and max(lengths) >= 35  # the whole range is used
    for src, tgt in pairs:
        assert src[0].isupper() and tgt[0].isupper()
        assert src[-1] in ".!" and tgt[-1] == src[-1]
        assert 0.5 < len(_words(tgt)) / len(_words(src)) < 1.5


def test_translation_needs_agreement_and_context():
    """'the' and 'saw' each have several target forms: word-by-word lookup cannot work."""
    lex = synthetic.build_lexicon(0)
    pairs = SyntheticSource(train_size=3001, dev_size=1, test_size=1, seed=0).pairs("train")
    the_forms = set()
    saw_forms = set()
    for src, tgt in pairs:
        tgt_words = set(w.lower() for w in _words(tgt))
        if _words(src.lower())[:1] == ["the"]:
            the_forms.add(_words(tgt.lower())[0])
        if "saw" in _words(src):
            saw_forms |= {w for w in tgt_words if w.startswith(lex.stem["see"])}
    assert len(the_forms) >= 5  # gender x number (subject case)
    assert len(saw_forms) >= 4  # person x number in the past tense


def test_every_source_word_has_a_base_translation():
    pairs = SyntheticSource(train_size=3001, dev_size=1, test_size=1, seed=0).pairs("train")
    table = base_translations(0)
    vocab = {w.lower() for src, _ in pairs for w in _words(src)}
    names = {n.lower() for n in synthetic.NAMES}
    assert vocab - names <= set(table)
    assert 150 <= len(vocab) <= 400  # small enough to learn on a CPU


def test_both_baselines_stay_below_40_bleu_on_the_test_split():
    pairs = SyntheticSource(train_size=1, dev_size=500, test_size=500, seed=0).pairs("test")
    refs = [[t for _, t in pairs]]
    scores = {"copy": sacrebleu.corpus_bleu(copy_baseline(pairs), refs).score,
              "lexicon": sacrebleu.corpus_bleu(lexicon_baseline(pairs, 0), refs).score}
    assert scores["copy"] < 40 and scores["lexicon"] < 40, scores
    assert scores["lexicon"] > scores["copy"]
    # The check can fail: the references themselves score 100.
    assert sacrebleu.corpus_bleu(refs[0], refs).score == pytest.approx(100.0)
    assert len(copy_baseline(pairs)) == len(lexicon_baseline(pairs)) == 500


def test_target_reorders_adjectives_and_puts_subordinate_verbs_last():
    lex = synthetic.build_lexicon(0)
    pairs = SyntheticSource(train_size=3001, dev_size=1, test_size=1, seed=0).pairs("train")
    verbs = {lex.stem[v] + suffix for v in lex.stem for persons in synthetic.VERB_SUFFIX.values()
             for suffix in persons.values()}  # fmt: skip
    subordinators = {lex.word[w] for w in ("because", "when", "if", "that")}
    adjective_checks = verb_checks = 0
    for src, tgt in pairs:
        src_words, tgt_words = _words(src.lower()), _words(tgt.lower())
        # 'the big dog' -> 'DET dog-stem big-stem+agreement'
        for adj, noun in zip(src_words, src_words[1:], strict=False):
            if adj in synthetic.ADJECTIVES and noun in lex.noun_stem:
                stems = [lex.stem[adj], lex.noun_stem[noun]]
                where = [[i for i, w in enumerate(tgt_words) if w.startswith(s)] for s in stems]
                if len(where[0]) == len(where[1]) == 1:
                    assert where[1][0] < where[0][0], (src, tgt)
                    adjective_checks += 1
        # The last clause, when subordinate, ends with its verb.
        parts = tgt[:-1].split(", ")
        last = parts[-1].split()
        if len(parts) > 1 and last[0] in subordinators and lex.word["and"] not in last:
            assert last[-1] in verbs, (src, tgt)
            verb_checks += 1
    assert adjective_checks > 300 and verb_checks > 300
