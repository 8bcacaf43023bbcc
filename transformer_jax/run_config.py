"""A run config (``configs/*.py``, an ml_collections ConfigDict) checked and turned into a ModelConfig.

``validate_config`` is the one check of a whole run config, done before any data is read or anything
compiles; ``model_config_from`` builds the model a config describes. ``config.model`` holds exactly
``ModelConfig``'s fields except ``vocab_size`` (which the tokenizer decides) and the modes.
"""

from __future__ import annotations

import ml_collections

from transformer_jax import data as data_lib
from transformer_jax import sharding
from transformer_jax.model import ModelConfig


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The validated ModelConfig of a run config (raises ValueError before anything compiles)."""
    return ModelConfig(vocab_size=vocab_size, **config.model)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Fails fast, before any data is read or anything compiles, on a bad config (ValueError)."""
    data_lib.validate_data_config(config.data)
    model_config = model_config_from(config, vocab_size=config.data.vocab_size)
    if model_config.max_len < max(config.data.length_buckets):
        raise ValueError(f"model.max_len={model_config.max_len} must cover the longest length bucket "
                         f"{max(config.data.length_buckets)}")
    t = config.train
    for name in ("num_steps", "warmup_steps", "grad_accum_steps"):
        value = getattr(t, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ValueError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing!r}")
    for name in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if config.log_every_steps == 0:
        raise ValueError("log_every_steps must be positive, got 0")
    sharding.rules_from_config(config.sharding.logical_axis_rules)
