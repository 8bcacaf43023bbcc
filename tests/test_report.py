"""Tests for transformer_jax.evaluation.paper_tables: the paper-comparison table."""

import importlib
import json

import pytest

from configs import table3
from transformer_jax.data.config import DataConfig
from transformer_jax.evaluation import bleu, paper, paper_tables
from transformer_jax.run_config import EvalConfig, RunConfig, run_config_from_saved
from transformer_jax.training import loop

RESULTS = {"tokenized_bleu": 26.91, "sacrebleu": 25.87, "ppl": 4.97, "step": 100_000, "num_sentences": 3003}


def _run(config_name: str, **overrides) -> RunConfig:
    """The RunConfig of the config file named ``config_name`` (a Table 3 row: configs/table3.py at the paper's
    scale, or at ``scale``), with ``{"section.field": value}`` overrides."""
    scale = overrides.pop("scale", "paper")
    if config_name.removeprefix("table3/") in paper.TABLE3_BY_NAME:
        config = table3.get_config(f"{config_name.removeprefix('table3/')},{scale}")
    else:
        config = importlib.import_module(f"configs.{config_name}").get_config()
    saved = json.loads(config.to_json_best_effort())
    for key, value in overrides.items():
        section, field = key.split(".")
        saved[section][field] = value
    return run_config_from_saved(saved)


def _table(config_name: str, split: str, results, **overrides) -> str:
    """``paper_comparison_table`` of a run of the config ``config_name`` (``_run``)."""
    run = _run(config_name if config_name != "table3/no-such-row" else "default", **overrides)
    return paper_tables.paper_comparison_table(config_name, split, results, run=run)


def _row(table: str, metric: str) -> list[str]:
    """The cells of the markdown row whose first cell starts with ``metric``."""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(metric):
            return cells
    raise AssertionError(f"no row {metric!r} in:\n{table}")


def test_en_de_base_test_uses_table2():
    table = _table("wmt14_en_de_base", "test", RESULTS)
    assert "Table 2" in table and "newstest2014" in table
    bleu_row = _row(table, "BLEU, tokenized")
    assert bleu_row[1:3] == ["26.91", "27.3"]
    assert "-0.39" in bleu_row[3]  # 26.91 - 27.3
    assert _row(table, "sacreBLEU")[1:3] == ["25.87", "—"]
    steps = _row(table, "training steps")
    assert steps[1:3] == ["100,000", "100,000"]
    assert " 5 " in steps[3]  # the base model averages the last 5 checkpoints (big: 20)
    assert "†" not in table  # the EN-FR flag does not leak into EN-DE


def test_en_de_base_dev_uses_table3():
    table = _table("wmt14_en_de_base", "dev", RESULTS)
    assert "Table 3" in table and "newstest2013" in table
    assert _row(table, "BLEU, tokenized")[1:3] == ["26.91", "25.8"]
    assert _row(table, "perplexity")[1:3] == ["4.97", "4.92"]
    assert "not the full set" in _row(table, "sentences")[3]  # newstest2013 has 3000 sentences


def test_en_fr_big_inconsistency_is_flagged():
    table = _table("wmt14_en_fr_big", "test", RESULTS)
    assert _row(table, "BLEU, tokenized")[2] == "41.8 †"
    flag = [line for line in table.splitlines() if line.startswith("†")]
    assert flag == [f"† Inconsistent paper figure: {paper.TABLE2['big'].note}"]
    assert "41.0" in flag[0]
    assert "32,000" in _row(table, "perplexity")[3]  # the EN-FR vocabulary, not EN-DE's 37,000
    assert _row(table, "training steps")[2] == "300,000"


def test_en_de_big():
    table = _table("wmt14_en_de_big", "test", RESULTS)
    assert _row(table, "BLEU, tokenized")[2] == "28.4"
    assert "†" not in table
    table = _table("wmt14_en_de_big", "dev", RESULTS)
    assert _row(table, "perplexity")[2] == "4.33"


@pytest.mark.parametrize("name", ["C-dmodel256", "table3/C-dmodel256"])
def test_table3_row_names_resolve(name):
    table = _table(name, "dev", RESULTS)
    assert "row 'C-dmodel256'" in table
    assert _row(table, "BLEU, tokenized")[2] == "24.5"
    assert _row(table, "perplexity")[2] == "5.75"


