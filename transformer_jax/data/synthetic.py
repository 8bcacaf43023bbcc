"""An embedded synthetic translation task: English-like source -> invented target language.

No files, no network: a seeded grammar generates sentence pairs that need what real translation
needs, while staying regular enough for a tiny Transformer to learn on a CPU in minutes:

- Lexicon: ~200 English lemmas (60 nouns, 30 adjectives, 49 verbs, pronouns, names, function
  words); every target word is invented from the seed (names are copied).
- Reordering: adjectives follow their noun; object pronouns become clitics before the verb;
  subordinate clauses ('because', 'when', 'if', 'that') are verb-final.
- Agreement and morphology: nouns have a hidden gender (one of 3) and a gender-specific plural;
  determiners and adjectives agree with the noun in gender, number and case (subject vs
  object); verbs inflect for tense and the subject's person and number ('see' -> 3 forms);
  negation 'do/does/did not V' becomes one particle plus the inflected verb.
- Form: 3 to 40 words by default (data.synthetic_min_words, synthetic_max_words), capitalised,
  '.' or '!' at the end; the target puts a comma before 'but' and before subordinate clauses, so
  detokenisation matters a little.

Splits are one stream of unique source sentences: the first `test_size` are test, the next
`dev_size` dev, the rest train, so splits never share a source sentence and the test set does
not change with the train size. data.synthetic_test_min_words > 0 makes the test split the first
sentences of at least that many words instead (dev and train take the others in order): a test set
longer than the training pairs that data.max_len keeps.

Baselines (`copy_baseline`, `lexicon_baseline`): copying the source, and word-by-word lexicon substitution
(each word's base translation, no reordering, no agreement): what a model must beat to show it learned
the reordering and agreement. Their scores on the default task are in docs/translation.md.

Word alignment (`word_alignment`): which target word inflects which source word's lemma, for
analysing what attention learned (transformer_jax.inspect).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Sequence

from transformer_jax.data.synthetic_lexicon import (
    ADJECTIVES,
    ADVERBS,
    AGREEMENT,
    AGREEMENT_SUFFIXES,
    COORDINATORS,
    DETERMINERS,
    INTRANSITIVE,
    NAMES,
    NOUN_PLURAL,
    NOUNS,
    PREPOSITIONS,
    PRONOUNS,
    SAYING,
    SUBORDINATORS,
    TRANSITIVE,
    VERB_SUFFIX,
    VERB_SUFFIXES,
    Lexicon,
    build_lexicon,
)
from transformer_jax.runtime.errors import DataError

# ----------------------------------------------------------------------------- the grammar


@dataclasses.dataclass
class _Phrase:
    src: list[str]
    tgt: list[str]
    person: str = "3s"
    gender: str = "m"
    clitic: bool = False  # an object pronoun: goes before the verb in the target


class _Generator:
    """Draws one (source, target) sentence pair per call from a seeded grammar."""

    def __init__(self, lex: Lexicon, rng: random.Random):
        self.lex, self.rng = lex, rng

    def noun_phrase(self, case: str, allow_pp: bool = True) -> _Phrase:
        rng, lex = self.rng, self.lex
        r = rng.random()
        if r < 0.08:  # pronoun
            s, o, person, gender = rng.choice(PRONOUNS)
            key = person + gender
            if case == "nom":
                return _Phrase([s], [lex.subj[key]], person, gender)
            return _Phrase([o], [lex.obj[key]], person, gender, clitic=True)
        if r < 0.14:  # name, copied
            name = rng.choice(sorted(NAMES))
            return _Phrase([name], [name], "3s", NAMES[name])
        sg, pl = rng.choice(NOUNS)
        number = "pl" if rng.random() < 0.35 else "sg"
        gender = lex.noun_gender[sg]
        det = rng.choice([d for d, (_, nums) in DETERMINERS.items() if number in nums])
        suffix = AGREEMENT[case][number][gender]
        num_adj = rng.choices((0, 1, 2), weights=(55, 30, 15))[0]
        adjs = rng.sample(ADJECTIVES, num_adj)
        noun_t = lex.noun_stem[sg] + (NOUN_PLURAL[gender] if number == "pl" else "")
        src = [det, *adjs, pl if number == "pl" else sg]
        tgt = [lex.stem[DETERMINERS[det][0]] + suffix, noun_t]
        tgt += [lex.stem[a] + suffix for a in adjs]  # adjectives follow the noun
        if allow_pp and rng.random() < 0.15:
            pp = self.prep_phrase()
            src, tgt = src + pp.src, tgt + pp.tgt
        return _Phrase(src, tgt, "3s" if number == "sg" else "3p", gender)

    def prep_phrase(self) -> _Phrase:
        prep = self.rng.choice(PREPOSITIONS)
        # A pronoun object stays after the preposition ('with him'), in its object form.
        np_ = self.noun_phrase("acc", allow_pp=False)
        return _Phrase([prep, *np_.src], [self.lex.word[prep], *np_.tgt])

    def verb_group(self, forms: tuple[str, str, str], subject: _Phrase, tense: str, neg: bool):
        """Source tokens and target tokens ([not], verb) for `forms` agreeing with `subject`."""
        base, third, past = forms
        person = subject.person
        if neg:
            aux = "did" if tense == "past" else ("does" if person == "3s" else "do")
            src = [aux, "not", base]
        else:
            src = [past if tense == "past" else (third if person == "3s" else base)]
        verb = self.lex.stem[base] + VERB_SUFFIX[tense][person]
        return src, ([self.lex.word["not"]] if neg else []), verb

    def clause(self, subordinate: bool, depth: int = 0) -> _Phrase:
        """One clause; subordinate clauses are verb-final in the target."""
        rng, lex = self.rng, self.lex
        subj = self.noun_phrase("nom")
        tense = "past" if rng.random() < 0.4 else "pres"
        neg = rng.random() < 0.15
        kind = rng.choices(("trans", "intrans", "copula", "say"), weights=(50, 20, 15, 15))[0]
        if kind == "say" and depth > 0:
            kind = "trans"
        after_src: list[str] = []
        obj_t: list[str] = []
        clitic: list[str] = []
        tail_t: list[str] = []  # after the verb in main clauses, before it in subordinate ones
        if kind == "copula":
            be = {"pres": {"1s": "am", "3s": "is"}, "past": {"1s": "was", "3s": "was"}}
            default = "are" if tense == "pres" else "were"
            verb_src = [be[tense].get(subj.person, default)] + (["not"] if neg else [])
            neg_t = [lex.word["not"]] if neg else []
            verb_t = lex.stem["be"] + VERB_SUFFIX[tense][subj.person]
            adj = rng.choice(ADJECTIVES)
            number = "sg" if subj.person[1] == "s" else "pl"
            after_src = [adj]
            tail_t = [lex.stem[adj] + AGREEMENT["nom"][number][subj.gender]]
        else:
            forms = rng.choice(
                {"trans": TRANSITIVE, "intrans": INTRANSITIVE, "say": SAYING}[kind]
            )
            verb_src, neg_t, verb_t = self.verb_group(forms, subj, tense, neg)
            if kind == "trans":
                obj = self.noun_phrase("acc")
                after_src = obj.src
                if obj.clitic:
                    clitic = obj.tgt
                else:
                    obj_t = obj.tgt
        extra_src: list[str] = []
        extra_t: list[str] = []
        if kind != "say":
            if rng.random() < 0.3:
                adv = rng.choice(ADVERBS)
                extra_src, extra_t = [adv], [lex.word[adv]]
            if rng.random() < 0.25:
                pp = self.prep_phrase()
                extra_src, extra_t = extra_src + pp.src, extra_t + pp.tgt
        src = subj.src + verb_src + after_src + extra_src
        verb_block = neg_t + clitic + [verb_t]
        if subordinate:
            tgt = subj.tgt + obj_t + tail_t + extra_t + verb_block
        else:
            tgt = subj.tgt + verb_block + obj_t + tail_t + extra_t
        if kind == "say":
            inner = self.clause(subordinate=True, depth=depth + 1)
            src += ["that", *inner.src]
            tgt += [",", lex.word["that"], *inner.tgt]
        return _Phrase(src, tgt)

    def sentence(self) -> tuple[list[str], list[str]]:
        rng, lex = self.rng, self.lex
        first = self.clause(subordinate=False)
        src, tgt = first.src, first.tgt
        for _ in range(rng.choices((0, 1, 2, 3), weights=(45, 35, 15, 5))[0]):
            if rng.random() < 0.5:
                conj = rng.choice(COORDINATORS)
                clause = self.clause(subordinate=False)
                comma = [","] if conj == "but" else []
            else:
                conj = rng.choice(SUBORDINATORS)
                clause = self.clause(subordinate=True)
                comma = [","]
            src = src + [conj, *clause.src]
            tgt = tgt + comma + [lex.word[conj], *clause.tgt]
        return src, tgt


def _render(tokens: list[str], end: str) -> str:
    """Joins words, attaches commas, capitalises the first letter and adds `end`."""
    text = " ".join(tokens).replace(" ,", ",") + end
    return text[0].upper() + text[1:]


MIN_WORDS, MAX_WORDS = 3, 40  # the default sentence lengths (data.synthetic_min_words, _max_words)
# A stream stops with DataError instead of drawing for ever: after this many draws in a row give no new
# sentence (a narrow word range exhausts the grammar), or this many in all (a test length seldom drawn).
# One draw takes about 60 microseconds.
MAX_FAILED_DRAWS, MAX_DRAWS = 100_000, 1_000_000


class _Stream:
    """The seed's stream of unique sentence pairs of ``min_words`` to ``max_words`` source words (commas
    not counted), extended on demand."""

    def __init__(self, seed: int, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS):
        self.gen = _Generator(build_lexicon(seed), random.Random(f"sentences-{seed}"))
        self.min_words, self.max_words = min_words, max_words
        self.pairs: list[tuple[str, str]] = []
        self.words: list[int] = []  # each pair's source words
        self._seen: set[str] = set()
        self.draws = 0

    def extend_to(self, n: int, what: str = "") -> None:
        failed = 0
        while len(self.pairs) < n:
            if failed >= MAX_FAILED_DRAWS or self.draws >= MAX_DRAWS:
                raise DataError(
                    f"the synthetic grammar gave {len(self.pairs)} unique sentences of {self.min_words} to "
                    f"{self.max_words} words in {self.draws:,} draws{what}, fewer than the {n} needed; widen "
                    "data.synthetic_min_words..synthetic_max_words or lower the split sizes")
            self.draws += 1
            failed += 1
            src, tgt = self.gen.sentence()
            words = len([w for w in src if w != ","])
            if not self.min_words <= words <= self.max_words:
                continue
            end = "!" if self.gen.rng.random() < 0.1 else "."
            src_text = _render(src, end)
            if src_text in self._seen:
                continue
            self._seen.add(src_text)
            self.pairs.append((src_text, _render(tgt, end)))
            self.words.append(words)
            failed = 0


@functools.lru_cache(maxsize=4)
def _stream(seed: int, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS) -> _Stream:
    return _Stream(seed, min_words, max_words)


class SyntheticSource:
    """The synthetic task as a `Source`: test, then dev, then train from one unique stream.

    Sentences have ``min_words`` to ``max_words`` source words. With ``test_min_words`` above
    ``min_words`` the test split takes the stream's first ``test_size`` sentences of at least that many
    words, and dev and train the other sentences in stream order (dev first): a test set longer than
    anything trained on (``data.max_len`` drops the long train pairs). The default (0) is the plain
    layout: test, dev and train are consecutive runs of the stream.
    """

    def __init__(self, *, train_size: int, dev_size: int, test_size: int, seed: int,
                 min_words: int = MIN_WORDS, max_words: int = MAX_WORDS, test_min_words: int = 0):
        self.sizes = {"test": test_size, "dev": dev_size, "train": train_size}
        self.seed = seed
        self.min_words, self.max_words, self.test_min_words = min_words, max_words, test_min_words

    def pairs(self, split: str) -> list[tuple[str, str]]:
        if split not in self.sizes:
            raise ValueError(f"split must be one of ('train', 'dev', 'test'), got {split!r}")
        stream = _stream(self.seed, self.min_words, self.max_words)
        if self.test_min_words > self.min_words:
            return [stream.pairs[i] for i in self._long_test_layout(stream)[split]]
        start = 0
        for name in ("test", "dev", "train"):
            if name == split:
                break
            start += self.sizes[name]
        stream.extend_to(start + self.sizes[split])
        return stream.pairs[start : start + self.sizes[split]]

    def _long_test_layout(self, stream: _Stream) -> dict[str, list[int]]:
        """{split: stream indices}: test the first ``test_size`` of at least ``test_min_words`` words,
        then dev and train from the rest, in stream order."""
        sizes, n = self.sizes, sum(self.sizes.values())
        while True:
            long = [i for i, w in enumerate(stream.words) if w >= self.test_min_words][:sizes["test"]]
            taken = set(long)
            rest = [i for i in range(len(stream.pairs)) if i not in taken][:sizes["dev"] + sizes["train"]]
            if len(long) == sizes["test"] and len(rest) == sizes["dev"] + sizes["train"]:
                return {"test": long, "dev": rest[:sizes["dev"]], "train": rest[sizes["dev"]:]}
            try:
                stream.extend_to(max(n, 2 * len(stream.pairs)),
                                 f" ({len(long)} of at least {self.test_min_words} words for the test split)")
            except DataError:
                if len(stream.pairs) >= n and len(long) < sizes["test"]:  # the long ones are what is missing
                    raise DataError(
                        f"data.synthetic_test_min_words={self.test_min_words}: only {len(long)} of the "
                        f"{sizes['test']} test sentences found in {stream.draws:,} draws (sentences that "
                        "long are rare); lower it, raise data.synthetic_max_words, or lower "
                        "synthetic_test_size"
                    ) from None
                raise


# ----------------------------------------------------------------------------- word alignment


def word_alignment(source: str, target: str, seed: int) -> list[tuple[int, int]]:
    """(target word index, source word index) pairs that the grammar of `seed` makes unambiguous.

    Words are `text.split()`, ignoring case and attached punctuation. A target word aligns with a
    source word when it inflects that word's lemma and no other source word has that lemma (in
    'The dog saw the cat.' both 'the' stay unaligned). Pairs are in target order; a pair whose
    source index is below an earlier pair's is a reordered word (adjective after its noun, verb
    at the end of a subordinate clause): 'The big dog sleeps.' -> [(0, 0), (1, 2), (2, 1), (3, 3)].
    """
    lemma_of_target, lemma_of_source = _lemma_tables(seed)
    src_lemmas = [lemma_of_source.get(w) for w in _plain_words(source)]
    pairs = []
    for t, word in enumerate(_plain_words(target)):
        lemma = lemma_of_target.get(word)
        matches = [s for s, lem in enumerate(src_lemmas) if lemma is not None and lem == lemma]
        if len(matches) == 1:
            pairs.append((t, matches[0]))
    return pairs


def _plain_words(text: str) -> list[str]:
    return [re.sub(r"[^\w]", "", w).lower() for w in text.split()]


@functools.lru_cache(maxsize=8)
def _lemma_tables(seed: int) -> tuple[dict[str, str], dict[str, str]]:
    """({target form: lemma}, {source form: lemma}); closed-class lemmas are prefixed ('det:the')."""
    lex = build_lexicon(seed)
    tgt: dict[str, str] = {}
    src: dict[str, str] = {}

    def add(lemma: str, source_forms, target_forms) -> None:
        src.update(dict.fromkeys(source_forms, lemma))
        tgt.update(dict.fromkeys(target_forms, lemma))

    for sg, pl in NOUNS:
        add(sg, (sg, pl), (lex.noun_stem[sg], lex.noun_stem[sg] + NOUN_PLURAL[lex.noun_gender[sg]]))
    for adj in ADJECTIVES:
        add(adj, (adj,), (lex.stem[adj] + s for s in AGREEMENT_SUFFIXES))
    for forms in TRANSITIVE + INTRANSITIVE + SAYING:
        add(forms[0], forms, (lex.stem[forms[0]] + s for s in VERB_SUFFIXES))
    add("be", ("am", "is", "are", "was", "were"), (lex.stem["be"] + s for s in VERB_SUFFIXES))
    for det, (lemma, _) in DETERMINERS.items():
        add("det:" + lemma, (det,), (lex.stem[lemma] + s for s in AGREEMENT_SUFFIXES))
    for word, translation in lex.word.items():
        add(word, (word,), (translation,))
    for subj, obj, person, gender in PRONOUNS:
        key = person + gender
        tgt[lex.subj[key]], tgt[lex.obj[key]] = "subj:" + key, "obj:" + key
        src.setdefault(subj.lower(), "subj:" + key)
        src.setdefault(obj, "obj:" + key)  # 'you' is both; its subject reading wins, as in base_translations
    for name in NAMES:
        add("name:" + name, (name.lower(),), (name.lower(),))
    return tgt, src


# ----------------------------------------------------------------------------- baselines


def copy_baseline(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """Hypothesis = source sentence."""
    return [src for src, _ in pairs]


@functools.lru_cache(maxsize=8)
def base_translations(seed: int) -> dict[str, str]:
    """Each source word's base translation: nouns keep their number; determiners and
    adjectives take the masculine singular subject form; verbs the most common person of
    their form ('see' -> 3rd plural, 'sees' -> 3rd singular, 'saw' -> 3rd singular past);
    'do/does/did' translate to nothing. Names are copied.
    """
    lex = build_lexicon(seed)
    table: dict[str, str] = {}
    for sg, pl in NOUNS:
        gender = lex.noun_gender[sg]
        table[sg], table[pl] = lex.noun_stem[sg], lex.noun_stem[sg] + NOUN_PLURAL[gender]
    default = AGREEMENT["nom"]["sg"]["m"]
    for det, (lemma, _) in DETERMINERS.items():
        table[det] = lex.stem[lemma] + default
    for adj in ADJECTIVES:
        table[adj] = lex.stem[adj] + default
    for base, third, past in TRANSITIVE + INTRANSITIVE + SAYING:
        table[base] = lex.stem[base] + VERB_SUFFIX["pres"]["3p"]
        table[third] = lex.stem[base] + VERB_SUFFIX["pres"]["3s"]
        table[past] = lex.stem[base] + VERB_SUFFIX["past"]["3s"]
    for src, person in (("am", "1s"), ("is", "3s"), ("are", "3p")):
        table[src] = lex.stem["be"] + VERB_SUFFIX["pres"][person]
    for src, person in (("was", "3s"), ("were", "3p")):
        table[src] = lex.stem["be"] + VERB_SUFFIX["past"][person]
    for aux in ("do", "does", "did"):
        table[aux] = ""
    table.update(lex.word)
    for subj, obj, person, gender in PRONOUNS:
        table[subj.lower()] = lex.subj[person + gender]
        table.setdefault(obj, lex.obj[person + gender])  # 'you' keeps its subject form
    return table


def lexicon_baseline(pairs: Sequence[tuple[str, str]], seed: int = 0) -> list[str]:
    """Word-by-word substitution with base translations: no reordering, no agreement."""
    table = base_translations(seed)
    hyps = []
    for src, _ in pairs:
        end = src[-1]
        words = [table.get(w.lower(), w) if w not in NAMES else w for w in src[:-1].split()]
        hyps.append(_render([w for w in words if w], end))
    return hyps
