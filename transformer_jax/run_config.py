"""The entry layer's config builder: a run config (``configs/*.py``) read once into frozen dataclasses.

``train.py``, ``evaluate.py`` and the other commands load an ml_collections ConfigDict from a config
file (``load_config``); ``build_run_config`` checks all of it before any tokenizer is trained, any data
is read or anything compiles, and returns a ``RunConfig`` whose parts go only where they are needed:

    RunConfig.model       ModelConfig (vocab_size from data.vocab_size until the tokenizer decides it)
    RunConfig.data        data.config.DataConfig: sources, tokenizer, batches
    RunConfig.train       TrainConfig: the optimizer, its schedule, the step
    RunConfig.eval        EvalConfig: periodic dev evaluation and the final evaluation
    RunConfig.checkpoint  CheckpointConfig: when to save and how many to keep
    RunConfig.loop        LoopConfig: logging, profiling, the MFU denominator
    RunConfig.sharding    ShardingConfig: the mesh and the logical axis rules

No module below this one takes a ConfigDict. ``RunConfig.saved`` is the plain JSON form (the same nested
fields as the config file) that checkpoints store; ``run_config_from_saved`` reads it back leniently,
without the validators: fields since removed are ignored, fields since added take their defaults.

Each problem raises ``ConfigError`` (a ``ValueError``) naming the field as it is set on the command
line (``config.train.learning_rate_scale``) or ``MissingFileError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from transformer_jax import data as data_lib
from transformer_jax.data.config import DataConfig
from transformer_jax.data.sources import check_input_files
from transformer_jax.model.config import ModelConfig
from transformer_jax.protocols import BLEU_PROTOCOLS
from transformer_jax.runtime import devices, errors, sharding
from transformer_jax.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """``config.train``: Adam, the warmup / inverse-square-root schedule (section 5.3) and the step."""

    num_steps: int
    warmup_steps: int
    learning_rate_scale: float
    adam_b1: float
    adam_b2: float
    adam_eps: float
    label_smoothing: float
    grad_accum_steps: int = 1
    max_grad_norm: float = 0.0  # 0: no clipping
    cooldown_steps: int = 0  # the last N updates ramp the rate linearly to 0
    loss_chunk_tokens: int = 0  # > 0: the loss forms the logits this many target tokens at a time


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The loop's own fields: logging, the MFU denominator, profiling."""

    log_every_steps: int
    peak_tflops_per_device: float  # 0: measure this device's matmul peak
    profile_start_step: int  # 0: off
    profile_num_steps: int
    platform: str = "any"  # the device JAX must have found (runtime/devices.py); "any" takes the CPU too


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When the loop saves and how many checkpoints it keeps."""

    checkpoint_every_steps: int  # 0: off
    checkpoint_every_minutes: float  # 0: off
    checkpoint_keep: int


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Periodic dev evaluation and the final evaluation after training."""

    eval_every_steps: int  # 0: off
    eval_bleu_examples: int  # dev sentences decoded greedily for the periodic BLEU (or F1); 0: off
    dev_bleu_protocol: str  # "sacrebleu", "tokenized" or "multi30k"
    final_eval_split: str  # "dev", "test" or "" (skip)
    final_beam_size: int
    final_alpha: float
    final_max_extra_len: int
    final_average_last: int  # score the mean of the newest N checkpoints

    @property
    def decodes(self) -> bool:
        """Whether training decodes (periodic dev BLEU or a final evaluation): positions must cover it."""
        return bool(self.eval_bleu_examples) or bool(self.final_eval_split)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """``config.sharding``: the mesh and the rules that map logical axis names onto it."""

    mesh_shape: tuple[int, ...]  # (data, model); -1 fills the remaining devices
    logical_axis_rules: tuple[tuple[str, str | None], ...]  # logical axis -> mesh axis (None: replicated)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run config, validated: see the module docstring for where each part goes."""

    name: str  # picks the paper row evaluate.py compares with
    seed: int  # parameter init, dropout and data order
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    loop: LoopConfig
    sharding: ShardingConfig
    saved: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)  # the JSON form

    def splits_read(self) -> tuple[str, ...]:
        """The data splits a training run reads: train, dev (always scored at the end) and maybe test."""
        return ("train", "dev") + (("test",) if self.eval.final_eval_split == "test" else ())


