"""Decoding throughput: greedy and beam search, with and without the key/value cache.

    python -m transformer_jax.decode_benchmark [--new_tokens 32 128] [--repeats 3] [--no_uncached]

A randomly initialized CPU-sized model (vocab 8000, d_model 256, d_ff 1024, 4 heads, 3+3 layers)
decodes 16 random sources of 32 tokens. EOS is banned (``min_len``) and ``max_len`` is set so that
every sequence gets exactly N new tokens. Each setting is first compiled and run with a one-token limit
(``max_extra_len`` is traced, so the same executable serves the timed runs), then timed ``--repeats``
times (``--uncached_repeats`` without the cache: those take minutes); one JSON line per setting reports
the median seconds and generated tokens/s = batch * N / seconds (for beam search, the best beam's).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import numpy as np

from transformer_jax import decode
from transformer_jax.model import ModelConfig, init_params


def _time(search, inputs: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(compile seconds, median seconds of ``repeats`` runs) of ``search(inputs, max_extra_len=new_tokens)``.

    The untimed first call has the same shapes but sources of one token and ``max_extra_len=0``: it
    compiles the executable the timed calls use, and its loop stops after one step.
    """
    one_token = np.where(np.arange(inputs.shape[1]) == 0, inputs, 0).astype(np.int32)  # [B, S]
    start = time.perf_counter()
    jax.block_until_ready(search(one_token, max_extra_len=0))
    compile_seconds = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(search(inputs, max_extra_len=new_tokens))
        times.append(time.perf_counter() - start)
    return compile_seconds, statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--src_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uncached_repeats", type=int, default=1)
    parser.add_argument("--no_uncached", action="store_true", help="skip the slow cache-off runs")
    parser.add_argument("--only", choices=["greedy", "beam"], default=None)
    args = parser.parse_args(argv)

    config = ModelConfig(vocab_size=8000, d_model=256, d_ff=1024, num_heads=4, num_encoder_layers=3,
                         num_decoder_layers=3, max_len=max(args.new_tokens + [args.src_len]),
                         deterministic=True)
    params = init_params(config, rng=jax.random.key(0))
    rng = np.random.default_rng(0)
    # Sources shorter than the output, so max_len = N is the length limit of every example.
    inputs = rng.integers(4, config.vocab_size, size=(args.batch, args.src_len)).astype(np.int32)

    searches = {
        "greedy": lambda n, cache, src, **kw: decode.greedy_search(
            params, config, src, max_len=n, min_len=n, use_cache=cache, **kw),
        "beam": lambda n, cache, src, **kw: decode.beam_search(
            params, config, src, beam_size=args.beam_size, max_len=n, min_len=n, use_cache=cache,
            **kw)[0],
    }
    for n in args.new_tokens:
        for name, search in searches.items():
            if args.only not in (None, name):
                continue
            for use_cache in (True,) if args.no_uncached else (True, False):
                compile_seconds, seconds = _time(
                    functools.partial(search, n, use_cache), inputs, n,
                    args.repeats if use_cache else args.uncached_repeats)
                print(json.dumps({
                    "search": name, "beam_size": args.beam_size if name == "beam" else 1,
                    "use_cache": use_cache, "batch": args.batch, "src_len": args.src_len, "new_tokens": n,
                    "seconds": round(seconds, 4), "tokens_per_s": round(args.batch * n / seconds, 1),
                    "compile_s": round(compile_seconds, 2), "backend": jax.default_backend(),
                }), flush=True)


if __name__ == "__main__":
    main()
