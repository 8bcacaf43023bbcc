"""Every row of the paper's Table 3 (model variations), as an override of a base config.

    python train.py --config=configs/table3.py:C-dmodel256            # paper scale (WMT14 EN-DE)
    python train.py --config=configs/table3.py:C-dmodel256,cpu        # shrunk: synthetic task, 2 CPU cores
    python -m transformer_jax.sweep --grid table3 --rows A,E --scale cpu --workdir runs/table3

The config argument is ``<row>[,<scale>]``: ``row`` is a name of ``paper.TABLE3`` (``base``, ``A-heads1``,
``A-heads4``, ``A-heads16``, ``A-heads32``, ``B-dk16``, ``B-dk32``, ``C-layers2``, ``C-layers4``,
``C-layers8``, ``C-dmodel256``, ``C-dmodel1024``, ``C-dff1024``, ``C-dff4096``, ``D-drop0.0``,
``D-drop0.2``, ``D-ls0.0``, ``D-ls0.2``, ``E-learned-pos``, ``big``; default ``base``) and ``scale`` is
``paper`` (default) or ``cpu``. ``config.name`` is ``table3/<row>``, which the evaluation report matches
to the paper's Table 3 row (newstest2013: PPL, BLEU).

The row's hyperparameters are ``paper.TABLE3[row].config()`` (the base recipe plus the row's changes;
the numbers live only in ``transformer_jax/paper.py``). Each one sets real config fields (the config is
locked, so a misspelt field fails):

    num_layers        -> model.num_encoder_layers and model.num_decoder_layers (N)
    d_model, d_ff, num_heads, d_k, d_v, dropout_rate, position_encoding -> model.<same name>
    label_smoothing   -> train.label_smoothing (eps_ls)
    train_steps       -> train.num_steps

Scale ``paper``: ``configs/wmt14_en_de_base.py`` (section 5: WMT14 EN-DE, 37k shared BPE, 25k tokens
per batch, warmup 4000) with the row applied; for the base row that changes nothing.

Scale ``cpu``: the same relative change on a base small enough for a 2-core CPU to train and evaluate
one row in about 2.5 minutes on the embedded synthetic task (``configs/default.py`` data; measured on a
shared, busy machine: rows base, A, D and E took 27 minutes). Mapping, paper -> cpu:

    d_model, d_ff, d_k, d_v   x 1/8    base 512/2048/64/64 -> 64/256/8/8; C-dmodel256 -> 32 (d_k 4),
                                       C-dmodel1024 and big -> 128, C-dff1024 -> 128, C-dff4096 -> 512,
                                       B-dk16 -> d_k 2, A-heads1 -> d_k 64 ... A-heads32 -> d_k 2
    num_layers (N)            x 1/2    base 6 -> 3; C-layers2/4/8 -> 1/2/4 (distinct and in order, which
                                       N=2 at the base could not give: 2/6 and 4/6 of 2 both round to 1)
    num_heads (h)             kept     so h * d_k = d_model holds wherever it holds in the paper
    dropout_rate, label_smoothing, position_encoding   kept
    train_steps               x 3/1000 base 100k -> 300 steps, big 300k -> 900
    vocabulary                         1000 shared BPE (synthetic task) instead of 37k
    batch                              2048 tokens per side instead of 25k, padded to 32 or 64; warmup 100
                                       instead of 4000; learning_rate_scale 0.5 (peak 0.0063 at d_model 64)
    dev set                            200 synthetic sentences, scored once at the end (no periodic eval,
                                       no test-set decode); ``transformer_jax.sweep`` decodes it greedily

Absolute numbers at cpu scale are not comparable with the paper's; the direction of each change against
the base row is (see ``python -m transformer_jax.sweep report``).
"""

from __future__ import annotations

import ml_collections

from configs import default as default_lib
from configs import wmt14_en_de_base as paper_base_lib
from transformer_jax import paper

SCALES = ("paper", "cpu")

# Table 3 hyperparameter (paper.BASE names) -> the config fields it sets.
FIELDS = {
    "num_layers": ("model.num_encoder_layers", "model.num_decoder_layers"),
    "d_model": ("model.d_model",),
    "d_ff": ("model.d_ff",),
    "num_heads": ("model.num_heads",),
    "d_k": ("model.d_k",),
    "d_v": ("model.d_v",),
    "dropout_rate": ("model.dropout_rate",),
    "position_encoding": ("model.position_encoding",),
    "label_smoothing": ("train.label_smoothing",),
    "train_steps": ("train.num_steps",),
}

