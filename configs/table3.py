"""Every row of the paper's Table 3 (model variations), as an override of a base config.

    python train.py --config=configs/table3.py:C-dmodel256            # paper scale (WMT14 EN-DE)
    python train.py --config=configs/table3.py:C-dmodel256,cpu        # shrunk: synthetic task, 2 CPU cores
    python train.py --config=configs/table3.py:C-dmodel256,multi30k   # shrunk: Multi30k EN->DE, 2 CPU cores
    python -m transformer_jax.sweep --grid table3 --rows A,E --scale cpu --workdir runs/table3
    python -m transformer_jax.sweep --grid table3 --rows A,B,D,E --scale multi30k --workdir runs/t3m
    python -m transformer_jax.sweep --grid table3 --rows E,E+ --seeds 3 --scale multi30k --workdir runs/t3e

The config argument is ``<row>[,<scale>]``: ``row`` is a name of ``paper.TABLE3`` (``base``, ``A-heads1``,
``A-heads4``, ``A-heads16``, ``A-heads32``, ``B-dk16``, ``B-dk32``, ``C-layers2``, ``C-layers4``,
``C-layers8``, ``C-dmodel256``, ``C-dmodel1024``, ``C-dff1024``, ``C-dff4096``, ``D-drop0.0``,
``D-drop0.2``, ``D-ls0.0``, ``D-ls0.2``, ``E-learned-pos``, ``big``; default ``base``), or a row beyond
the paper (``paper.TABLE3_BEYOND``, group E+: ``E+-rotary-pos``, ``E+-alibi-pos``, ``E+-relative-pos``,
``E+-no-pos``, row E with the position schemes that came after the paper), and ``scale`` is
``paper`` (default), ``cpu`` or ``multi30k``. ``config.name`` is ``table3/<row>``, which the evaluation
report matches to the paper's Table 3 row (newstest2013: PPL, BLEU); an E+ row has none.

A row is a set of overrides (``paper.TABLE3``; the numbers live only in
``transformer_jax/evaluation/paper.py``):
``row.model`` holds ``ModelConfig`` fields and ``row.train`` ``config.train`` fields, applied with
``config.model.update(...)`` / ``config.train.update(...)`` to a locked config, so a misspelt field fails.
The base row's model is ``ModelConfig``'s defaults and its training values ``paper.BASE_TRAIN``.

Scale ``paper``: ``configs/wmt14_en_de_base.py`` (section 5: WMT14 EN-DE, 37k shared BPE, 25k tokens
per batch, warmup 4000) with the row applied; for the base row that changes nothing.

Scale ``cpu``: the same relative change on a base small enough for a 2-core CPU to train and evaluate
one row in about 2.5 minutes on the embedded synthetic task (``configs/default.py`` data; measured on a
shared, busy machine: rows base, A, D and E took 27 minutes). Mapping, paper -> cpu:

    d_model, d_ff, d_k, d_v   x 1/8    base 512/2048 -> 64/256 (d_k = d_v = 8); C-dmodel256 -> 32 (d_k 4),
                                       C-dmodel1024 and big -> 128, C-dff1024 -> 128, C-dff4096 -> 512,
                                       B-dk16 -> d_k 2, A-heads1 -> d_k 64 ... A-heads32 -> d_k 2
    num_encoder_layers and
    num_decoder_layers (N)    x 1/2    base 6 -> 3; C-layers2/4/8 -> 1/2/4 (distinct and in order, which
                                       N=2 at the base could not give: 2/6 and 4/6 of 2 both round to 1)
    num_heads (h)             kept     so h * d_k = d_model holds wherever it holds in the paper
    dropout_rate, label_smoothing, position_encoding   kept
    num_steps                 x 3/1000 base 100k -> 300 steps, big 300k -> 900
    vocabulary                         1000 shared BPE (synthetic task) instead of 37k
    batch                              2048 tokens per side instead of 25k, padded to 32 or 64; warmup 100
                                       instead of 4000; learning_rate_scale 0.5 (peak 0.0063 at d_model 64)
    dev set                            200 synthetic sentences, scored once at the end (no periodic eval,
                                       no test-set decode); ``transformer_jax.sweep`` decodes it greedily

Scale ``multi30k``: the same relative change on configs/multi30k.py (real data: Multi30k EN->DE, 29k
pairs, its 8k shared BPE, pre-norm; 2k-token batches), sized so that rows base (3 seeds), A, B, D and
E, 14 runs, take about 100 minutes on 2 CPU cores, dev decoding included. Mapping, paper -> multi30k:

    d_model, d_ff, d_k, d_v   x 1/4    base 512/2048 -> 128/512 (d_k = d_v = 16); A-heads1 -> d_k 128 ...
                                       A-heads32 -> d_k 4; B-dk16 -> d_k 4, B-dk32 -> 8
    N                         x 2/3    base 6 -> 4 (the recipe's); C-layers2/4/8 -> 1/2/5
    h, P_drop, eps_ls, positions kept  so the base row has 8 heads and P_drop 0.1, where the 3k-step
                                       recipe has 4 heads and 0.3: at 600 steps nothing overfits yet
    num_steps                 x 3/500  base 100k -> 600 steps of 2k tokens (~3 epochs), big -> 1800
    schedule                           the paper's, warmup 200, learning_rate_scale 0.9: peak 5.6e-3 at
                                       d_model 128, the recipe's peak
    dev set                            all 1014 val sentences, scored once at the end with beam 4 (alpha
                                       0.6) in the dataset's BLEU convention (dev_bleu_protocol multi30k)

The budget: a base row took 310-345 s here (~4.3 min of train.py: start-up, compilation and 600 steps at
~2.5 steps/s; ~1 min of evaluate.py); the 14 rows took 85.5 minutes, one kill and resume included
(docs/sweeps.md).

Absolute numbers at cpu and multi30k scale are not comparable with the paper's; the direction of each
change against the base row is (see ``python -m transformer_jax.sweep report``).

A scale is one entry of ``SCALES``: its base config and, per field, how a paper value maps onto it.

E+ rows scale as row E does: only ``position_encoding`` changes (``max_relative_position`` keeps its
default, 16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from configs import default as default_lib
from configs import multi30k as multi30k_lib
from configs import wmt14_en_de_base as paper_base_lib
from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig


def _keep(value: Any) -> Any:
    return value


def _times(numerator: int, denominator: int) -> Callable[[int | None], int | None]:
    """paper value -> value * numerator // denominator (None, "derive it", stays None)."""
    return lambda value: None if value is None else value * numerator // denominator


