"""Exports a trained workdir to an inference engine's format.

    python -m transformer_jax.export --workdir=DIR [--format=ctranslate2] [--out=DIR] [--quantization=Q]

Averages the same checkpoints as ``translate`` (the run's final_average_last, or --average_last up to
--step) and writes a CTranslate2 model (default: <workdir>/export/ctranslate2), the tokenizer and
export.json (step, averaged steps, config hash, decoding defaults). ``translate --engine=ctranslate2``
decodes with it. Needs the ``serve`` extra: pip install -e ".[serve]". The logic is in
transformer_jax.evaluation.ctranslate2_engine; a user error prints two lines and exits 1.
"""

import os

from absl import flags, logging

from transformer_jax.evaluation import ctranslate2_engine
from transformer_jax.runtime import errors

_WORKDIR = flags.DEFINE_string("workdir", "workdir", "A train.py workdir.")
_FORMAT = flags.DEFINE_enum("format", "ctranslate2", ["ctranslate2"], "The engine to export to.")
_OUT = flags.DEFINE_string("out", None, "The export folder (default: <workdir>/export/ctranslate2); "
                           "an earlier export there is replaced whole.")
_QUANTIZATION = flags.DEFINE_enum(
    "quantization", None, list(ctranslate2_engine.QUANTIZATIONS),
    "Weight type; default: the fastest measured on a CPU at the model's width (float32 below d_model "
    "256, int8 from it; docs/translation.md).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest good one).")
_AVERAGE_LAST = flags.DEFINE_integer(
    "average_last", None, "Average the last N checkpoints up to --step; 0 or 1: no averaging; default: "
    "the run config's final_average_last.")


def main(argv):
    logging.set_verbosity(logging.WARNING)
    record = ctranslate2_engine.export_workdir(
        _WORKDIR.value, out_dir=_OUT.value, quantization=_QUANTIZATION.value, step=_STEP.value,
        average_last=_AVERAGE_LAST.value)
    out_dir = _OUT.value or ctranslate2_engine.default_export_dir(_WORKDIR.value)
    size = sum(os.path.getsize(os.path.join(out_dir, name)) for name in os.listdir(out_dir))
    steps = record["averaged_steps"]
    which = (f"step {steps[0]}" if len(steps) == 1
             else f"the mean of steps {', '.join(map(str, steps))}")
    print(f"exported {which} as {record['quantization']} to {out_dir} ({size / 2**20:.1f} MiB); translate "
          f"with: python -m transformer_jax.translate --workdir={_WORKDIR.value} --engine=ctranslate2"
          + (f" --export_dir={_OUT.value}" if _OUT.value else ""))


if __name__ == "__main__":
    errors.run_main(main)
