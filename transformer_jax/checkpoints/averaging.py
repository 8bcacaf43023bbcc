"""Checkpoint averaging (paper section 6.1): the mean parameters of the last N checkpoints.

The paper averages the last 5 checkpoints (base, written every 10 minutes) or the last 20 (big) for the
reported numbers. Keep the Checkpointer's ``max_to_keep`` >= the number averaged. Each step read is
checked like a restore: shapes against the target first, then the arrays against their saved checksums.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.checkpoints.integrity import CheckpointMismatchError
from transformer_jax.checkpoints.manager import Checkpointer
from transformer_jax.runtime.errors import short_error

_log = logging.getLogger(__name__)


def average_checkpoints(
    directory: str, abstract_params_or_state: Any, last_n: int, *, steps: Sequence[int] | None = None,
) -> Any:
    """The element-wise mean of the parameters of the newest ``last_n`` checkpoints (paper section 6.1).

    Only the parameters of each saved state are read (``Checkpointer.read_params``, an orbax partial
    restore), and the mean is a running float32 sum, so memory holds two copies of the parameters. The
    result has the dtypes (and shardings) of the abstract parameters.

    Args:
      directory: a checkpoint directory written by :class:`Checkpointer`.
      abstract_params_or_state: the abstract parameters, or a whole abstract state with ``.params``.
      last_n: how many of the newest steps to average (5 for base, 20 for big).
      steps: average exactly these steps instead of the newest ``last_n`` (e.g. the N ending at a step).

    Raises:
      ValueError: fewer than ``last_n`` steps exist (the paper's protocol needs exactly ``last_n``).
      CheckpointMismatchError: a step holds another model's arrays.
      RuntimeError: a step could not be read (named with the directory).
    """
    if last_n < 1:
        raise ValueError(f"last_n must be >= 1, got {last_n}")
    abstract_params = getattr(abstract_params_or_state, "params", abstract_params_or_state)
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_params,
    )
    reader = Checkpointer(directory, save_every_steps=None, save_every_minutes=None, read_only=True)
    try:
        available = reader.all_steps()
        if steps is not None:
            missing = sorted(set(steps) - set(available))
            if missing:
                raise ValueError(f"steps {missing} are not in {directory} (it has {available})")
            available = sorted(steps)
        steps = available
        if len(steps) < last_n:
            raise ValueError(
                f"averaging needs the last {last_n} checkpoints but {directory} has {len(steps)} "
                f"(steps {steps}); train longer, lower last_n, or set Checkpointer(max_to_keep>={last_n})"
            )
        chosen = steps[-last_n:]
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
    finally:
        reader.close()
    _log.info("Averaged parameters of steps %s from %s", chosen, directory)
    return jax.tree.map(lambda s, a: (s / last_n).astype(a.dtype), total, abstract_params)
