"""Host memory: keep the memory XLA:CPU frees for its next step, instead of handing it back to the OS.

XLA:CPU allocates each step's temporaries (hundreds of MB at 4k tokens and an 8k vocabulary) with
malloc and frees them when the step ends. glibc's defaults return that memory to the kernel: large blocks
are ``mmap``-ed and unmapped, and per-thread arenas are trimmed. The next step then faults every page back
in: page faults and kernel time that cost a large share of a training step on CPU (measured in
docs/benchmarks.md).

``keep_freed_memory`` sets glibc's ``mallopt`` so that freed memory stays in the process: one arena (the
XLA threads share the main heap), no ``mmap``-ed blocks, and no trimming. Host
memory then stays at the high-water mark of a step (a multiple of the default's resident size) instead
of being returned after every step. It must run before jax starts its threads; the entry points that
train (``errors.run_main``) call it first. Set ``TRANSFORMER_JAX_GLIBC_MALLOC=default`` to keep glibc's
defaults. Elsewhere than on glibc it does nothing.

Decoding is the exception, and its entry points (translate, evaluate.py, ``benchmarks.decoding`` and
``benchmarks.profile``) keep glibc's defaults: with one arena, beam search both compiled and ran
slower, while the train step ran faster (docs/benchmarks.md, "Measurements behind code choices").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = -1  # M_TRIM_THRESHOLD -1 "disables trimming completely" (man 3 mallopt)
OPT_OUT_VARIABLE = "TRANSFORMER_JAX_GLIBC_MALLOC"


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory (see the module docstring); returns whether it did."""
    if os.environ.get(OPT_OUT_VARIABLE) == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))
