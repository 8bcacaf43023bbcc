"""Test-wide JAX settings: strict rank promotion and exact f32 matmuls; one compilation cache per run.

The command-line tools the tests start (train.py, evaluate.py, translate, the sweep's rows) share one
persistent compilation cache per test run, in pytest's temporary folder (shared by the xdist workers and
rotated by pytest), so a program compiled by one subprocess is loaded by the next. The test processes
themselves keep it off: ``JAX_COMPILATION_CACHE_DIR`` is empty when jax starts here.
"""

import os

import jax
import pytest

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _subprocess_compilation_cache(tmp_path_factory):
    """Points the subprocesses' ``JAX_COMPILATION_CACHE_DIR`` at ``<pytest's run folder>/jax_cache``."""
    if os.environ["JAX_COMPILATION_CACHE_DIR"]:  # set by the user: theirs
        yield
        return
    folder = tmp_path_factory.getbasetemp()
    if folder.name.startswith("popen-gw"):  # an xdist worker's folder: share the run's
        folder = folder.parent
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder / "jax_cache")
    yield
    os.environ["JAX_COMPILATION_CACHE_DIR"] = ""
