"""Checkpoint averaging (paper section 6.1): the mean parameters of the last N checkpoints.

The paper averages the last 5 checkpoints (base, written every 10 minutes) or the last 20 (big) for the
reported numbers. Keep the training Checkpointer's ``max_to_keep`` >= the number averaged. Each step read is
checked like a restore: shapes against the target first, then the arrays against their saved checksums.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.checkpoints.integrity import CheckpointMismatchError
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.runtime.errors import short_error

_log = logging.getLogger(__name__)


def average_checkpoints(directory: str, abstract_params_or_state: Any, steps: Sequence[int]) -> Any:
    """The element-wise mean of the parameters saved at ``steps`` (paper section 6.1: the newest N).

    Only the parameters of each saved state are read (``CheckpointReader.read_params``, an orbax partial
    restore), and the mean is a running float32 sum, so memory holds two copies of the parameters. The
    result has the dtypes (and shardings) of the abstract parameters.

    Args:
      directory: a checkpoint directory written by ``manager.Checkpointer``.
      abstract_params_or_state: the abstract parameters, or a whole abstract state with ``.params``.
      steps: the steps to average (e.g. ``restore.steps_to_average``: the newest N up to a step).

    Raises:
      ValueError: no steps, or a step that ``directory`` does not hold (named, with those it has).
      CheckpointMismatchError: a step holds another model's arrays.
      RuntimeError: a step could not be read (named with the directory).
    """
    if not steps:
        raise ValueError("no checkpoint steps to average")
    abstract_params = getattr(abstract_params_or_state, "params", abstract_params_or_state)
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_params,
    )
    reader = CheckpointReader(directory)
    available = reader.all_steps()
    missing = sorted(set(steps) - set(available))
    if missing:
        raise ValueError(f"steps {missing} are not in {directory} (it has {available})")
    chosen = sorted(steps)
    total = None
    for step in chosen:
        try:
            params = reader.read_params(step, abstract_params)
        except CheckpointMismatchError:
            raise
        except Exception as e:
            raise RuntimeError(
                f"checkpoint step {step} in {directory} could not be read for averaging "
                f"({short_error(e)})"
            ) from e
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
        del params
    _log.info("Averaged parameters of steps %s from %s", chosen, directory)
    return jax.tree.map(lambda s, a: (s / len(chosen)).astype(a.dtype), total, abstract_params)
