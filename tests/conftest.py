"""Test-wide JAX settings: strict rank promotion and exact f32 matmuls; one compilation cache per run.

The test processes and the command-line tools they start (train.py, evaluate.py, translate, the sweep's
rows) share one persistent compilation cache per test run, a temporary folder made by the first pytest
process (the xdist workers inherit it) and removed when that process ends. Programs that compile in
0.1 s or more are cached, not only those over JAX's default 1 s: the tiny test models compile in well
under a second, and many tests build the same ones (single eager operations stay out). A
``JAX_COMPILATION_CACHE_DIR`` set by the user wins.
"""

import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # before jax is imported: jax reads both at import
    _RUN_CACHE = tempfile.mkdtemp(prefix="transformer_jax_test_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
else:
    _RUN_CACHE = None  # the user's, or (in an xdist worker) the one the first process made

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _RUN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
