"""Checkpoint averaging (paper section 6.1): the mean parameters of the last N checkpoints.

The paper averages the last 5 checkpoints (base, written every 10 minutes) or the last 20 (big) for the
reported numbers. Keep the Checkpointer's ``max_to_keep`` >= the number averaged. Each step read is
checked like a restore: shapes against the target first, then the arrays against their saved checksums.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints.manager import STATE_ITEM, Checkpointer
from transformer_jax.runtime.errors import short_error
from transformer_jax.runtime.sharding import with_default_sharding

_log = logging.getLogger(__name__)


def _subtree(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        tree = tree[key] if isinstance(tree, Mapping) else getattr(tree, key)
    return tree


def _nest(path: Sequence[str], leaf_tree: Any) -> Any:
    for key in reversed(path):
        leaf_tree = {key: leaf_tree}
    return leaf_tree


def average_checkpoints(
    directory: str, abstract_params_or_state: Any, last_n: int, *, item_path: Sequence[str] = ("params",),
    steps: Sequence[int] | None = None,
) -> Any:
    """The element-wise mean of the parameters of the newest ``last_n`` checkpoints (paper section 6.1).

    Only the sub-tree at ``item_path`` of each saved state is read (an orbax partial restore), and the mean is
    a running float32 sum, so memory holds two copies of the parameters. The result has the dtypes (and
    shardings) of the abstract parameters.

    Args:
      directory: a checkpoint directory written by :class:`Checkpointer`.
      abstract_params_or_state: the abstract parameters, or the whole abstract state (its ``item_path``
        sub-tree is used if it has one; a parameter tree that itself contains ``item_path`` is therefore
        mistaken for a state: pass the state then).
      last_n: how many of the newest steps to average (5 for base, 20 for big).
      item_path: where the parameters sit in the saved state.
      steps: average exactly these steps instead of the newest ``last_n`` (e.g. the N ending at a step).

    Raises:
      ValueError: fewer than ``last_n`` steps exist (the paper's protocol needs exactly ``last_n``).
      RuntimeError: a step could not be read (named with the directory).
    """
    if last_n < 1:
        raise ValueError(f"last_n must be >= 1, got {last_n}")
    item_path = tuple(item_path)
    try:
        abstract_params = _subtree(abstract_params_or_state, item_path)
    except (KeyError, AttributeError, TypeError):
        abstract_params = abstract_params_or_state
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_params,
    )
    target = _nest(item_path, with_default_sharding(abstract_params))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)

    # A fresh read-only manager: one that has saved with StandardSave refuses PyTreeRestore for the same item.
    manager = ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
    )
    reader = Checkpointer(directory, save_every_steps=None, save_every_minutes=None, read_only=True)
    try:
        available = sorted(int(s) for s in manager.all_steps())
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
            integrity = reader.check_shapes(step, abstract_params, prefix="/".join(item_path))
            try:
                restored = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE_ITEM: ocp.args.PyTreeRestore(
                                target, restore_args=restore_args, partial_restore=True
                            )
                        }
                    ),
                )
                if integrity is not None and integrity.get("format") == checks.DIGEST_FORMAT:
                    checks.verify_digest(integrity["arrays"], restored[STATE_ITEM])
            except Exception as e:
                raise RuntimeError(
                    f"checkpoint step {step} in {directory} could not be read for averaging "
                    f"({short_error(e)})"
                ) from e
            params = _subtree(restored[STATE_ITEM], item_path)
            params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
            del restored, params
    finally:
        manager.close()
        reader.close()
    _log.info("Averaged parameters of steps %s from %s", chosen, directory)
    return jax.tree.map(lambda s, a: (s / last_n).astype(a.dtype), total, abstract_params)
