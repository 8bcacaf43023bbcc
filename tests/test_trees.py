"""Trees (transformer_jax/data/trees.py) and the PCFG treebank (transformer_jax/data/pcfg.py)."""

from pathlib import Path

import pytest
from shared_data import SHARED_DATA

from transformer_jax.data import pcfg
from transformer_jax.data.trees import (
    Tree,
    delinearize,
    find_mrg_files,
    linearize,
    parse_file_ranges,
    parse_trees,
    preprocess,
    read_treebank,
    repair,
    retag,
    strip_label,
)
from transformer_jax.runtime.errors import DataError

PTB_SAMPLE = SHARED_DATA / "ptb_sample"


def t(text: str) -> Tree:
    """One tree from bracket notation."""
    (tree,) = parse_trees(text)
    return tree


DOG = t("(S (NP (DT The) (NN dog)) (VP (VBD saw) (NP (DT a) (NN cat))) (. .))")
DOG_WORDS = ["The", "dog", "saw", "a", "cat", "."]
DOG_TOKENS = "(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX )S".split()


# ----------------------------------------------------------------------------- reading


def test_parse_trees_reads_several_trees_and_the_outer_bracket():
    text = "( (S (NP (PRP He)) (VP (VBD ran)) (. .)) )\n((NP (NN Hi)))\n"
    first, second = parse_trees(text)
    assert first.label == "" and first.children[0].label == "S"
    assert first.children[0].words() == ["He", "ran", "."]
    assert first.children[0].tags() == ["PRP", "VBD", "."]
    assert str(second) == "( (NP (NN Hi)))"


@pytest.mark.parametrize(
    "text, message",
    [
        ("( (S (NN a)) )\n( (S (NN b))) )", r"f\.mrg:2: after tree 2: '\)' closes nothing"),
        ("( (S (NN a)) )\n( (S (NN b)", r"f\.mrg: tree 2 is not closed"),
        ("( (S (NN a) b) )", r"f\.mrg:1: tree 1: word 'b' after a constituent"),
        ("word ( (S (NN a)) )", r"f\.mrg:1: tree 1: 'word' outside any bracket"),
        ("( (S (NN a) ()) )", r"f\.mrg:1: tree 1: empty bracket"),
    ],
)
def test_parse_errors_name_file_line_and_tree(text, message):
    """User errors (one ``error:`` line at the entry points), naming the file, the line and the tree."""
    with pytest.raises(DataError, match=message):
        parse_trees(text, source="f.mrg")


# ----------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize(
    "label, stripped",
    [("NP-SBJ-1", "NP"), ("PP-LOC=2", "PP"), ("NP=3", "NP"), ("S", "S"), ("-LRB-", "-LRB-"),
     ("-RRB-", "-RRB-"), ("-NONE-", "-NONE-"), ("ADVP|PRT", "ADVP|PRT"), ("PRP$", "PRP$")],
)  # fmt: skip
def test_strip_label(label, stripped):
    assert strip_label(label) == stripped


def test_preprocess_removes_empty_elements_and_what_they_leave_empty():
    # The example of EVALB's README: traces and the constituents that dominate only traces go.
    raw = t(
        "( (S (NP-SBJ-1 (-NONE- *)) (VP (VBD reported) (SBAR (-NONE- 0)"
        " (S (-NONE- *T*-1)))) (. .)) )"
    )
    assert preprocess(raw) == t("(S (VP (VBD reported)) (. .))")


def test_preprocess_strips_function_tags_but_keeps_bracket_tags():
    raw = t("( (S-TPC-1 (PP-LOC=2 (IN in) (NP (-LRB- -LRB-) (NN x) (-RRB- -RRB-))) (VBD ran)) )")
    assert preprocess(raw) == t("(S (PP (IN in) (NP (-LRB- -LRB-) (NN x) (-RRB- -RRB-))) (VBD ran))")