# Top-level fields of a config file, by the part of RunConfig that holds them.
_TOP_LEVEL_GROUPS = {"eval": EvalConfig, "checkpoint": CheckpointConfig, "loop": LoopConfig}


# config.final_eval_split: the split decoded and scored after training; "" skips it.
FINAL_EVAL_SPLITS = ("dev", "test", "")


def model_config_from(model_fields: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    """The validated ModelConfig of a config's ``model`` section (ConfigError before anything compiles)."""
    try:
        return ModelConfig(vocab_size=vocab_size, **model_fields)
    except TypeError as e:
        raise ConfigError(f"config.model: {e}; the fields are ModelConfig's (transformer_jax/model/config.py)"
                          ) from None
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def _get(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError):
            raise ConfigError(f"config.{path} is missing; every config starts from configs/default.py, "
                              "which sets it") from None
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
        if math.isinf(high):
            expected = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            expected = ("a finite number in " + ("(" if low_open else "[") + f"{low:g}, {high:g}"
                        + (")" if high_open else "]"))
        raise _bad(path, value, expected, hint)
    return value


def _check_choice(config: Any, path: str, choices: tuple, hint: str = "") -> Any:
    value = _get(config, path)
    if value not in choices:
        raise _bad(path, value, "one of " + ", ".join(repr(c) for c in choices), hint)
    return value


def _check_train(config: Mapping[str, Any]) -> None:
    for name in ("num_steps", "warmup_steps", "grad_accum_steps"):
        _check_int(config, f"train.{name}", 1)
    _check_int(config, "train.cooldown_steps", 0, "0 keeps the inverse square root to the end")
    if _get(config, "train.cooldown_steps") > _get(config, "train.num_steps"):
        raise _bad("train.cooldown_steps", _get(config, "train.cooldown_steps"),
                   f"at most train.num_steps ({_get(config, 'train.num_steps')})")
    _check_number(config, "train.learning_rate_scale", 0.0, low_open=True,
                  hint="it multiplies the warmup / inverse-square-root schedule; a negative scale "
                       "climbs the loss and 0 never moves")
    for name in ("adam_b1", "adam_b2"):
        _check_number(config, f"train.{name}", 0.0, 1.0, high_open=True)
    _check_number(config, "train.adam_eps", 0.0, low_open=True)
    _check_number(config, "train.label_smoothing", 0.0, 1.0, high_open=True)
    _check_number(config, "train.max_grad_norm", 0.0, hint="0 disables clipping")
    _check_int(config, "train.loss_chunk_tokens", 0,
               "0 forms the logits of a whole micro-batch at once")


def _check_loop(config: Mapping[str, Any]) -> None:
    """Logging, evaluation, checkpoints, profiling: the loop's own fields."""
    name = config["name"]
    if not isinstance(name, str) or not name:
        raise _bad("name", name, "a non-empty string (it picks the paper row evaluate.py compares with)")
    _check_int(config, "seed", 0)
    _check_int(config, "log_every_steps", 1)
    for path in ("eval_every_steps", "checkpoint_every_steps"):
        _check_int(config, path, 0, "0 turns it off")
    _check_int(config, "eval_bleu_examples", 0, "0 turns the periodic dev BLEU off")
    _check_choice(config, "dev_bleu_protocol", BLEU_PROTOCOLS)
    _check_number(config, "checkpoint_every_minutes", 0.0, hint="0 turns it off")
    _check_int(config, "checkpoint_keep", 1, "at least the newest checkpoint is kept")
    _check_number(config, "peak_tflops_per_device", 0.0, hint="0 measures the device's matmul peak")
    _check_int(config, "profile_start_step", 0, "0 turns profiling off")
    _check_int(config, "profile_num_steps", 1)
    _check_choice(config, "platform", devices.PLATFORMS,
                  "'any' runs wherever JAX runs; 'accelerator' needs a GPU or a TPU")
    _check_choice(config, "final_eval_split", FINAL_EVAL_SPLITS,
                  "'' skips the final evaluation; the train split is never scored")
    _check_int(config, "final_beam_size", 1, "1 is greedy search")
    _check_number(config, "final_alpha", 0.0, hint="the GNMT length penalty; 0 turns it off")
    _check_int(config, "final_max_extra_len", 0)
    _check_int(config, "final_average_last", 1, "1 scores the final state alone")
    if config["final_average_last"] > config["checkpoint_keep"]:
        raise _bad("final_average_last", config["final_average_last"],
                   f"at most checkpoint_keep={config['checkpoint_keep']} (only that many are kept)")


def _check_sharding(config: Mapping[str, Any], environment: bool) -> None:
    shape = _get(config, "sharding.mesh_shape")
    try:
        known = [int(s) for s in shape if int(s) != -1]
        sharding.resolve_mesh_shape(shape, jax.device_count() if environment else math.prod(known))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.sharding.mesh_shape={tuple(shape)!r}: {e}; use (data, model) "
                          "sizes whose product is the device count, with -1 for 'the rest'") from None
    try:
        sharding.rules_from_config(_get(config, "sharding.logical_axis_rules"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.sharding.logical_axis_rules: {e}") from None


def _check_lengths(data: DataConfig, eval_config: EvalConfig, model_config: ModelConfig) -> None:
    """A learned position table covers the longest bucket and, when training decodes, its output
    allowance too; the other position schemes take any length (``ModelConfig.position_limit``)."""
    if model_config.position_limit is None:
        return
    largest = max(data.length_buckets)
    if model_config.max_len < largest:
        raise ConfigError(
            f"config.model.max_len={model_config.max_len} (the learned position table) must cover the "
            f"longest length bucket {largest} (config.data.length_buckets); raise model.max_len or drop "
            "the longest buckets")
    needed = largest + eval_config.final_max_extra_len
    if eval_config.decodes and model_config.max_len < needed:
        raise ConfigError(
            f"config.model.max_len={model_config.max_len} (the learned position table) must be >= {needed}: "
            "decoding a "
            f"{largest}-token bucket may output {eval_config.final_max_extra_len} tokens more "
            "(config.final_max_extra_len); raise model.max_len or lower final_max_extra_len")


def _group(cls: type, fields: Mapping[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
    try:
        return cls(**fields)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form of a ConfigDict or nested mapping (tuples become lists, as in a checkpoint)."""
    if isinstance(config, ml_collections.ConfigDict):
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config))


def build_run_config(config: Mapping[str, Any], *, environment: bool = True) -> RunConfig:
    """Validates a whole run config and reads it into a RunConfig, before anything is read or compiled.

    Args:
      config: a run config: the ConfigDict of ``configs/*.py`` or its JSON form (a checkpoint's).
      environment: also check what this machine must provide: every input file the run reads (text
        and treebank sources) and the devices ``sharding.mesh_shape`` asks for. A sweep launcher that
        checks configs for other machines passes False.

    Raises:
      ConfigError: naming the first bad field, what it expects and what it got.
      MissingFileError: naming the first missing input file and the config fields that point to it.
    """
    saved = _plain(config)
    for section in ("data", "model", "train", "sharding"):
        if not isinstance(saved.get(section), dict):
            raise ConfigError(f"config.{section} is missing; every config starts from configs/default.py")
    data = DataConfig.from_mapping(saved["data"])
    data_lib.validate_data_config(data)
    _check_train(saved)
    _check_loop(saved)
    model = model_config_from(saved["model"], vocab_size=data.vocab_size)
    groups = {}
    for group, cls in _TOP_LEVEL_GROUPS.items():
        groups[group] = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls)})
    _check_lengths(data, groups["eval"], model)
    _check_sharding(saved, environment)
    sharding_config = ShardingConfig(
        mesh_shape=tuple(saved["sharding"]["mesh_shape"]),
        logical_axis_rules=tuple(tuple(rule) for rule in saved["sharding"]["logical_axis_rules"]))
    run = RunConfig(name=saved["name"], seed=saved["seed"], model=model, data=data,
                    train=_group(TrainConfig, saved["train"], "config.train"), sharding=sharding_config,
                    saved=saved, **groups)
    if environment:
        data_devices = sharding.resolve_mesh_shape(run.sharding.mesh_shape, jax.device_count())[0]
        data_lib.check_tokens_per_batch(data, batch_multiple=data_devices * run.train.grad_accum_steps)
        check_input_files(data, run.splits_read())
    return run


def _known_fields(cls: type, fields: Mapping[str, Any], where: str) -> Any:
    """``cls`` built from the entries of ``fields`` that are its fields; the others are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in fields.items() if k in names})
    except TypeError as e:
        raise ConfigError(f"the saved config's {where} lacks a field without a default ({e})") from None


def run_config_from_saved(saved: Mapping[str, Any]) -> RunConfig:
    """The RunConfig of a checkpoint's saved JSON config, read leniently.

    The config was checked when it was saved, so the validators do not run again (a check added since
    must not lock out earlier checkpoints); nothing is read from files or devices. Fields the code no
    longer has are ignored, and fields added since take their defaults.
    """
    saved = _plain(saved)
    data_fields = dict(saved["data"])
    data_fields["length_buckets"] = tuple(data_fields.get("length_buckets", ()))
    data = _known_fields(DataConfig, data_fields, "data")
    model = _known_fields(ModelConfig, {**saved["model"], "vocab_size": data.vocab_size}, "model")
    groups = {group: _known_fields(cls, saved, group) for group, cls in _TOP_LEVEL_GROUPS.items()}
    sharding_config = ShardingConfig(
        mesh_shape=tuple(saved["sharding"]["mesh_shape"]),
        logical_axis_rules=tuple(tuple(rule) for rule in saved["sharding"]["logical_axis_rules"]))
    return RunConfig(name=saved["name"], seed=saved["seed"], model=model, data=data,
                     train=_known_fields(TrainConfig, saved["train"], "train"), sharding=sharding_config,
                     saved=saved, **groups)


def define_config_file(name: str, default: str, help_string: str, **kwargs: Any):
    """``config_flags.DEFINE_config_file`` whose load and override errors are one ``error:`` line.

    Without ``--<name>=`` on the command line, ml_collections loads the default and applies the
    ``--<name>.x=y`` overrides at this call (import time), so errors are caught here too.
    """
    errors.note_config_flag(name)
    try:
        return config_flags.DEFINE_config_file(name, default, help_string, **kwargs)
    except (KeyError, AttributeError, OSError, TypeError, ValueError) as e:
        if errors.show_tracebacks():
            raise
        errors.print_error(errors.config_flag_message(e, sys.argv, name))


def load_config(config_arg: str, overrides: Sequence[str] = ()) -> tuple[ml_collections.ConfigDict, dict]:
    """``path[:argument]`` plus ``--config.key=value`` overrides, loaded as train.py's flags load them.

    Returns (the locked config, the parsed overrides as ``{"model.num_heads": 4}``); of a field given twice
    the last value wins. Raises ValueError naming the config and the override at fault.
    """
    path, sep, argument = config_arg.partition(":")
    argv = errors.last_override_wins(["load_config", f"--config={path}{sep}{argument}", *overrides])
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "A run config.", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
        config = flag_values.config
        config.lock()  # a config that failed to load raises here (config_flags defers IOError)
    except (flags.Error, ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        reason = (errors.config_flag_message(e, argv) if isinstance(e, KeyError | AttributeError)
                  else _last_line(e))  # a misspelt field: ml_collections' "Did you mean"
        raise ValueError(f"cannot load {config_arg}{''.join(' ' + o for o in overrides)}: {reason}") from e
    return config, dict(flag_values["config"].override_values)


def _last_line(error: Exception) -> str:
    """config_flags wraps errors of ``get_config`` in a traceback; its last line says what went wrong."""
    lines = [line for line in str(error).strip("'\"").splitlines() if line.strip()]
    return lines[-1].removeprefix("ValueError: ") if lines else type(error).__name__
