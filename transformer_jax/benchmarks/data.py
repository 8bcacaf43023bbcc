"""Throughput of tokenize + batch on Multi30k train, on one core.

    python -m transformer_jax.benchmarks.data [--data_dir=data/multi30k]
        [--vocab_size=8000] [--workdir=DIR] [--repeats=3]

Trains (or loads from --workdir) the tokenizer first, untimed; then times, with SentencePiece on
one thread and the process pinned to one CPU, (1) encoding every train pair and (2) assembling
one full epoch of token-budget batches. Prints one JSON line per stage (best of --repeats).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from absl import flags

from transformer_jax.data.batching import TrainIterator, tokenize_pairs
from transformer_jax.data.config import default_data_config
from transformer_jax.data.sources import get_source
from transformer_jax.data.tokenizer import load_or_train_tokenizer
from transformer_jax.runtime import errors

# Where `python -m transformer_jax.data.prepare multi30k --dir=data/multi30k` puts it.
_DEFAULT_DIR = "data/multi30k"


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.data``."""
    flags.DEFINE_string("data_dir", _DEFAULT_DIR,
                        "Directory of the Multi30k text files (train.en, train.de, val.*, test.*).",
                        flag_values=flag_values)
    flags.DEFINE_integer("vocab_size", 8000, "Size of the shared SentencePiece vocabulary to train.",
                         flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "Where the tokenizer is cached (trained there if absent); "
                        "default: a temporary directory, so it is trained every run.",
                        flag_values=flag_values)
    flags.DEFINE_integer("tokens_per_batch", 4096, "Token budget of one batch (source and target tokens).",
                         flag_values=flag_values)
    flags.DEFINE_integer("repeats", 3, "Timed passes over the data; the best is reported.",
                         flag_values=flag_values)


def main(argv: list[str]) -> None:
    args = flags.FLAGS
    if not Path(args.data_dir).is_dir():
        raise FileNotFoundError(f"--data_dir={args.data_dir} is not a directory; pass the Multi30k text "
                                "directory, as `python -m transformer_jax.data.prepare multi30k "
                                "--dir=DIR` makes it")

    cfg = default_data_config(
        source="text",
        dir=args.data_dir,
        train_prefix="train",
        dev_prefix="val",
        test_prefix="test",
        src_lang="en",
        tgt_lang="de",
        vocab_size=args.vocab_size,
        max_len=256,
        tokens_per_batch=args.tokens_per_batch,
        length_buckets=(8, 16, 24, 32, 48, 64, 96, 128, 256),
    )
    tokenizer = load_or_train_tokenizer(cfg, args.workdir)  # not timed
    tokenizer.num_threads = 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    pairs = get_source(cfg).pairs("train")  # file reading is not part of the pipeline's cost

    best = {"tokenize": float("inf"), "batch": float("inf")}
    for _ in range(args.repeats):
        start = time.perf_counter()
        data = tokenize_pairs(pairs, tokenizer)
        mid = time.perf_counter()
        iterator = TrainIterator(
            data,
            length_buckets=cfg.length_buckets,
            tokens_per_batch=cfg.tokens_per_batch,
            seed=0,
        )
        for _ in range(iterator.batches_per_epoch):
            next(iterator)
        end = time.perf_counter()
        best["tokenize"] = min(best["tokenize"], mid - start)
        best["batch"] = min(best["batch"], end - mid)
    best["total"] = best["tokenize"] + best["batch"]
    num_tokens = int(data.src_ids.size + data.tgt_ids.size)  # EOS included, padding not
    for stage, seconds in best.items():
        print(
            json.dumps(
                {
                    "stage": stage,
                    "pairs": len(data),
                    "tokens": num_tokens,
                    "seconds": round(seconds, 4),
                    "pairs_per_s": round(len(data) / seconds),
                    "tokens_per_s": round(num_tokens / seconds),
                    "vocab_size": tokenizer.vocab_size,
                    "threads": 1,
                }
            )
        )


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
