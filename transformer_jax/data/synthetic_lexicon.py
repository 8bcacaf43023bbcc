"""The synthetic task's lexicon: English lemmas, the invented target morphology, and the seeded lexicon.

Shared by the grammar (``synthetic.py``), its word alignment and its baselines. Every target word is
invented from the seed (names are copied); see ``build_lexicon``.
"""

from __future__ import annotations

import dataclasses
import functools
import random

NOUNS = [
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
ADJECTIVES = (
    "big small old young red blue green white black happy sad tall short new beautiful quiet"
    " loud strong kind clever lazy hungry tired brave rich poor warm cold dark bright"
).split()
# (base, third person singular, past)
TRANSITIVE = [
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
INTRANSITIVE = [
    ("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("walk", "walks", "walked"),
    ("sing", "sings", "sang"), ("dance", "dances", "danced"), ("laugh", "laughs", "laughed"),
    ("cry", "cries", "cried"), ("swim", "swims", "swam"), ("wait", "waits", "waited"),
    ("work", "works", "worked"), ("play", "plays", "played"), ("smile", "smiles", "smiled"),
    ("jump", "jumps", "jumped"), ("fall", "falls", "fell"), ("sit", "sits", "sat"),
]  # fmt: skip
# Verbs taking a 'that' clause.
SAYING = [
    ("say", "says", "said"), ("think", "thinks", "thought"), ("know", "knows", "knew"),
    ("hope", "hopes", "hoped"),
]  # fmt: skip
ADVERBS = (
    "quickly slowly often today again always sometimes quietly happily early late here".split()
)
PREPOSITIONS = "in on under near behind with without for".split()
COORDINATORS = ("and", "but")
SUBORDINATORS = ("because", "when", "if")
# Determiners: source word -> (target lemma, numbers it allows).
DETERMINERS = {
    "the": ("the", ("sg", "pl")), "a": ("a", ("sg",)), "this": ("this", ("sg",)),
    "these": ("this", ("pl",)), "my": ("my", ("sg", "pl")), "your": ("your", ("sg", "pl")),
    "our": ("our", ("sg", "pl")), "some": ("some", ("pl",)), "every": ("every", ("sg",)),
}  # fmt: skip
NAMES = {"Anna": "f", "Maria": "f", "Lena": "f", "Eva": "f", "Tom": "m", "Paul": "m",
          "Peter": "m", "Max": "m"}  # fmt: skip
PERSONS = ("1s", "2s", "3s", "1p", "3p")
# (subject, object, person, gender); 1st/2nd person and 'they' agree as masculine.
PRONOUNS = [("I", "me", "1s", "m"), ("you", "you", "2s", "m"), ("he", "him", "3s", "m"),
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


AGREEMENT_SUFFIXES = tuple(
    {s for numbers in AGREEMENT.values() for genders in numbers.values() for s in genders.values()}
)
VERB_SUFFIXES = tuple(s for persons in VERB_SUFFIX.values() for s in persons.values())


@functools.lru_cache(maxsize=8)
def build_lexicon(seed: int) -> Lexicon:
    """The target language of `seed`; no two lemmas share an inflected form."""
    rng = random.Random(f"lexicon-{seed}")
    used: set[str] = set(NAMES)
    noun_gender = {sg: rng.choice(GENDERS) for sg, _ in NOUNS}
    noun_stem = {
        sg: _invent(rng, used, 2, True, ("", NOUN_PLURAL[noun_gender[sg]])) for sg, _ in NOUNS
    }
    stem = {a: _invent(rng, used, 2, True, sorted(AGREEMENT_SUFFIXES)) for a in ADJECTIVES}
    for base, _, _ in TRANSITIVE + INTRANSITIVE + SAYING:
        stem[base] = _invent(rng, used, 2, True, VERB_SUFFIXES)
    stem["be"] = _invent(rng, used, 1, True, VERB_SUFFIXES)
    for lemma in sorted({lemma for lemma, _ in DETERMINERS.values()}):
        stem[lemma] = _invent(rng, used, 1, True, sorted(AGREEMENT_SUFFIXES))
    word = {w: _invent(rng, used, 2, False) for w in ADVERBS}
    for w in PREPOSITIONS + list(COORDINATORS + SUBORDINATORS) + ["that", "not"]:
        word[w] = _invent(rng, used, 1, False)
    keys = [p + g for _, _, p, g in PRONOUNS]
    subj = {k: _invent(rng, used, 1, False) for k in keys}
    obj = {k: _invent(rng, used, 1, True) for k in keys}
    return Lexicon(noun_stem, noun_gender, stem, word, subj, obj)