def test_every_table3_row_resolves_to_its_own_row():
    references = {row.name: paper_tables.paper_reference(f"table3/{row.name}", "dev") for row in paper.TABLE3}
    assert all(f"row {name!r}" in ref.source for name, ref in references.items())
    # 20 rows, 19 distinct figures: A-heads32 and B-dk32 both print PPL 5.01, BLEU 25.4.
    assert len({(ref.ppl, ref.bleu) for ref in references.values()}) == 19
    assert {name: ref.train_steps for name, ref in references.items()} == {
        row.name: 300_000 if row.name == "big" else 100_000 for row in paper.TABLE3}


def test_table3_base_and_big_map_to_table2_on_test():
    assert paper_tables.paper_reference("table3/base", "test").bleu == 27.3
    assert paper_tables.paper_reference("big", "test").bleu == 28.4
    assert paper_tables.paper_reference("C-dmodel256", "test") is None
    assert "use split 'dev'" in _table("C-dmodel256", "test", RESULTS)


@pytest.mark.parametrize("name, split", [("default", "test"), ("multi30k", "dev"), ("wmt14_en_fr_big", "dev"),
                                         ("table3/no-such-row", "dev")])
def test_no_paper_row(name, split):
    table = _table(name, split, RESULTS)
    assert "| paper |" in table and f"{name!r}" in table
    assert all(cells[2] == "—" for cells in (_row(table, m) for m in ("BLEU", "sacreBLEU", "perplexity")))
    assert _row(table, "BLEU, tokenized")[1:3] == ["26.91", "—"]
    assert _row(table, "sentences")[1] == "3,003"


def test_missing_results_and_bleu_result_objects():
    result = bleu.tokenized_bleu(["the cat sat on the mat"], ["the cat sat on the mat"], "en")
    table = _table("wmt14_en_de_base", "test", {"tokenized_bleu": result, "sacrebleu": result.to_dict()})
    assert _row(table, "BLEU, tokenized")[1] == "100.00"
    assert _row(table, "sacreBLEU")[1] == "100.00"
    assert _row(table, "training steps")[1] == "—"
    empty = _table("wmt14_en_de_base", "test", {})
    assert _row(empty, "BLEU, tokenized")[1:3] == ["—", "27.3"]


@pytest.mark.parametrize("overrides, named", [
    ({"model.position_encoding": "learned"}, "model.position_encoding='learned' (paper: 'sinusoidal')"),
    ({"model.position_encoding": "rotary"}, "model.position_encoding='rotary' (paper: 'sinusoidal')"),
    ({"model.position_encoding": "none"}, "model.position_encoding='none' (paper: 'sinusoidal')"),
    ({"model.ffn_activation": "swish"}, "model.ffn_activation='swish' (paper: 'relu')"),
    ({"model.position_encoding": "relative", "model.max_relative_position": 8},
     "model.position_encoding='relative' (paper: 'sinusoidal'); model.max_relative_position=8 (paper: "
     "none, its positions are 'sinusoidal')"),
    ({"train.num_steps": 1000}, "train.num_steps=1000 (paper: 100000)"),
    ({"model.dropout_rate": 0.2, "model.norm_style": "pre"},
     "model.dropout_rate=0.2 (paper: 0.1); model.norm_style='pre' (paper: 'post')"),
    ({"data.vocab_size": 8000, "model.attention_init": "narrow"},
     "model.attention_init='narrow' (paper: 'matrix'); data.vocab_size=8000 (paper: 37000)"),
])
@pytest.mark.parametrize("split", ["test", "dev"])
def test_a_run_that_is_not_the_papers_row_is_not_put_beside_it(overrides, named, split):
    """A paper config with overrides (another position scheme, fewer steps, another dropout...) is the
    paper's row in name only: the table says what differs and shows no paper figure."""
    table = _table("wmt14_en_de_base", split, RESULTS, **overrides)
    assert named in table and "not compared" in table, table
    cells = {cell.strip() for line in table.splitlines() if line.startswith("|") for cell in line.split("|")}
    assert not cells & {"27.3", "25.8", "4.92"}, table  # no figure of the paper's row
    assert all(_row(table, m)[2] == "—" for m in ("BLEU, tokenized", "perplexity"))
    assert _row(table, "BLEU, tokenized")[1] == "26.91"


