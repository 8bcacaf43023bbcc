"""One pass over the dev batches: head statistics and the model half of the scaling experiment."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from transformer_jax.checkpoints.restore import Restored
from transformer_jax.inspect import forward, scaling
from transformer_jax.inspect.heads import HeadStatistics


@dataclasses.dataclass
class DevAnalysis:
    """Head statistics and the model half of the scaling experiment, from one pass over dev batches.

    Attributes:
      stats: {(kind, layer): HeadStatistics}.
      scaling: {(kind, layer): ``scaling.add_scaling`` sums}.
      num_sentences: real rows seen.
    """

    stats: dict
    scaling: dict
    num_sentences: int


def analyse_dev(restored: Restored, batches: Sequence) -> DevAnalysis:
    """Head statistics and entropy with/without 1/sqrt(d_k) of the model's own q and k, over ``batches``;
    the recomputed maps add the position scheme's logit term (``scaling.logit_bias``), as the model does."""
    cfg = restored.model_config
    stats, sums, seen = {}, {}, 0
    for b in batches:
        seen += b.num_real
        records = forward.attention_records(restored.params, cfg, b.inputs, b.targets)
        for kind, layers in records.items():
            mask = forward.attention_mask(kind, b.inputs, b.targets)
            for layer, record in enumerate(layers):
                stats.setdefault((kind, layer), HeadStatistics(kind, cfg.num_heads)).add(record.weights, mask)
                bias = scaling.logit_bias(restored.params, cfg, kind, layer, record)  # ALiBi, relative
                scaling.add_scaling(sums.setdefault((kind, layer), scaling.new_sums()), record, mask, bias)
    return DevAnalysis(stats, sums, seen)
