"""Labeled bracket F1 as EVALB computes it with the standard COLLINS.prm (Sekine & Collins, 1997).

The number every parsing paper reports, Table 4 included. Per sentence (gold tree, test tree):

1. Leaves whose part-of-speech tag is a DELETE_LABEL are removed from each tree by its OWN tags:
   -NONE- and the punctuation tags , : `` '' . (not -LRB-/-RRB-, $, #). Test trees from the
   seq2seq parser carry gold tags (`score_outputs` puts them on; EVALB does not score tags).
2. The remaining words must match the gold words one for one; otherwise the sentence is an
   ERROR ("Length unmatch" / "Words unmatch"): counted, reported, and left out of the totals.
   A test tree with no words is SKIPPED, likewise.
3. Brackets are the nonterminal constituents (preterminals are not brackets), as
   (label, start, end) over the remaining words. A label is cut at its first '-' or '='
   (NP-SBJ-1 -> NP); brackets labeled TOP (or a DELETE_LABEL) and brackets left with no words
   are not counted. The tree's top constituent (S) counts; an outer TOP or unlabeled wrapper is
   not there (`trees.preprocess` drops it) -- EVALB would count an unlabeled `( (S ..))` wrapper
   as one always-matching bracket; COLLINS.prm deletes TOP.
4. Matching is one-to-one on equal spans and equal labels, ADVP and PRT being the same label
   (EQ_LABEL ADVP PRT); a unary chain with one span counts once per bracket.

Corpus totals: recall = matched / gold brackets, precision = matched / test brackets,
F1 = 2PR / (P + R) (all in percent), exact match = sentences with gold == test == matched,
over valid sentences. EVALB's MAX_ERROR (abort after 10 errors) is not applied: every error is
counted instead. Scores are over all lengths (EVALB also prints a len <= 40 block).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from transformer_jax.data.trees import PLACEHOLDER, Tree, is_bracket, repair, retag

PUNCTUATION_TAGS = (",", ":", "``", "''", ".")  # COLLINS.prm DELETE_LABEL, for leaves
DELETE_LABELS = frozenset(("TOP", "-NONE-") + PUNCTUATION_TAGS)
EQUIVALENT_LABELS = {"PRT": "ADVP"}  # COLLINS.prm EQ_LABEL ADVP PRT


@dataclasses.dataclass(frozen=True)
class SentenceScore:
    """One sentence's counts; `status` is 'ok', 'error' (words differ) or 'skip' (no test words)."""

    status: str
    gold_brackets: int = 0
    test_brackets: int = 0
    matched: int = 0
    message: str = ""


def _evalb_label(label: str) -> str:
    """EVALB's modify_label (cut at the first '-' or '=') and the ADVP=PRT equivalence."""
    for i, char in enumerate(label):
        if char in "-=":
            label = label[:i]
            break
    return EQUIVALENT_LABELS.get(label, label)


def brackets(tree: Tree, *, labeled: bool = True) -> tuple[list[str], collections.Counter]:
    """(kept words, multiset of (label, start, end)) of a tree after EVALB's deletions.

    `start`/`end` index the kept words (end exclusive). `labeled=False` (EVALB's LABELED 0)
    gives every bracket the label ''.
    """
    words: list[str] = []
    spans: collections.Counter = collections.Counter()

    def walk(node: Tree) -> None:
        if node.is_preterminal:
            if node.label not in DELETE_LABELS:
                words.append(node.children[0])
            return
        start = len(words)
        for child in node.children:
            walk(child)
        label = _evalb_label(node.label)
        if len(words) > start and label not in DELETE_LABELS:
            spans[(label if labeled else "", start, len(words))] += 1

    walk(tree)
    return words, spans


