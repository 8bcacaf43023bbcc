"""What a checkpoint is checked against: digests of its arrays, the saved run config and the tokenizer.

* ``state_digest``: one jitted pass over the state on its devices, returning per array a 64-bit checksum
  and a count of non-finite values (uint32[num_arrays, 3], the only transfer to the host). The
  Checkpointer computes it at save time only (never on the training hot path): a state holding NaN/inf is
  refused, and the checksums are saved beside the state (the ``integrity`` item). At restore the restored
  arrays are digested again; a mismatch means silent corruption of the files (``CorruptCheckpointError``),
  which the Checkpointer treats like any other damage (warn, fall back to the previous step).
* ``model_differences``: the fields that decide the arrays' shapes or meaning (the model's and the
  vocabulary's) in which two run configs differ, so a resume with a different model fails with one clear
  error before any array is read; ``run_time_differences``: the fields a resume may change (dtype,
  attention kernel, dropout...), for a notice.

The checksum of an array with bits b_i (its elements as uint32, i the flat row-major index) is the pair
  h1 = sum_i b_i * (2 i + 1),   h2 = sum_i mix(b_i) * (golden * i | 1)   (mod 2^32 each),
so a change of any single element always changes h1 (odd multipliers are invertible mod 2^32), and any
other change goes unnoticed with probability about 2^-64. It is order-sensitive and computed from
broadcast iotas, so sharded arrays need no reshape or gather. It costs a small share of a save
(docs/benchmarks.md, "Measurements behind code choices").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime.errors import UserError

DIGEST_FORMAT = 1  # bump when state_digest changes; older digests are then not compared
_GOLDEN = np.uint32(0x9E3779B1)
_MIX = np.uint32(0x45D9F3B)


class NonFiniteStateError(UserError, FloatingPointError):
    """Training produced NaN/inf (in the loss, or in the state about to be saved); nothing bad was saved."""


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint was written for another model (config fields or array shapes differ); not damage."""


class TokenizerMismatchError(UserError, ValueError):
    """The workdir's tokenizer is missing or is not the one the checkpoint was trained with."""


class NoUsableCheckpointError(UserError, RuntimeError):
    """No checkpoint step in the directory could be read; the message lists the steps and their errors."""


class DamagedCheckpointError(UserError, RuntimeError):
    """The checkpoint step asked for does not read (changed files, a missing part); the message names it."""


class CorruptCheckpointError(ValueError):
    """The restored arrays do not match the checksums written at save time (the files changed)."""


def first_few(items: list[str], n: int = 3, sep: str = ", ") -> str:
    """The first ``n`` items joined, and how many more there are."""
    return sep.join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# ------------------------------------------------------------------------------------------------ digests
def _bits(x: jax.Array) -> jax.Array:
    """The elements of ``x`` as uint32 (64-bit elements as two words along a new last axis)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if width in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[width]).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes -> [..., 2]


def _leaf_digest(x: jax.Array) -> jax.Array:
    """uint32[3]: (h1, h2, number of non-finite elements) of one array, in one pass over it."""
    bits = _bits(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = np.uint32(1)
    for axis in reversed(range(bits.ndim)):  # flat row-major index from broadcast iotas: no reshape
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * stride
        stride = np.uint32((int(stride) * bits.shape[axis]) % (1 << 32))
    h1_terms = bits * (index * np.uint32(2) + np.uint32(1))
    h2_terms = ((bits ^ (bits >> 16)) * _MIX) * ((index * _GOLDEN) | np.uint32(1))
    finite = jnp.isfinite(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.ones(x.shape, bool)
    bad_terms = jnp.broadcast_to((~finite).astype(jnp.uint32)[..., None] if bits.ndim > x.ndim
                                 else (~finite).astype(jnp.uint32), bits.shape)
    zero = np.uint32(0)
    # One variadic reduction: a single loop over the array, where three separate sums read it three times.
    sums = jax.lax.reduce((h1_terms, h2_terms, bad_terms), (zero, zero, zero),
                          lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True)),
                          tuple(range(bits.ndim)))
    return jnp.stack(sums)


@jax.jit
def _digest_leaves(leaves: list) -> jax.Array:
    return jnp.stack([_leaf_digest(x) for x in leaves]) if leaves else jnp.zeros((0, 3), jnp.uint32)


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def state_digest(state: Any) -> dict[str, dict]:
    """{array path: {"h": "<16 hex digits>", "shape": [...], "dtype": str, "nonfinite": int}}.

    One jitted reduction over every array of ``state`` (a pytree of jax Arrays, possibly sharded), one
    small transfer to the host. Non-array leaves are skipped.
    """
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0] if isinstance(x, jax.Array)]
    digests = np.asarray(jax.device_get(_digest_leaves([x for _, x in flat])))
    return {
        _path_name(path): {"h": f"{int(d[0]):08x}{int(d[1]):08x}", "shape": list(x.shape),
                           "dtype": str(x.dtype), "nonfinite": int(d[2])}
        for (path, x), d in zip(flat, digests, strict=True)
    }


def nonfinite_arrays(digest: dict[str, dict]) -> list[str]:
    """The paths of the arrays holding NaN or inf."""
    return [path for path, d in digest.items() if d["nonfinite"]]


def shape_differences(saved: dict[str, dict], abstract_state: Any, prefix: str = "") -> list[str]:
    """Where ``abstract_state`` (arrays or ShapeDtypeStructs) differs in structure or shape from ``saved``.

    ``prefix``: the path of ``abstract_state`` inside the saved state (e.g. "params" for a partial read).
    """
    target = {}
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        if hasattr(x, "shape"):
            name = _path_name(path)
            target[f"{prefix}/{name}" if prefix and name else prefix or name] = list(x.shape)
    saved_here = {p: d["shape"] for p, d in saved.items()
                  if not prefix or p == prefix or p.startswith(prefix + "/")}
    out = [f"{p}: saved {saved_here[p]}, expected {target[p]}"
           for p in sorted(set(saved_here) & set(target)) if saved_here[p] != target[p]]
    out += [f"{p}: not in the checkpoint" for p in sorted(set(target) - set(saved_here))]
    if not prefix:
        out += [f"{p}: in the checkpoint, not expected" for p in sorted(set(saved_here) - set(target))]
    return out


def verify_digest(saved: dict[str, dict], restored_state: Any, prefix: str = "") -> None:
    """Raises CorruptCheckpointError if an array of ``restored_state`` differs from its saved checksum.

    Arrays restored with another dtype than saved (a cast on restore) are not compared.
    """
    bad = []
    for path, d in state_digest(restored_state).items():
        path = f"{prefix}/{path}" if prefix and path else prefix or path
        want = saved.get(path)
        if want is not None and want["dtype"] == d["dtype"] and want["h"] != d["h"]:
            bad.append(path)
    if bad:
        raise CorruptCheckpointError(
            f"checksum mismatch in {len(bad)} array(s) ({first_few(bad)}): the files changed after the save")


def json_sha256(value: Any) -> str:
    """A hash of a JSON-able value (the saved data-iterator state and config)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------ config checks
