"""The paper's own figures that this codebase compares against (Vaswani et al., 2017, arXiv v7).

Transcribed from Tables 2 and 3 and section 5 of arXiv:1706.03762. Table 3 rows are keyed by readable
names and carry only what differs from the base row, as overrides in this package's config terms:
``model`` holds ``ModelConfig`` fields (``num_encoder_layers`` / ``num_decoder_layers`` for N, ``d_model``,
``d_ff``, ``num_heads`` for h, ``d_k``, ``d_v``, ``dropout_rate`` for P_drop, ``position_encoding``) and
``train`` holds ``config.train`` fields (``label_smoothing`` for eps_ls, ``num_steps``). The base row's model
is ``ModelConfig``'s defaults (transformer_jax/model/config.py); its training values are ``BASE_TRAIN``.

Apart from the paper's figures, ``TABLE3_BEYOND`` lists the rows this codebase adds to Table 3's row (E):
other position schemes, group ``E+``. They carry no figures (the paper has none) and are not in ``TABLE3``
or ``TABLE3_BY_NAME``, so nothing matches a run of them with a paper row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Table 3 "base" training values (sections 5.2 and 5.4), as config.train fields. Its model is
# ModelConfig's defaults, which are not repeated here.
BASE_TRAIN = {"label_smoothing": 0.1, "num_steps": 100_000}
ADAM = {"b1": 0.9, "b2": 0.98, "eps": 1e-9}  # section 5.3
WARMUP_STEPS = 4000  # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
TOKENS_PER_BATCH = 25_000  # about 25k source and 25k target tokens per step (section 5.1)
VOCAB_EN_DE = 37_000  # shared BPE vocabulary (section 5.1)
VOCAB_EN_FR = 32_000  # word-piece vocabulary (section 5.1)
BEAM_SIZE = 4  # section 6.1
LENGTH_PENALTY_ALPHA = 0.6
MAX_EXTRA_LEN = 50  # max output length = input length + 50
AVERAGE_LAST = {"base": 5, "big": 20}  # checkpoints averaged for Table 2 (10-minute intervals for base)
# Section 5.2: one machine with 8 NVIDIA P100 GPUs; base steps took about 0.4 s (100k steps, 12 hours),
# big steps 1.0 s (300k steps, 3.5 days).
TRAINING_HARDWARE = "8 NVIDIA P100 GPUs"
TRAINING_HOURS = {"base": 12.0, "big": 3.5 * 24}
STEP_SECONDS = {"base": 0.4, "big": 1.0}


@dataclasses.dataclass(frozen=True)
class Table3Row:
    """One row of Table 3 (newstest2013 dev set, beam search, no checkpoint averaging)."""

    name: str
    group: str  # "base", "A".."E" or "big"
    model: dict[str, Any]  # ModelConfig fields that differ from the base row
    train: dict[str, Any]  # config.train fields that differ from BASE_TRAIN
    ppl_dev: float  # per-wordpiece perplexity
    bleu_dev: float
    params_millions: int | None  # None where the paper leaves the cell blank

    @property
    def num_steps(self) -> int:
        """Training steps of the row (100k, or 300k for big)."""
        return {**BASE_TRAIN, **self.train}["num_steps"]


def _row(name, group, ppl, bleu, params, *, model=None, train=None):
    return Table3Row(name, group, model or {}, train or {}, ppl, bleu, params)


def _n(layers: int) -> dict[str, int]:
    """N of Table 3: the encoder and the decoder alike."""
    return {"num_encoder_layers": layers, "num_decoder_layers": layers}


TABLE3 = (
    _row("base", "base", 4.92, 25.8, 65),
    _row("A-heads1", "A", 5.29, 24.9, None, model={"num_heads": 1, "d_k": 512, "d_v": 512}),
    _row("A-heads4", "A", 5.00, 25.5, None, model={"num_heads": 4, "d_k": 128, "d_v": 128}),
    _row("A-heads16", "A", 4.91, 25.8, None, model={"num_heads": 16, "d_k": 32, "d_v": 32}),
    _row("A-heads32", "A", 5.01, 25.4, None, model={"num_heads": 32, "d_k": 16, "d_v": 16}),
    _row("B-dk16", "B", 5.16, 25.1, 58, model={"d_k": 16}),
    _row("B-dk32", "B", 5.01, 25.4, 60, model={"d_k": 32}),
    _row("C-layers2", "C", 6.11, 23.7, 36, model=_n(2)),
    _row("C-layers4", "C", 5.19, 25.3, 50, model=_n(4)),
    _row("C-layers8", "C", 4.88, 25.5, 80, model=_n(8)),
    _row("C-dmodel256", "C", 5.75, 24.5, 28, model={"d_model": 256, "d_k": 32, "d_v": 32}),
    _row("C-dmodel1024", "C", 4.66, 26.0, 168, model={"d_model": 1024, "d_k": 128, "d_v": 128}),
    _row("C-dff1024", "C", 5.12, 25.4, 53, model={"d_ff": 1024}),
    _row("C-dff4096", "C", 4.75, 26.2, 90, model={"d_ff": 4096}),
    _row("D-drop0.0", "D", 5.77, 24.6, None, model={"dropout_rate": 0.0}),
    _row("D-drop0.2", "D", 4.95, 25.5, None, model={"dropout_rate": 0.2}),
    _row("D-ls0.0", "D", 4.67, 25.3, None, train={"label_smoothing": 0.0}),
    _row("D-ls0.2", "D", 5.47, 25.7, None, train={"label_smoothing": 0.2}),
    _row("E-learned-pos", "E", 4.92, 25.7, None, model={"position_encoding": "learned"}),
    _row("big", "big", 4.33, 26.4, 213,
         model={"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout_rate": 0.3},
         train={"num_steps": 300_000}),
)
TABLE3_BY_NAME = {row.name: row for row in TABLE3}


@dataclasses.dataclass(frozen=True)
class BeyondTable3Row:
    """A row beyond the paper, in Table 3's terms: one change against the base row, and no figures."""

    name: str
    group: str  # "E+"
    model: dict[str, Any]  # ModelConfig fields that differ from the base row
    source: str  # where the change comes from
    train: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return {**BASE_TRAIN, **self.train}["num_steps"]


