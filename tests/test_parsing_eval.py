"""Parsing evaluation (transformer_jax/evaluation/parsing.py): decoding through translation's path, the
report, end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny import config_with, random_params

from transformer_jax import run_config
from transformer_jax.data import (
    EvalBatch,
    default_data_config,
    eval_batches,
    get_source,
    load_or_train_tokenizer,
)
from transformer_jax.evaluation import decode, paper, parsing, translation, tree_constraints
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def treebank(tmp_path_factory):
    """(data config, its tokenizer, model config, params): the synthetic treebank with the words as leaves,
    and the one random tiny model over its vocabulary that every decoding test here uses (its max_len
    holds the paper's input + 300 for a 64-token source)."""
    data = default_data_config(source="synthetic_trees", synthetic_train_size=300, synthetic_dev_size=5,
                               synthetic_test_size=7, vocab_size=150, tree_leaves="words")
    tokenizer = load_or_train_tokenizer(data, str(tmp_path_factory.mktemp("tokenizer")))
    config = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, d_ff=24, num_heads=2,
                         num_encoder_layers=1, num_decoder_layers=1,
                         max_len=64 + paper.PARSING_MAX_EXTRA_LEN, dropout_rate=0.0)
    return data, tokenizer, config, random_params(config, seed=3)


class _IdsTokenizer:
    """Decodes ids as space-joined numbers up to EOS (so outputs can be compared exactly)."""

    def decode_batch(self, rows):
        rows = [list(np.asarray(row)) for row in rows]
        return [" ".join(str(i) for i in row[: row.index(1)] if i != PAD_ID) if 1 in row
                else " ".join(str(i) for i in row if i != PAD_ID) for row in rows]


def _batches(sources, padded_len, batch_size):
    """EvalBatches over `sources` (lists of ids without EOS), padded to `padded_len`, in a shuffled
    split order, as make_eval_batches buckets a parsing split (sources padded to target lengths)."""
    order = np.random.default_rng(5).permutation(len(sources))
    batches = []
    for start in range(0, len(order), batch_size):
        real = order[start:start + batch_size]
        inputs = np.full((batch_size, padded_len), PAD_ID, np.int32)
        for row, i in enumerate(real):
            inputs[row, : len(sources[i]) + 1] = [*sources[i], 1]  # EOS = 1
        batches.append(EvalBatch(inputs, inputs.copy(), [""] * len(real), [""] * len(real), real,
                                 len(real)))
    return batches


@pytest.mark.parametrize("beam_size", [1, 3])
def test_decode_split_matches_one_sentence_at_a_time(treebank, beam_size):
    """Re-batching by source length (two padded lengths) and restoring the split order give what decoding
    each sentence alone gives."""
    _, _, config, params = treebank
    rng = np.random.default_rng(0)
    sources = [list(rng.integers(4, 37, size=n)) for n in (3, 14, 5, 11, 9, 4, 12)]
    batches = _batches(sources, padded_len=40, batch_size=3)
    budget = beam_size * 64  # beams x sentences x (padded length + 13): 3 sentences at length 8, 2 at 16
    got = parsing.decode_split(params, config, _IdsTokenizer(), batches, beam_size=beam_size,
                               alpha=0.3, max_extra_len=13, tokens_per_batch=budget)
    _, sizes = translation.decode_buckets(15, translation.Settings(beam_size, 0.3, 13), budget)
    assert sizes == [3, 2]  # batches (3 x 8), (2 x 16), (2 x 16)
    want = []
    for ids in sources:  # each alone (in both rows of the split's (2 x 16) program; limits use ids)
        inputs = np.full((2, 16), PAD_ID, np.int32)
        inputs[:, : len(ids) + 1] = [*ids, 1]
        if beam_size == 1:
            tokens = decode.greedy_search(params, config, inputs, max_extra_len=13)
        else:
            tokens, _ = decode.beam_search(params, config, inputs, beam_size=beam_size, alpha=0.3,
                                           max_extra_len=13)
        want.append(_IdsTokenizer().decode_batch(tokens)[0])
    assert got == want
    assert all(len(w.split()) <= len(s) + 1 + 13 for w, s in zip(want, sources, strict=True))


