"""Evaluation reports: this run's numbers beside the paper's, as a markdown table.

The paper's figures come from ``transformer_jax.evaluation.paper``: Table 2 (newstest2014, the ``"test"``
split,
BLEU only, checkpoint-averaged) and Table 3 (newstest2013, the ``"dev"`` split, per-wordpiece perplexity
and BLEU, EN-DE, no checkpoint averaging). A config is matched to paper rows through
``paper.CONFIG_TO_PAPER`` (e.g. ``wmt14_en_de_base``); a Table 3 row name (``C-dmodel256``) or
``table3/<row>`` names that row directly, and the ``base`` and ``big`` rows also match Table 2 EN-DE.

A run sits beside a paper row only when it is that row: every field the row fixes (``paper.row_fields``:
the model, the steps, label smoothing, the schedule, the batch, the vocabulary) must be the paper's, and
every other model field ``ModelConfig``'s default, except those that change how the model is computed,
not what it is (``HOW_FIELDS``). A run with an override (another position scheme, fewer steps, another
dropout) gets its numbers alone and a line naming what differs; a new model field is compared unless it is
added to ``HOW_FIELDS``.

The paper's BLEU is tokenized and compound-split (see ``transformer_jax.evaluation.bleu``), so the comparable
number of a run is ``tokenized_bleu``; sacreBLEU is shown for reference only. Inconsistent paper figures
(the EN-FR big score) are flagged in a footnote, never silently picked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig

TEST_SETS = {"test": "newstest2014", "dev": "newstest2013"}
# Sentences in the full test sets; a smaller count means a subset, whose BLEU is not the paper's.
FULL_TEST_SET_SENTENCES = {"test": 3003, "dev": 3000}
LANG_PAIRS = {"en_de": "EN-DE", "en_fr": "EN-FR"}
PAPER_VOCAB = {"EN-DE": f"{paper.VOCAB_EN_DE:,} shared BPE", "EN-FR": f"{paper.VOCAB_EN_FR:,} word-piece"}
# Measured on identical outputs: tokenized compound-split BLEU minus sacreBLEU
# (paper_tables.json, bleu_protocol.measured_gaps_same_outputs).
SACREBLEU_GAP = "about 0.7-1.9"
_NONE = "—"
# ModelConfig fields that change how the model is computed, not what it is: a run may set them and still
# be compared with the paper's row. Every other field must be the row's.
HOW_FIELDS = ("vocab_size", "max_len", "attention_impl", "attention_block_size", "dtype", "attention_witness",
              "deterministic", "decode")
# Fields that only some position schemes read, none of them the paper's: a run that uses such a scheme
# already differs in position_encoding, and the field is named beside it; under the other schemes it is
# not read, so it is not compared.
SCHEME_FIELDS = {"max_relative_position": ("relative",)}


@dataclasses.dataclass(frozen=True)
class PaperReference:
    """The paper's row that a run on one split is compared with."""

    source: str  # e.g. "Table 2, Transformer (big), EN-FR"
    lang_pair: str  # "EN-DE" or "EN-FR"
    bleu: float
    ppl: float | None  # Table 3 only
    train_steps: int
    average_last: int | None  # checkpoints averaged (Table 2); None for Table 3
    fields: Mapping[str, Any]  # what the row fixes, as run-config fields (``paper.row_fields``)
    inconsistency: str = ""  # the paper contradicts itself about ``bleu``; say so wherever it is shown


def paper_reference(config_name: str, split: str) -> PaperReference | None:
    """The paper's row for ``config_name`` on ``split`` ("test" or "dev"), or None when it has none."""
    _check_split(split)
    row_name = config_name.removeprefix("table3/")
    mapping = paper.CONFIG_TO_PAPER.get(config_name)
    if split == "test":
        if mapping is not None:
            table2_key = mapping.get("table2")
        else:  # Table 3 is EN-DE, and its base and big rows are the models of Table 2.
            in_both = row_name in paper.TABLE2 and row_name in paper.TABLE3_BY_NAME
            table2_key = (row_name, "en_de") if in_both else None
        return None if table2_key is None else _table2_reference(*table2_key)
    table3_name = mapping.get("table3") if mapping is not None else row_name
    row = paper.TABLE3_BY_NAME.get(table3_name) if table3_name is not None else None
    if row is None:
        return None
    return PaperReference(
        source=f"Table 3, row {row.name!r}, EN-DE", lang_pair="EN-DE", bleu=row.bleu_dev, ppl=row.ppl_dev,
        train_steps=row.num_steps, average_last=None, fields=paper.row_fields(row.name))


