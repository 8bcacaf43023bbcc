"""Dense vs blockwise attention: forward+backward time and compiled peak memory per sequence length.

    python -m transformer_jax.benchmarks.attention [--lengths=256,1024] [--skip_timing] [--block_size=512]

Causal self-attention, batch 1, 8 heads, d_k = d_v = 64, float32. Prints one JSON line per
(implementation, length), then one line with the blockwise / dense memory ratio at the longest length.

Memory is XLA's compiled memory analysis of ``jit(grad(sum(attention(q, k, v) * d_out)))``:
``peak_bytes = argument + output + temp - alias``. (On CPU, ``CompiledMemoryStats.peak_memory_in_bytes``
leaves out the temporaries, so it is not used.) Timing is the median wall time of the compiled function;
a dense run whose time, extrapolated quadratically from the previous length, would exceed
``--max_dense_seconds`` is not run (``median_s`` is null) but its memory is still analysed.
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags

from transformer_jax.model import attention
from transformer_jax.model.blockwise_attention import blockwise_attention
from transformer_jax.runtime import errors, timing
from transformer_jax.runtime.errors import ConfigError

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
        times = timing.time_calls(lambda: compiled(*inputs), repeats)
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


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.attention``."""
    flags.DEFINE_list("lengths", [str(n) for n in DEFAULT_LENGTHS],
                      "Comma-separated sequence lengths to measure, e.g. 256,1024.", flag_values=flag_values)
    flags.DEFINE_bool("skip_timing", False, "Only compile and analyse memory; time nothing.",
                      flag_values=flag_values)
    flags.DEFINE_integer("block_size", 512, "Query/key tile size of the blockwise implementation.",
                         flag_values=flag_values)
    flags.DEFINE_float("max_dense_seconds", 30.0,
                       "Do not time dense attention at a length where its time, extrapolated "
                       "quadratically from the previous length, would exceed this many seconds.",
                       flag_values=flag_values)


def parse_lengths(values: list[str]) -> list[int]:
    """The ``--lengths`` values as positive ints, else a ValueError that says what was expected."""
    try:
        lengths = [int(n) for n in values if n]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--lengths takes comma-separated positive integers, e.g. 256,1024; got {values!r}")
    return lengths


def main(argv: list[str]) -> None:
    values = flags.FLAGS
    run(parse_lengths(values.lengths), block_size=values.block_size, skip_timing=values.skip_timing,
        max_dense_seconds=values.max_dense_seconds)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
