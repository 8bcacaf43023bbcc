"""Constituency trees: the Penn Treebank reader, preprocessing, linearization and repair.

Parsing as translation (section 6.3 of the paper, following Vinyals & Kaiser et al., 2014):

    tree    (S (NP (DT The) (NN dog)) (VP (VBZ barks)) (. .))
    source  The dog barks .
    target  (S (NP XX XX )NP (VP XX )VP XX )S

The source is the words; the target is the bracketing with labeled open and labeled closing
brackets, one token per bracket and one token per word. Part-of-speech tags are normalized to
the placeholder `XX` by default (`keep_pos=False`): that is what Vinyals et al. did and the paper
follows them; it keeps the target vocabulary small (the ~26 phrase labels twice, plus `XX`), and
F1 does not score tags anyway. `keep_pos=True` writes the tag instead of `XX`.

`delinearize(tokens, words)` inverts `linearize` (strict: a malformed sequence raises ValueError);
`repair(tokens, words)` turns ANY token sequence into a tree over `words` deterministically and
says whether it had to change anything (see its docstring for the rules).

Treebank files (`.mrg`): one or more bracketed trees per file, each wrapped in an unlabeled outer
bracket `( (S ...) )`. `read_treebank(folder, ranges)` reads the files whose 4-digit number is in
`ranges`, e.g. '02-21' (WSJ sections: two digits) or '0001-0159' (file numbers: four digits),
from LDC's layout `wsj/NN/wsj_NNNN.mrg` or from a flat folder of `wsj_NNNN.mrg` alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Union

from transformer_jax.runtime.errors import DataError

PLACEHOLDER = "XX"  # the normalized part-of-speech tag of the target sequence
FALLBACK_ROOT = "S"  # root label `repair` adds when an output has no single root
NONE_TAG = "-NONE-"  # empty elements (traces, null complementizers)
_OUTER_LABELS = ("", "TOP", "ROOT")  # wrappers of a whole tree, dropped by `preprocess`


@dataclasses.dataclass(frozen=True)
class Tree:
    """A constituent: a label and its children. A preterminal is `Tree(tag, (word,))`."""

    label: str
    children: tuple[Union[Tree, str], ...]  # noqa: UP007 (a string forward reference)

    @property
    def is_preterminal(self) -> bool:
        return len(self.children) == 1 and isinstance(self.children[0], str)

    def preterminals(self) -> Iterator[Tree]:
        """The (tag, word) nodes, left to right."""
        if self.is_preterminal:
            yield self
            return
        for child in self.children:
            if isinstance(child, Tree):
                yield from child.preterminals()

    def words(self) -> list[str]:
        return [p.children[0] for p in self.preterminals()]

    def tags(self) -> list[str]:
        return [p.label for p in self.preterminals()]

    def __str__(self) -> str:
        """One line in the treebank's bracket notation: `(S (NP (DT the) (NN dog)) ...)`."""
        inner = " ".join(str(c) for c in self.children)
        return f"({self.label} {inner})"


def retag(tree: Tree, tags: Sequence[str]) -> Tree:
    """`tree` with its preterminal labels replaced by `tags` (one per word, left to right)."""
    tags_iter = iter(tags)

    def walk(node: Tree) -> Tree:
        if node.is_preterminal:
            return Tree(next(tags_iter), node.children)
        return Tree(node.label, tuple(walk(c) for c in node.children))

    if len(tags) != len(tree.words()):
        raise ValueError(f"retag: {len(tags)} tags for a tree of {len(tree.words())} words")
    return walk(tree)


