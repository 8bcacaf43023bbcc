"""Wall-clock timing helpers and the device's measured matmul peak, the yardstick of every MFU figure.

MFU = achieved FLOP/s / peak FLOP/s. The peak is a jitted ``size^3`` matmul (float32 on CPU, bfloat16 on
an accelerator) timed ``repeats`` times; the denominator is the BEST run, because the hardware can do at
least that much, while a median peak drifts with whatever else shares the machine and flatters the MFU.
Both are reported. Every MFU record carries the peak it was divided by (``mfu_fields``).

The size is the backend's (``peak_size``): 2048 on a CPU, 8192 on an accelerator, where a 2048^3 matmul
(17 GFLOP, some 20 us on an H100) is mostly dispatch and would read a low peak, so a high MFU. A float32
peak is labelled with what its multiplies run in (``precision_label``): at JAX's default precision an
NVIDIA GPU from Ampere on multiplies float32 as TF32, and a TPU in bfloat16 passes.
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
    precision: str = ""  # what the multiplies ran in (``precision_label``); "" for ``dtype`` itself

    @classmethod
    def from_times(cls, flop: float, times: list[float], *, dtype: str, size: int,
                   precision: str = "") -> Peak:
        """The peak of a computation of ``flop`` FLOPs that took ``times`` seconds per run."""
        return cls(best_flops=flop / min(times), median_flops=flop / statistics.median(times),
                   dtype=dtype, size=size, repeats=len(times), precision=precision)

    @property
    def label(self) -> str:
        """``dtype`` and, where the multiplies run in another precision, that precision."""
        return self.precision or self.dtype

    def record(self) -> dict:
        """The JSON record printed once per run."""
        return dict(measured=f"matmul_peak_{self.size}", dtype=self.dtype, precision=self.label,
                    peak_best_gflops=round(self.best_flops / 1e9, 1),
                    peak_median_gflops=round(self.median_flops / 1e9, 1), repeats=self.repeats,
                    jax=jax.__version__, backend=jax.default_backend())


# The peak's matmul size by backend (see the module docstring); any other backend takes ACCELERATOR_PEAK_SIZE.
PEAK_SIZES = {"cpu": 2048}
ACCELERATOR_PEAK_SIZE = 8192


def peak_size(backend: str) -> int:
    """The side of the peak's square matmul on ``backend`` ("cpu", "gpu", "tpu", ...)."""
    return PEAK_SIZES.get(backend, ACCELERATOR_PEAK_SIZE)


def precision_label(dtype: str, *, backend: str, compute_capability: str | None,
                    precision: str | None) -> str:
    """What a ``dtype`` matmul multiplies in on ``backend`` at ``jax_default_matmul_precision``
    ``precision`` (None: JAX's default): "" where that is ``dtype`` itself, else a label naming it.
    ``compute_capability``: an NVIDIA GPU's ("9.0" on Hopper), None elsewhere."""
    if dtype != "float32" or backend == "cpu" or precision in ("highest", "float32"):
        return ""
    at = f"float32 at matmul precision {precision!r}" if precision else "float32 at JAX's default precision"
    if backend == "tpu":
        return f"{at}: bfloat16 passes on a TPU"
    if backend in ("gpu", "cuda") and compute_capability and float(compute_capability) >= 8:
        return f"{at}: TF32 multiplies on this GPU (compute capability {compute_capability})"
    return ""


def matmul_peak(repeats: int = 20, size: int | None = None, dtype: str | None = None) -> Peak:
    """Times a jitted ``float[size, size] @ float[size, size]`` on the default device.

    ``size`` defaults to the backend's (``peak_size``), ``dtype`` to float32 on CPU and bfloat16 elsewhere
    (the dtype the benchmarks compute in).
    """
    backend = jax.default_backend()
    size = size or peak_size(backend)
    dtype = jnp.dtype(dtype or ("float32" if backend == "cpu" else "bfloat16")).name
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))  # compile and warm up
    times = time_calls(lambda: matmul(a, b), repeats)
    precision = precision_label(dtype, backend=backend,
                                compute_capability=getattr(jax.devices()[0], "compute_capability", None),
                                precision=jax.config.jax_default_matmul_precision)
    return Peak.from_times(2.0 * size**3, times, dtype=dtype, size=size, precision=precision)


def mfu_fields(flop: float, seconds: float, peak: Peak) -> dict:
    """``mfu`` of ``flop`` FLOPs done in ``seconds``, with the peak beside it (best and median)."""
    return dict(gflop=round(flop / 1e9, 3), mfu=round(flop / seconds / peak.best_flops, 4),
                peak_best_gflops=round(peak.best_flops / 1e9, 1),
                peak_median_gflops=round(peak.median_flops / 1e9, 1), peak_dtype=peak.dtype)
