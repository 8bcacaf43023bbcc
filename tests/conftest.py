"""Test-wide JAX settings: strict rank promotion and exact f32 matmuls; one folder per test run.

Exact f32 matmuls (``JAX_DEFAULT_MATMUL_PRECISION=highest``) are set in the environment, so the command-line
tools the tests start compile the same programs as the test processes and share their cached programs (the
precision is part of a program; on CPU it changes no result).

The suite's programs are tiny, so compiling them costs more than running them: ``XLA_FLAGS`` gets
``TEST_XLA_FLAGS`` beside any flags the user set, and the command-line tools the tests start inherit them.
They change how the CPU backend writes machine code, not the HLO passes: LLVM's lowest optimization level,
XLA's classic fusion code generator in place of the MLIR fusion emitters (a compile in about half the CPU
time, the same results), and one codegen part a program (splitting a tiny program for threads costs more
than it saves). A test that sets ``XLA_FLAGS`` for a child (a device count) keeps them:
``with_test_xla_flags``.

The first pytest process makes one temporary folder per test run (``TRANSFORMER_JAX_TEST_RUN``; the xdist
workers inherit it) and removes it when it ends. It holds:

- ``xla/``: the persistent compilation cache that the test processes and the command-line tools they start
  (train.py, evaluate.py, translate, the sweep's rows) share. Programs that compile in 0.1 s or more are
  cached, not only those over JAX's default 1 s: the tiny test models compile in well under a second, and
  many tests build the same ones (single eager operations stay out). A ``JAX_COMPILATION_CACHE_DIR`` set by
  the user wins.
- ``data_cache/``: the data cache (``TRANSFORMER_JAX_CACHE``) of every run whose config sets no
  ``data.cache_dir``, so that no test reads or writes the user's.
- ``trained/``: the one trained tiny workdir (``tiny.TRAINED``) of the ``trained_run`` fixture, built once
  per run and read by every test that only reads a trained run. Where the collected tests use it, a
  background process starts building it right after collection, so that no test process waits idle for it
  later; a test that comes first waits for it (``tiny.trained_run``'s lock), or builds it itself if that
  process failed.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")


def with_test_xla_flags(flags: str = "") -> str:
    """``flags`` with the suite's compile-time flags added (once)."""
    return flags if TEST_XLA_FLAGS in flags else f"{TEST_XLA_FLAGS} {flags}".strip()


# A suite started in the background by a non-interactive shell (`cmd &` in a script, nohup) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: the tools the Ctrl-C tests interrupt would never
# see it. A handler (not SIG_IGN) is reset to the default in every child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # before jax is imported, as are the two below
RUN_DIR_VARIABLE = "TRANSFORMER_JAX_TEST_RUN"
if RUN_DIR_VARIABLE not in os.environ:
    _RUN_DIR = tempfile.mkdtemp(prefix="transformer_jax_test_run_")
    os.environ[RUN_DIR_VARIABLE] = _RUN_DIR
    os.environ["TRANSFORMER_JAX_CACHE"] = os.path.join(_RUN_DIR, "data_cache")  # never the user's
    os.environ["XLA_FLAGS"] = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_RUN_DIR, "xla")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
else:
    _RUN_DIR = None  # (in an xdist worker) the one the first process made

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def trained_run():
    """(path, final metrics) of the shared trained tiny workdir; see ``tiny.trained_run``. Read it only
    (``shutil.copytree`` it to change anything): the fixture fails at the end of the session if its files
    changed."""
    import tiny

    path, final = tiny.trained_run(os.environ[RUN_DIR_VARIABLE])
    before = tiny.listing(path)
    yield path, final
    assert tiny.listing(path) == before, f"a test changed the shared workdir {path}; copy it first"


_builder: subprocess.Popen | None = None  # the background build of the shared trained workdir


def pytest_collection_modifyitems(config, items):
    """Runs the tests marked slow first, so that the last tests the xdist workers take are short ones and
    the workers end together. Starts building the shared trained workdir in the background, in one process
    per test run (the only one, or xdist's first worker), if a collected test uses it."""
    global _builder
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any(
            "trained_run" in item.fixturenames for item in items):
        return
    tests = os.path.dirname(os.path.abspath(__file__))
    run_dir = os.environ[RUN_DIR_VARIABLE]
    with open(os.path.join(run_dir, "trained_build.log"), "w") as log:
        _builder = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path[:0] = {[tests, os.path.dirname(tests)]!r}; "
             f"import tiny; tiny.trained_run({run_dir!r})"],
            env=dict(os.environ, JAX_NUMPY_RANK_PROMOTION="raise"), stdout=log, stderr=subprocess.STDOUT)


def pytest_unconfigure(config):
    if _builder is not None and _builder.poll() is None:  # the run ended before it finished
        _builder.terminate()
        _builder.wait()
    if _RUN_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(_RUN_DIR, ignore_errors=True)