@dataclasses.dataclass(frozen=True)
class Scale:
    """Where Table 3 rows run: a base config, and how each paper value maps onto it.

    ``model`` (ModelConfig fields) and ``train`` (config.train fields) map a field's paper value (the base
    row's, or the row's own) to its value at this scale. The fields they name are set on every row; a
    field a row changes is set too, as is when no mapping names it.
    """

    base: Callable[[], ml_collections.ConfigDict]
    model: Mapping[str, Callable[[Any], Any]]
    train: Mapping[str, Callable[[Any], Any]]


def _cpu_base() -> ml_collections.ConfigDict:
    config = default_lib.get_config()
    config.data.vocab_size = 1000  # shared BPE on the synthetic task
    config.data.tokens_per_batch = 2048  # per side, padding included
    config.data.length_buckets = (32, 64)  # two compiled programs, not four: compiling dominates short runs
    config.data.synthetic_dev_size = 200  # dev set the sweep scores (PPL and greedy BLEU)
    config.dev_bleu_protocol = "tokenized"  # the paper's, as the sweep reports it
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


# Per row at multi30k scale: the base row's 100k paper steps become MULTI30K_STEPS (other rows in
# proportion), with this warmup. Chosen so that rows base (3 seeds), A, B, D and E take about 100 minutes.
MULTI30K_STEPS, MULTI30K_WARMUP = 600, 200


