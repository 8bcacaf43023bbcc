"""Translates raw text with a trained workdir.

    python -m transformer_jax.translate --workdir=DIR [--average_last=N] [--beam_size=K] < in.txt > out.txt
    python -m transformer_jax.translate --workdir=DIR --engine=ctranslate2 [--threads=N] < in.txt > out.txt
    python -m transformer_jax.translate --workdir=DIR --score --references=ref.txt < in.txt > scores.txt

One sentence a line from stdin (or --input); the detokenized translations, one a line in the input
order, go to stdout (or --output). An empty line gives an empty line. A line too long for the model is
an error naming it, unless --truncate. Sentences are sorted by length and batched by a token budget
internally; a progress bar goes to stderr when the input is a file. The logic is in
transformer_jax.evaluation.workdir_scoring (evaluate.py's driver: the same restore, averaging and
decoding path); a user error prints two lines and exits 1.

With --score nothing is searched: each source line and the same line of --references are scored, one
line a pair: the log-probability (natural log) of the whole reference, a tab, then that of each of its
SentencePiece tokens and of the EOS after them, given the source and the tokens before (teacher forcing;
``evaluation.reference_scores``).
"""

import json
import sys

from absl import flags, logging

from transformer_jax.evaluation import translation, workdir_scoring
from transformer_jax.runtime import compile_cache, errors

_WORKDIR = flags.DEFINE_string("workdir", "workdir", "A train.py workdir.")
_INPUT = flags.DEFINE_string("input", None, "Source text, one sentence a line (default: stdin).")
_OUTPUT = flags.DEFINE_string("output", None, "Where the translations go (default: stdout).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest good one).")
_AVERAGE_LAST = flags.DEFINE_integer(
    "average_last", None, "Average the last N checkpoints up to --step; 0 or 1: no averaging; default: "
    "the run config's final_average_last, as its final report and evaluate.py average.")
_BEAM_SIZE = flags.DEFINE_integer(
    "beam_size", None, "Beam size (1 = greedy); default: the run config's final_beam_size.")
_ALPHA = flags.DEFINE_float(
    "alpha", None, "GNMT length penalty alpha; default: the run config's final_alpha.")
_MAX_EXTRA_LEN = flags.DEFINE_integer(
    "max_extra_len", None,
    "Max output length = input length + this; default: the run config's final_max_extra_len.")
_TRUNCATE = flags.DEFINE_bool(
    "truncate", False, "Cut a line too long for the model to the longest it can take, instead of an error.")
_TOKENS_PER_BATCH = flags.DEFINE_integer(
    "tokens_per_batch", None,
    "Decoding batch budget: beams x sentences x (padded source length + max_extra_len); default: "
    "a 768 MiB self-attention cache (docs/benchmarks.md gives the Multi30k model's figure).")
_PROGRESS = flags.DEFINE_bool(
    "progress", None, "Show a progress bar on stderr (default: when the input is a file).")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", compile_cache.DEFAULT_DIR, compile_cache.FLAG_HELP)
_ENGINE = flags.DEFINE_enum(
    "engine", "jax", list(translation.ENGINES),
    "jax: this codebase's decoder, the reference; ctranslate2: the workdir's CTranslate2 export (made "
    "first when missing; python -m transformer_jax.export), needs pip install -e \".[serve]\".")
_THREADS = flags.DEFINE_integer(
    "threads", None, "--engine=ctranslate2: CPU threads (default: CTranslate2's, all cores).")
_EXPORT_DIR = flags.DEFINE_string(
    "export_dir", None, "--engine=ctranslate2: the export to decode with (default: "
    "<workdir>/export/ctranslate2).")
_SCORE = flags.DEFINE_bool(
    "score", False, "Score the --references instead of translating: one line a pair, the reference's "
    "log-probability, a tab, then each of its tokens' and EOS's (natural log).")
_REFERENCES = flags.DEFINE_string(
    "references", None, "--score: the translations to score, one a line, beside the source lines.")
_STATS = flags.DEFINE_bool(
    "stats", False, "Print sentences/s and target tokens/s as one JSON line on stderr.")


def main(argv):
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable(_COMPILATION_CACHE_DIR.value)
    if _SCORE.value:
        stats = _score()
    else:
        if _REFERENCES.value is not None:
            raise errors.ConfigError("--references applies to --score; add --score to score them, or leave "
                                     "--references out to translate")
        stats = _translate()
    if _STATS.value:
        print(json.dumps(stats), file=sys.stderr)


def _score() -> dict:
    for flag in (_BEAM_SIZE, _ALPHA, _MAX_EXTRA_LEN, _TRUNCATE):
        if flag.present:
            raise errors.ConfigError(f"--{flag.name} sets the search; --score searches nothing (it scores "
                                     "the given references): leave it out")
    if _REFERENCES.value is None:
        raise errors.ConfigError("--score needs --references=FILE: the translations to score, one a line "
                                 "beside the source lines")
    return workdir_scoring.score_workdir(
        _WORKDIR.value, references_path=_REFERENCES.value, input_path=_INPUT.value, output_path=_OUTPUT.value,
        step=_STEP.value, average_last=_AVERAGE_LAST.value, tokens_per_batch=_TOKENS_PER_BATCH.value,
        show_progress=_PROGRESS.value, engine=_ENGINE.value, threads=_THREADS.value,
        export_dir=_EXPORT_DIR.value)


def _translate() -> dict:
    return workdir_scoring.translate_workdir(
        _WORKDIR.value, input_path=_INPUT.value, output_path=_OUTPUT.value, step=_STEP.value,
        average_last=_AVERAGE_LAST.value, beam_size=_BEAM_SIZE.value, alpha=_ALPHA.value,
        max_extra_len=_MAX_EXTRA_LEN.value, truncate=_TRUNCATE.value,
        tokens_per_batch=_TOKENS_PER_BATCH.value, show_progress=_PROGRESS.value, engine=_ENGINE.value,
        threads=_THREADS.value, export_dir=_EXPORT_DIR.value)


if __name__ == "__main__":
    errors.run_main(main, keep_freed_memory=False,  # decoding: see runtime/host_memory.py
                    interrupted="nothing was written (the output is written whole at the end). Run the "
                                "same command again to translate.")
