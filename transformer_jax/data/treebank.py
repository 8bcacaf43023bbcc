"""Parsing sources: constituency trees as (words, linearized bracketing) pairs.

    source = get_source(data_config)      # data_config.source in {'ptb', 'synthetic_trees'}
    source.pairs('test')                  # [('The dog barks .', '(S (NP XX XX )NP ... )S'), ...]
    source.trees('test')                  # the gold trees, aligned with pairs('test')

'ptb' reads Penn Treebank `.mrg` files from `data_config.dir`, split by file-number ranges
(`ptb_train_files`, `ptb_dev_files`, `ptb_test_files`; see `trees.parse_file_ranges`): the
paper's WSJ setup is '02-21' / '22' / '23' on LDC's `wsj/NN/wsj_NNNN.mrg` folder. 'synthetic_trees'
is the seeded PCFG treebank of `pcfg.py` (split sizes and seed from the `synthetic_*` fields).
`data_config.keep_pos_tags` chooses between `XX` placeholders (default) and real tags in the
target (see `trees.py`); `data_config.tree_leaves='words'` writes the words themselves as the
leaves (`(S (NP The dog )NP ... )S`), for decoding that copies them (`evaluation/tree_constraints.py`).
"""

from __future__ import annotations

from typing import Any

from transformer_jax.data.pcfg import pcfg_trees
from transformer_jax.data.tree_augment import substituted_trees
from transformer_jax.data.trees import Tree, linearize, read_treebank

PARSING_SOURCES = ("ptb", "synthetic_trees")
SPLITS = ("train", "dev", "test")


def is_parsing(data_config: Any) -> bool:
    """Whether `data_config` describes a parsing task (outputs are scored by F1, not BLEU)."""
    return getattr(data_config, "source", None) in PARSING_SOURCES


class TreebankSource:
    """A `Source` over trees: `pairs(split)` for training, `trees(split)` for scoring.

    Built by `from_config` (or directly with a `load(split) -> list[Tree]` function).
    """

    def __init__(self, load, *, keep_pos: bool = False, copy_words: bool = False,
                 augment_copies: int = 0):
        self._load = load
        self.keep_pos = keep_pos
        self.copy_words = copy_words
        self.augment_copies = augment_copies
        self._trees: dict[str, list[Tree]] = {}
        self._pairs: dict[str, list[tuple[str, str]]] = {}

    @classmethod
    def from_config(cls, data_config: Any) -> TreebankSource:
        keep_pos = bool(data_config.keep_pos_tags)
        kwargs = dict(keep_pos=keep_pos, copy_words=data_config.tree_leaves == "words",
                      augment_copies=data_config.tree_augment_copies)
        if data_config.source == "ptb":
            ranges = {
                "train": data_config.ptb_train_files,
                "dev": data_config.ptb_dev_files,
                "test": data_config.ptb_test_files,
            }
            return cls(lambda split: read_treebank(data_config.dir, ranges[split]), **kwargs)
        if data_config.source == "synthetic_trees":
            sizes = dict(
                train_size=data_config.synthetic_train_size,
                dev_size=data_config.synthetic_dev_size,
                test_size=data_config.synthetic_test_size,
                seed=data_config.synthetic_seed,
            )
            return cls(lambda split: pcfg_trees(split, **sizes), **kwargs)
        raise ValueError(
            f"TreebankSource: data_config.source must be one of {PARSING_SOURCES}, got"
            f" {data_config.source!r}"
        )

    def trees(self, split: str) -> list[Tree]:
        """The preprocessed gold trees of `split`, in file order (cached)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._trees:
            self._trees[split] = list(self._load(split))
        return self._trees[split]

    def pairs(self, split: str) -> list[tuple[str, str]]:
        """(space-joined words, space-joined target tokens), aligned with `trees(split)`.

        The train split is followed by its `augment_copies` substituted trees per tree
        (`tree_augment.substituted_trees`), if any.
        """
        if split not in self._pairs:
            trees = self.trees(split)
            if split == "train" and self.augment_copies:
                trees = [*trees, *substituted_trees(trees, self.augment_copies)]
            self._pairs[split] = [
                (" ".join(words), " ".join(tokens))
                for words, tokens in (linearize(t, keep_pos=self.keep_pos, copy_words=self.copy_words)
                                      for t in trees)
            ]
        return self._pairs[split]
