"""Logical axis names shared by the model and the sharding rules.

Parameters and activations are annotated with these names; the mapping from names to mesh axes lives
in the config (``config.sharding.logical_axis_rules``), never in the model.
"""

BATCH = "batch"  # examples in a batch
LENGTH = "length"  # sequence positions
EMBED = "embed"  # d_model
HEADS = "heads"  # h, the attention heads
KV = "kv"  # d_k or d_v, the per-head size
MLP = "mlp"  # d_ff, the feed-forward hidden size
VOCAB = "vocab"  # the shared vocabulary
