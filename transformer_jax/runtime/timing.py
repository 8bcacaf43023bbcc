"""Wall-clock timing helpers and the device's measured matmul peak, the yardstick of every MFU figure.

MFU = achieved FLOP/s / peak FLOP/s. The peak is a jitted ``size^3`` matmul (float32 on CPU, bfloat16 on
an accelerator) timed ``repeats`` times; the denominator is the BEST run, because the hardware can do at
least that much, while a median peak drifts with whatever else shares the machine and flatters the MFU.
Both are reported. Every MFU record carries the peak it was divided by (``mfu_fields``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def time_calls(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, each waited on with ``jax.block_until_ready``.

    Compile and warm up before calling this: every call is timed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


@dataclasses.dataclass(frozen=True)
class Peak:
    """A measured matmul peak. ``best_flops`` (the fastest run) is the MFU denominator."""

    best_flops: float  # FLOP/s of the fastest run
    median_flops: float  # FLOP/s of the median run, for comparison only
    dtype: str
    size: int  # the matmul is [size, size] @ [size, size]
    repeats: int

    @classmethod
    def from_times(cls, flop: float, times: list[float], *, dtype: str, size: int) -> Peak:
        """The peak of a computation of ``flop`` FLOPs that took ``times`` seconds per run."""
        return cls(best_flops=flop / min(times), median_flops=flop / statistics.median(times),
                   dtype=dtype, size=size, repeats=len(times))

    def record(self) -> dict:
        """The JSON record printed once per run."""
        return dict(measured=f"matmul_peak_{self.size}", dtype=self.dtype,
                    peak_best_gflops=round(self.best_flops / 1e9, 1),
                    peak_median_gflops=round(self.median_flops / 1e9, 1), repeats=self.repeats,
                    jax=jax.__version__, backend=jax.default_backend())


def matmul_peak(repeats: int = 20, size: int = 2048, dtype: str | None = None) -> Peak:
    """Times a jitted ``float[size, size] @ float[size, size]`` on the default device.

    ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere (the dtype the benchmarks compute in).
    """
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))  # compile and warm up
    times = time_calls(lambda: matmul(a, b), repeats)
    return Peak.from_times(2.0 * size**3, times, dtype=jnp.dtype(dtype).name, size=size)


def mfu_fields(flop: float, seconds: float, peak: Peak) -> dict:
    """``mfu`` of ``flop`` FLOPs done in ``seconds``, with the peak beside it (best and median)."""
    return dict(gflop=round(flop / 1e9, 3), mfu=round(flop / seconds / peak.best_flops, 4),
                peak_best_gflops=round(peak.best_flops / 1e9, 1),
                peak_median_gflops=round(peak.median_flops / 1e9, 1), peak_dtype=peak.dtype)
