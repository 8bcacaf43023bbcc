"""Scores a trained workdir against the paper: `python evaluate.py --workdir=DIR [options]`.

Restores the run's config, tokenizer and a checkpoint (or the average of the last N: by default the
run's final_average_last, as in its final report; the last line says which steps), then
reports per-subword perplexity, sacreBLEU (with its signature) and the paper's tokenized compound-split
BLEU, beside the paper's Table 2 (newstest2014) or Table 3 (newstest2013) row for the config.
Writes <output_dir>/<split or source file name>-<step>[-avg<N>].txt/.json and never replaces an earlier
result unless --overwrite. --by_length adds the score per bucket of source length (a table, the JSON's
by_length and <...>-by_length.png), the training length marked. All logic is in
transformer_jax.evaluation.scoring; a user error (bad flag, missing file, unwritable output folder) prints
two lines and exits 1 (TRANSFORMER_JAX_TRACEBACK=1 for more).
"""

import json

from absl import flags, logging

from transformer_jax.evaluation import by_length, ctranslate2_engine, paper, translation, workdir_scoring
from transformer_jax.runtime import compile_cache, errors, provenance

_WORKDIR = flags.DEFINE_string("workdir", "workdir", "A train.py workdir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest good one).")
_AVERAGE_LAST = flags.DEFINE_integer(
    "average_last", None,
    "Average the last N checkpoints up to --step (paper: 5 base, 20 big); 0 or 1: no averaging; "
    "default: the run config's final_average_last, as the training's final report averaged.")
_SPLIT = flags.DEFINE_enum("split", "test", ["dev", "test"],
                           "Split of the run's data config to score (test: newstest2014 for WMT).")
_SOURCE_FILE = flags.DEFINE_string(
    "source_file", None,
    "Score this source file (one sentence a line) instead of --split; needs --reference_file. "
    "Outputs are named after it (<output_dir>/<its base name>-<step>.txt/.json); newstest2014/2013 "
    "files are compared with the paper's Table 2/3 row. A line longer than the model can decode is "
    "an error naming the file and line.")
_REFERENCE_FILE = flags.DEFINE_string(
    "reference_file", None, "The references of --source_file, line-aligned with it.")
_BEAM_SIZE = flags.DEFINE_integer(
    "beam_size", None,
    f"Beam size; default: the run config's final_beam_size (paper: {paper.BEAM_SIZE} for "
    f"translation, {paper.PARSING_BEAM_SIZE} for parsing; 1 = greedy).")
_ALPHA = flags.DEFINE_float(
    "alpha", None,
    f"GNMT length penalty alpha; default: the run config's final_alpha (paper: "
    f"{paper.LENGTH_PENALTY_ALPHA} translation, {paper.PARSING_LENGTH_PENALTY_ALPHA} parsing).")
_MAX_EXTRA_LEN = flags.DEFINE_integer(
    "max_extra_len", None,
    f"Max output length = input length + this; default: the run config's final_max_extra_len "
    f"(paper: {paper.MAX_EXTRA_LEN} translation, {paper.PARSING_MAX_EXTRA_LEN} parsing).")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None,
    "Folder for the outputs (default: <workdir>/eval); checked for writing before anything is decoded, "
    "so a read-only workdir can be scored with --output_dir elsewhere.")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", compile_cache.DEFAULT_DIR, compile_cache.FLAG_HELP)
_ENGINE = flags.DEFINE_enum(
    "engine", "jax", list(translation.ENGINES),
    "Decoder: jax (the reference) or ctranslate2 (the averaged parameters exported to a temporary "
    "CTranslate2 model; needs pip install -e \".[serve]\"); outputs are named <...>-ctranslate2.")
_THREADS = flags.DEFINE_integer("threads", None, "--engine=ctranslate2: CPU threads (default: all cores).")
_QUANTIZATION = flags.DEFINE_enum(
    "quantization", None, list(ctranslate2_engine.QUANTIZATIONS),
    "--engine=ctranslate2: weight type; default: the export's (float32 below d_model 256, int8 from it).")
_ENSEMBLE = flags.DEFINE_list(
    "ensemble", [],
    "More workdirs (comma-separated) whose models decode together with --workdir's: the mean of their "
    "next-token distributions. Each is restored at its latest checkpoint with the same --average_last; "
    "the model shape and tokenizer must match. Outputs are named <...>-ens<M>.")
_BY_LENGTH = flags.DEFINE_bool(
    "by_length", False,
    "Also score each bucket of source length (tokens, EOS included): BLEU in the run's dev_bleu_protocol, "
    "or F1 for parsing. Prints a table that marks the buckets beyond the training length (data.max_len), "
    "adds them to the JSON as by_length, and draws <...>-by_length.png beside it.")
_LENGTH_BUCKETS = flags.DEFINE_list(
    "length_buckets", None,
    f"--by_length: the buckets' upper edges, increasing; the last bucket is open-ended (default "
    f"{','.join(map(str, by_length.DEFAULT_EDGES))}: 1-10, 11-20, ..., 61+).")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace an existing result of the same step and inputs (otherwise an error).")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # as train.py: warnings (e.g. skipped blank pairs), no info
    compile_cache.enable(_COMPILATION_CACHE_DIR.value)
    results = workdir_scoring.evaluate_workdir(
        _WORKDIR.value, step=_STEP.value, average_last=_AVERAGE_LAST.value, split=_SPLIT.value,
        source_file=_SOURCE_FILE.value, reference_file=_REFERENCE_FILE.value,
        beam_size=_BEAM_SIZE.value, alpha=_ALPHA.value, max_extra_len=_MAX_EXTRA_LEN.value,
        output_dir=_OUTPUT_DIR.value, overwrite=_OVERWRITE.value, engine=_ENGINE.value,
        threads=_THREADS.value, quantization=_QUANTIZATION.value, ensemble=tuple(_ENSEMBLE.value),
        by_length=_BY_LENGTH.value, length_buckets=_LENGTH_BUCKETS.value)
    table, length_table = results.pop("table"), results.pop("length_table", None)
    print(json.dumps(results, indent=1))
    print()
    print(table)
    print(f"scored on {provenance.describe(results['provenance'])}")
    print(f"trained on {provenance.describe(results['run_provenance'])}")
    if length_table:
        print(f"by source length ({by_length.LENGTH_UNIT}); plot: {results['by_length']['plot']}")
        print(length_table)
    print(_averaged_line(results["averaged_steps"], default=_AVERAGE_LAST.value is None))


def _averaged_line(steps: list[int], *, default: bool) -> str:
    """What was scored: one checkpoint, or the mean of which ones (and where the N came from)."""
    source = "the run's final_average_last" if default else "--average_last"
    if len(steps) == 1:
        return f"scored the checkpoint at step {steps[0]} (no averaging: {source} <= 1)"
    return (f"scored the mean of the {len(steps)} checkpoints at steps {', '.join(map(str, steps))} "
            f"({source}={len(steps)})")


if __name__ == "__main__":
    errors.run_main(main, keep_freed_memory=False,  # decoding: see runtime/host_memory.py
                    interrupted="no result was written (the outputs are written whole at the end). Run the "
                                "same command again to score it.")