def paper_differences(reference: PaperReference, run: Any) -> list[str]:
    """``["model.position_encoding='learned' (paper: 'sinusoidal')", ...]``: where ``run`` (a RunConfig)
    is not the paper's row: the fields the row fixes, and every model field but ``HOW_FIELDS`` (a field of
    ``SCHEME_FIELDS`` only under a scheme that reads it)."""
    row_model = {k.removeprefix("model."): v for k, v in reference.fields.items() if k.startswith("model.")}
    paper_model = ModelConfig(vocab_size=run.model.vocab_size, **row_model)
    differences = []
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(run.model, f.name), getattr(paper_model, f.name)
        if f.name in SCHEME_FIELDS:
            if run.model.position_encoding in SCHEME_FIELDS[f.name]:
                differences.append(f"model.{f.name}={mine!r} (paper: none, its positions are "
                                   f"{paper_model.position_encoding!r})")
        elif f.name not in HOW_FIELDS and mine != theirs:
            differences.append(f"model.{f.name}={mine!r} (paper: {theirs!r})")
    for key, value in reference.fields.items():
        section, name = key.split(".")
        if section != "model" and getattr(getattr(run, section), name) != value:
            differences.append(f"{key}={getattr(getattr(run, section), name)!r} (paper: {value!r})")
    return differences


