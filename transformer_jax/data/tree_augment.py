"""Training-tree augmentation by same-label subtree substitution (Shi et al., 2021).

    extra = substituted_trees(train_trees, copies=2)   # 2 new trees per training tree

Each new tree is a training tree with one of its constituents (not the root, not a
preterminal) replaced by another constituent of the same label drawn from the training trees:
`(S (NP The dog )NP (VP barks )VP )S` may become `(S (NP a new chairman )NP (VP barks )VP )S`.
The result is a well-formed tree whose bracketing is locally as plausible as the treebank's
(an NP where an NP was), over a sentence the treebank does not have; the parser sees more
contexts for each phrase. Only the training split is augmented (`TreebankSource.pairs`), and the
draw is seeded by the tree's index, so the set is the same on every run and host.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from transformer_jax.data.trees import Tree

_Path = tuple[int, ...]  # child indices from the root down to a constituent


def _constituents(tree: Tree) -> list[tuple[_Path, Tree]]:
    """(path, node) of every nonterminal below the root, preterminals excluded, in preorder."""
    found: list[tuple[_Path, Tree]] = []

    def walk(node: Tree, path: _Path) -> None:
        for i, child in enumerate(node.children):
            if isinstance(child, Tree) and not child.is_preterminal:
                found.append(((*path, i), child))
                walk(child, (*path, i))

    walk(tree, ())
    return found


def _replace(tree: Tree, path: _Path, new: Tree) -> Tree:
    if not path:
        return new
    head, rest = path[0], path[1:]
    children = list(tree.children)
    children[head] = _replace(children[head], rest, new)
    return Tree(tree.label, tuple(children))


def substituted_trees(trees: Sequence[Tree], copies: int, *, seed: int = 0) -> list[Tree]:
    """`copies` new trees per tree of `trees` (tree-major order), each with one substitution.

    A tree without a constituent below its root yields no copies. Deterministic in (`trees`,
    `copies`, `seed`).
    """
    if copies < 0:
        raise ValueError(f"copies must be >= 0, got {copies}")
    per_tree = [_constituents(t) for t in trees]
    pool: dict[str, list[Tree]] = {}
    for nodes in per_tree:
        for _, node in nodes:
            pool.setdefault(node.label, []).append(node)
    out: list[Tree] = []
    for index, (tree, nodes) in enumerate(zip(trees, per_tree, strict=True)):
        if not nodes:
            continue
        rng = random.Random(f"{seed}:{index}")
        for _ in range(copies):
            path, node = rng.choice(nodes)
            out.append(_replace(tree, path, rng.choice(pool[node.label])))
    return out
