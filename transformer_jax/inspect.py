"""Attention maps, head statistics and the paper's explanations as experiments, for a trained workdir.

    python -m transformer_jax.inspect --workdir DIR --sentence "The old teacher saw a red car." [--out OUT]

Writes PNGs, tables, ``index.html`` (open it in a browser; works offline) and ``summary.md`` into the
output folder and prints the summary. All logic is in ``transformer_jax.inspect_lib``.

(This module shadows nothing: it is ``transformer_jax.inspect``; the package imports the standard
library's ``inspect`` by its absolute name. Run it with ``python -m``, not as a script path.)
"""

from __future__ import annotations

import argparse

from transformer_jax import inspect_lib


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m transformer_jax.inspect",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a train.py workdir (checkpoints, tokenizer)")
    parser.add_argument("--sentence", required=True, help="source sentence whose attention maps to draw")
    parser.add_argument("--out", default=None, help="output folder (default: WORKDIR/inspect)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest good)")
    parser.add_argument("--num_dev", type=int, default=200, help="dev sentences for statistics/ablation")
    parser.add_argument("--d_ks", type=_ints, default=inspect_lib.DEFAULT_D_KS,
                        help="comma-separated d_k values of the random scaling experiment")
    parser.add_argument("--lengths", type=_ints, default=inspect_lib.DEFAULT_LENGTHS,
                        help="comma-separated sequence lengths of the cost experiment")
    parser.add_argument("--block_size", type=int, default=128, help="blockwise attention tile")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    parser.add_argument("--max_extra_len", type=int, default=50,
                        help="greedy decoding may output up to input length + this many tokens")
    parser.add_argument("--skip_ablation", action="store_true", help="no head ablation")
    parser.add_argument("--skip_benchmark", action="store_true", help="no FLOP/time measurement")
    args = parser.parse_args(argv)
    options = inspect_lib.InspectOptions(
        num_dev=args.num_dev, d_ks=args.d_ks, lengths=args.lengths, block_size=args.block_size,
        repeats=args.repeats, max_extra_len=args.max_extra_len, ablation=not args.skip_ablation,
        benchmark=not args.skip_benchmark)
    results = inspect_lib.run(args.workdir, args.sentence, args.out, step=args.step, options=options)
    print(results["summary"])
    print(f"\nOpen {results['out_dir']}/index.html")


if __name__ == "__main__":
    main()