def paper_comparison_table(config_name: str, split: str, results: Mapping[str, Any], *, run: Any) -> str:
    """A markdown table of this run's evaluation beside the paper's row for the config.

    Args:
      config_name: the config's name, e.g. "wmt14_en_de_base", "C-dmodel256" or "table3/C-dmodel256".
      split: "test" (newstest2014, Table 2) or "dev" (newstest2013, Table 3).
      results: this run's numbers; recognised keys are ``tokenized_bleu``, ``sacrebleu`` (floats, or
        ``bleu.BleuResult``s or their ``to_dict()``), ``ppl``, ``step`` and ``num_sentences``.
        Missing keys are shown as a dash.
      run: the run's RunConfig. The paper's figures are shown only if it is the row's run
        (``paper_differences`` is empty).

    Returns:
      A heading line, the table (columns: metric, this run, paper, note) and footnote lines. Configs with
      no paper row (synthetic data, Multi30k, ...), and runs that differ from their config's row, get this
      run's numbers and a line saying why.
    """
    reference = paper_reference(config_name, split)
    test_set = TEST_SETS[split]
    tokenized, sacre = _number(results.get("tokenized_bleu")), _number(results.get("sacrebleu"))
    ppl, step = _number(results.get("ppl")), _number(results.get("step"))
    num_sentences = _number(results.get("num_sentences"))
    differences = paper_differences(reference, run) if reference is not None else []

    if reference is None or differences:
        table = "Table 2" if split == "test" else "Table 3"
        why = (f"The paper has no row for config {config_name!r} on split {split!r} ({table}, {test_set}); "
               "this run's numbers only.")
        beyond = paper.TABLE3_BEYOND_BY_NAME.get(config_name.removeprefix("table3/"))
        if beyond is not None:
            why = (f"Row {beyond.name!r} is beyond the paper ({beyond.source}): Table 3 has no such row, so "
                   "no paper figure stands beside it; this run's numbers only.")
        if differences:
            why = (f"This run is not the paper's {reference.source}, so it is not compared with it: "
                   f"{'; '.join(differences)}. This run's numbers only.")
        lines = [f"**{config_name}**, split {split!r}", "", why, ""]
        table3_row = config_name.removeprefix("table3/") in paper.TABLE3_BY_NAME
        if not differences and split == "test" and table3_row:
            lines[-1:-1] = ["Table 3 reports newstest2013 only: use split 'dev' to compare this row."]
        rows = [("BLEU, tokenized + compound-split", _fmt(tokenized), _NONE, ""),
                ("sacreBLEU (13a, detokenized)", _fmt(sacre), _NONE, ""),
                ("perplexity (per wordpiece)", _fmt(ppl), _NONE, ""),
                ("training steps", _fmt_int(step), _NONE, ""),
                ("sentences", _fmt_int(num_sentences), _NONE, "")]
        return "\n".join(lines + _markdown(rows)) + "\n"

    mark = " †" if reference.inconsistency else ""
    delta = f"; Δ = {tokenized - reference.bleu:+.2f}" if tokenized is not None else ""
    if split == "test":
        bleu_note = f"the paper's protocol: compare this number{delta}"
        steps_note = f"paper averages the last {reference.average_last} checkpoints"
    else:
        bleu_note = f"beam search, no checkpoint averaging{delta}"
        steps_note = "no checkpoint averaging in Table 3"
    full = FULL_TEST_SET_SENTENCES[split]
    sentences_note = f"full {test_set} has {full:,}" + (
        "; not the full set, not comparable" if num_sentences is not None and num_sentences != full else "")
    rows = [
        ("BLEU, tokenized + compound-split", _fmt(tokenized), f"{reference.bleu}{mark}", bleu_note),
        ("sacreBLEU (13a, detokenized)", _fmt(sacre), _NONE,
         f"reference only, not the paper's protocol; typically {SACREBLEU_GAP} below tokenized"),
    ]
    if reference.ppl is not None or ppl is not None:
        paper_ppl = _NONE if reference.ppl is None else f"{reference.ppl}"
        rows.append(("perplexity (per wordpiece)", _fmt(ppl), paper_ppl,
                     f"depends on the vocabulary (paper: {PAPER_VOCAB[reference.lang_pair]})"
                     + ("" if reference.ppl is not None else "; not in Table 2")))
    rows += [("training steps", _fmt_int(step), f"{reference.train_steps:,}", steps_note),
             ("sentences", _fmt_int(num_sentences), _NONE, sentences_note)]

    lines = [f"**{config_name}** on {test_set} ({split}) vs. the paper's {reference.source}", ""]
    lines += _markdown(rows)
    lines += ["", "The paper's BLEU is tokenized, compound-split BLEU (Moses tokenizer, hyphenated "
                  "compounds split as ##AT##-##AT##, multi-bleu.perl; tensor2tensor's get_ende_bleu.sh): "
                  "the comparable number of this run is `tokenized_bleu`. sacreBLEU is shown for reference; "
                  f"on the same outputs it typically reads {SACREBLEU_GAP} BLEU lower."]
    if reference.lang_pair == "EN-FR":
        lines.append("EN-FR: the paper does not document its EN-FR BLEU protocol (get_ende_bleu.sh is "
                     "EN-DE); the comparison assumes the same tokenized, compound-split protocol.")
    if reference.inconsistency:
        lines.append(f"† Inconsistent paper figure: {reference.inconsistency}")
    return "\n".join(lines) + "\n"


def _table2_reference(row_name: str, lang: str) -> PaperReference:
    row = paper.TABLE2[row_name]
    lang_pair = LANG_PAIRS[lang]
    # The row's note names the language pair it concerns ("EN-FR: ..."); flag it only for that pair.
    inconsistency = row.note if lang_pair in row.note else ""
    return PaperReference(
        source=f"Table 2, {row.model}, {lang_pair}", lang_pair=lang_pair,
        bleu=row.bleu_en_de if lang == "en_de" else row.bleu_en_fr, ppl=None,
        train_steps=paper.TABLE3_BY_NAME[row_name].num_steps,
        average_last=paper.AVERAGE_LAST[row_name], fields=paper.row_fields(row_name, lang),
        inconsistency=inconsistency)