def _multi30k_base() -> ml_collections.ConfigDict:
    config = multi30k_lib.get_config()  # data, vocabulary, pre-norm: the recipe's
    config.data.tokens_per_batch = 2048  # half the recipe's: twice the updates in the same time
    config.data.length_buckets = (16, 24, 32, 48, 64)  # five shapes: 14 rows compile them 14 times
    config.train.warmup_steps = MULTI30K_WARMUP
    config.train.cooldown_steps = 0  # Table 3's schedule, as the paper's rows
    config.train.learning_rate_scale = 0.9  # peak 0.9 * 128^-0.5 * 200^-0.5 = 5.6e-3, the recipe's peak
    config.log_every_steps = 50
    config.eval_every_steps = 0  # no periodic dev evaluation; the sweep scores dev once (beam 4)
    config.eval_bleu_examples = 0
    config.final_eval_split = ""  # no test-set decode: rows are compared on dev, as in Table 3
    config.final_average_last = 1  # Table 3 rows are single checkpoints, not averages
    config.final_alpha = paper.LENGTH_PENALTY_ALPHA  # dev decoding as Table 3: beam 4 (the sweep), 0.6
    config.checkpoint_every_steps = 100  # a killed row resumes from here
    config.checkpoint_every_minutes = 0.0
    config.checkpoint_keep = 2
    return config


_CPU_WIDTH, _CPU_DEPTH = _times(1, 8), _times(1, 2)
_M30K_WIDTH, _M30K_DEPTH = _times(1, 4), _times(2, 3)
SCALES = {
    # The paper's own recipe: WMT14 EN-DE with the row's values as they are.
    "paper": Scale(base=paper_base_lib.get_config, model={}, train={}),
    # The synthetic task on 2 CPU cores (see the module docstring for the whole mapping).
    "cpu": Scale(
        base=_cpu_base,
        model={"d_model": _CPU_WIDTH, "d_ff": _CPU_WIDTH, "d_k": _CPU_WIDTH, "d_v": _CPU_WIDTH,
               "num_encoder_layers": _CPU_DEPTH, "num_decoder_layers": _CPU_DEPTH,
               "num_heads": _keep, "dropout_rate": _keep, "position_encoding": _keep},
        train={"num_steps": _times(3, 1000), "label_smoothing": _keep}),
    # Multi30k EN->DE on 2 CPU cores: configs/multi30k.py's data and batches (see the module docstring).
    "multi30k": Scale(
        base=_multi30k_base,
        model={"d_model": _M30K_WIDTH, "d_ff": _M30K_WIDTH, "d_k": _M30K_WIDTH, "d_v": _M30K_WIDTH,
               "num_encoder_layers": _M30K_DEPTH, "num_decoder_layers": _M30K_DEPTH,
               "num_heads": _keep, "dropout_rate": _keep, "position_encoding": _keep},
        train={"num_steps": _times(MULTI30K_STEPS, paper.BASE_TRAIN["num_steps"]), "label_smoothing": _keep}),
}


def parse_argument(argument: str | None) -> tuple[str, str]:
    """``"<row>[,<scale>]"`` -> (row, scale); raises ValueError listing the valid rows and scales."""
    parts = [p.strip() for p in (argument or "").split(",")] if argument else []
    if len(parts) > 2:
        raise ValueError(f"configs/table3.py takes '<row>[,<scale>]', got {argument!r}")
    row = parts[0] if parts and parts[0] else "base"
    scale = parts[1] if len(parts) == 2 else "paper"
    if row not in paper.TABLE3_ALL_BY_NAME:
        raise ValueError(f"unknown Table 3 row {row!r} in configs/table3.py:{argument}; valid rows: "
                         f"{', '.join(r.name for r in paper.TABLE3_ALL)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r} in configs/table3.py:{argument}; valid scales: "
                         f"{', '.join(SCALES)} (e.g. configs/table3.py:{row},cpu)")
    return row, scale


def _scaled(mapping: Mapping[str, Callable[[Any], Any]], base: Mapping[str, Any],
            row: Mapping[str, Any]) -> dict[str, Any]:
    values = {**base, **row}
    return {name: mapping.get(name, _keep)(values[name]) for name in {**mapping, **row}}


def row_overrides(row: str, scale: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, train): the fields ``row`` sets at ``scale``, as ModelConfig / config.train values."""
    table3_row, spec = paper.TABLE3_ALL_BY_NAME[row], SCALES[scale]
    model = _scaled(spec.model, ModelConfig.settable_defaults(), table3_row.model)
    train = _scaled(spec.train, paper.BASE_TRAIN, table3_row.train)
    return model, train


def get_config(argument: str | None = None) -> ml_collections.ConfigDict:
    row, scale = parse_argument(argument)
    config = SCALES[scale].base()
    config.lock()  # every field a row sets must already exist
    config.name = f"table3/{row}"
    model, train = row_overrides(row, scale)
    config.model.update(model)
    config.train.update(train)
    return config