def test_preprocess_drops_top_wrappers_and_empty_trees():
    assert preprocess(t("(TOP (S (NN a)))")) == t("(S (NN a))")
    assert preprocess(t("( (S (-NONE- *)) )")) is None


# ----------------------------------------------------------------------------- linearization


def test_linearize_xx_and_kept_tags():
    assert linearize(DOG) == (DOG_WORDS, DOG_TOKENS)
    words, tokens = linearize(DOG, keep_pos=True)
    assert tokens == "(S (NP DT NN )NP (VP VBD (NP DT NN )NP )VP . )S".split()
    assert delinearize(tokens, words) == DOG


def test_delinearize_accepts_plain_closers():
    tokens = "(S (NP XX XX ) (VP XX (NP XX XX ) ) XX )".split()
    assert delinearize(tokens, DOG_WORDS) == retag(DOG, ["XX"] * 6)


@pytest.mark.parametrize(
    "tokens, words",
    [
        ("(S (NP XX XX )VP (VP XX (NP XX XX )NP )VP XX )S", DOG_WORDS),  # wrong closer label
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX )S )S", DOG_WORDS),  # extra closer
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX", DOG_WORDS),  # not closed
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX )S", DOG_WORDS[:-1]),  # leaf count
        ("(S (NP )NP XX XX XX XX XX XX )S", DOG_WORDS),  # empty constituent
    ],
)
def test_delinearize_rejects_malformed_sequences(tokens, words):
    with pytest.raises(ValueError, match="malformed bracket sequence"):
        delinearize(tokens.split(), words)


def _check_round_trip(trees: list[Tree]) -> None:
    for tree in trees:
        words, tokens = linearize(tree)
        assert delinearize(tokens, words) == retag(tree, ["XX"] * len(words)), str(tree)
        words, tokens = linearize(tree, keep_pos=True)
        assert delinearize(tokens, words) == tree, str(tree)
        assert repair(tokens, words) == (tree, False, ())


def test_round_trip_on_every_tree_of_the_ptb_sample():
    if not PTB_SAMPLE.is_dir():
        pytest.skip(f"{PTB_SAMPLE} is absent")
    trees = read_treebank(PTB_SAMPLE, "0001-0199")
    assert len(trees) == 3914  # SOURCES.md: 3,914 trees
    _check_round_trip(trees)


def test_round_trip_on_pcfg_trees():
    trees = pcfg.pcfg_trees("train", train_size=301, dev_size=7, test_size=11, seed=3)
    _check_round_trip(trees)


# ----------------------------------------------------------------------------- repair


def _xx(text: str) -> Tree:
    tree = t(text)
    return retag(tree, ["XX"] * len(tree.words()))


@pytest.mark.parametrize(
    "output, expected",
    [
        # Open brackets are closed at the end.
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX", str(DOG)),
        # ... and a missing leaf goes to the root, not into the brackets left open.
        ("(S (NP XX XX )NP (VP XX (NP XX XX", str(DOG)),
        # Closers with nothing open are dropped.
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX )S )NP )S", str(DOG)),
        # A closer with another label closes the innermost bracket.
        ("(S (NP XX XX )VP (VP XX (NP XX XX )NP )VP XX )S", str(DOG)),
        # Missing leaves are appended to the root as XX leaves.
        ("(S (NP XX XX )NP (VP XX )VP )S", "(S (NP (DT The) (NN dog)) (VP (VBD saw)) (DT a) (NN cat) (. .))"),
        # Extra leaves at the end are dropped, with the constituents left empty.
        ("(S (NP XX XX )NP (VP XX (NP XX XX )NP )VP XX (NP XX XX )NP )S", str(DOG)),
        # A constituent with no words is dropped.
        ("(S (NP XX XX )NP (ADJP )ADJP (VP XX (NP XX XX )NP )VP XX )S", str(DOG)),
        # Several top-level items are wrapped in (S.
        ("(NP XX XX )NP (VP XX (NP XX XX )NP )VP XX", str(DOG)),
        # An empty output becomes a flat (S over XX leaves.
        ("", "(S (DT The) (NN dog) (VBD saw) (DT a) (NN cat) (. .))"),
    ],
)  # fmt: skip
def test_repair_cases(output, expected):
    tree, repaired, notes = repair(output.split(), DOG_WORDS)
    assert tree == _xx(expected)
    assert repaired and notes


