"""A small synthetic treebank from a seeded probabilistic context-free grammar.

The embedded parsing task: trees with Penn Treebank labels (S, NP, VP, PP, SBAR, ADJP, ADVP, PRT)
and tags (DT, NN, VBZ, `,`, `.` ...), so the whole parsing path (linearization, training,
decoding, repair, EVALB-style F1 with punctuation and ADVP=PRT) runs with nothing but pip.

Structure the model must learn from the words: clause and NP coordination, clausal complements
(SBAR), particles (PRT) versus adverbs (ADVP), and PP attachment. A PP after an object NP attaches
to the NP or to the VP at random, so that ambiguity is not resolvable and F1 stays below 100.

Splits are one stream of unique sentences (like the synthetic translation task): the first
`test_size` are test, the next `dev_size` dev, the rest train, so the splits never share a
sentence and the test set does not change with the train size.
"""

from __future__ import annotations

import functools
import random

from transformer_jax.data.trees import Tree

# label -> [(right-hand side, weight, recursive)]; recursive rules are not used beyond _MAX_DEPTH.
_RULES: dict[str, list[tuple[tuple[str, ...], float, bool]]] = {
    "S": [
        (("NP", "VP"), 6.0, False),
        (("PP", ",", "NP", "VP"), 1.0, True),
        (("NP", "ADVP", "VP"), 1.0, False),
        (("S", ",", "CC", "S"), 1.0, True),
    ],
    "NP": [
        (("DT", "NN"), 4.0, False),
        (("DT", "JJ", "NN"), 2.0, False),
        (("DT", "ADJP", "NN"), 0.7, False),
        (("NNS",), 1.0, False),
        (("PRP",), 2.0, False),
        (("NNP", "NNP"), 1.0, False),
        (("NP", "PP"), 1.5, True),
        (("NP", "CC", "NP"), 0.5, True),
    ],
    "VP": [
        (("VBZ", "NP"), 4.0, False),
        (("VBD", "NP", "PP"), 2.0, True),
        (("VBD",), 1.0, False),
        (("VBZ", "SBAR"), 1.0, True),
        (("VBD", "PRT", "NP"), 1.0, False),
        (("MD", "VP"), 1.0, True),
        (("VBZ", "ADJP"), 1.0, False),
        (("VBD", "ADVP"), 1.0, False),
    ],
    "PP": [(("IN", "NP"), 1.0, False)],
    "SBAR": [(("IN", "S"), 1.0, False)],
    "ADJP": [(("RB", "JJ"), 1.0, False), (("JJ",), 1.0, False)],
    "ADVP": [(("RB",), 1.0, False)],
    "PRT": [(("RP",), 1.0, False)],
}
_WORDS = {
    "DT": "the a this every some".split(),
    "NN": "dog cat teacher garden house river city book letter market".split(),
    "NNS": "dogs cats teachers gardens houses books letters".split(),
    "NNP": "Anna Maria Tom Paul Peter Lena".split(),
    "PRP": "he she it they we".split(),
    "JJ": "big small old young red happy quiet".split(),
    "RB": "very quickly often slowly really".split(),
    "VBZ": "sees likes finds is watches".split(),
    "VBD": "saw liked found watched called picked".split(),
    "MD": "will can might".split(),
    "IN": "in on with near that because".split(),
    "CC": "and but".split(),
    "RP": "up out".split(),
    ",": [","],
    ".": ["."],
}
_MAX_DEPTH = 6
MIN_WORDS, MAX_WORDS = 3, 40


def _expand(label: str, rng: random.Random, depth: int) -> Tree:
    if label in _WORDS:
        return Tree(label, (rng.choice(_WORDS[label]),))
    rules = [r for r in _RULES[label] if depth < _MAX_DEPTH or not r[2]]
    rhs = rng.choices([r[0] for r in rules], weights=[r[1] for r in rules])[0]
    return Tree(label, tuple(_expand(child, rng, depth + 1) for child in rhs))


def sample_tree(rng: random.Random) -> Tree:
    """One sentence: an S from the grammar, closed by a '.' under the root."""
    s = _expand("S", rng, 0)
    return Tree("S", s.children + (Tree(".", (".",)),))


class _Stream:
    """The seed's stream of trees with unique sentences, extended on demand."""

    def __init__(self, seed: int):
        self.rng = random.Random(f"pcfg-{seed}")
        self.trees: list[Tree] = []
        self._seen: set[str] = set()

    def extend_to(self, n: int) -> None:
        while len(self.trees) < n:
            tree = sample_tree(self.rng)
            words = tree.words()
            sentence = " ".join(words)
            if MIN_WORDS <= len(words) <= MAX_WORDS and sentence not in self._seen:
                self._seen.add(sentence)
                self.trees.append(tree)


@functools.lru_cache(maxsize=4)
def _stream(seed: int) -> _Stream:
    return _Stream(seed)


def pcfg_trees(split: str, *, train_size: int, dev_size: int, test_size: int, seed: int):
    """The trees of `split` ('train' | 'dev' | 'test'): test, then dev, then train."""
    sizes = {"test": test_size, "dev": dev_size, "train": train_size}
    if split not in sizes:
        raise ValueError(f"split must be one of ('train', 'dev', 'test'), got {split!r}")
    start = 0
    for name in ("test", "dev", "train"):
        if name == split:
            break
        start += sizes[name]
    stream = _stream(seed)
    stream.extend_to(start + sizes[split])
    return stream.trees[start : start + sizes[split]]