def score_sentence(gold: Tree, test: Tree, *, labeled: bool = True) -> SentenceScore:
    """EVALB's counts for one sentence (see the module docstring)."""
    gold_words, gold_spans = brackets(gold, labeled=labeled)
    test_words, test_spans = brackets(test, labeled=labeled)
    if not test_words:
        return SentenceScore("skip", message="test tree has no words")
    if len(gold_words) != len(test_words):
        return SentenceScore(
            "error", message=f"Length unmatch ({len(gold_words)}|{len(test_words)})"
        )
    for g, t in zip(gold_words, test_words, strict=True):
        if g != t:
            return SentenceScore("error", message=f"Words unmatch ({g}|{t})")
    matched = sum((gold_spans & test_spans).values())
    return SentenceScore(
        "ok", sum(gold_spans.values()), sum(test_spans.values()), matched
    )


def _percent(numerator: int, denominator: int) -> float:
    return 100.0 * numerator / denominator if denominator else 0.0


def score_corpus(
    gold_trees: Sequence[Tree], predicted_trees: Sequence[Tree], *, labeled: bool = True
) -> dict:
    """Corpus-level EVALB figures of aligned tree lists (`labeled=False`: EVALB's LABELED 0).

    Returns a dict: `f1`, `precision`, `recall`, `exact_match` (percent); `sentences`,
    `scored` (valid), `errors`, `skipped`; `matched`, `gold_brackets`, `test_brackets`;
    `error_messages` (up to 10 'sentence i: message' strings, 0-based i).

    Raises:
      ValueError: the lists have different lengths.
    """
    if len(gold_trees) != len(predicted_trees):
        raise ValueError(
            f"score_corpus: {len(gold_trees)} gold trees but {len(predicted_trees)} predicted"
            " trees; they must be aligned one for one"
        )
    pairs = zip(gold_trees, predicted_trees, strict=True)
    scores = [score_sentence(g, t, labeled=labeled) for g, t in pairs]
    valid = [s for s in scores if s.status == "ok"]
    matched = sum(s.matched for s in valid)
    gold = sum(s.gold_brackets for s in valid)
    test = sum(s.test_brackets for s in valid)
    recall, precision = _percent(matched, gold), _percent(matched, test)
    exact = sum(s.gold_brackets == s.test_brackets == s.matched for s in valid)
    return {
        "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "precision": precision,
        "recall": recall,
        "exact_match": _percent(exact, len(valid)),
        "sentences": len(scores),
        "scored": len(valid),
        "errors": sum(s.status == "error" for s in scores),
        "skipped": sum(s.status == "skip" for s in scores),
        "matched": matched,
        "gold_brackets": gold,
        "test_brackets": test,
        "error_messages": [
            f"sentence {i}: {s.message}" for i, s in enumerate(scores) if s.status != "ok"
        ][:10],
    }


def yield_differs(tokens: Sequence[str], words: Sequence[str], *, word_leaves: bool) -> bool:
    """Whether an output's leaves (its non-bracket tokens) are not the input, before any repair.

    With `word_leaves` the leaves must be the words themselves, in order; with `XX`/tag leaves,
    which do not spell the words, there must be one leaf per word.
    """
    leaves = [token for token in tokens if not is_bracket(token)]
    return leaves != list(words) if word_leaves else len(leaves) != len(words)