def test_beam21_with_input_plus_300_fits_the_cache_budget(treebank):
    """The paper's parsing decoding (beam 21, input + 300) on sample-length sentences: every batch's
    cache stays within the budget, and outputs respect the length limit."""
    _, _, config, params = treebank
    rng = np.random.default_rng(1)
    lengths = (61, 47, 40, 54)  # WSJ sample sentences: 24 words on average, 54 at most in test
    sources = [list(rng.integers(4, 37, size=n)) for n in lengths]
    batches = _batches(sources, padded_len=64, batch_size=3)
    settings = translation.Settings(paper.PARSING_BEAM_SIZE, paper.PARSING_LENGTH_PENALTY_ALPHA,
                                    paper.PARSING_MAX_EXTRA_LEN)
    budget = 2 * 21 * (64 + 300)
    buckets, sizes = translation.decode_buckets(62, settings, budget, config.max_len - 300)
    assert buckets == [32, 64] and sizes == [2, 2]  # the budget forces batches: two of two sentences
    assert all(21 * rows * (length + 300) <= budget for length, rows in zip(buckets, sizes, strict=True))
    outputs = parsing.decode_split(
        params, config, _IdsTokenizer(), batches, beam_size=paper.PARSING_BEAM_SIZE,
        alpha=paper.PARSING_LENGTH_PENALTY_ALPHA, max_extra_len=paper.PARSING_MAX_EXTRA_LEN,
        tokens_per_batch=budget)
    assert len(outputs) == 4
    for output, n in zip(outputs, lengths, strict=True):
        assert len(output.split()) <= n + 1 + paper.PARSING_MAX_EXTRA_LEN


@pytest.mark.parametrize("beam_size", [1, 3])
def test_constrained_outputs_do_not_depend_on_the_budget(treebank, beam_size):
    """With the tree constraint (the words as leaves), outputs under two budgets (one batch; batches of
    one or two sentences) equal each other and the constrained search over one batch of every sentence."""
    data, tokenizer, config, params = treebank
    words = [t.words() for t in get_source(data).trees("test")]
    sources = [tokenizer.encode(" ".join(w)) for w in words]
    batches = _batches(sources, padded_len=max(map(len, sources)) + 1, batch_size=4)
    settings = dict(beam_size=beam_size, alpha=0.3, max_extra_len=20, words=words)
    small = parsing.decode_split(params, config, tokenizer, batches,
                                 tokens_per_batch=2 * beam_size * 28, **settings)
    large = parsing.decode_split(params, config, tokenizer, batches, **settings)
    # One batch of every sentence, padded to the rows of the one batch the large budget makes (one program).
    inputs = _batches(sources, padded_len=max(map(len, sources)) + 1,
                      batch_size=eval_batches.padded_rows(len(sources)))[0]
    order = np.argsort(inputs.indices)
    constraint = tree_constraints.TreeConstraint.from_tokenizer(tokenizer)
    if beam_size == 1:
        tokens = decode.greedy_search(params, config, inputs.inputs, max_extra_len=20, constraint=constraint)
    else:
        tokens, _ = decode.beam_search(params, config, inputs.inputs, beam_size=beam_size, alpha=0.3,
                                       max_extra_len=20, constraint=constraint)
    tokens = np.asarray(tokens)
    want = [" ".join(tree_constraints.output_tokens(tokens[r], tokenizer, inputs.inputs[r], words[i]))
            for r, i in ((r, int(inputs.indices[r])) for r in order)]
    assert small == large == want
    settings = translation.Settings(beam_size, 0.3, 20)
    _, sizes = translation.decode_buckets(max(map(len, sources)) + 1, settings, 2 * beam_size * 28)
    assert max(sizes) <= 2 < len(sources)  # the small budget decodes in many batches


def _report(**overrides):
    return {"f1": 81.234, "precision": 80.0, "recall": 82.5, "exact_match": 20.0, "repaired": 3,
            "yield_mismatch": 0, "sentences": 245, "scored": 245, "errors": 0, "skipped": 0,
            "right_branching_f1": 17.5, **overrides}


