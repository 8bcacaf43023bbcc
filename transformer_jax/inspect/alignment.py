"""Synthetic task only: does cross-attention follow the grammar's word alignment?

``data.synthetic.word_alignment`` says which source word each target word inflects; here the pieces of
each word are found and every cross-attention head's mass on the aligned source word is measured, over
all aligned words and over the reordered ones (adjectives after their noun, verb-final subordinate
clauses). Chance is the mass a uniform head would put there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.checkpoints.restore import Restored
from transformer_jax.data import synthetic
from transformer_jax.inspect import forward
from transformer_jax.model.special_ids import PAD_ID

GROUPS = ("all", "reordered", "first", "first_reordered")


def word_of_piece(pieces: Sequence[str]) -> list[int]:
    """Word index of each SentencePiece piece (a piece starting with U+2581 opens a word; specials: -1)."""
    out, word = [], -1
    for p in pieces:
        if p in ("</s>", "<s>", "<pad>"):
            out.append(-1)
            continue
        if p.startswith("\u2581") or word < 0:
            word += 1
        out.append(word)
    return out


def reordered_words(pairs: Sequence[tuple[int, int]]) -> set[int]:
    """Target words whose (target, source) alignment crosses an earlier pair's (reordered vs the source)."""
    out = set()
    for i, (t, s) in enumerate(pairs):
        if any(s2 > s for _, s2 in pairs[:i]):
            out.add(t)
    return out


def alignment_analysis(restored: Restored, batches: Sequence) -> list[dict[str, Any]]:
    """Per cross-attention head: mean attention mass on the aligned source word's pieces (dev references).

    A query is the decoder position that predicts a piece of an aligned target word. ``mass_all`` averages
    over every piece of every aligned word, ``mass_first`` over the first (stem) piece of each word only,
    since later pieces are mostly agreement suffixes that may look elsewhere. ``*_reordered`` restricts to
    ``reordered_words``; ``chance_*`` is the mass a uniform head would put on the aligned word.

    Returns:
      One row per (layer, head): {"layer", "head", "mass_{group}" for GROUPS, "chance_all",
      "chance_first_reordered", "words", "reordered_words"}.
    """
    seed = restored.run.data.synthetic_seed
    tok, cfg = restored.tokenizer, restored.model_config
    mass = {g: {} for g in GROUPS}  # group -> layer -> float64[heads] summed mass
    chance = dict.fromkeys(GROUPS, 0.0)
    count = dict.fromkeys(GROUPS, 0)
    for b in batches:
        records = forward.attention_records(restored.params, cfg, b.inputs, b.targets)["cross"]
        for row in range(b.num_real):
            src_ids = b.inputs[row][b.inputs[row] != PAD_ID]
            tgt_ids = b.targets[row][b.targets[row] != PAD_ID]
            src_word = np.asarray(word_of_piece(forward.pieces(tok, src_ids)))
            tgt_word = np.asarray(word_of_piece(forward.pieces(tok, tgt_ids)))
            # word_alignment's words are text.split(); skip a pair whose pieces split otherwise.
            if (src_word.max(initial=-1) + 1 != len(b.source_texts[row].split())
                    or tgt_word.max(initial=-1) + 1 != len(b.target_texts[row].split())):
                continue
            pairs = synthetic.word_alignment(b.source_texts[row], b.target_texts[row], seed)
            reordered = reordered_words(pairs)
            for t, s in pairs:
                pieces = np.flatnonzero(tgt_word == t)
                keys = src_word == s
                word_groups = [("all", pieces), ("first", pieces[:1])]
                if t in reordered:
                    word_groups += [("reordered", pieces), ("first_reordered", pieces[:1])]
                for group, queries in word_groups:
                    count[group] += len(queries)
                    chance[group] += len(queries) * keys.sum() / len(src_ids)
                    for layer, rec in enumerate(records):
                        w = rec.weights[row][:, queries, : len(src_ids)]  # [H, q, S]
                        on_word = w[:, :, keys].sum(axis=(1, 2))  # [H]
                        mass[group][layer] = mass[group].get(layer, 0.0) + on_word
    rows = []
    for layer in sorted(mass["all"]):
        for head in range(cfg.num_heads):
            row = {"layer": layer, "head": head}
            row.update({f"mass_{g}": float(mass[g][layer][head]) / count[g] if count[g] else float("nan")
                        for g in GROUPS})
            row.update({f"chance_{g}": chance[g] / max(count[g], 1) for g in ("all", "first_reordered")})
            row.update({"words": count["first"], "reordered_words": count["first_reordered"]})
            rows.append(row)
    return rows
