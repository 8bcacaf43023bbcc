"""Test-wide JAX settings: strict rank promotion and exact f32 matmuls; no persistent compilation cache."""

import os

import jax

# The command-line tools the tests start would otherwise keep compiled programs in ~/.cache.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