def label_scores(gold_trees: Sequence[Tree], predicted_trees: Sequence[Tree], *,
                 top: int = 8) -> dict[str, dict]:
    """Precision, recall and F1 (percent) per label, for the `top` labels with most gold brackets.

    Counted as `score_corpus` counts (EVALB's deletions, one-to-one matching, ADVP = PRT) over the
    sentences whose words match (errors and skipped sentences are left out, as there).

    Returns:
      {label: {'gold', 'test', 'matched', 'precision', 'recall', 'f1'}}, most frequent first.
    """
    gold_n: collections.Counter = collections.Counter()
    test_n: collections.Counter = collections.Counter()
    matched_n: collections.Counter = collections.Counter()
    for gold, test in zip(gold_trees, predicted_trees, strict=True):
        if score_sentence(gold, test).status != "ok":
            continue
        _, gold_spans = brackets(gold)
        _, test_spans = brackets(test)
        for counter, spans in ((gold_n, gold_spans), (test_n, test_spans),
                               (matched_n, gold_spans & test_spans)):
            for (label, _, _), count in spans.items():
                counter[label] += count
    result = {}
    for label, gold in sorted(gold_n.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        recall, precision = _percent(matched_n[label], gold), _percent(matched_n[label], test_n[label])
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        result[label] = {"gold": gold, "test": test_n[label], "matched": matched_n[label],
                         "precision": precision, "recall": recall, "f1": f1}
    return result


def score_outputs(outputs: Sequence[str], gold_trees: Sequence[Tree], *,
                  word_leaves: bool = False) -> dict:
    """`score_corpus` of raw decoder outputs (linearized bracket strings, one per gold tree).

    Each output is split on whitespace, repaired over its gold tree's words (`trees.repair`) and
    given the gold part-of-speech tags before scoring, as seq2seq parsers are scored (the target
    has `XX` placeholders; EVALB deletes punctuation by each tree's own tags). Adds `repaired`:
    how many outputs needed a repair; `yield_mismatch`: how many had leaves that are not the
    input before any repair (`yield_differs`); `labels`: `label_scores` of the 8 most frequent.
    """
    if len(outputs) != len(gold_trees):
        raise ValueError(
            f"score_outputs: {len(outputs)} outputs but {len(gold_trees)} gold trees; they must"
            " be aligned one for one"
        )
    predicted, num_repaired, num_mismatched = [], 0, 0
    for output, gold in zip(outputs, gold_trees, strict=True):
        tokens = output.split()
        num_mismatched += yield_differs(tokens, gold.words(), word_leaves=word_leaves)
        tree, was_repaired, _ = repair(tokens, gold.words())
        predicted.append(retag(tree, gold.tags()))
        num_repaired += was_repaired
    return {**score_corpus(gold_trees, predicted), "repaired": num_repaired,
            "yield_mismatch": num_mismatched, "labels": label_scores(gold_trees, predicted)}


def right_branching_tree(
    words: Sequence[str], tags: Sequence[str] | None = None, *, label: str = "S"
) -> Tree:
    """The right-branching tree (label w1 (label w2 (... (label w_{n-1} w_n)))) over `words`.

    Every constituent is labeled `label`; preterminals get `tags` (default `XX`). With gold
    tags, EVALB's punctuation deletion treats it like any parser's output.
    """
    if not words:
        raise ValueError("right_branching_tree: no words")
    tags = list(tags) if tags is not None else [PLACEHOLDER] * len(words)
    leaves = [Tree(t, (w,)) for w, t in zip(words, tags, strict=True)]
    tree = Tree(label, tuple(leaves[-2:]))
    for leaf in reversed(leaves[:-2]):
        tree = Tree(label, (leaf, tree))
    return tree


def right_branching_baseline(
    gold_trees: Sequence[Tree], *, label: str = "S", labeled: bool = True
) -> dict:
    """`score_corpus` of `right_branching_tree` (gold words and tags) against `gold_trees`."""
    predicted = [right_branching_tree(g.words(), g.tags(), label=label) for g in gold_trees]
    return score_corpus(gold_trees, predicted, labeled=labeled)


def parsing_report(outputs: Sequence[str], gold_trees: Sequence[Tree], *,
                   word_leaves: bool = False) -> dict:
    """What evaluate.py reports for a parsing run: `score_outputs` plus `right_branching_f1`, the
    labeled F1 of the right-branching baseline on the same sentences, scored the same way.
    `word_leaves`: the outputs' leaves are words (data.tree_leaves='words'), not `XX`/tags."""
    baseline = right_branching_baseline(gold_trees)
    return {**score_outputs(outputs, gold_trees, word_leaves=word_leaves),
            "right_branching_f1": baseline["f1"]}