def test_settings_that_change_how_not_what_keep_the_comparison():
    table = _table("wmt14_en_de_base", "test", RESULTS, **{
        "model.attention_impl": "blockwise", "model.dtype": "bfloat16", "data.max_len": 128,
        "train.grad_accum_steps": 2, "model.max_len": 400})
    assert _row(table, "BLEU, tokenized")[1:3] == ["26.91", "27.3"]
    # The relative tables' clip distance is read only by relative positions: the sinusoid's run is the row.
    table = _table("wmt14_en_de_base", "test", RESULTS, **{"model.max_relative_position": 8})
    assert _row(table, "BLEU, tokenized")[1:3] == ["26.91", "27.3"], table
    # EN-FR big is trained with P_drop 0.1 (section 6.1), not big's 0.3.
    assert _row(_table("wmt14_en_fr_big", "test", RESULTS), "BLEU, tokenized")[2] == "41.8 †"
    # A Table 3 row at a smaller scale is not the paper's row either.
    assert _row(_table("table3/C-dmodel256", "dev", RESULTS), "BLEU, tokenized")[2] == "24.5"
    small = _table("table3/C-dmodel256", "dev", RESULTS, scale="cpu")
    assert "model.d_model=32 (paper: 256)" in small and _row(small, "BLEU, tokenized")[2] == "—"


def test_unknown_split_raises():
    with pytest.raises(ValueError, match="split='valid'"):
        _table("wmt14_en_de_base", "valid", RESULTS)


def test_final_summary_puts_each_score_beside_its_yardstick():
    eval_config = EvalConfig(eval_every_steps=0, eval_bleu_examples=0, dev_bleu_protocol="multi30k",
                             final_eval_split="test", final_beam_size=4, final_alpha=0.6,
                             final_max_extra_len=50, final_average_last=5)
    data = DataConfig(source="text", src_lang="en", tgt_lang="de")
    final = {"step": 900, "averaged_checkpoints": 5, "test_sacrebleu": 33.333, "test_multi30k_bleu": 38.76,
             "test_ppl": 4.5, "dev_bleu": 37.0}
    table = paper_tables.final_summary(final, data, eval_config)
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in table.splitlines()
            if line.startswith("| ") and "measure" not in line}
    assert rows["BLEU, sacreBLEU (13a, cased)"][0].strip() == "33.33"
    multi30k = rows["BLEU, Multi30k convention (lowercased, Moses-tokenized)"]
    assert multi30k[0].strip() == "38.76" and "41.0" in multi30k[1]
    assert rows["dev BLEU (multi30k, greedy)"][0].strip() == "37.00"
    assert "BLEU, the paper's tokenized compound-split" not in rows  # absent numbers are left out
    assert "step 900" in table and "5 checkpoints" in table
    table = paper_tables.final_summary({"test_sacrebleu": 80.0, "test_sacrebleu_copy_baseline": 0.08,
                                        "test_sacrebleu_lexicon_baseline": 11.2},
                                       DataConfig(source="synthetic"), eval_config)
    assert "copy baseline 0.1" in table and "lexicon baseline 11.2" in table and "41.0" not in table


def test_a_final_report_on_dev_keeps_the_greedy_dev_f1_apart():
    eval_config = EvalConfig(eval_every_steps=0, eval_bleu_examples=0, dev_bleu_protocol="sacrebleu",
                             final_eval_split="dev", final_beam_size=4, final_alpha=2.0,
                             final_max_extra_len=300, final_average_last=1)
    final = {"step": 16000, "dev_f1": 78.62, "dev_f1_greedy": 76.5, "dev_right_branching_f1": 8.9}
    table = paper_tables.final_summary(final, DataConfig(source="ptb"), eval_config)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()
            if line.startswith("| ") and "measure" not in line}
    assert rows["bracket F1 (EVALB, COLLINS.prm)"] == "78.62" and rows["dev F1 (greedy)"] == "76.50"
    merged = loop.merge_final_report({"step": 5, "dev_f1": 76.5, "dev_ppl": 1.4}, {"dev_f1": 78.62})
    assert merged == {"step": 5, "dev_f1": 78.62, "dev_f1_greedy": 76.5, "dev_ppl": 1.4}
    assert loop.merge_final_report({"dev_f1": 76.5}, {"test_f1": 75.0}) == {"dev_f1": 76.5, "test_f1": 75.0}
