"""The model's logical axis names.

Every parameter and activation of the model is annotated with these names. Which mesh axis each one is
split over is not the model's business: ``config.sharding.logical_axis_rules`` says it, and
``sharding.py`` turns the rules into shardings.
"""

BATCH = "batch"  # examples in a batch
LENGTH = "length"  # sequence positions
EMBED = "embed"  # d_model
HEADS = "heads"  # h, the attention heads
KV = "kv"  # d_k or d_v, the per-head size
MLP = "mlp"  # d_ff, the feed-forward hidden size
VOCAB = "vocab"  # the shared vocabulary

ALL = (BATCH, LENGTH, EMBED, HEADS, KV, MLP, VOCAB)
