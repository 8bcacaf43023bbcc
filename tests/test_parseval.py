"""EVALB-compatible F1 (transformer_jax/evaluation/evalb.py) on hand-computed examples.

Gold sentence: (S (NP The dog) (VP saw (NP a cat)) .). After the '.' is deleted its brackets are
S[0,5) NP[0,2) VP[2,5) NP[3,5): 4 brackets. Figures below are percentages.
"""

import pytest

from transformer_jax.data.trees import Tree, linearize, parse_trees
from transformer_jax.evaluation.evalb import (
    brackets,
    label_scores,
    parsing_report,
    right_branching_baseline,
    right_branching_tree,
    score_corpus,
    score_outputs,
    score_sentence,
    yield_differs,
)

TOL = 1e-9


def t(text: str) -> Tree:
    (tree,) = parse_trees(text)
    return tree


GOLD = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a) (NN cat))) (. .))")


def f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r)


def scores(test: Tree, gold: Tree = GOLD) -> tuple[float, float, float]:
    s = score_corpus([gold], [test])
    assert s["scored"] == 1 and s["errors"] == 0
    return s["precision"], s["recall"], s["f1"]


def test_brackets_of_the_gold_tree():
    words, spans = brackets(GOLD)
    assert words == ["The", "dog", "saw", "a", "cat"]
    assert sorted(spans.elements()) == [("NP", 0, 2), ("NP", 3, 5), ("S", 0, 5), ("VP", 2, 5)]


def test_identical_trees_score_100():
    s = score_corpus([GOLD, GOLD], [GOLD, GOLD])
    assert (s["precision"], s["recall"], s["f1"], s["exact_match"]) == (100, 100, 100, 100)
    assert (s["matched"], s["gold_brackets"], s["test_brackets"], s["scored"]) == (8, 8, 8, 2)


def test_one_wrong_label():
    # VP -> ADJP: 3 of 4 brackets match on both sides.
    test = t("(S (NP (DT The) (NN dog)) (ADJP (VBD saw) (NP (DT a) (NN cat))) (. .))")
    assert scores(test) == pytest.approx((75.0, 75.0, 75.0), abs=TOL)
    assert score_corpus([GOLD], [test])["exact_match"] == 0


def test_one_wrong_span():
    # NP[3,5) -> NP[3,4): 3 matched of 4 gold and 4 test brackets.
    test = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a)) (NN cat)) (. .))")
    assert scores(test) == pytest.approx((75.0, 75.0, 75.0), abs=TOL)


def test_one_missing_bracket():
    # No inner NP: 3 test brackets, all correct. P = 3/3, R = 3/4, F1 = 6/7.
    test = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (DT a) (NN cat)) (. .))")
    assert scores(test) == pytest.approx((100.0, 75.0, 600 / 7), abs=TOL)


def test_crossing_bracket():
    # X[1,3) crosses NP[0,2) and VP[2,5): S and NP[3,5) match. P = 2/3, R = 2/4, F1 = 4/7.
    test = t("(S (DT The) (X (NN dog) (VBD saw)) (NP (DT a) (NN cat)) (. .))")
    assert scores(test) == pytest.approx((200 / 3, 50.0, 400 / 7), abs=TOL)


def test_unary_chain_counts_each_bracket():
    gold = t("(S (VP (VB Go)) (. .))")  # S[0,1) and VP[0,1)
    assert scores(t("(S (VB Go) (. .))"), gold) == pytest.approx((100.0, 50.0, 200 / 3), abs=TOL)


def test_bracketing_that_differs_only_in_punctuation_scores_as_equal():
    inside = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a) (NN cat) (. .))))")
    assert scores(inside) == (100, 100, 100)
    only_punct = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a) (NN cat))) (X (. .)))")
    assert scores(only_punct) == (100, 100, 100)
    gold = t("(S (NP (NP (NNP Pierre)) (, ,) (ADJP (JJ old)) (, ,)) (VP (VBD won)) (. .))")
    test = t("(S (NP (NP (NNP Pierre) (, ,)) (ADJP (JJ old))) (, ,) (VP (VBD won) (. .)))")
    assert scores(test, gold) == (100, 100, 100)
    # Control: -LRB- is not a deleted tag, so moving it changes the score.
    gold = t("(S (NP (-LRB- -LRB-) (NN a)) (VP (VBD b)))")
    test = t("(S (-LRB- -LRB-) (NP (NN a)) (VP (VBD b)))")
    assert scores(test, gold)[2] < 100


def test_advp_equals_prt():
    gold = t("(S (NP (PRP He)) (VP (VBD looked) (PRT (RP up))) (. .))")
    assert scores(t("(S (NP (PRP He)) (VP (VBD looked) (ADVP (RP up))) (. .))"), gold) == (
        100,
        100,
        100,
    )
    assert scores(t("(S (NP (PRP He)) (VP (VBD looked) (PP (RP up))) (. .))"), gold) == (
        pytest.approx((75.0, 75.0, 75.0), abs=TOL)
    )


def test_function_tags_and_top_wrapper_are_not_scored():
    test = t("(S-TPC-1 (NP-SBJ (DT The) (NN dog)) (VP (VBD saw) (NP=2 (DT a) (NN cat))) (. .))")
    assert scores(test) == (100, 100, 100)
    assert scores(GOLD, Tree("TOP", (GOLD,))) == (100, 100, 100)
    # An unlabeled wrapper is a bracket for EVALB: it is an extra (matching) one here.
    s = score_corpus([Tree("", (GOLD,))], [Tree("", (GOLD,))])
    assert s["gold_brackets"] == 5


