"""The benchmark presets: a model (ModelConfig overrides) and a run shape, kept apart.

``MODELS`` holds ModelConfig keyword arguments only, and only those that differ from ModelConfig's
defaults, which ARE the paper's base model (d_model 512, d_ff 2048, 8 heads, 6+6 layers, P_drop 0.1).
``vocab_size`` has no default and is always given. A run sets the modes (``dtype``, ``deterministic``)
itself. The shapes are those of the side-by-side comparison with the Flax WMT example of 2026-11-29.

  tiny: d_model 256, d_ff 1024, 4 heads, 3+3 layers, vocab 8000 (the size of configs/multi30k.py).
  base: the paper's base model, vocab 32000.
  big:  the paper's big model: Table 3's "big" row (d_model 1024, d_ff 4096, 16 heads, P_drop 0.3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime.errors import ConfigError

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=8000, d_model=256, d_ff=1024, num_heads=4, num_encoder_layers=3,
                 num_decoder_layers=3),
    "base": dict(vocab_size=32000),
    "big": dict(vocab_size=32000, **paper.TABLE3_BY_NAME["big"].model),
}


@dataclasses.dataclass(frozen=True)
class TrainPreset:
    """One train-step benchmark: the model and a batch of ``batch`` x ``length`` source and target tokens."""

    model: dict[str, Any]  # ModelConfig keyword arguments
    batch: int
    length: int


@dataclasses.dataclass(frozen=True)
class DecodePreset:
    """One decoding benchmark: ``batch`` sources of ``src_len`` tokens, ``new_tokens`` output tokens each."""

    model: dict[str, Any]  # ModelConfig keyword arguments
    batch: int
    src_len: int
    new_tokens: int


TRAIN_PRESETS = {
    "tiny": TrainPreset(MODELS["tiny"], batch=64, length=32),
    "base": TrainPreset(MODELS["base"], batch=16, length=64),
    "big": TrainPreset(MODELS["big"], batch=16, length=64),
}
DECODE_PRESETS = {
    "tiny": DecodePreset(MODELS["tiny"], batch=16, src_len=32, new_tokens=32),
    "base": DecodePreset(MODELS["base"], batch=16, src_len=32, new_tokens=32),
}


def model_config(model: dict[str, Any], **modes) -> ModelConfig:
    """``ModelConfig(**model, **modes)``; ``modes`` (e.g. ``dtype``, ``deterministic``, ``max_len``) win."""
    return ModelConfig(**{**model, **modes})


def check_names(names: list[str], known: dict, flag: str) -> list[str]:
    """``names`` if each is a key of ``known``, else a ValueError that lists the choices."""
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"{flag} takes a comma-separated list of {list(known)}; got {names!r}")
    return list(names)