def test_repair_leaves_well_formed_output_alone():
    assert repair(DOG_TOKENS, DOG_WORDS) == (retag(DOG, ["XX"] * 6), False, ())


# ----------------------------------------------------------------------------- treebank folders


def test_parse_file_ranges():
    assert parse_file_ranges("02-21") == [(200, 2199)]
    assert parse_file_ranges("23") == [(2300, 2399)]
    assert parse_file_ranges("0001-0159") == [(1, 159)]
    assert parse_file_ranges("00-01, 0200-0249") == [(0, 199), (200, 249)]
    for bad in ("2-21", "021", "21-02", "02-0021", "", "a-b"):
        with pytest.raises(ValueError, match="file range"):
            parse_file_ranges(bad)


def _tree_file(path: Path, word: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"( (S (NP (NN {word})) (VP (VBD ran)) (. .)) )\n( (NP (NN x)) )\n")


@pytest.mark.parametrize("layout", ["ldc", "flat"])
def test_same_ranges_work_on_ldc_and_flat_layouts(tmp_path, layout):
    for number in (199, 200, 2199, 2200, 2300, 2399):
        name = f"wsj_{number:04d}.mrg"
        _tree_file(tmp_path / (f"{number // 100:02d}/{name}" if layout == "ldc" else name), str(number))
    train = read_treebank(tmp_path, "02-21")
    assert [tree.words()[0] for tree in train[::2]] == ["200", "2199"]
    assert len(train) == 4
    assert [p.name for p in find_mrg_files(tmp_path, "23")] == ["wsj_2300.mrg", "wsj_2399.mrg"]
    assert [p.name for p in find_mrg_files(tmp_path, "0199,22")] == ["wsj_0199.mrg", "wsj_2200.mrg"]
    with pytest.raises(FileNotFoundError, match=r"no \.mrg file numbered in '24'"):
        find_mrg_files(tmp_path, "24")


def test_missing_folder_and_bad_file_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder; expected LDC's Penn Treebank"):
        read_treebank(tmp_path / "wsj", "02-21")
    (tmp_path / "wsj_0001.mrg").write_text("( (S (NN a)) )\n( (S (NN b) )\n")
    with pytest.raises(ValueError, match=r"wsj_0001\.mrg: tree 2 is not closed"):
        read_treebank(tmp_path, "0001")


# ----------------------------------------------------------------------------- PCFG treebank


def test_pcfg_splits_are_deterministic_disjoint_and_sized():
    sizes = dict(train_size=203, dev_size=17, test_size=19, seed=5)
    splits = {s: pcfg.pcfg_trees(s, **sizes) for s in ("train", "dev", "test")}
    assert {s: len(v) for s, v in splits.items()} == {"train": 203, "dev": 17, "test": 19}
    sentences = {s: {" ".join(x.words()) for x in v} for s, v in splits.items()}
    assert sum(map(len, sentences.values())) == 203 + 17 + 19  # unique, so disjoint
    # The test split does not depend on the train size; another seed gives other trees.
    assert pcfg.pcfg_trees("test", **{**sizes, "train_size": 5}) == splits["test"]
    assert pcfg.pcfg_trees("test", **{**sizes, "seed": 6}) != splits["test"]
    fresh = pcfg._Stream(5)  # not the cached stream: the same seed gives the same trees
    fresh.extend_to(19)
    assert fresh.trees == splits["test"]
    for tree in splits["train"]:
        assert tree.label == "S" and tree.tags()[-1] == "."
        assert pcfg.MIN_WORDS <= len(tree.words()) <= pcfg.MAX_WORDS
