"""A run config (``configs/*.py``, an ml_collections ConfigDict) checked and turned into a ModelConfig.

``validate_config`` is the one check of a whole run config, done before any tokenizer is trained, any
data is read or anything compiles: every field's type and range, the fields that must agree with each
other, and (``environment=True``) every input file the run will read and the devices the mesh asks
for. Each problem raises ``ConfigError`` (a ``ValueError``) naming the field as it is set on the command
line (``config.train.learning_rate_scale``) or ``MissingFileError`` naming the file.
``model_config_from`` builds the model a config describes. ``config.model`` holds exactly
``ModelConfig``'s fields except ``vocab_size`` (which the tokenizer decides) and the modes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections

from transformer_jax import data as data_lib
from transformer_jax.data.sources import check_input_files
from transformer_jax.evaluation import bleu
from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime import sharding
from transformer_jax.runtime.errors import ConfigError

# config.final_eval_split: the split decoded and scored after training; "" skips it.
FINAL_EVAL_SPLITS = ("dev", "test", "")


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The validated ModelConfig of a run config (raises ConfigError before anything compiles)."""
    try:
        return ModelConfig(vocab_size=vocab_size, **config.model)
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def _get(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def _bad(path: str, value: Any, expected: str, hint: str = "") -> ConfigError:
    return ConfigError(f"config.{path}={value!r}: expected {expected}" + (f"; {hint}" if hint else ""))


def _check_int(config: Any, path: str, minimum: int, hint: str = "") -> int:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(path, value, f"an integer >= {minimum}", hint)
    return value


def _check_number(config: Any, path: str, low: float, high: float = math.inf, *,
                  low_open: bool = False, high_open: bool = False, hint: str = "") -> float:
    """A finite int or float in the interval from ``low`` to ``high`` (open ends as flagged)."""
    value = _get(config, path)
    ok = (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
          and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high))
    if not ok:
        interval = (("(" if low_open else "[") + f"{low:g}, {high:g}" + (")" if high_open else "]"))
        raise _bad(path, value, f"a finite number in {interval}", hint)
    return value


def _check_choice(config: Any, path: str, choices: tuple, hint: str = "") -> Any:
    value = _get(config, path)
    if value not in choices:
        raise _bad(path, value, "one of " + ", ".join(repr(c) for c in choices), hint)
    return value


def decodes(config: ml_collections.ConfigDict) -> bool:
    """Whether training decodes (periodic dev BLEU or a final evaluation), which needs longer positions."""
    return bool(config.eval_bleu_examples) or bool(config.final_eval_split)


