"""Attention maps, head statistics and the paper's explanations as experiments, for a trained workdir.

    python -m transformer_jax.inspect --workdir DIR --sentence "The old teacher saw a red car." [--out OUT]

Writes PNGs, tables, index.html (open it in a browser; works offline) and summary.md into the output
folder and prints the summary. All logic is in transformer_jax.inspect.run_all and its sibling modules.
"""

from __future__ import annotations

from absl import flags, logging

from transformer_jax.evaluation import paper
from transformer_jax.inspect import run_all
from transformer_jax.runtime import errors

_DEFAULTS = run_all.InspectOptions()

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir (its checkpoints, tokenizer and config).")
_SENTENCE = flags.DEFINE_string(
    "sentence", None, "Source sentence whose attention maps are drawn; it is greedy-decoded first and the "
    "decoder maps follow that output.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: WORKDIR/inspect).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to inspect (default: the latest good one).")
_NUM_DEV = flags.DEFINE_integer(
    "num_dev", _DEFAULTS.num_dev, "Dev sentences for the head statistics, the model half of the scaling "
    "experiment, the ablation and the alignment.", lower_bound=1)
_D_KS = flags.DEFINE_list(
    "d_ks", [str(d) for d in _DEFAULTS.d_ks], "Comma-separated d_k values of the random-q/k scaling "
    "experiment (entropy with and without 1/sqrt(d_k)).")
_LENGTHS = flags.DEFINE_list(
    "lengths", [str(n) for n in _DEFAULTS.lengths], "Comma-separated sequence lengths n of the Table 1 "
    "cost experiment (FLOPs and time of one self-attention layer).")
_BLOCK_SIZE = flags.DEFINE_integer(
    "block_size", _DEFAULTS.block_size, "Blockwise-attention tile (queries and keys) in the cost experiment.",
    lower_bound=1)
_REPEATS = flags.DEFINE_integer(
    "repeats", _DEFAULTS.repeats, "Timing repeats per length in the cost experiment (the median is "
    "reported).", lower_bound=1)
_MAX_EXTRA_LEN = flags.DEFINE_integer(
    "max_extra_len", _DEFAULTS.max_extra_len, "Greedy decoding of --sentence may output up to its input "
    f"length + this many tokens (the paper's limit: +{paper.MAX_EXTRA_LEN}).", lower_bound=0)
_SKIP_ABLATION = flags.DEFINE_bool(
    "skip_ablation", False, "Leave out the head ablation (one dev pass per head; the slowest part).")
_SKIP_BENCHMARK = flags.DEFINE_bool("skip_benchmark", False, "Leave out the FLOP and timing measurement.")

flags.mark_flags_as_required(["workdir", "sentence"])


def _positive_ints(values: list[str]) -> bool:
    return bool(values) and all(v.strip().isdigit() and int(v) > 0 for v in values)


for _name in ("d_ks", "lengths"):
    flags.register_validator(_name, _positive_ints,
                             message=f"--{_name} must be comma-separated positive integers, like 16,64")


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # as train.py and evaluate.py: warnings, no orbax info lines
    if not _SENTENCE.value.split():  # before the restore: fail in a second
        raise errors.ConfigError("--sentence is empty; pass the source sentence whose attention maps to draw")
    options = run_all.InspectOptions(
        num_dev=_NUM_DEV.value, d_ks=tuple(int(d) for d in _D_KS.value),
        lengths=tuple(int(n) for n in _LENGTHS.value), block_size=_BLOCK_SIZE.value,
        repeats=_REPEATS.value, max_extra_len=_MAX_EXTRA_LEN.value, ablation=not _SKIP_ABLATION.value,
        benchmark=not _SKIP_BENCHMARK.value)
    results = run_all.run(_WORKDIR.value, _SENTENCE.value, _OUT.value, step=_STEP.value, options=options)
    print(results["summary"])
    print(f"\nOpen {results['out_dir']}/index.html")


if __name__ == "__main__":
    errors.run_main(main)
