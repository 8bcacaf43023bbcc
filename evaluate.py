"""Scores a trained workdir against the paper: `python evaluate.py --workdir=DIR [options]`.

Restores the run's config, tokenizer and a checkpoint (optionally the average of the last N), then
reports per-subword perplexity, sacreBLEU (with its signature) and the paper's tokenized compound-split
BLEU, beside the paper's Table 2 (newstest2014) or Table 3 (newstest2013) row for the config.
All logic is in transformer_jax.evaluation.
"""

import json

from absl import app, flags

from transformer_jax import evaluation, paper

_WORKDIR = flags.DEFINE_string("workdir", "workdir", "A train.py workdir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest good one).")
_AVERAGE_LAST = flags.DEFINE_integer(
    "average_last", 0, "Average the last N checkpoints (paper: 5 base, 20 big).")
_SPLIT = flags.DEFINE_enum("split", "test", ["dev", "test"],
                           "Split of the run's data config to score (test: newstest2014 for WMT).")
_SOURCE_FILE = flags.DEFINE_string(
    "source_file", None,
    "Score this source file (one sentence a line) instead of --split; needs --reference_file. "
    "Outputs are named test-/dev- for newstest2014/2013 files, files- otherwise.")
_REFERENCE_FILE = flags.DEFINE_string(
    "reference_file", None, "The references of --source_file, line-aligned with it.")
_BEAM_SIZE = flags.DEFINE_integer(
    "beam_size", paper.BEAM_SIZE, f"Beam size (paper: {paper.BEAM_SIZE}; 1 = greedy).")
_ALPHA = flags.DEFINE_float(
    "alpha", paper.LENGTH_PENALTY_ALPHA,
    f"GNMT length penalty alpha (paper: {paper.LENGTH_PENALTY_ALPHA}).")
_MAX_EXTRA_LEN = flags.DEFINE_integer(
    "max_extra_len", paper.MAX_EXTRA_LEN,
    f"Max output length = input length + this (paper: {paper.MAX_EXTRA_LEN}).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    results = evaluation.evaluate_workdir(
        _WORKDIR.value, step=_STEP.value, average_last=_AVERAGE_LAST.value, split=_SPLIT.value,
        source_file=_SOURCE_FILE.value, reference_file=_REFERENCE_FILE.value,
        beam_size=_BEAM_SIZE.value, alpha=_ALPHA.value, max_extra_len=_MAX_EXTRA_LEN.value)
    table = results.pop("table")
    print(json.dumps(results, indent=1))
    print()
    print(table)


if __name__ == "__main__":
    app.run(main)