def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: list(tree) if isinstance(tree, tuple) else tree}


# The config fields that decide the arrays' shapes and meaning; the rest (steps, schedules) may change.
COMPARED_SECTIONS = ("model",)
COMPARED_DATA_FIELDS = ("vocab_size", "vocab_type")
# How step 0 draws the arrays, or how a step computes with them (precision, attention kernel, dropout,
# decoding), not their shapes or meaning: a resume may change these (``run_time_differences`` lists them
# for a notice).
RUN_TIME_FIELDS = tuple(f"model.{name}" for name in (
    "attention_init", "dropout_rate", "attention_dropout_rate", "attention_impl", "attention_block_size",
    "dtype", "attention_witness", "deterministic", "decode",
    "decode_cache_len", "decode_beams"))  # the last two: fields of older saved configs (now cache shapes)

# Fields that shape the parameters only under some position schemes (the relative tables' 2k+1 rows):
# compared only when the saved or the new config uses one of those schemes.
SCHEME_FIELDS = {"model.max_relative_position": ("relative",)}


def _as_dict(config: Any) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


def _differences(saved_config: Any, new_config: Any) -> list[tuple[str, Any, Any]]:
    """(field, saved, new) for every model and vocabulary field in which the configs differ.

    A model field missing from a config (one saved before the field existed) is compared as its default,
    as ``run_config_from_saved`` restores it: a field is added with the default that keeps the model it
    was added to.
    """
    saved, new = _as_dict(saved_config), _as_dict(new_config)
    old_fields, new_fields = {}, {}
    model_defaults = _flatten(ModelConfig.settable_defaults(), "model")
    for section in COMPARED_SECTIONS:
        old_fields.update(_flatten(saved.get(section, {}), section))
        new_fields.update(_flatten(new.get(section, {}), section))
    for fields in (old_fields, new_fields):
        for key, default in model_defaults.items():
            fields.setdefault(key, default)
    for name in COMPARED_DATA_FIELDS:
        for fields, config in ((old_fields, saved), (new_fields, new)):
            if name in config.get("data", {}):
                fields[f"data.{name}"] = config["data"][name]
    keys = sorted(set(old_fields) | set(new_fields))
    return [(key, old_fields.get(key), new_fields.get(key)) for key in keys
            if old_fields.get(key) != new_fields.get(key)]


def model_differences(saved_config: Any, new_config: Any) -> list[str]:
    """``["model.d_model: saved 32, new 64", ...]``: the fields that decide the arrays' shapes or meaning
    (the model's, and the vocabulary's) in which the configs differ; ``RUN_TIME_FIELDS`` are not compared.

    Both configs may be dicts (a checkpoint's saved JSON) or ConfigDicts. A model field missing on one side
    is read as its default (``_differences``); any other field missing on one side counts as a difference
    only if the other side sets it to something other than None. A field of
    ``SCHEME_FIELDS`` counts only where either side uses a position scheme that reads it (so a config saved
    before the field existed resumes under the other schemes).
    """
    schemes = {_as_dict(config).get("model", {}).get("position_encoding", "sinusoidal")
               for config in (saved_config, new_config)}
    return [f"{key}: saved {old!r}, new {cur!r}" for key, old, cur in _differences(saved_config, new_config)
            if key not in RUN_TIME_FIELDS and (key not in SCHEME_FIELDS or schemes & set(SCHEME_FIELDS[key]))]


def run_time_differences(saved_config: Any, new_config: Any) -> list[str]:
    """Like ``model_differences``, for the ``RUN_TIME_FIELDS`` a resume may change; a field missing from
    the saved config (saved before it existed) is not listed."""
    return [f"{key}: saved {old!r}, new {cur!r}" for key, old, cur in _differences(saved_config, new_config)
            if key in RUN_TIME_FIELDS and old is not None]
