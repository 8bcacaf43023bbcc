"""Same-label subtree substitution (transformer_jax/data/tree_augment.py) and its data_config field."""

import pytest

from transformer_jax.data import default_data_config, get_source, pcfg, validate_data_config
from transformer_jax.data.tree_augment import substituted_trees
from transformer_jax.data.trees import Tree, delinearize, linearize, parse_trees
from transformer_jax.runtime.errors import ConfigError


def _constituents(tree, path=()):
    """(path, node) of every nonterminal below the root that is not a preterminal."""
    for i, child in enumerate(tree.children):
        if isinstance(child, Tree) and not child.is_preterminal:
            yield (*path, i), child
            yield from _constituents(child, (*path, i))


def _at(tree, path):
    for i in path:
        if not isinstance(tree, Tree) or i >= len(tree.children):
            return None
        tree = tree.children[i]
    return tree


def _put(tree, path, node):
    if not path:
        return node
    children = list(tree.children)
    children[path[0]] = _put(children[path[0]], path[1:], node)
    return Tree(tree.label, tuple(children))


def test_each_copy_swaps_one_constituent_for_one_of_the_same_label():
    trees = pcfg.pcfg_trees("train", train_size=60, dev_size=1, test_size=1, seed=5)
    extra = substituted_trees(trees, copies=3)
    assert len(extra) == 3 * len(trees)
    pool = {}
    for tree in trees:
        for _, node in _constituents(tree):
            pool.setdefault(node.label, []).append(node)
    for i, new in enumerate(extra):
        original = trees[i // 3]
        # Some constituent of the original, put back into the copy, gives the original again, and
        # what the copy has there is a same-label constituent of the training trees.
        assert any(
            (swapped := _at(new, path)) is not None and isinstance(swapped, Tree)
            and swapped.label == node.label and swapped in pool[node.label]
            and _put(new, path, node) == original
            for path, node in _constituents(original)
        ), (original, new)
        words, tokens = linearize(new, copy_words=True)  # a well-formed target over its own words
        assert linearize(delinearize(tokens, words), copy_words=True) == (words, tokens)
    assert sum(new != trees[i // 3] for i, new in enumerate(extra)) > len(extra) // 2


def test_substitution_by_hand():
    a, b = parse_trees("(S (NP (DT The) (NN dog)) (VP (VBZ barks)))"
                       "(S (NP (DT A) (JJ big) (NN cat)) (VP (VBZ sleeps)))")
    extra = substituted_trees([a, b], copies=20)
    sentences = {" ".join(t.words()) for t in extra}
    # Every copy swaps one NP or one VP: the words of both trees recombine, nothing else appears.
    assert sentences <= {"The dog barks", "A big cat barks", "The dog sleeps",
                         "A big cat sleeps"}
    assert {"A big cat barks", "The dog sleeps"} <= sentences


def test_deterministic_and_zero_copies():
    trees = pcfg.pcfg_trees("train", train_size=20, dev_size=1, test_size=1, seed=2)
    assert substituted_trees(trees, 2) == substituted_trees(trees, 2)
    assert substituted_trees(trees, 2, seed=1) != substituted_trees(trees, 2)
    assert substituted_trees(trees, 0) == []
    assert substituted_trees(parse_trees("(S (NN hi))"), 3) == []  # nothing below the root to swap
    with pytest.raises(ValueError, match="copies must be >= 0"):
        substituted_trees(trees, -1)


def test_source_augments_only_the_train_split():
    sizes = dict(source="synthetic_trees", synthetic_train_size=25, synthetic_dev_size=5,
                 synthetic_test_size=7, tree_leaves="words")
    plain = get_source(default_data_config(**sizes))
    augmented = get_source(default_data_config(**sizes, tree_augment_copies=2))
    assert augmented.pairs("train")[:25] == plain.pairs("train")
    assert len(augmented.pairs("train")) == 75
    assert len(augmented.trees("train")) == 25
    for split in ("dev", "test"):
        assert augmented.pairs(split) == plain.pairs(split)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_bad_copies_are_refused(value):
    cfg = default_data_config(source="synthetic_trees", tree_augment_copies=value)
    with pytest.raises(ConfigError, match="tree_augment_copies must be an int >= 0"):
        validate_data_config(cfg)
