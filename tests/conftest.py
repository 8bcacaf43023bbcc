"""Test-wide JAX settings: strict rank promotion and exact f32 matmuls."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
