"""A persistent XLA compilation cache for translate and evaluate.py: each program compiles once a machine.

Decoding compiles one program per batch shape: test2016 through the Multi30k model at beam 5 spends
about 18 of its 37 seconds compiling on 2 CPU cores. The cache keeps the compiled programs on disk,
keyed by the program, the jax version and the compiler flags, so a later run with the same model
shapes (another checkpoint of the run, another input file) loads them instead (docs/benchmarks.md).
It is JAX's own cache: ``JAX_COMPILATION_CACHE_DIR``, when set, takes precedence over the flag.
"""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "transformer_jax", "xla")
FLAG_HELP = ("Folder of the persistent compilation cache, so a later run with the same model shapes "
             "skips compiling; '' turns it off; JAX_COMPILATION_CACHE_DIR, when set, wins.")


def enable(path: str) -> str | None:
    """Caches compiled programs (those that take 1 s or more to compile) under ``path``.

    ``path`` '' leaves the cache off, as does ``JAX_COMPILATION_CACHE_DIR`` set to ''. Returns the folder
    in use, or None.
    """
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # jax reads it itself
        return os.environ["JAX_COMPILATION_CACHE_DIR"] or None
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    return path
