"""Dense vs blockwise attention: forward+backward time and compiled peak memory per sequence length.

    python -m transformer_jax.attention_benchmark [--lengths 256,1024] [--skip_timing] [--block_size 512]

Causal self-attention, batch 1, 8 heads, d_k = d_v = 64, float32. Prints one JSON line per
(implementation, length), then one line with the blockwise / dense memory ratio at the longest length.

Memory is XLA's compiled memory analysis of ``jit(grad(sum(attention(q, k, v) * d_out)))``:
``peak_bytes = argument + output + temp - alias``. (On CPU, ``CompiledMemoryStats.peak_memory_in_bytes``
leaves out the temporaries, so it is not used.) Timing is the median wall time of the compiled function;
a dense run whose time, extrapolated quadratically from the previous length, would exceed
``--max_dense_seconds`` is not run (``median_s`` is null) but its memory is still analysed.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from transformer_jax import attention
from transformer_jax.blockwise_attention import blockwise_attention

BATCH, NUM_HEADS, D_K = 1, 8, 64
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


def _attention_fn(impl: str, length: int, block_size: int):
    """(q, k, v) -> out for causal self-attention of ``length`` positions."""
    if impl == "dense":
        return lambda q, k, v: attention.dot_product_attention(q, k, v, attention.causal_mask(length))
    return functools.partial(blockwise_attention, causal=True, block_size=block_size)


def _forward_backward(fn):
    """Gradients of sum(out * d_out) w.r.t. q, k, v: one forward and one backward pass."""
    return jax.grad(lambda q, k, v, d_out: jnp.sum(fn(q, k, v) * d_out), argnums=(0, 1, 2))


def measure(impl: str, length: int, *, block_size: int, time_it: bool, max_seconds: float = float("inf"),
            repeats: int = 3) -> dict:
    """Compiles forward+backward of one implementation; returns its memory (and time) as a dict.

    The warm-up run is timed too: if it takes longer than ``max_seconds`` the repeats are skipped.
    """
    shape = (BATCH, length, NUM_HEADS, D_K)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    start = time.perf_counter()
    compiled = jax.jit(_forward_backward(_attention_fn(impl, length, block_size))).lower(
        spec, spec, spec, spec).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    result = dict(impl=impl, length=length, block_size=block_size if impl == "blockwise" else None,
                  peak_bytes=int(peak), temp_bytes=int(mem.temp_size_in_bytes),
                  argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                  compile_s=round(compile_s, 3), median_s=None, timing=None)
    if not time_it:
        result["timing"] = "skipped"
        return result
    inputs = [jax.random.normal(k, shape, jnp.float32) for k in jax.random.split(jax.random.key(0), 4)]
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))  # warm-up
    warmup_s = time.perf_counter() - start
    if warmup_s > max_seconds:
        result["timing"] = f"warm-up took {warmup_s:.1f} s > {max_seconds} s; not repeated"
    else:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*inputs))
            times.append(time.perf_counter() - start)
        result["median_s"] = round(statistics.median(times), 4)
        result["timing"] = f"median of {repeats}"
    return result


def run(lengths, *, block_size: int, skip_timing: bool, max_dense_seconds: float) -> list[dict]:
    """Measures both implementations at every length; prints and returns the JSON records."""
    records, last_dense = [], None
    for length in lengths:
        for impl in ("dense", "blockwise"):
            time_it, note = not skip_timing, None
            if impl == "dense" and time_it and last_dense is not None:
                if last_dense["median_s"] is None:
                    time_it, note = False, "skipped: the previous length was not timed"
                else:
                    estimate = last_dense["median_s"] * (length / last_dense["length"]) ** 2
                    if estimate > max_dense_seconds:
                        time_it = False
                        note = f"skipped: quadratic estimate {estimate:.3g} s > {max_dense_seconds} s"
            max_seconds = max_dense_seconds if impl == "dense" else float("inf")
            record = measure(impl, length, block_size=block_size, time_it=time_it, max_seconds=max_seconds)
            if note:
                record["timing"] = note
            if impl == "dense":
                last_dense = record
            records.append(record)
            print(json.dumps(record), flush=True)
    longest = max(lengths)
    dense, block = (next(r for r in records if r["impl"] == impl and r["length"] == longest)
                    for impl in ("dense", "blockwise"))
    summary = dict(summary="peak_memory_ratio", length=longest,
                   blockwise_over_dense=round(block["peak_bytes"] / dense["peak_bytes"], 5),
                   dense_over_blockwise=round(dense["peak_bytes"] / block["peak_bytes"], 1))
    print(json.dumps(summary), flush=True)
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help="comma-separated sequence lengths")
    parser.add_argument("--skip_timing", action="store_true", help="only compile and analyse memory")
    parser.add_argument("--block_size", type=int, default=512, help="blockwise tile size")
    parser.add_argument("--max_dense_seconds", type=float, default=30.0,
                        help="do not run dense when its extrapolated time exceeds this")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths needs positive integers, got {args.lengths!r}")
    run(lengths, block_size=args.block_size, skip_timing=args.skip_timing,
        max_dense_seconds=args.max_dense_seconds)


if __name__ == "__main__":
    main()