def test_word_mismatch_is_an_error_not_scored():
    wrong_word = t("(S (NP (DT The) (NN cat)) (VP (VBD saw) (NP (DT a) (NN cat))) (. .))")
    too_short = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a))) (. .))")
    half = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (DT a) (NN cat)) (. .))")  # 3/3 of 4
    assert score_sentence(GOLD, wrong_word).message == "Words unmatch (dog|cat)"
    assert score_sentence(GOLD, too_short).message == "Length unmatch (5|4)"
    s = score_corpus([GOLD, GOLD, GOLD], [wrong_word, too_short, half])
    assert (s["sentences"], s["scored"], s["errors"], s["skipped"]) == (3, 1, 2, 0)
    assert (s["precision"], s["recall"]) == pytest.approx((100.0, 75.0), abs=TOL)
    assert s["error_messages"] == [
        "sentence 0: Words unmatch (dog|cat)",
        "sentence 1: Length unmatch (5|4)",
    ]
    # Only punctuation words in the test tree: skipped.
    assert score_sentence(GOLD, t("(S (. .))")).status == "skip"


def test_corpus_figures_are_totals_not_averages():
    # Sentence 1: 4/4/4. Sentence 2: gold 4, test 3, matched 3. P = 7/7, R = 7/8.
    half = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (DT a) (NN cat)) (. .))")
    s = score_corpus([GOLD, GOLD], [GOLD, half])
    assert (s["precision"], s["recall"], s["f1"]) == pytest.approx(
        (100.0, 87.5, f1(100.0, 87.5)), abs=TOL
    )
    assert s["exact_match"] == 50.0
    with pytest.raises(ValueError, match="aligned"):
        score_corpus([GOLD], [])


def test_score_outputs_repairs_and_counts():
    good = " ".join(linearize(GOLD)[1])
    truncated = "(S (NP XX XX )NP (VP XX (NP XX XX"  # closes to the gold tree: correct
    s = score_outputs([good, truncated, ""], [GOLD, GOLD, GOLD])
    # The empty output is a flat (S ...): 1 bracket, correct. Totals: matched 9, gold 12, test 9.
    assert s["repaired"] == 2 and s["scored"] == 3
    assert (s["precision"], s["recall"]) == pytest.approx((100.0, 75.0), abs=TOL)


def test_right_branching():
    assert right_branching_tree(["a", "b", "c"]) == t("(S (XX a) (S (XX b) (XX c)))")
    assert right_branching_tree(["a"], ["NN"]) == t("(S (NN a))")
    # Over 'The dog saw a cat .': S[0,5) S[1,5) S[2,5) S[3,5) S[4,5) after the '.' goes.
    # Labeled: only S[0,5) matches (P = 1/5, R = 1/4); unlabeled: [0,5) [2,5) [3,5) (3/5, 3/4).
    s = right_branching_baseline([GOLD])
    assert (s["precision"], s["recall"]) == pytest.approx((20.0, 25.0), abs=TOL)
    s = right_branching_baseline([GOLD], labeled=False)
    assert (s["precision"], s["recall"], s["f1"]) == pytest.approx(
        (60.0, 75.0, f1(60.0, 75.0)), abs=TOL
    )


def test_parsing_report_puts_the_baseline_beside_the_model():
    good = " ".join(linearize(GOLD)[1])
    report = parsing_report([good], [GOLD])
    assert (report["f1"], report["repaired"], report["scored"]) == (100, 0, 1)
    assert report["right_branching_f1"] == pytest.approx(f1(20.0, 25.0), abs=TOL)


def test_yield_differs_before_repair():
    words = ["The", "dog", "saw", "a", "cat", "."]
    assert not yield_differs(linearize(GOLD, copy_words=True)[1], words, word_leaves=True)
    assert yield_differs("(S The dog saw a dog . )S".split(), words, word_leaves=True)  # a wrong word
    assert yield_differs("(S The dog saw a cat )S".split(), words, word_leaves=True)  # one missing
    assert not yield_differs(linearize(GOLD)[1], words, word_leaves=False)  # XX: one leaf per word
    assert yield_differs("(S (NP XX XX )NP XX )S".split(), words, word_leaves=False)
    report = score_outputs(["(S The dog saw a cat . )S", "(S The dog )S"], [GOLD, GOLD], word_leaves=True)
    assert report["yield_mismatch"] == 1 and report["repaired"] == 1


def test_label_scores_hand_computed():
    # Test 1 misses the object NP; test 2 has it but labels the VP as an S.
    # NP: gold 4, test 3, matched 3 -> P 100, R 75. VP: gold 2, test 1, matched 1 -> P 100, R 50.
    # S: gold 2, test 3 (S[0,5) twice and S[2,5)), matched 2 -> P 66.67, R 100.
    test1 = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (DT a) (NN cat)) (. .))")
    test2 = t("(S (NP (DT The) (NN dog)) (S (VBD saw) (NP (DT a) (NN cat))) (. .))")
    labels = label_scores([GOLD, GOLD], [test1, test2], top=2)
    assert list(labels) == ["NP", "S"]  # the 2 most frequent gold labels (NP 4; S and VP 2: by name)
    assert (labels["NP"]["gold"], labels["NP"]["test"], labels["NP"]["matched"]) == (4, 3, 3)
    assert labels["NP"]["f1"] == pytest.approx(f1(100.0, 75.0), abs=TOL)
    assert (labels["S"]["precision"], labels["S"]["recall"]) == pytest.approx((200 / 3, 100.0), abs=TOL)
    vp = label_scores([GOLD, GOLD], [test1, test2])["VP"]
    assert (vp["precision"], vp["recall"]) == pytest.approx((100.0, 50.0), abs=TOL)
