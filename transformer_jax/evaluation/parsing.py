"""Scoring a parser (section 6.3, Table 4): decode a split, repair, EVALB F1, the paper beside it.

Parsing is translation from words to a linearized tree (``data/trees.py``), so the model, trainer,
decoder and checkpoints are the translation ones. What differs is here:

- decoding: with a tokenizer that has bracket symbols (``data.tree_leaves='words'``), every search
  is constrained by ``tree_constraints.TreeConstraint`` so each output is a tree over exactly the
  input words, and the outputs are written with those words as leaves; beam search with the
  config's ``final_beam_size`` / ``final_alpha`` / ``final_max_extra_len`` (the paper: 21, 0.3,
  input + 300). The sentences go through translation's decoding path (``translation.decode_ids``:
  its planner and cache budget, with the constraint as an option), so beam 21 with a 300-token
  allowance does not exhaust memory;
- scoring: ``evalb.parsing_report`` (EVALB with COLLINS.prm, outputs repaired and counted, the
  right-branching baseline scored the same way) instead of BLEU;
- the report: this run beside the paper's Table 4 (``paper.TABLE4``), with a plain statement of
  when the numbers are not comparable.

``tasks.ParsingTask`` and ``workdir_scoring.evaluate_workdir`` dispatch here when
``data.is_parsing(config.data)``; the training loop's periodic dev F1 is ``dev_scores``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformer_jax import data as data_lib
from transformer_jax.evaluation import evalb, paper, scoring, translation, tree_constraints
from transformer_jax.model.config import ModelConfig

WSJ23_SENTENCES = 2416  # sentences of WSJ section 23, the test set of Table 4 (EVALB's count)
PAPER_SPLIT = {"train": "02-21", "dev": "22", "test": "23"}  # the WSJ sections of Table 4
# The figures of this run that the report shows, in order: (key, row name).
REPORT_KEYS = (("f1", "F1 (EVALB, COLLINS.prm)"), ("precision", "precision"), ("recall", "recall"),
               ("exact_match", "exact match (%)"))
_NONE = "—"


def decode_split(params, model_config: ModelConfig, tokenizer, batches, *, beam_size: int,
                 alpha: float, max_extra_len: int, words: Sequence[Sequence[str]] | None = None,
                 constrain: bool = True, tokens_per_batch: int | None = None) -> list[str]:
    """Decoded target strings of every real row of ``batches``, in the split's order.

    The sources are decoded by ``scoring.decode_batches`` (translation's path: re-batched by their own
    length within the decoding budget ``tokens_per_batch``, None for the model's); output i may be at
    most (source length_i + ``max_extra_len``) tokens long.

    Args:
      batches: ``data.EvalBatch`` items; ``indices`` give each row's position in the split.
      beam_size: 1 is greedy search, otherwise beam search with length penalty ``alpha``.
      words: the words of every sentence of the split (by index). With them and a tokenizer that
        has bracket symbols, outputs are written with the words as leaves (``tree_constraints.
        output_tokens``), and with ``constrain`` the search is constrained to trees over them.
    """
    constraint = tree_constraints.TreeConstraint.from_tokenizer(tokenizer)
    with_words = constraint is not None and words is not None
    settings = translation.Settings(beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len)
    sources, outputs = scoring.decode_batches(params, model_config, batches, settings,
                                              constraint=constraint if with_words and constrain else None,
                                              tokens_per_batch=tokens_per_batch)
    if not with_words:
        return tokenizer.decode_batch(outputs)
    indices = sorted(int(i) for b in batches for i in b.indices)
    return [" ".join(tree_constraints.output_tokens(output, tokenizer, source, words[i]))
            for output, source, i in zip(outputs, sources, indices, strict=True)]


def score_batches(params, model_config: ModelConfig, tokenizer, data_config, split: str, batches, *,
                  beam_size: int, alpha: float, max_extra_len: int, constrain: bool = True) -> dict[str, Any]:
    """``evalb.parsing_report`` of the decoded ``batches`` of ``split`` against the gold trees.

    Returns the report (``f1``, ``precision``, ``recall``, ``exact_match`` in percent; ``scored``,
    ``errors``, ``skipped``, ``repaired``, ``yield_mismatch`` counts; ``right_branching_f1``;
    ``labels``, F1 per label) plus ``outputs`` (decoded
    strings), ``sources`` and ``gold`` (gold trees as bracket strings), all in split order.
    """
    indices = sorted(int(i) for b in batches for i in b.indices)
    trees = data_lib.get_source(data_config).trees(split)
    gold = [trees[i] for i in indices]
    copy_words = data_config.tree_leaves == "words"
    outputs = decode_split(params, model_config, tokenizer, batches, beam_size=beam_size, alpha=alpha,
                           max_extra_len=max_extra_len,
                           words=[t.words() for t in trees] if copy_words else None,
                           constrain=constrain)
    report = evalb.parsing_report(outputs, gold, word_leaves=copy_words)
    return {**report, "outputs": outputs, "sources": [" ".join(t.words()) for t in gold],
            "gold": [str(t) for t in gold]}


def dev_scores(params, model_config: ModelConfig, tokenizer, data_config, batches, *,
               max_extra_len: int) -> dict[str, float]:
    """Greedy dev F1 of the training loop's periodic evaluation (on the batches' dev sentences)."""
    report = score_batches(params, model_config, tokenizer, data_config, "dev", batches, beam_size=1,
                           alpha=0.0, max_extra_len=max_extra_len)
    return {"dev_f1": report["f1"], "dev_repaired": report["repaired"],
            "dev_yield_mismatch": report["yield_mismatch"]}


def final_report(params, model_config: ModelConfig, tokenizer, data_config, batches, *, split: str,
                 beam_size: int, alpha: float, max_extra_len: int,
                 config_name: str = "") -> dict[str, Any]:
    """The end-of-training parsing scores on ``split``, as ``{split}_f1``, ``{split}_repaired``, ...

    Prints three decoded examples and the Table 4 comparison.
    """
    report = score_batches(params, model_config, tokenizer, data_config, split, batches,
                           beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len)
    for source, output, gold in list(zip(report["sources"], report["outputs"], report["gold"],
                                         strict=True))[:3]:
        print(f"  words:  {source}\n  output: {output}\n  gold:   {gold}")
    print(table4_comparison(config_name, data_config, split, report))
    return {f"{split}_{key}": report[key] for key in summary_keys()}


def summary_keys() -> tuple[str, ...]:
    """The numbers a parsing report returns (no per-sentence lists)."""
    return ("f1", "precision", "recall", "exact_match", "repaired", "yield_mismatch", "scored",
            "sentences", "errors", "skipped", "right_branching_f1")


def evaluate_restored(restored, params, batches, ppl: dict, *, split: str, average_last: int,
                      averaged_steps: list[int] | None = None, source_file: str | None,
                      beam_size: int, alpha: float,
                      max_extra_len: int) -> tuple[list[str], dict[str, Any], str]:
    """``workdir_scoring.evaluate_workdir`` for a parsing run: F1 and friends, and Table 4.

    Returns (the decoded trees, the numbers, the markdown table), for ``evaluate_workdir`` to write
    (repaired bracket strings are not written: the raw outputs are).

    Raises:
      ValueError: ``source_file`` is given (parsing is scored on the run's own split, which has gold
        trees).
    """
    if source_file:
        raise ValueError(f"--source_file={source_file!r}: a parsing run is scored on its own "
                         "split (which has gold trees); drop --source_file/--reference_file and use "
                         "--split=dev|test")
    run = restored.run
    report = score_batches(params, restored.model_config, restored.tokenizer, run.data, split,
                           batches, beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len)
    results = {"config": run.name, "task": "parsing", "split": split, "step": restored.step,
               "average_last": average_last, "averaged_steps": averaged_steps or [restored.step],
               "beam_size": beam_size, "alpha": alpha,
               "max_extra_len": max_extra_len, "ppl": ppl["ppl"], "nll": ppl["nll"],
               **{key: report[key] for key in summary_keys()},
               "num_sentences": report["sentences"], "error_messages": report["error_messages"],
               "labels": report["labels"]}
    return (report["outputs"], results,
            table4_comparison(run.name, run.data, split, report,
                              train_trees=len(data_lib.get_source(run.data).trees("train"))))


def is_paper_setup(data_config) -> bool:
    """Whether ``data_config`` is Table 4's data: WSJ sections 02-21 / 22 / 23 of the Penn Treebank."""
    return (data_config.source == "ptb"
            and all(str(getattr(data_config, f"ptb_{s}_files")).strip() == PAPER_SPLIT[s]
                    for s in PAPER_SPLIT))