# ----------------------------------------------------------------------------- reading

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse_trees(text: str, *, source: str = "<string>") -> list[Tree]:
    """Every bracketed tree in `text`, as written (outer bracket, tags and -NONE- kept).

    Raises:
      DataError (a ValueError): unbalanced brackets, a word outside a bracket or a bracket without a label
        inside a tree; the message names `source`, the line and the tree number (1-based).
    """
    trees: list[Tree] = []
    stack: list[tuple[str, list]] = []  # open constituents: (label, children)
    line, pos = 1, 0
    for match in _TOKEN.finditer(text):
        line += text.count("\n", pos, match.start())
        pos = match.start()
        token = match.group()
        where = f"{source}:{line}: tree {len(trees) + 1}"
        if token == "(":
            stack.append(("", []))
        elif token == ")":
            if not stack:
                raise DataError(
                    f"{source}:{line}: after tree {len(trees)}: ')' closes nothing (unbalanced)"
                )
            label, children = stack.pop()
            if not children:
                raise DataError(f"{where}: empty bracket '({label})'")
            node = Tree(label, tuple(children))
            if stack:
                stack[-1][1].append(node)
            else:
                trees.append(node)
        elif not stack:
            raise DataError(f"{where}: {token!r} outside any bracket")
        elif not stack[-1][0] and not stack[-1][1]:
            stack[-1] = (token, [])  # the label right after '('
        else:
            children = stack[-1][1]
            if children:
                raise DataError(f"{where}: word {token!r} after a constituent in one bracket")
            children.append(token)
    if stack:
        raise DataError(f"{source}: tree {len(trees) + 1} is not closed ({len(stack)} open)")
    return trees


def read_mrg(path: str | Path) -> list[Tree]:
    """The raw trees of one `.mrg` file (see `parse_trees`)."""
    path = Path(path)
    return parse_trees(path.read_text(encoding="utf-8", errors="strict"), source=str(path))


# ----------------------------------------------------------------------------- preprocessing


def strip_label(label: str) -> str:
    """Function tags and indices removed: NP-SBJ-1 -> NP, PP-LOC=2 -> PP; -LRB-, -NONE- kept."""
    if label.startswith("-") and label.endswith("-"):
        return label
    return re.split(r"[-=]", label, maxsplit=1)[0] or label


def preprocess(tree: Tree) -> Tree | None:
    """A raw treebank tree as parsers are evaluated on it (None if nothing is left).

    Removes -NONE- empty elements and the constituents left empty by that, strips function tags
    and indices from every label (tags like -LRB- stay intact), and drops the outer unlabeled
    (or TOP/ROOT) bracket.
    """

    def walk(node: Tree) -> Tree | None:
        if node.is_preterminal:
            return None if node.label == NONE_TAG else Tree(strip_label(node.label), node.children)
        children = tuple(c for c in (walk(c) for c in node.children) if c is not None)
        return Tree(strip_label(node.label), children) if children else None

    while tree.label in _OUTER_LABELS and len(tree.children) == 1 and not tree.is_preterminal:
        tree = tree.children[0]
    return walk(tree)


# ----------------------------------------------------------------------------- linearization


def linearize(tree: Tree, *, keep_pos: bool = False,
              copy_words: bool = False) -> tuple[list[str], list[str]]:
    """(source words, target tokens) of a tree; see the module docstring for the format.

    `copy_words=True` writes each word itself as its leaf (`(S (NP The dog )NP ... )S`): the
    target's yield is then the source, which constrained decoding enforces (docs/parsing.md).
    """
    tokens: list[str] = []

    def walk(node: Tree) -> None:
        if node.is_preterminal:
            tokens.append(node.children[0] if copy_words else node.label if keep_pos else PLACEHOLDER)
            return
        tokens.append(f"({node.label}")
        for child in node.children:
            walk(child)
        tokens.append(f"){node.label}")

    walk(tree)
    return tree.words(), tokens


def is_bracket(token: str) -> bool:
    """Whether a target token is an opening `(NP` or closing `)NP` / `)` bracket (not a leaf)."""
    return token[:1] in ("(", ")") and (len(token) > 1 or token == ")")


