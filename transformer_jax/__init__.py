"""transformer_jax: the Transformer of Vaswani et al. (2017) in JAX/Flax."""