def table4_comparison(config_name: str, data_config, split: str, report: dict,
                      train_trees: int | None = None) -> str:
    """Markdown: this run's F1, precision, recall, exact match, repairs and sentences beside the
    paper's Table 4 (the Transformer's 91.3 WSJ-only F1) and the right-branching baseline, then the
    whole of Table 4 and whether the numbers are comparable.

    Args:
      config_name: the run's ``config.name``.
      data_config: the run's ``config.data`` (its source and file ranges decide comparability).
      split: the scored split.
      report: ``evalb.parsing_report``'s keys (``f1`` ... ``right_branching_f1``).
      train_trees: how many training trees the run had, if known.
    """
    paper_f1 = paper.TABLE4_TRANSFORMER_F1["wsj_only"]
    comparable = is_paper_setup(data_config) and split == "test"
    f1_note = ("Transformer (4 layers), WSJ only; comparable: same data and split" if comparable
               else "Transformer (4 layers), WSJ only; NOT comparable (see below)")
    rows = [(name, _fmt(report.get(key)), f"{paper_f1}" if key == "f1" else _NONE,
             f1_note if key == "f1" else "") for key, name in REPORT_KEYS]
    rows += [
        ("right-branching baseline F1", _fmt(report.get("right_branching_f1")), _NONE,
         "same sentences, gold tags, scored the same way"),
        ("yield differs from the input", f"{report.get('yield_mismatch', 0):,} of "
         f"{report.get('sentences', 0):,}", _NONE, "outputs whose leaves are not the input words, "
         "before any repair (0 with constrained decoding)"),
        ("repaired outputs", f"{report.get('repaired', 0):,} of {report.get('sentences', 0):,}", _NONE,
         "malformed bracket sequences fixed deterministically before scoring"),
        ("sentences scored", f"{report.get('scored', 0):,}", f"{WSJ23_SENTENCES:,}",
         f"errors {report.get('errors', 0)}, skipped {report.get('skipped', 0)}; WSJ section 23"),
        ("training trees", _NONE if train_trees is None else f"{train_trees:,}",
         f"~{paper.PARSING_TRAIN_SENTENCES_WSJ_ONLY:,}", "WSJ sections 02-21"),
    ]
    lines = [f"**{config_name}** ({data_config.source}, split {split!r}) vs. the paper's Table 4 "
             "(WSJ section 23 F1)", ""]
    lines += _markdown(("metric", "this run", "paper", "note"), rows)
    if report.get("labels"):
        lines += ["", f"F1 per label (the {len(report['labels'])} most frequent gold labels):", ""]
        lines += _markdown(("label", "gold", "test", "matched", "P", "R", "F1"),
                           [(label, f"{c['gold']:,}", f"{c['test']:,}", f"{c['matched']:,}",
                             _fmt(c["precision"]), _fmt(c["recall"]), _fmt(c["f1"]))
                            for label, c in report["labels"].items()])
    lines += ["", "The paper's Table 4:", ""]
    lines += _markdown(("parser", "training", "WSJ 23 F1"),
                       [(row.parser, row.training, f"{row.wsj23_f1}") for row in paper.TABLE4])
    lines.append("")
    if comparable:
        lines.append(f"This run used the paper's data (WSJ {PAPER_SPLIT['train']} train, section "
                     f"{PAPER_SPLIT['test']} test): its F1 is comparable with {paper_f1}.")
    else:
        trained = f"{train_trees:,} trees" if train_trees is not None else "its own data"
        lines.append(
            f"Not comparable with {paper_f1}: this model was trained on {trained} "
            f"({data_config.source}), the paper's on WSJ sections {PAPER_SPLIT['train']} (about "
            f"{paper.PARSING_TRAIN_SENTENCES_WSJ_ONLY:,} trees) and tested on section "
            f"{PAPER_SPLIT['test']}. Compare it with the right-branching baseline above.")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return _NONE if value is None else f"{float(value):.2f}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    numeric = ("this run", "paper", "WSJ 23 F1", "gold", "test", "matched", "P", "R", "F1")
    align = ["---"] + ["---:" if h in numeric else "---" for h in header[1:]]
    return (["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows])
