"""Constrained decoding for parsing with the words as leaves: every output is a tree over its input.

The target of `data_config.tree_leaves='words'` is the bracketing with the source words as leaves,
`(S (NP The dog )NP (VP barks )VP . )S`, where each bracket is one id (a SentencePiece user-defined
symbol) and each word is exactly the pieces it has in the source (`data/tokenizer.py`). A small
automaton per row, carried through greedy and beam search, masks the logits so that only these
continue a prefix:

- an opening bracket `(L`: between words, while words remain, below `max_depth`, at most
  `max_open_run` in a row between two words, at the top level only as the first token (one root),
  and only if the rest still fits the length limit (the open, its close, the remaining pieces, the
  open closes and EOS);
- the next source piece (a copy): inside a constituent while pieces remain; in the middle of a
  word (the next piece does not start with U+2581) nothing else is allowed;
- the closing bracket of the innermost open constituent: between words, once that constituent
  has a child, and for the root only when every piece has been copied;
- EOS: once every piece has been copied and every bracket closed.

So the leaves of every output are the input's pieces in order, grouped into its words, and the
brackets are balanced: the yield is the input by construction, for any model, trained or not.

The copy gets the probability of every piece, not only of the right one (`wrap`): outputting a
word is one action, whichever word the model would have spelled. A model that would misspell the
next word (early in training, or an unknown word) still chooses "a word comes here" rather than
being pushed onto the brackets, which otherwise made greedy search open brackets until the depth
limit (measured: dev F1 6.1 at step 750 of the sample, outputs like `(NP (NP (NP (NP ...`).
The
decoder still conditions on the words it has written (as in parsing as language modelling), which
the `XX` placeholders of the paper's linearization cannot give it.

A word whose text is itself a bracket symbol (`(NP`) is cut into that symbol by SentencePiece and
cannot be copied as a word; treebank words never look like that (brackets are -LRB-, -RRB-).

Shapes: `n` rows (batch * beams), `src_len` padded source length, `vocab` ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.special_ids import BOS_ID, EOS_ID, PAD_ID

Array = jax.Array
NEG_INF = -1.0e7  # as evaluation/decode.py: a finite log(0)
DEFAULT_MAX_DEPTH = 64  # open constituents at once; the sample's deepest tree has 28
DEFAULT_MAX_OPEN_RUN = 8  # opening brackets in a row between two words; the sample's train trees: <= 6


class TreeState(NamedTuple):
    """The automaton of every row; `reorder` and beam selection gather its rows."""

    source: Array  # int32[n, src_len] the row's source ids (PAD-padded, EOS after the pieces)
    num_pieces: Array  # int32[n] source pieces before the first EOS/PAD
    limits: Array  # int32[n] the row's output length limit, EOS included
    pos: Array  # int32[n] pieces copied so far
    depth: Array  # int32[n] open constituents
    stack: Array  # int32[n, max_depth] label index of each open constituent, outermost first
    has_child: Array  # bool[n] whether the innermost open constituent has a child yet
    open_run: Array  # int32[n] opening brackets since the last copied piece


@dataclasses.dataclass(frozen=True)
class TreeConstraint:
    """The vocabulary facts the automaton needs; hashable, so jit can take it as a static argument.

    `open_ids[k]` and `close_ids[k]` are the ids of `(L` and `)L` for the k-th label.
    """

    vocab_size: int
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    word_start_ids: tuple[int, ...]  # pieces that begin a word (U+2581 first)
    max_depth: int = DEFAULT_MAX_DEPTH
    max_open_run: int = DEFAULT_MAX_OPEN_RUN

    def __post_init__(self):
        if len(self.open_ids) != len(self.close_ids) or not self.open_ids:
            raise ValueError(f"TreeConstraint needs one close id per open id, got {len(self.open_ids)}"
                             f" open and {len(self.close_ids)} close ids")
        if self.max_depth < 1 or self.max_open_run < 1:
            raise ValueError(f"max_depth and max_open_run must be >= 1, got {self.max_depth} and "
                             f"{self.max_open_run}")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, max_depth: int = DEFAULT_MAX_DEPTH,
                       max_open_run: int = DEFAULT_MAX_OPEN_RUN) -> TreeConstraint | None:
        """The constraint of a tokenizer with bracket symbols (`Tokenizer.bracket_ids`), else None."""
        brackets = getattr(tokenizer, "bracket_ids", None) or {}
        by_token = {token: i for i, token in brackets.items()}
        labels = sorted(token[1:] for token in by_token if token.startswith("(")
                        and f"){token[1:]}" in by_token)
        if not labels:
            return None
        return cls(vocab_size=tokenizer.vocab_size,
                   open_ids=tuple(by_token[f"({label}"] for label in labels),
                   close_ids=tuple(by_token[f"){label}"] for label in labels),
                   word_start_ids=tuple(sorted(tokenizer.word_start_ids)), max_depth=max_depth,
                   max_open_run=max_open_run)

    # ---------------------------------------------------------------------------------- tables

    def _tables(self) -> tuple[Array, Array, Array, Array]:
        """label_of int32[vocab] (-1 if not an opening bracket), is_close bool[vocab],
        starts_word bool[vocab], close_of int32[labels]."""
        label_of = np.full(self.vocab_size, -1, np.int32)
        label_of[list(self.open_ids)] = np.arange(len(self.open_ids))
        is_close = np.zeros(self.vocab_size, bool)
        is_close[list(self.close_ids)] = True
        starts_word = np.zeros(self.vocab_size, bool)
        starts_word[list(self.word_start_ids)] = True
        return (jnp.asarray(label_of), jnp.asarray(is_close), jnp.asarray(starts_word),
                jnp.asarray(self.close_ids, jnp.int32))

    # ---------------------------------------------------------------------------------- automaton

    def init(self, inputs: Array, limits: Array) -> TreeState:
        """The empty state of int32[n, src_len] `inputs` with int32[n] output `limits`."""
        n = inputs.shape[0]
        pieces = (inputs != PAD_ID) & (inputs != EOS_ID)  # [n, S]
        num_pieces = jnp.sum(jnp.cumprod(pieces, axis=1), axis=1).astype(jnp.int32)
        zeros = jnp.zeros((n,), jnp.int32)
        return TreeState(source=inputs.astype(jnp.int32), num_pieces=num_pieces,
                         limits=limits.astype(jnp.int32), pos=zeros, depth=zeros,
                         stack=jnp.zeros((n, self.max_depth), jnp.int32),
                         has_child=jnp.zeros((n,), bool), open_run=zeros)

    def allowed(self, state: TreeState, t: Array) -> Array:
        """bool[n, vocab]: the tokens that may be output at position `t` (see the module docstring).

        A row with nothing allowed (no tree fits its length limit, or an empty source) may end (EOS).
        """
        others, next_piece, can_copy = self._actions(state, t)
        vocab = jnp.arange(self.vocab_size)[None, :]  # [1, V]
        return others | ((vocab == next_piece[:, None]) & can_copy[:, None])

    def _actions(self, state: TreeState, t: Array) -> tuple[Array, Array, Array]:
        """(bool[n, vocab] allowed brackets and EOS, int32[n] the next source piece, bool[n] whether
        it may be copied); EOS is allowed where nothing else is."""
        label_of, _, starts_word, close_of = self._tables()
        n, src_len = state.source.shape
        remaining = state.num_pieces - state.pos  # [n]
        next_piece = jnp.take_along_axis(
            state.source, jnp.clip(state.pos, 0, src_len - 1)[:, None], axis=1)[:, 0]  # [n]
        between_words = (state.pos == 0) | (remaining <= 0) | starts_word[next_piece]
        depth = state.depth
        fits = t + remaining + depth + 3 <= state.limits  # the open, its close, the rest, EOS
        can_open = (between_words & (remaining > 0) & (depth < self.max_depth)
                    & (state.open_run < self.max_open_run) & ((depth > 0) | (t == 0)) & fits)
        can_copy = (depth > 0) & (remaining > 0)
        can_close = between_words & (depth > 0) & state.has_child & ((depth > 1) | (remaining == 0))
        can_end = (depth == 0) & (remaining <= 0) & (t > 0)
        top = jnp.take_along_axis(state.stack, jnp.clip(depth - 1, 0, self.max_depth - 1)[:, None],
                                  axis=1)[:, 0]  # [n]
        vocab = jnp.arange(self.vocab_size)[None, :]  # [1, V]
        mask = (((label_of >= 0)[None, :] & can_open[:, None])
                | ((vocab == close_of[top][:, None]) & can_close[:, None])
                | ((vocab == EOS_ID) & can_end[:, None]))  # [n, V]
        stuck = ~jnp.any(mask, axis=1, keepdims=True) & ~can_copy[:, None]  # [n, 1]
        return mask | ((vocab == EOS_ID) & stuck), next_piece, can_copy

    def advance(self, state: TreeState, tokens: Array) -> TreeState:
        """The state after each row outputs int32[n] `tokens` (EOS, PAD and BOS change nothing)."""
        label_of, is_close, _, _ = self._tables()
        label = label_of[tokens]  # [n]
        opens = label >= 0
        closes = is_close[tokens]
        copies = ~opens & ~closes & (tokens != EOS_ID) & (tokens != PAD_ID) & (tokens != BOS_ID)
        slot = jnp.arange(self.max_depth)[None, :] == state.depth[:, None]  # [n, max_depth]
        stack = jnp.where(opens[:, None] & slot, label[:, None], state.stack)
        depth = state.depth + opens.astype(jnp.int32) - closes.astype(jnp.int32)
        has_child = jnp.where(opens, False, state.has_child | closes | copies)
        open_run = jnp.where(copies, 0, state.open_run + opens.astype(jnp.int32))
        return state._replace(pos=state.pos + copies.astype(jnp.int32), depth=depth, stack=stack,
                              has_child=has_child, open_run=open_run)

    # ---------------------------------------------------------------------------------- search hook

    def scores(self, state: TreeState, t: Array, logits: Array) -> Array:
        """float32[n, vocab] next-token scores: log P of each allowed bracket and of EOS, the log of
        the total probability of all pieces at the next source piece (the copy), NEG_INF elsewhere.

        Args:
          logits: float32[n, vocab] the model's next-token logits.
        """
        others, next_piece, can_copy = self._actions(state, t)
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [n, V]
        vocab = jnp.arange(self.vocab_size)[None, :]  # [1, V]
        label_of, is_close, _, _ = self._tables()
        is_piece = (label_of < 0) & ~is_close & (vocab[0] != EOS_ID) & (vocab[0] != PAD_ID) & (
            vocab[0] != BOS_ID)  # [V]
        copy = jax.nn.logsumexp(jnp.where(is_piece[None, :], logprobs, NEG_INF), axis=-1)  # [n]
        scores = jnp.where(others, logprobs, NEG_INF)
        return jnp.where((vocab == next_piece[:, None]) & can_copy[:, None], copy[:, None], scores)

    def wrap(self, stepper: Any, inputs: Array, limits: Array) -> Any:
        """`kv_cache.Stepper` whose logits are replaced by `scores` (NEG_INF where not allowed).

        Args:
          stepper: the search's next-token function over n rows (state, step, reorder).
          inputs: int32[n, src_len] each row's source ids (beams repeated).
          limits: int32[n] each row's output length limit.
        """
        inner_step, inner_reorder = stepper.step, stepper.reorder

        def step(state, seqs, t):
            inner, tree = state
            previous = jax.lax.dynamic_index_in_dim(seqs, jnp.maximum(t - 1, 0), axis=1, keepdims=False)
            tree = self.advance(tree, jnp.where(t == 0, PAD_ID, previous))  # [n]
            logits, inner = inner_step(inner, seqs, t)  # [n, V]
            return self.scores(tree, t, logits), (inner, tree)

        def reorder(state, rows):
            inner, tree = state
            return inner_reorder(inner, rows), jax.tree.map(lambda x: jnp.take(x, rows, axis=0), tree)

        return type(stepper)((stepper.state, self.init(inputs, limits)), step, reorder)


# -------------------------------------------------------------------------------------- outputs


def _groups(ids: Sequence[int], word_start_ids: frozenset) -> list[list[int]]:
    """Pieces grouped into words: a new word at every word-start piece."""
    groups: list[list[int]] = []
    for i in ids:
        if i in word_start_ids or not groups:
            groups.append([])
        groups[-1].append(i)
    return groups


def output_tokens(ids: Sequence[int], tokenizer: Any, source_ids: Sequence[int],
                  words: Sequence[str]) -> list[str]:
    """The linearized tree of one decoded row, with words as leaves.

    Brackets become their tokens; each run of pieces between brackets is cut into words at
    word-start pieces. Word k of the output is `words[k]` when its pieces are exactly the pieces of
    the k-th source word (so an unknown word comes back as itself, not as the UNK mark); any other
    run of pieces is written as its decoded text, so a yield that differs from the input shows.

    Args:
      ids: int[length] one row of a search's output (stops at EOS; PAD and BOS ignored).
      tokenizer: with `bracket_ids`, `word_start_ids` and `decode`.
      source_ids: int[src_len] the row's source (EOS and PAD ignored).
      words: the source words, in order.
    """
    starts = tokenizer.word_start_ids
    source = [int(i) for i in source_ids if i not in (PAD_ID, EOS_ID, BOS_ID)]
    source_words = _groups(source, starts)
    aligned = len(source_words) == len(words)
    tokens: list[str] = []
    pieces: list[int] = []
    copied = [0]  # words output so far

    def flush() -> None:
        for group in _groups(pieces, starts):
            k = copied[0]
            if aligned and k < len(words) and group == source_words[k]:
                tokens.append(words[k])
            else:
                text = "_".join(tokenizer.decode(group).split())
                tokens.append(text or "<unk>")
            copied[0] += 1
        pieces.clear()

    for i in (int(x) for x in np.asarray(ids).reshape(-1)):
        if i == EOS_ID:
            break
        if i in (PAD_ID, BOS_ID):
            continue
        if i in tokenizer.bracket_ids:
            flush()
            tokens.append(tokenizer.bracket_ids[i])
        else:
            pieces.append(i)
    flush()
    return tokens
