"""The model layer: attention, the Transformer, its config, axes, ids, loss and FLOP counts.

Stands on jax and flax only: nothing here reads a run config, data files or checkpoints.
"""