def test_table4_comparison_sample_is_not_comparable():
    data = default_data_config(source="ptb", dir="x", ptb_train_files="0001-0159",
                               ptb_dev_files="0160-0179", ptb_test_files="0180-0199")
    table = parsing.table4_comparison("ptb_sample", data, "test", _report(), train_trees=3396)
    assert "| F1 (EVALB, COLLINS.prm) | 81.23 | 91.3 |" in table
    assert "| right-branching baseline F1 | 17.50 |" in table
    assert "| repaired outputs | 3 of 245 |" in table
    assert "| yield differs from the input | 0 of 245 |" in table
    assert "| sentences scored | 245 | 2,416 |" in table
    assert "Not comparable with 91.3: this model was trained on 3,396 trees" in table
    for row in paper.TABLE4:  # the whole of Table 4 is printed
        assert f"| {row.parser} | {row.training} | {row.wsj23_f1} |" in table


def test_table4_comparison_prints_f1_per_label():
    data = default_data_config(source="ptb", dir="x")
    labels = {"NP": {"gold": 1200, "test": 1100, "matched": 1000, "precision": 90.909, "recall": 83.333,
                     "f1": 86.957}}
    table = parsing.table4_comparison("wsj_parsing", data, "test", _report(labels=labels))
    assert "F1 per label (the 1 most frequent gold labels):" in table
    assert "| NP | 1,200 | 1,100 | 1,000 | 90.91 | 83.33 | 86.96 |" in table


def test_table4_comparison_wsj_setup_is_comparable():
    data = default_data_config(source="ptb", dir="x")  # 02-21 / 22 / 23
    assert parsing.is_paper_setup(data)
    table = parsing.table4_comparison("wsj_parsing", data, "test", _report())
    assert "comparable with 91.3" in table and "Not comparable" not in table
    dev = parsing.table4_comparison("wsj_parsing", data, "dev", _report())
    assert "Not comparable" in dev  # section 22 is not Table 4's test set


TINY_PARSING = {
    "data.source": "synthetic_trees", "data.synthetic_train_size": 300, "data.synthetic_dev_size": 6,
    "data.synthetic_test_size": 9, "data.vocab_size": 120, "data.max_len": 128,
    "data.tokens_per_batch": 1024, "data.length_buckets": (128,),  # one compiled training program
    "model.d_model": 16, "model.d_ff": 24, "model.num_heads": 2, "model.num_encoder_layers": 1,
    "model.num_decoder_layers": 1, "model.max_len": 128 + 40,
    "train.num_steps": 4, "train.warmup_steps": 2, "log_every_steps": 2, "eval_every_steps": 2,
    "eval_bleu_examples": 3, "checkpoint_every_steps": 4, "checkpoint_every_minutes": 0.0,
    "final_eval_split": "test", "final_beam_size": 3, "final_alpha": 0.3,
    "final_max_extra_len": 40,  # the paper's 300 works too; 40 keeps an untrained model's loops short
}


@pytest.mark.slow
def test_synthetic_trees_train_final_report_and_evaluate_py(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    final = loop.train_and_evaluate(run_config.build_run_config(config_with(TINY_PARSING)), workdir)
    printed = capsys.readouterr().out
    for key in ("test_f1", "test_precision", "test_recall", "test_exact_match",
                "test_right_branching_f1", "test_ppl", "dev_f1"):
        assert 0.0 <= final[key] <= (100.0 if key != "test_ppl" else np.inf), key
    assert final["test_sentences"] == final["test_scored"] == 9  # repair aligns every output
    assert 0 <= final["test_repaired"] <= 9
    assert "test_sacrebleu" not in final
    assert "Not comparable with 91.3" in printed
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert any("dev_f1" in row for row in rows)

    result = subprocess.run([sys.executable, os.path.join(REPO, "evaluate.py"), f"--workdir={workdir}",
                             "--split=dev"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.load(open(os.path.join(workdir, "eval", "dev-4.json")))
    assert numbers["task"] == "parsing" and numbers["num_sentences"] == numbers["scored"] == 6
    assert (numbers["beam_size"], numbers["alpha"], numbers["max_extra_len"]) == (3, 0.3, 40)
    for key in ("f1", "precision", "recall", "exact_match", "repaired", "right_branching_f1"):
        assert key in numbers
    assert "| F1 (EVALB, COLLINS.prm) |" in result.stdout and "Not comparable with 91.3" in result.stdout
    outputs = open(os.path.join(workdir, "eval", "dev-4.txt")).read().splitlines()
    assert len(outputs) == 6
