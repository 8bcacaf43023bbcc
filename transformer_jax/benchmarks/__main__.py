"""The benchmark suite: matmul peak, train-step MFU, cached decoding, attention memory; JSON lines.

    python -m transformer_jax.benchmarks [--train_presets=tiny,base,big] [--decode_presets=tiny,base]
        [--skip_decode] [--skip_attention]

First the device's matmul peak (best and median of ``--peak_repeats``); every MFU after it divides by
the best run, and each record prints that peak beside its MFU. Then the train step per preset
(``train_step.py``), cached greedy and beam-4 decoding per preset (``decoding.py``) and dense vs
blockwise attention (``attention.py``). The presets are in ``presets.py``.
"""

from __future__ import annotations

import json

from absl import flags

from transformer_jax.benchmarks import attention, decoding, presets, train_step
from transformer_jax.runtime import errors, timing

_TRAIN_PRESETS = flags.DEFINE_list(
    "train_presets", list(presets.TRAIN_PRESETS),
    f"Comma-separated train-step presets, of {list(presets.TRAIN_PRESETS)} ('big' counts FLOPs only on "
    "a CPU).")
_DECODE_PRESETS = flags.DEFINE_list(
    "decode_presets", list(presets.DECODE_PRESETS),
    f"Comma-separated decoding presets (greedy and beam search, cache on), of "
    f"{list(presets.DECODE_PRESETS)}.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, train_step.DTYPES,
    "Compute dtype of the train step. Default: float32 on CPU, bfloat16 on an accelerator.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs per train step and decoding setting (median).")
_PEAK_REPEATS = flags.DEFINE_integer(
    "peak_repeats", 20, "Timed runs of the matmul peak; MFU divides by the best of them.")
_SKIP_TRAIN = flags.DEFINE_bool("skip_train", False, "Do not run the train-step benchmark.")
_SKIP_DECODE = flags.DEFINE_bool("skip_decode", False, "Do not run the decoding benchmark.")
_SKIP_ATTENTION = flags.DEFINE_bool("skip_attention", False, "Do not run the attention memory benchmark.")
_ATTENTION_LENGTHS = flags.DEFINE_list(
    "attention_lengths", [str(n) for n in attention.DEFAULT_LENGTHS],
    "Comma-separated sequence lengths of the attention benchmark.")


def main(argv: list[str]) -> None:
    train_names = presets.check_names(_TRAIN_PRESETS.value, presets.TRAIN_PRESETS, "--train_presets")
    decode_names = presets.check_names(_DECODE_PRESETS.value, presets.DECODE_PRESETS, "--decode_presets")
    lengths = attention.parse_lengths(_ATTENTION_LENGTHS.value)
    peak = timing.matmul_peak(_PEAK_REPEATS.value)
    print(json.dumps(peak.record()), flush=True)
    if not _SKIP_TRAIN.value:
        train_step.run(train_names, peak, dtype=_DTYPE.value or train_step.default_dtype(),
                       repeats=_REPEATS.value)
    if not _SKIP_DECODE.value:
        decoding.run(decode_names, peak, repeats=_REPEATS.value)
    if not _SKIP_ATTENTION.value:
        attention.run(lengths, block_size=512, skip_timing=False, max_dense_seconds=30.0)


if __name__ == "__main__":
    errors.run_main(main)
