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
- Form: 3 to 40 words, capitalised, '.' or '!' at the end; the target puts a comma before
  'but' and before subordinate clauses, so detokenisation matters a little.

Splits are one stream of unique source sentences: the first `test_size` are test, the next
`dev_size` dev, the rest train, so splits never share a source sentence and the test set does
not change with the train size.

Baselines (`baseline_bleus`): copying the source, and word-by-word lexicon substitution
(each word's base translation, no reordering, no agreement). Both score below 40 BLEU.

Word alignment (`word_alignment`): which target word inflects which source word's lemma, for
analysing what attention learned (transformer_jax.inspect).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Sequence

# ----------------------------------------------------------------------------- source lexicon

_NOUNS = [
    ("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"), ("cow", "cows"),
    ("mouse", "mice"), ("man", "men"), ("woman", "women"), ("child", "children"),
    ("boy", "boys"), ("girl", "girls"), ("teacher", "teachers"), ("doctor", "doctors"),
    ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"), ("friend", "friends"),
    ("neighbor", "neighbors"), ("student", "students"), ("baker", "bakers"),
    ("house", "houses"), ("garden", "gardens"), ("table", "tables"), ("chair", "chairs"),
    ("book", "books"), ("letter", "letters"), ("apple", "apples"), ("cake", "cakes"),
    ("river", "rivers"), ("tree", "trees"), ("flower", "flowers"), ("city", "cities"),
    ("village", "villages"), ("road", "roads"), ("car", "cars"), ("boat", "boats"),
    ("window", "windows"), ("door", "doors"), ("key", "keys"), ("box", "boxes"),
    ("bag", "bags"), ("cup", "cups"), ("glass", "glasses"), ("song", "songs"),
    ("story", "stories"), ("picture", "pictures"), ("ball", "balls"), ("hat", "hats"),
    ("shoe", "shoes"), ("coat", "coats"), ("mountain", "mountains"), ("bridge", "bridges"),
    ("school", "schools"), ("market", "markets"), ("shop", "shops"), ("room", "rooms"),
    ("bed", "beds"), ("lamp", "lamps"), ("clock", "clocks"), ("map", "maps"),
]  # fmt: skip
_ADJECTIVES = (
    "big small old young red blue green white black happy sad tall short new beautiful quiet"
    " loud strong kind clever lazy hungry tired brave rich poor warm cold dark bright"
).split()
# (base, third person singular, past)
_TRANSITIVE = [
    ("see", "sees", "saw"), ("find", "finds", "found"), ("like", "likes", "liked"),
    ("love", "loves", "loved"), ("want", "wants", "wanted"), ("watch", "watches", "watched"),
    ("follow", "follows", "followed"), ("help", "helps", "helped"),
    ("carry", "carries", "carried"), ("open", "opens", "opened"),
    ("close", "closes", "closed"), ("build", "builds", "built"), ("buy", "buys", "bought"),
    ("sell", "sells", "sold"), ("paint", "paints", "painted"), ("write", "writes", "wrote"),
    ("hold", "holds", "held"), ("bring", "brings", "brought"), ("meet", "meets", "met"),
    ("visit", "visits", "visited"), ("call", "calls", "called"), ("clean", "cleans", "cleaned"),
    ("cook", "cooks", "cooked"), ("draw", "draws", "drew"), ("hear", "hears", "heard"),
    ("push", "pushes", "pushed"), ("pull", "pulls", "pulled"), ("catch", "catches", "caught"),
    ("throw", "throws", "threw"), ("wash", "washes", "washed"),
]  # fmt: skip
_INTRANSITIVE = [
    ("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("walk", "walks", "walked"),
    ("sing", "sings", "sang"), ("dance", "dances", "danced"), ("laugh", "laughs", "laughed"),
    ("cry", "cries", "cried"), ("swim", "swims", "swam"), ("wait", "waits", "waited"),
    ("work", "works", "worked"), ("play", "plays", "played"), ("smile", "smiles", "smiled"),
    ("jump", "jumps", "jumped"), ("fall", "falls", "fell"), ("sit", "sits", "sat"),
]  # fmt: skip
# Verbs taking a 'that' clause.
_SAYING = [
    ("say", "says", "said"), ("think", "thinks", "thought"), ("know", "knows", "knew"),
    ("hope", "hopes", "hoped"),
]  # fmt: skip
_ADVERBS = (
    "quickly slowly often today again always sometimes quietly happily early late here".split()
)
_PREPOSITIONS = "in on under near behind with without for".split()
_COORDINATORS = ("and", "but")
_SUBORDINATORS = ("because", "when", "if")
# Determiners: source word -> (target lemma, numbers it allows).
_DETERMINERS = {
    "the": ("the", ("sg", "pl")), "a": ("a", ("sg",)), "this": ("this", ("sg",)),
    "these": ("this", ("pl",)), "my": ("my", ("sg", "pl")), "your": ("your", ("sg", "pl")),
    "our": ("our", ("sg", "pl")), "some": ("some", ("pl",)), "every": ("every", ("sg",)),
}  # fmt: skip
_NAMES = {"Anna": "f", "Maria": "f", "Lena": "f", "Eva": "f", "Tom": "m", "Paul": "m",
          "Peter": "m", "Max": "m"}  # fmt: skip
PERSONS = ("1s", "2s", "3s", "1p", "3p")
# (subject, object, person, gender); 1st/2nd person and 'they' agree as masculine.
_PRONOUNS = [("I", "me", "1s", "m"), ("you", "you", "2s", "m"), ("he", "him", "3s", "m"),
             ("she", "her", "3s", "f"), ("we", "us", "1p", "m"), ("they", "them", "3p", "m")]  # fmt: skip

# ----------------------------------------------------------------------------- target morphology

GENDERS = ("m", "f", "n")
# Agreement suffix of determiners and adjectives: [case][number][gender]. Neuter and plural
# feminine do not distinguish case (syncretism, as in German).
AGREEMENT = {
    "nom": {"sg": {"m": "o", "f": "a", "n": "u"}, "pl": {"m": "i", "f": "as", "n": "ua"}},
    "acc": {"sg": {"m": "on", "f": "an", "n": "u"}, "pl": {"m": "in", "f": "as", "n": "ua"}},
}
NOUN_PLURAL = {"m": "i", "f": "en", "n": "a"}
# Verb suffix: [tense][person].
VERB_SUFFIX = {
    "pres": {"1s": "o", "2s": "es", "3s": "et", "1p": "emos", "3p": "ent"},
    "past": {"1s": "ai", "2s": "aste", "3s": "ait", "1p": "amos", "3p": "aren"},
}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class Lexicon:
    """Invented target words for every source lemma (seeded).

    Attributes:
      noun_stem, noun_gender: source singular -> target stem / gender.
      stem: any other lemma (adjective, verb base, determiner lemma, 'be') -> target stem.
      word: uninflected words (adverbs, prepositions, conjunctions, 'not', 'that') -> target.
      subj, obj: person+gender key like '3sf' -> target subject pronoun / object clitic.
    """

    noun_stem: dict[str, str]
    noun_gender: dict[str, str]
    stem: dict[str, str]
    word: dict[str, str]
    subj: dict[str, str]
    obj: dict[str, str]


def _invent(
    rng: random.Random, used: set[str], syllables: int, final_consonant: bool, suffixes=("",)
) -> str:
    """A fresh pronounceable stem: `syllables` CV syllables, optionally closed by a consonant.

    None of its inflected forms (stem + each of `suffixes`) is a form of an earlier word.
    """
    while True:
        stem = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if final_consonant:
            stem += rng.choice(_CONSONANTS)
        forms = {stem + s for s in suffixes}
        if not forms & used:
            used |= forms
            return stem


_AGREEMENT_SUFFIXES = tuple(
    {s for numbers in AGREEMENT.values() for genders in numbers.values() for s in genders.values()}
)
_VERB_SUFFIXES = tuple(s for persons in VERB_SUFFIX.values() for s in persons.values())


@functools.lru_cache(maxsize=8)
def build_lexicon(seed: int) -> Lexicon:
    """The target language of `seed`; no two lemmas share an inflected form."""
    rng = random.Random(f"lexicon-{seed}")
    used: set[str] = set(_NAMES)
    noun_gender = {sg: rng.choice(GENDERS) for sg, _ in _NOUNS}
    noun_stem = {
        sg: _invent(rng, used, 2, True, ("", NOUN_PLURAL[noun_gender[sg]])) for sg, _ in _NOUNS
    }
    stem = {a: _invent(rng, used, 2, True, sorted(_AGREEMENT_SUFFIXES)) for a in _ADJECTIVES}
    for base, _, _ in _TRANSITIVE + _INTRANSITIVE + _SAYING:
        stem[base] = _invent(rng, used, 2, True, _VERB_SUFFIXES)
    stem["be"] = _invent(rng, used, 1, True, _VERB_SUFFIXES)
    for lemma in sorted({lemma for lemma, _ in _DETERMINERS.values()}):
        stem[lemma] = _invent(rng, used, 1, True, sorted(_AGREEMENT_SUFFIXES))
    word = {w: _invent(rng, used, 2, False) for w in _ADVERBS}
    for w in _PREPOSITIONS + list(_COORDINATORS + _SUBORDINATORS) + ["that", "not"]:
        word[w] = _invent(rng, used, 1, False)
    keys = [p + g for _, _, p, g in _PRONOUNS]
    subj = {k: _invent(rng, used, 1, False) for k in keys}
    obj = {k: _invent(rng, used, 1, True) for k in keys}
    return Lexicon(noun_stem, noun_gender, stem, word, subj, obj)


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
            s, o, person, gender = rng.choice(_PRONOUNS)
            key = person + gender
            if case == "nom":
                return _Phrase([s], [lex.subj[key]], person, gender)
            return _Phrase([o], [lex.obj[key]], person, gender, clitic=True)
        if r < 0.14:  # name, copied
            name = rng.choice(sorted(_NAMES))
            return _Phrase([name], [name], "3s", _NAMES[name])
        sg, pl = rng.choice(_NOUNS)
        number = "pl" if rng.random() < 0.35 else "sg"
        gender = lex.noun_gender[sg]
        det = rng.choice([d for d, (_, nums) in _DETERMINERS.items() if number in nums])
        suffix = AGREEMENT[case][number][gender]
        num_adj = rng.choices((0, 1, 2), weights=(55, 30, 15))[0]
        adjs = rng.sample(_ADJECTIVES, num_adj)
        noun_t = lex.noun_stem[sg] + (NOUN_PLURAL[gender] if number == "pl" else "")
        src = [det, *adjs, pl if number == "pl" else sg]
        tgt = [lex.stem[_DETERMINERS[det][0]] + suffix, noun_t]
        tgt += [lex.stem[a] + suffix for a in adjs]  # adjectives follow the noun
        if allow_pp and rng.random() < 0.15:
            pp = self.prep_phrase()
            src, tgt = src + pp.src, tgt + pp.tgt
        return _Phrase(src, tgt, "3s" if number == "sg" else "3p", gender)

    def prep_phrase(self) -> _Phrase:
        prep = self.rng.choice(_PREPOSITIONS)
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
            adj = rng.choice(_ADJECTIVES)
            number = "sg" if subj.person[1] == "s" else "pl"
            after_src = [adj]
            tail_t = [lex.stem[adj] + AGREEMENT["nom"][number][subj.gender]]
        else:
            forms = rng.choice(
                {"trans": _TRANSITIVE, "intrans": _INTRANSITIVE, "say": _SAYING}[kind]
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
                adv = rng.choice(_ADVERBS)
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
                conj = rng.choice(_COORDINATORS)
                clause = self.clause(subordinate=False)
                comma = [","] if conj == "but" else []
            else:
                conj = rng.choice(_SUBORDINATORS)
                clause = self.clause(subordinate=True)
                comma = [","]
            src = src + [conj, *clause.src]
            tgt = tgt + comma + [lex.word[conj], *clause.tgt]
        return src, tgt


def _render(tokens: list[str], end: str) -> str:
    """Joins words, attaches commas, capitalises the first letter and adds `end`."""
    text = " ".join(tokens).replace(" ,", ",") + end
    return text[0].upper() + text[1:]


MIN_WORDS, MAX_WORDS = 3, 40


class _Stream:
    """The seed's stream of unique sentence pairs, extended on demand."""

    def __init__(self, seed: int):
        self.gen = _Generator(build_lexicon(seed), random.Random(f"sentences-{seed}"))
        self.pairs: list[tuple[str, str]] = []
        self._seen: set[str] = set()

    def extend_to(self, n: int) -> None:
        while len(self.pairs) < n:
            src, tgt = self.gen.sentence()
            if not MIN_WORDS <= len([w for w in src if w != ","]) <= MAX_WORDS:
                continue
            end = "!" if self.gen.rng.random() < 0.1 else "."
            src_text = _render(src, end)
            if src_text in self._seen:
                continue
            self._seen.add(src_text)
            self.pairs.append((src_text, _render(tgt, end)))


@functools.lru_cache(maxsize=4)
def _stream(seed: int) -> _Stream:
    return _Stream(seed)


class SyntheticSource:
    """The synthetic task as a `Source`: test, then dev, then train from one unique stream."""

    def __init__(self, *, train_size: int, dev_size: int, test_size: int, seed: int):
        self.sizes = {"test": test_size, "dev": dev_size, "train": train_size}
        self.seed = seed

    def pairs(self, split: str) -> list[tuple[str, str]]:
        if split not in self.sizes:
            raise ValueError(f"split must be one of ('train', 'dev', 'test'), got {split!r}")
        start = 0
        for name in ("test", "dev", "train"):
            if name == split:
                break
            start += self.sizes[name]
        stream = _stream(self.seed)
        stream.extend_to(start + self.sizes[split])
        return stream.pairs[start : start + self.sizes[split]]


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

    for sg, pl in _NOUNS:
        add(sg, (sg, pl), (lex.noun_stem[sg], lex.noun_stem[sg] + NOUN_PLURAL[lex.noun_gender[sg]]))
    for adj in _ADJECTIVES:
        add(adj, (adj,), (lex.stem[adj] + s for s in _AGREEMENT_SUFFIXES))
    for forms in _TRANSITIVE + _INTRANSITIVE + _SAYING:
        add(forms[0], forms, (lex.stem[forms[0]] + s for s in _VERB_SUFFIXES))
    add("be", ("am", "is", "are", "was", "were"), (lex.stem["be"] + s for s in _VERB_SUFFIXES))
    for det, (lemma, _) in _DETERMINERS.items():
        add("det:" + lemma, (det,), (lex.stem[lemma] + s for s in _AGREEMENT_SUFFIXES))
    for word, translation in lex.word.items():
        add(word, (word,), (translation,))
    for subj, obj, person, gender in _PRONOUNS:
        key = person + gender
        tgt[lex.subj[key]], tgt[lex.obj[key]] = "subj:" + key, "obj:" + key
        src.setdefault(subj.lower(), "subj:" + key)
        src.setdefault(obj, "obj:" + key)  # 'you' is both; its subject reading wins, as in base_translations
    for name in _NAMES:
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
    for sg, pl in _NOUNS:
        gender = lex.noun_gender[sg]
        table[sg], table[pl] = lex.noun_stem[sg], lex.noun_stem[sg] + NOUN_PLURAL[gender]
    default = AGREEMENT["nom"]["sg"]["m"]
    for det, (lemma, _) in _DETERMINERS.items():
        table[det] = lex.stem[lemma] + default
    for adj in _ADJECTIVES:
        table[adj] = lex.stem[adj] + default
    for base, third, past in _TRANSITIVE + _INTRANSITIVE + _SAYING:
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
    for subj, obj, person, gender in _PRONOUNS:
        table[subj.lower()] = lex.subj[person + gender]
        table.setdefault(obj, lex.obj[person + gender])  # 'you' keeps its subject form
    return table


def lexicon_baseline(pairs: Sequence[tuple[str, str]], seed: int = 0) -> list[str]:
    """Word-by-word substitution with base translations: no reordering, no agreement."""
    table = base_translations(seed)
    hyps = []
    for src, _ in pairs:
        end = src[-1]
        words = [table.get(w.lower(), w) if w not in _NAMES else w for w in src[:-1].split()]
        hyps.append(_render([w for w in words if w], end))
    return hyps


def baseline_bleus(split: str = "test", *, seed: int = 0, size: int = 500) -> dict[str, float]:
    """sacrebleu corpus BLEU of `copy_baseline` and `lexicon_baseline` on a split.

    The split is the default task's (500 test / 500 dev sentences from `seed`).
    """
    import sacrebleu

    source = SyntheticSource(train_size=size, dev_size=size, test_size=size, seed=seed)
    pairs = source.pairs(split)
    refs = [[tgt for _, tgt in pairs]]
    return {
        "copy": sacrebleu.corpus_bleu(copy_baseline(pairs), refs).score,
        "lexicon": sacrebleu.corpus_bleu(lexicon_baseline(pairs, seed), refs).score,
    }
