"""The paper's own figures that this codebase compares against (Vaswani et al., 2017, arXiv v7).

Transcribed from Tables 2 and 3 and section 5 of arXiv:1706.03762. Table 3 rows are keyed by readable
names; ``changes`` lists only what differs from the base row, in this package's config names:
``num_layers`` (N, encoder and decoder alike), ``d_model``, ``d_ff``, ``num_heads`` (h), ``d_k``, ``d_v``,
``dropout_rate`` (P_drop), ``label_smoothing`` (eps_ls), ``position_encoding`` and ``train_steps``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Section 5 and Table 3 "base": the recipe every Table 3 row starts from.
BASE = {
    "num_layers": 6, "d_model": 512, "d_ff": 2048, "num_heads": 8, "d_k": 64, "d_v": 64,
    "dropout_rate": 0.1, "label_smoothing": 0.1, "train_steps": 100_000,
    "position_encoding": "sinusoidal",
}
ADAM = {"b1": 0.9, "b2": 0.98, "eps": 1e-9}  # section 5.3
WARMUP_STEPS = 4000  # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
TOKENS_PER_BATCH = 25_000  # about 25k source and 25k target tokens per step (section 5.1)
VOCAB_EN_DE = 37_000  # shared BPE vocabulary (section 5.1)
VOCAB_EN_FR = 32_000  # word-piece vocabulary (section 5.1)
BEAM_SIZE = 4  # section 6.1
LENGTH_PENALTY_ALPHA = 0.6
MAX_EXTRA_LEN = 50  # max output length = input length + 50
AVERAGE_LAST = {"base": 5, "big": 20}  # checkpoints averaged for Table 2 (10-minute intervals for base)


@dataclasses.dataclass(frozen=True)
class Table3Row:
    """One row of Table 3 (newstest2013 dev set, beam search, no checkpoint averaging)."""

    name: str
    group: str  # "base", "A".."E" or "big"
    changes: dict[str, Any]
    ppl_dev: float  # per-wordpiece perplexity
    bleu_dev: float
    params_millions: int | None  # None where the paper leaves the cell blank

    def config(self) -> dict[str, Any]:
        """The full effective hyperparameters of the row."""
        return {**BASE, **self.changes}


def _row(name, group, changes, ppl, bleu, params):
    return Table3Row(name, group, changes, ppl, bleu, params)


TABLE3 = (
    _row("base", "base", {}, 4.92, 25.8, 65),
    _row("A-heads1", "A", {"num_heads": 1, "d_k": 512, "d_v": 512}, 5.29, 24.9, None),
    _row("A-heads4", "A", {"num_heads": 4, "d_k": 128, "d_v": 128}, 5.00, 25.5, None),
    _row("A-heads16", "A", {"num_heads": 16, "d_k": 32, "d_v": 32}, 4.91, 25.8, None),
    _row("A-heads32", "A", {"num_heads": 32, "d_k": 16, "d_v": 16}, 5.01, 25.4, None),
    _row("B-dk16", "B", {"d_k": 16}, 5.16, 25.1, 58),
    _row("B-dk32", "B", {"d_k": 32}, 5.01, 25.4, 60),
    _row("C-layers2", "C", {"num_layers": 2}, 6.11, 23.7, 36),
    _row("C-layers4", "C", {"num_layers": 4}, 5.19, 25.3, 50),
    _row("C-layers8", "C", {"num_layers": 8}, 4.88, 25.5, 80),
    _row("C-dmodel256", "C", {"d_model": 256, "d_k": 32, "d_v": 32}, 5.75, 24.5, 28),
    _row("C-dmodel1024", "C", {"d_model": 1024, "d_k": 128, "d_v": 128}, 4.66, 26.0, 168),
    _row("C-dff1024", "C", {"d_ff": 1024}, 5.12, 25.4, 53),
    _row("C-dff4096", "C", {"d_ff": 4096}, 4.75, 26.2, 90),
    _row("D-drop0.0", "D", {"dropout_rate": 0.0}, 5.77, 24.6, None),
    _row("D-drop0.2", "D", {"dropout_rate": 0.2}, 4.95, 25.5, None),
    _row("D-ls0.0", "D", {"label_smoothing": 0.0}, 4.67, 25.3, None),
    _row("D-ls0.2", "D", {"label_smoothing": 0.2}, 5.47, 25.7, None),
    _row("E-learned-pos", "E", {"position_encoding": "learned"}, 4.92, 25.7, None),
    _row("big", "big", {"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout_rate": 0.3,
                        "train_steps": 300_000}, 4.33, 26.4, 213),
)
TABLE3_BY_NAME = {row.name: row for row in TABLE3}


@dataclasses.dataclass(frozen=True)
class Table2Row:
    """The paper's own newstest2014 BLEU (Table 2), as computed by its tokenized, compound-split protocol."""

    model: str
    bleu_en_de: float
    bleu_en_fr: float
    train_flops: float
    note: str = ""


TABLE2 = {
    "base": Table2Row("Transformer (base model)", 27.3, 38.1, 3.3e18),
    "big": Table2Row(
        "Transformer (big)", 28.4, 41.8, 2.3e19,
        note="EN-FR: arXiv Table 2 and abstract say 41.8, but section 6.1 of the same paper says 41.0 "
             "and the NIPS 2017 proceedings print 41.0 in Table 2. Both are the paper's own figures."),
}

# Which paper rows a config is compared with, by config name (``config.name``).
CONFIG_TO_PAPER = {
    "wmt14_en_de_base": {"table2": ("base", "en_de"), "table3": "base"},
    "wmt14_en_de_big": {"table2": ("big", "en_de"), "table3": "big"},
    "wmt14_en_fr_big": {"table2": ("big", "en_fr"), "table3": None},
}