def bracket_tokens(trees: Sequence[Tree]) -> list[str]:
    """The sorted opening and closing bracket tokens of the nonterminals of `trees`."""
    labels: set[str] = set()

    def walk(node: Tree) -> None:
        if not node.is_preterminal:
            labels.add(node.label)
            for child in node.children:
                if isinstance(child, Tree):
                    walk(child)

    for tree in trees:
        walk(tree)
    return sorted(f"({label}" for label in labels) + sorted(f"){label}" for label in labels)


class Repaired(NamedTuple):
    """What `repair` returns: the tree, whether anything was changed, and what (in words)."""

    tree: Tree
    repaired: bool
    notes: tuple[str, ...]


def _build(tokens: Sequence[str], words: Sequence[str], *, strict: bool) -> Repaired:
    notes: list[str] = []

    def problem(note: str) -> None:
        if strict:
            raise ValueError(f"malformed bracket sequence: {note}")
        notes.append(note)

    top: list = []  # children of a virtual root
    stack: list[tuple[str, list]] = []
    for i, token in enumerate(tokens):
        if token.startswith("(") and len(token) > 1:
            stack.append((token[1:], []))
        elif token.startswith(")"):
            if not stack:
                problem(f"token {i} {token!r} closes nothing (dropped)")
                continue
            label, children = stack.pop()
            if token != ")" and token[1:] != label:
                problem(f"token {i} {token!r} closes ({label} (treated as ){label})")
            if children:
                (stack[-1][1] if stack else top).append(Tree(label, tuple(children)))
            else:
                problem(f"token {i}: ({label} has no words (dropped)")
        else:
            (stack[-1][1] if stack else top).append(Tree(token, ("",)))  # word filled in below
    while stack:
        label, children = stack.pop()
        problem(f"({label} is not closed (closed at the end)")
        if children:
            (stack[-1][1] if stack else top).append(Tree(label, tuple(children)))
    if len(top) != 1 or top[0].is_preterminal:
        problem(f"{len(top)} top-level items (wrapped in ({FALLBACK_ROOT})")
        top = [Tree(FALLBACK_ROOT, tuple(top))] if top else []
    root = top[0] if top else Tree(FALLBACK_ROOT, ())
    num_leaves = sum(1 for _ in root.preterminals()) if root.children else 0
    if num_leaves != len(words):
        problem(f"{num_leaves} leaves for {len(words)} words (padded or cut at the end)")
        root = _fit_leaves(root, len(words))
    return Repaired(_fill_words(root, words), bool(notes), tuple(notes))


def _fit_leaves(root: Tree, num_words: int) -> Tree:
    """Drops leaves after the first `num_words` (and the constituents left empty), or appends
    `XX` leaves to the root until there are `num_words`."""
    budget = [num_words]

    def cut(node: Tree) -> Tree | None:
        if node.is_preterminal:
            budget[0] -= 1
            return node if budget[0] >= 0 else None
        children = tuple(c for c in (cut(c) for c in node.children) if c is not None)
        return Tree(node.label, children) if children else None

    kept = cut(root) if root.children else None
    if kept is None:
        kept = Tree(root.label, ())
    missing = max(budget[0], 0)
    pad = tuple(Tree(PLACEHOLDER, ("",)) for _ in range(missing))
    return Tree(kept.label, kept.children + pad)


def _fill_words(root: Tree, words: Sequence[str]) -> Tree:
    words_iter = iter(words)

    def walk(node: Tree) -> Tree:
        if node.is_preterminal:
            return Tree(node.label, (next(words_iter),))
        return Tree(node.label, tuple(walk(c) for c in node.children))

    return walk(root)


def delinearize(tokens: Sequence[str], words: Sequence[str]) -> Tree:
    """The tree of a well-formed target sequence over `words`; inverse of `linearize`.

    Closing brackets may be labeled (`)NP`, must then match) or plain (`)`). Leaf tokens become
    preterminals with that tag (`XX` when tags were normalized).

    Raises:
      ValueError: the sequence is malformed or its leaves do not match len(words).
    """
    return _build(tokens, words, strict=True).tree