def _check_split(split: str) -> None:
    if split not in TEST_SETS:
        raise ValueError(f"split={split!r} is not one of 'test' (newstest2014, Table 2) or 'dev' "
                         "(newstest2013, Table 3)")


def _number(value: Any) -> float | None:
    """A float from a number, a ``BleuResult`` or its ``to_dict()``; None stays None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value["score"]
    elif hasattr(value, "score"):
        value = value.score
    return float(value)


def _fmt(value: float | None) -> str:
    return _NONE if value is None else f"{value:.2f}"


def _fmt_int(value: float | None) -> str:
    return _NONE if value is None else f"{int(value):,}"


def _markdown(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| metric | this run | paper | note |", "|---|---:|---:|---|"]
    return lines + [f"| {metric} | {ours} | {theirs} | {note} |" for metric, ours, theirs, note in rows]


# Published results on other benchmarks that the final summary puts beside a run, keyed by
# (config.data.source, src_lang, tgt_lang) and the protocol they use.
ANCHORS = {
    ("text", "en", "de"): ("multi30k_bleu", 41.0, "fairseq Transformer 4+4, d_model 128, beam 5, test2016 "
                           "(Wu et al., 2021, text-only baseline)"),
}
_SUMMARY_ROWS = (  # (key suffix, label); the split prefix is added
    ("sacrebleu", "BLEU, sacreBLEU (13a, cased)"),
    ("tokenized_bleu", "BLEU, the paper's tokenized compound-split"),
    ("multi30k_bleu", "BLEU, Multi30k convention (lowercased, Moses-tokenized)"),
    ("f1", "bracket F1 (EVALB, COLLINS.prm)"),
    ("ppl", "perplexity (per subword)"),
)


def final_summary(final: Mapping[str, Any], data: Any, eval_config: Any) -> str:
    """A small markdown table of a run's final scores, each beside its yardstick where one exists.

    Yardsticks: the synthetic task's copy and lexicon baselines, the right-branching parse, a published
    anchor for the data set (``ANCHORS``) or the paper's Table 2 row (``paper_comparison_table``).
    The run is described by its ``data`` (DataConfig) and ``eval_config`` (EvalConfig).
    """
    split = eval_config.final_eval_split
    anchor = ANCHORS.get((data.source, data.src_lang, data.tgt_lang))
    averaged = final.get("averaged_checkpoints")
    title = (f"Final scores ({split} split, beam {eval_config.final_beam_size}, step {final.get('step')}"
             + (f", average of {averaged} checkpoints" if averaged else "") + ")")
    lines = [title, "", "| measure | this run | beside it |", "|---|---:|---|"]
    for suffix, label in _SUMMARY_ROWS:
        value = final.get(f"{split}_{suffix}")
        if not isinstance(value, (int, float)):
            continue
        beside = []
        if suffix == "sacrebleu":
            beside += [f"{name} baseline {final[key]:.1f}" for name in ("copy", "lexicon")
                       if isinstance(final.get(key := f"{split}_sacrebleu_{name}_baseline"), (int, float))]
        if suffix == "f1" and isinstance(final.get(f"{split}_right_branching_f1"), (int, float)):
            beside.append(f"right-branching {final[f'{split}_right_branching_f1']:.1f}; paper (WSJ, 40k "
                          f"trees) {paper.TABLE4_TRANSFORMER_F1['wsj_only']}")
        if anchor and anchor[0] == suffix:
            beside.append(f"{anchor[1]:.1f}: {anchor[2]}")
        lines.append(f"| {label} | {value:.2f} | {'; '.join(beside) or _NONE} |")
    dev_rows = (("dev_ppl", "dev perplexity"),
                ("dev_bleu", f"dev BLEU ({eval_config.dev_bleu_protocol}, greedy)"),
                ("dev_f1_greedy" if "dev_f1_greedy" in final else "dev_f1", "dev F1 (greedy)"))
    for key, label in dev_rows:
        if isinstance(final.get(key), (int, float)):
            lines.append(f"| {label} | {final[key]:.2f} | {_NONE} |")
    return "\n".join(lines)