# cpu scale: paper value -> cpu value, per hyperparameter (absent: kept as is).
CPU_WIDTH_DIVISOR = 8  # d_model, d_ff, d_k, d_v
CPU_LAYER_DIVISOR = 2  # N
CPU_STEPS_FRACTION = (3, 1000)  # train_steps: 100k -> 300, 300k -> 900
CPU_SCALING = {
    "d_model": lambda v: v // CPU_WIDTH_DIVISOR,
    "d_ff": lambda v: v // CPU_WIDTH_DIVISOR,
    "d_k": lambda v: v // CPU_WIDTH_DIVISOR,
    "d_v": lambda v: v // CPU_WIDTH_DIVISOR,
    "num_layers": lambda v: v // CPU_LAYER_DIVISOR,
    "train_steps": lambda v: v * CPU_STEPS_FRACTION[0] // CPU_STEPS_FRACTION[1],
}


def parse_argument(argument: str | None) -> tuple[str, str]:
    """``"<row>[,<scale>]"`` -> (row, scale); raises ValueError listing the valid rows and scales."""
    parts = [p.strip() for p in (argument or "").split(",")] if argument else []
    if len(parts) > 2:
        raise ValueError(f"configs/table3.py takes '<row>[,<scale>]', got {argument!r}")
    row = parts[0] if parts and parts[0] else "base"
    scale = parts[1] if len(parts) == 2 else "paper"
    if row not in paper.TABLE3_BY_NAME:
        raise ValueError(f"unknown Table 3 row {row!r} in configs/table3.py:{argument}; valid rows: "
                         f"{', '.join(r.name for r in paper.TABLE3)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r} in configs/table3.py:{argument}; valid scales: "
                         f"{', '.join(SCALES)} (e.g. configs/table3.py:{row},cpu)")
    return row, scale


def row_hparams(row: str, scale: str) -> dict:
    """The row's effective Table 3 hyperparameters at ``scale`` (paper.BASE names)."""
    hparams = paper.TABLE3_BY_NAME[row].config()
    if scale == "cpu":
        hparams = {k: CPU_SCALING[k](v) if k in CPU_SCALING else v for k, v in hparams.items()}
    return hparams


def apply_hparams(config: ml_collections.ConfigDict, hparams: dict) -> None:
    """Sets the fields of ``FIELDS`` on a locked config (an unknown field raises)."""
    for name, value in hparams.items():
        if name not in FIELDS:
            raise ValueError(f"Table 3 hyperparameter {name!r} has no config field; known: {sorted(FIELDS)}")
        for path in FIELDS[name]:
            section, field = path.split(".")
            setattr(config[section], field, value)


def _cpu_base() -> ml_collections.ConfigDict:
    config = default_lib.get_config()
    config.data.vocab_size = 1000  # shared BPE on the synthetic task
    config.data.tokens_per_batch = 2048  # per side, padding included
    config.data.length_buckets = (32, 64)  # two compiled programs, not four: compiling dominates short runs
    config.data.synthetic_dev_size = 200  # dev set the sweep scores (PPL and greedy BLEU)
    config.train.warmup_steps = 100
    config.train.learning_rate_scale = 0.5  # peak 0.0063 at d_model 64; 1.0 and 2.0 learned slower
    config.log_every_steps = 50
    config.eval_every_steps = 0  # no periodic dev evaluation; scored once at the end
    config.eval_bleu_examples = 0  # the sweep decodes the dev set afterwards (evaluate.py)
    config.final_eval_split = ""  # no test-set decode
    config.checkpoint_every_steps = 100  # a killed row resumes from here
    config.checkpoint_every_minutes = 0.0
    config.checkpoint_keep = 2
    return config


def get_config(argument: str | None = None) -> ml_collections.ConfigDict:
    row, scale = parse_argument(argument)
    config = paper_base_lib.get_config() if scale == "paper" else _cpu_base()
    config.lock()  # every field a row sets must already exist
    config.name = f"table3/{row}"
    apply_hparams(config, row_hparams(row, scale))
    return config