def splits_read(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The data splits a training run reads: train, dev (always scored at the end) and maybe test."""
    return ("train", "dev") + (("test",) if config.final_eval_split == "test" else ())


def _check_train(config: ml_collections.ConfigDict) -> None:
    for name in ("num_steps", "warmup_steps", "grad_accum_steps"):
        _check_int(config, f"train.{name}", 1)
    _check_int(config, "train.cooldown_steps", 0, "0 keeps the inverse square root to the end")
    if config.train.cooldown_steps > config.train.num_steps:
        raise _bad("train.cooldown_steps", config.train.cooldown_steps,
                   f"at most train.num_steps ({config.train.num_steps})")
    _check_number(config, "train.learning_rate_scale", 0.0, low_open=True,
                  hint="it multiplies the warmup / inverse-square-root schedule; a negative scale "
                       "climbs the loss and 0 never moves")
    for name in ("adam_b1", "adam_b2"):
        _check_number(config, f"train.{name}", 0.0, 1.0, high_open=True)
    _check_number(config, "train.adam_eps", 0.0, low_open=True)
    _check_number(config, "train.label_smoothing", 0.0, 1.0, high_open=True)
    _check_number(config, "train.max_grad_norm", 0.0, hint="0 disables clipping")


def _check_loop(config: ml_collections.ConfigDict) -> None:
    """Logging, evaluation, checkpoints, profiling: the loop's own fields."""
    name = config.name
    if not isinstance(name, str) or not name:
        raise _bad("name", name, "a non-empty string (it picks the paper row evaluate.py compares with)")
    _check_int(config, "seed", 0)
    _check_int(config, "log_every_steps", 1)
    for path in ("eval_every_steps", "checkpoint_every_steps"):
        _check_int(config, path, 0, "0 turns it off")
    _check_int(config, "eval_bleu_examples", 0, "0 turns the periodic dev BLEU off")
    _check_choice(config, "dev_bleu_protocol", tuple(bleu.PROTOCOLS))
    _check_number(config, "checkpoint_every_minutes", 0.0, hint="0 turns it off")
    _check_int(config, "checkpoint_keep", 1, "at least the newest checkpoint is kept")
    _check_number(config, "peak_tflops_per_device", 0.0, hint="0 measures the device's matmul peak")
    _check_int(config, "profile_start_step", 0, "0 turns profiling off")
    _check_int(config, "profile_num_steps", 1)
    _check_choice(config, "final_eval_split", FINAL_EVAL_SPLITS,
                  "'' skips the final evaluation; the train split is never scored")
    _check_int(config, "final_beam_size", 1, "1 is greedy search")
    _check_number(config, "final_alpha", 0.0, hint="the GNMT length penalty; 0 turns it off")
    _check_int(config, "final_max_extra_len", 0)
    _check_int(config, "final_average_last", 1, "1 scores the final state alone")
    if config.final_average_last > config.checkpoint_keep:
        raise _bad("final_average_last", config.final_average_last,
                   f"at most checkpoint_keep={config.checkpoint_keep} (only that many checkpoints are kept)")


def _check_sharding(config: ml_collections.ConfigDict, environment: bool) -> None:
    shape = config.sharding.mesh_shape
    try:
        known = [int(s) for s in shape if int(s) != -1]
        sharding.resolve_mesh_shape(shape, jax.device_count() if environment else math.prod(known))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.sharding.mesh_shape={tuple(shape)!r}: {e}; use (data, model) "
                          "sizes whose product is the device count, with -1 for 'the rest'") from None
    try:
        sharding.rules_from_config(config.sharding.logical_axis_rules)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.sharding.logical_axis_rules: {e}") from None


def _check_lengths(config: ml_collections.ConfigDict, model_config: ModelConfig) -> None:
    """Positions cover the longest bucket and, when training decodes, its output allowance too."""
    largest = max(config.data.length_buckets)
    if model_config.max_len < largest:
        raise ConfigError(
            f"config.model.max_len={model_config.max_len} must cover the longest length bucket {largest} "
            "(config.data.length_buckets); raise model.max_len or drop the longest buckets")
    needed = largest + config.final_max_extra_len
    if decodes(config) and model_config.max_len < needed:
        raise ConfigError(
            f"config.model.max_len={model_config.max_len} must be >= {needed}: decoding a "
            f"{largest}-token bucket may output {config.final_max_extra_len} tokens more "
            "(config.final_max_extra_len); raise model.max_len or lower final_max_extra_len")


def validate_config(config: ml_collections.ConfigDict, *, environment: bool = True) -> None:
    """Fails fast, before any tokenizer training, data reading or compiling, on a bad config.

    Args:
      config: a run config (``configs/*.py``).
      environment: also check what this machine must provide: every input file the run reads (text
        and treebank sources) and the devices ``config.sharding.mesh_shape`` asks for. A sweep launcher
        that checks configs for other machines passes False.

    Raises:
      ConfigError: naming the first bad field, what it expects and what it got.
      MissingFileError: naming the first missing input file and the config fields that point to it.
    """
    data_lib.validate_data_config(config.data)
    _check_train(config)
    _check_loop(config)
    model_config = model_config_from(config, vocab_size=config.data.vocab_size)
    _check_lengths(config, model_config)
    _check_sharding(config, environment)
    if environment:
        data_devices = sharding.resolve_mesh_shape(config.sharding.mesh_shape, jax.device_count())[0]
        data_lib.check_tokens_per_batch(
            config.data, batch_multiple=data_devices * config.train.grad_accum_steps)
        check_input_files(config.data, splits_read(config))