def repair(tokens: Sequence[str], words: Sequence[str]) -> Repaired:
    """A tree over `words` from any token sequence, e.g. a decoder's output. Deterministic rules:

    1. a closer with nothing open is dropped; a closer with another label closes the innermost
       open bracket; brackets still open at the end are closed;
    2. a constituent with no words is dropped;
    3. several top-level items (or a lone leaf) are wrapped in one `(S` root;
    4. leaves are aligned with `words`: extra leaves at the end are dropped, missing ones are
       appended to the root as `XX` leaves; then the words fill the leaves in order.

    `repaired` is True iff some rule had to change the sequence (`notes` says which).
    """
    return _build(tokens, words, strict=False)


# ----------------------------------------------------------------------------- treebank folders

_FILE_NUMBER = re.compile(r"(\d{4})\.mrg$", re.IGNORECASE)


def parse_file_ranges(spec: str) -> list[tuple[int, int]]:
    """Inclusive ranges of 4-digit file numbers from a spec like '02-21', '22' or '0001-0159'.

    Two-digit numbers are WSJ sections (section 22 = files 2200-2299); four-digit numbers are
    files. Comma-separated parts combine: '00-01,0200-0249'.

    Raises:
      ValueError: the spec does not have that form.
    """
    ranges = []
    for part in str(spec).split(","):
        match = re.fullmatch(r"\s*(\d{2}|\d{4})\s*(?:-\s*(\d{2}|\d{4})\s*)?", part)
        if not match or (match.group(2) and len(match.group(1)) != len(match.group(2))):
            raise ValueError(
                f"file range {spec!r}: expected sections like '02-21' or '23' (two digits) or"
                f" file numbers like '0001-0159' (four digits), comma-separated"
            )
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if len(lo_text) == 2:
            lo, hi = lo * 100, hi * 100 + 99
        if lo > hi:
            raise ValueError(f"file range {spec!r}: {part.strip()!r} is empty (start > end)")
        ranges.append((lo, hi))
    return ranges


def find_mrg_files(directory: str | Path, spec: str) -> list[Path]:
    """The `*NNNN.mrg` files anywhere under `directory` whose number NNNN is in `spec`, sorted.

    Raises:
      FileNotFoundError: `directory` is missing, or no file falls in the ranges.
      ValueError: two files have the same number.
    """
    directory = Path(directory)
    layout = (
        "LDC's Penn Treebank layout (treebank_3/parsed/mrg/wsj/NN/wsj_NNNN.mrg: point data.dir at"
        " the wsj folder) or a flat folder of wsj_NNNN.mrg files"
    )
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such folder; expected {layout}")
    ranges = parse_file_ranges(spec)
    by_number: dict[int, Path] = {}
    for path in sorted(directory.rglob("*")):
        match = _FILE_NUMBER.search(path.name)
        if not match or not path.is_file():
            continue
        number = int(match.group(1))
        if number in by_number:
            raise ValueError(f"{path} and {by_number[number]} have the same file number {number}")
        by_number[number] = path
    chosen = [by_number[n] for n in sorted(by_number) if any(lo <= n <= hi for lo, hi in ranges)]
    if not chosen:
        raise FileNotFoundError(
            f"{directory}: no .mrg file numbered in {spec!r} ({len(by_number)} .mrg files found);"
            f" expected {layout}"
        )
    return chosen


def read_treebank(directory: str | Path, spec: str) -> list[Tree]:
    """The preprocessed trees of the files in `spec` (see `find_mrg_files`), in file order.

    Trees left empty by preprocessing (only -NONE- elements) are skipped.
    """
    trees = []
    for path in find_mrg_files(directory, spec):
        for raw in read_mrg(path):
            tree = preprocess(raw)
            if tree is not None:
                trees.append(tree)
    return trees