# Beyond the paper: row (E) with the position schemes that came after it. Not the paper's; no figures.
TABLE3_BEYOND = (
    BeyondTable3Row("E+-rotary-pos", "E+", {"position_encoding": "rotary"}, "RoPE, Su et al. 2021"),
    BeyondTable3Row("E+-alibi-pos", "E+", {"position_encoding": "alibi"}, "ALiBi, Press et al. 2021"),
    BeyondTable3Row("E+-relative-pos", "E+", {"position_encoding": "relative"},
                    "relative positions, Shaw et al. 2018"),
    BeyondTable3Row("E+-no-pos", "E+", {"position_encoding": "none"}, "no position information"),
)
TABLE3_BEYOND_BY_NAME = {row.name: row for row in TABLE3_BEYOND}
# Every row a Table 3 sweep can run, in the order its report lists them: the paper's, with E+ after E.
TABLE3_ALL = (*(r for r in TABLE3 if r.name != "big"), *TABLE3_BEYOND, TABLE3_BY_NAME["big"])
TABLE3_ALL_BY_NAME = {row.name: row for row in TABLE3_ALL}

EN_FR_DROPOUT = 0.1  # section 6.1: the EN-FR big model used P_drop = 0.1 instead of 0.3
# The training recipe every row of Tables 2 and 3 shares (sections 5.1-5.4), as run-config fields.
RECIPE = {"train.warmup_steps": WARMUP_STEPS, "train.learning_rate_scale": 1.0,
          "train.adam_b1": ADAM["b1"], "train.adam_b2": ADAM["b2"], "train.adam_eps": ADAM["eps"],
          "train.max_grad_norm": 0.0, "train.cooldown_steps": 0, "data.tokens_per_batch": TOKENS_PER_BATCH}


def row_fields(row_name: str, lang: str = "en_de") -> dict[str, Any]:
    """What Table 3's row ``row_name`` (and Table 2's model of that name, on ``lang``) fixes, as run-config
    fields: ``{"train.num_steps": 100000, "model.d_model": 256, "data.vocab_size": 37000, ...}``.

    ``model.*`` holds only the row's changes: the other model fields are ``ModelConfig``'s defaults, the
    base model. ``lang``: "en_de" (Tables 2 and 3) or "en_fr" (Table 2; the big model with P_drop 0.1).
    """
    row = TABLE3_BY_NAME[row_name]
    fields = {**RECIPE, **{f"train.{k}": v for k, v in {**BASE_TRAIN, **row.train}.items()},
              **{f"model.{k}": v for k, v in row.model.items()},
              "data.src_lang": "en", "data.tgt_lang": lang.removeprefix("en_"),
              "data.vocab_size": VOCAB_EN_DE if lang == "en_de" else VOCAB_EN_FR}
    if lang == "en_fr":
        fields["model.dropout_rate"] = EN_FR_DROPOUT
    return fields


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


# Section 6.3 and Table 4: English constituency parsing (F1 on WSJ section 23; section 22 is dev).
PARSING_NUM_LAYERS = 4  # "a 4-layer transformer with d_model = 1024"
PARSING_D_MODEL = 1024
PARSING_VOCAB_WSJ_ONLY = 16_000  # WSJ only (about 40K training sentences)
PARSING_VOCAB_SEMI_SUPERVISED = 32_000  # with the ~17M-sentence high-confidence/BerkeleyParser corpora
PARSING_BEAM_SIZE = 21
PARSING_LENGTH_PENALTY_ALPHA = 0.3
PARSING_MAX_EXTRA_LEN = 300  # max output length = input length + 300
PARSING_TRAIN_SENTENCES_WSJ_ONLY = 40_000  # "about 40K", sections 02-21


@dataclasses.dataclass(frozen=True)
class Table4Row:
    """One row of Table 4: a parser, how it was trained, and its WSJ section 23 F1."""

    parser: str
    training: str  # "WSJ only, discriminative", "semi-supervised", "multi-task" or "generative"
    wsj23_f1: float


TABLE4 = (
    Table4Row("Vinyals & Kaiser et al. (2014)", "WSJ only, discriminative", 88.3),
    Table4Row("Petrov et al. (2006)", "WSJ only, discriminative", 90.4),
    Table4Row("Zhu et al. (2013)", "WSJ only, discriminative", 90.4),
    Table4Row("Dyer et al. (2016)", "WSJ only, discriminative", 91.7),
    Table4Row("Transformer (4 layers)", "WSJ only, discriminative", 91.3),
    Table4Row("Zhu et al. (2013)", "semi-supervised", 91.3),
    Table4Row("Huang & Harper (2009)", "semi-supervised", 91.3),
    Table4Row("McClosky et al. (2006)", "semi-supervised", 92.1),
    Table4Row("Vinyals & Kaiser et al. (2014)", "semi-supervised", 92.1),
    Table4Row("Transformer (4 layers)", "semi-supervised", 92.7),
    Table4Row("Luong et al. (2015)", "multi-task", 93.0),
    Table4Row("Dyer et al. (2016)", "generative", 93.3),
)
TABLE4_TRANSFORMER_F1 = {"wsj_only": 91.3, "semi_supervised": 92.7}  # the paper's own rows
