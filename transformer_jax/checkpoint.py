"""Checkpoints: orbax manager, resume past damaged steps, averaging.

A checkpoint directory holds one sub-directory per step (``<directory>/<step>/``) with three orbax items:

* ``state``  - the training state, any JAX pytree (``TrainState`` with step, params, opt_state, rng);
  arrays are restored against an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``), so
  they come back laid out on the current mesh. Typed PRNG keys (``jax.random.key``) are stored as such.
* ``data``   - the data iterator's state, a small JSON dict, so a resumed run sees the batches it would have.
* ``config`` - the run config as JSON, so ``evaluate.py`` can rebuild the model before restoring any arrays.

The paper (section 6.1) averages the last 5 checkpoints (base, written every 10 minutes) or the last 20 (big)
for the reported numbers; :func:`average_checkpoints` does that. Keep ``max_to_keep`` >= the number averaged.

Robustness: a save killed mid-way (``kill -9``, preemption) leaves ``<step>.orbax-checkpoint-tmp*``
directories; :class:`Checkpointer` deletes them on start. A damaged latest checkpoint (truncated files,
missing metadata) is skipped with a warning and the previous step is used. (The workdir lock is in
``workdir_lock.py``, the SIGTERM handling in ``preemption.py``.)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

_log = logging.getLogger(__name__)

# Orbax writes a save into "<step>.orbax-checkpoint-tmp" (older releases: "...-tmp-<timestamp>") and renames
# it to "<step>" when the save is complete, so any name containing this suffix is an unfinished save.
TMP_DIR_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
# A damaged step directory "<step>" is renamed to "<step>.damaged-<unix time>", which orbax does not list.
DAMAGED_SUFFIX = ".damaged"

_STATE, _DATA, _CONFIG = "state", "data", "config"


def _now() -> float:
    """Seconds on a monotonic clock (a function so tests can replace it)."""
    return time.monotonic()


def _remove_tmp_dirs(directory: str) -> list[str]:
    """Deletes unfinished orbax saves (``*.orbax-checkpoint-tmp*``) in ``directory``; returns their names."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if TMP_DIR_SUFFIX in name:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(name)
    return removed


def _with_default_sharding(abstract_tree: Any) -> Any:
    """Gives ``ShapeDtypeStruct`` leaves without a sharding the first local device (orbax would guess one)."""
    device = jax.local_devices()[0]

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct) and getattr(leaf, "sharding", None) is None:
            return jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
            )
        return leaf

    return jax.tree.map(fill, abstract_tree)


def _short(error: BaseException, limit: int = 300) -> str:
    """One line naming the exception type, for logs and error messages (tensorstore errors run to pages)."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(error).__name__}: {text}"


class Checkpointer:
    """Saves and restores ``(state, data_state, config)`` at training steps in ``directory``.

    Saves are asynchronous by default: :meth:`save` returns once the arrays are copied off the device, and the
    files are written in the background (the next :meth:`save`, :meth:`wait` or :meth:`close` waits for it).

    Args:
      directory: the checkpoint directory (created if missing); steps live in ``<directory>/<step>/``.
      save_every_steps: :meth:`should_save` is True at positive multiples of this step count; None disables.
      save_every_minutes: :meth:`should_save` is True once this many minutes passed since the last save (or
        since this object was created); None disables. The paper saved every 10 minutes.
      max_to_keep: keep only the newest this many steps (None keeps all). Must be >= the number you average.
      async_save: write files in a background thread.
      read_only: for readers such as ``evaluate.py`` next to a running training job: no tmp-directory cleanup
        (that could delete a save in progress), no renaming of damaged steps, :meth:`save` refused.
      time_check_every: with several processes, the clock is consulted (and process 0's answer broadcast,
        a host sync) only at multiples of this many steps; None means 1 for one process, 100 for several.
    """

    def __init__(
        self,
        directory: str,
        *,
        save_every_steps: int | None,
        save_every_minutes: float | None,
        max_to_keep: int | None = 5,
        async_save: bool = True,
        read_only: bool = False,
        time_check_every: int | None = None,
    ):
        if save_every_steps is not None and (not isinstance(save_every_steps, int) or save_every_steps < 1):
            raise ValueError(f"save_every_steps must be a positive int or None, got {save_every_steps!r}")
        if save_every_minutes is not None and not save_every_minutes > 0:
            raise ValueError(f"save_every_minutes must be positive or None, got {save_every_minutes!r}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep!r}")
        if time_check_every is None:
            time_check_every = 1 if jax.process_count() == 1 else 100
        if time_check_every < 1:
            raise ValueError(f"time_check_every must be >= 1 or None, got {time_check_every!r}")
        self.time_check_every = time_check_every
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every_steps = save_every_steps
        self.save_every_minutes = save_every_minutes
        self.read_only = read_only
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(
                f"checkpoint directory {self.directory} does not exist (opened read-only)"
            )

        if not read_only and jax.process_index() == 0:
            removed = _remove_tmp_dirs(self.directory)
            if removed:
                _log.warning(
                    "Removed %d unfinished checkpoint save(s) left by an interrupted run in %s: %s",
                    len(removed), self.directory, ", ".join(removed))
        if not read_only and jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoint.cleanup")

        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # "Since the last save" starts at construction: the first timed save comes one interval into the run.
        self._last_save_time = _now()
        self._last_saved_step = self._manager.latest_step()

    # ----------------------------------------------------------------------------------------------- listing
    def all_steps(self) -> list[int]:
        """The finished checkpoint steps, ascending (unfinished tmp directories are never listed)."""
        if self.read_only:  # another process may be writing; re-read the directory.
            self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished step, or None if there is none. Not checked for damage; :meth:`restore` is."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        """True if ``step`` is due: a positive multiple of ``save_every_steps``, or ``save_every_minutes`` up.

        A step at or below the last saved (or restored-from) step is never due. With several processes the
        time-based decision is process 0's, broadcast to all, because hosts' clocks differ and all must save
        at the same step; that broadcast is a host sync, so it happens only every ``time_check_every`` steps.
        """
        if self.read_only:
            return False
        if self._last_saved_step is not None and step <= self._last_saved_step:
            return False
        if self.save_every_steps is not None and step > 0 and step % self.save_every_steps == 0:
            return True
        if self.save_every_minutes is None or step % self.time_check_every != 0:
            return False
        due = _now() - self._last_save_time >= 60.0 * self.save_every_minutes
        if jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    def save(self, step: int, state: Any, *, data_state: dict, config: dict, force: bool = False) -> bool:
        """Starts saving ``state``, ``data_state`` and ``config`` as ``step`` if it is due (or ``force``).

        Returns True if a save was started, False if it was not due or ``step`` is already saved. Call it
        every step, or after :meth:`should_save`. All processes must call it together.
        """
        if self.read_only:
            raise ValueError(f"cannot save step {step} to {self.directory}: the Checkpointer is read-only")
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            _log.info(
                "Checkpoint for step %d already exists in %s; not saving it again", step, self.directory)
            return False
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardSave(state),
                _DATA: ocp.args.JsonSave(dict(data_state)),
                _CONFIG: ocp.args.JsonSave(dict(config)),
            }
        )
        started = bool(self._manager.save(step, args=args, force=True))
        if started:
            self._last_save_time = _now()
            self._last_saved_step = step
            _log.info("Saving checkpoint for step %d to %s", step, self.directory)
        return started

    def wait(self) -> None:
        """Blocks until any background save has been written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for background saves and releases orbax's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- restoring
    def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardRestore(_with_default_sharding(abstract_state)),
                _DATA: ocp.args.JsonRestore(),
                _CONFIG: ocp.args.JsonRestore(),
            }
        )
        restored = self._manager.restore(step, args=args)
        data_state, config = restored[_DATA], restored[_CONFIG]
        for name, value in ((_DATA, data_state), (_CONFIG, config)):
            if not isinstance(value, dict):
                raise ValueError(f"item {name!r} should hold a JSON object, got {type(value).__name__}")
        return restored[_STATE], data_state, config

    def _require_step(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}"
            )

    def _quarantine(self, steps: Sequence[int]) -> None:
        """Renames damaged step directories out of orbax's view, so the resumed run can save those steps."""
        if self.read_only or not steps:
            return
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            for step in steps:
                src = os.path.join(self.directory, str(step))
                dst = f"{src}{DAMAGED_SUFFIX}-{int(time.time())}"
                try:
                    os.rename(src, dst)
                    _log.warning("Moved damaged checkpoint %s aside to %s", src, dst)
                except OSError as e:
                    _log.warning("Could not move damaged checkpoint %s aside: %s", src, _short(e))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoint.quarantine")
        self._manager.reload()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict, int]:
        """Restores ``(state, data_state, config, step)``.

        Args:
          abstract_state: the state's structure: a pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding`` for
            sharded arrays, e.g. from ``jax.eval_shape`` plus the mesh's shardings) or of real arrays.
          step: the step to restore; None means the newest step that restores cleanly. A damaged newest step
            is skipped with a warning naming the directory, step and error, and (unless read-only) renamed to
            ``<step>.damaged-<time>`` once an older step restored, so the resumed run can write it again.

        Raises:
          FileNotFoundError: no checkpoints, or ``step`` is not among them.
          RuntimeError: the explicitly requested ``step`` is damaged, or (step None) no step restores; the
            message names the directory, the steps tried and their errors.
        """
        if step is not None:
            self._require_step(step)
            try:
                state, data_state, config = self._restore_step(step, abstract_state)
            except Exception as e:
                raise RuntimeError(
                    f"checkpoint step {step} in {self.directory} could not be restored ({_short(e)}); "
                    f"available steps: {self.all_steps()}"
                ) from e
            self._last_saved_step = max(step, self._last_saved_step or step)
            return state, data_state, config, step

        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoints to restore in {self.directory}")
        failed: list[tuple[int, Exception]] = []
        for candidate in reversed(steps):
            try:
                state, data_state, config = self._restore_step(candidate, abstract_state)
            # Damage shows up as ValueError, OSError, JSONDecodeError or tensorstore errors.
            except Exception as e:
                _log.warning(
                    "Checkpoint step %d in %s is damaged and was skipped (%s); trying an older step",
                    candidate, self.directory, _short(e))
                failed.append((candidate, e))
                continue
            # Only once an older step worked: if all fail the cause is more likely the target than the files.
            self._quarantine([s for s, _ in failed])
            self._last_saved_step = max(candidate, self._last_saved_step or candidate)
            return state, data_state, config, candidate
        details = "; ".join(f"step {s}: {_short(e, 200)}" for s, e in failed)
        raise RuntimeError(
            f"no checkpoint in {self.directory} could be restored (tried steps {[s for s, _ in failed]}): "
            f"{details}. If every step fails the same way, check that abstract_state matches the saved state "
            "(model config)."
        ) from failed[0][1]

    def restore_config(self, step: int | None = None) -> dict:
        """Only the run config of ``step`` (default: the newest step whose config reads); no arrays."""
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if step is not None:
            self._require_step(step)
        if not candidates:
            raise FileNotFoundError(f"no checkpoints to read a config from in {self.directory}")
        errors = []
        for candidate in candidates:
            try:
                config = self._manager.restore(
                    candidate, args=ocp.args.Composite(config=ocp.args.JsonRestore())
                )
                config = config[_CONFIG]
                if not isinstance(config, dict):
                    raise ValueError(f"expected a JSON object, got {type(config).__name__}")
                return config
            except Exception as e:
                if step is not None:
                    raise RuntimeError(
                        f"config of checkpoint step {step} in {self.directory} could not be read "
                        f"({_short(e)})"
                    ) from e
                _log.warning(
                    "Config of checkpoint step %d in %s is damaged (%s); trying an older step",
                    candidate, self.directory, _short(e))
                errors.append(f"step {candidate}: {_short(e, 200)}")
        raise RuntimeError(f"no readable config in {self.directory}: {'; '.join(errors)}")


# ------------------------------------------------------------------------------------------------ averaging
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
    target = _nest(item_path, _with_default_sharding(abstract_params))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)

    # A fresh read-only manager: one that has saved with StandardSave refuses PyTreeRestore for the same item.
    manager = ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
    )
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
            try:
                restored = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            _STATE: ocp.args.PyTreeRestore(
                                target, restore_args=restore_args, partial_restore=True
                            )
                        }
                    ),
                )
            except Exception as e:
                raise RuntimeError(
                    f"checkpoint step {step} in {directory} could not be read for averaging ({_short(e)})"
                ) from e
            params = _subtree(restored[_STATE], item_path)
            params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
            del restored, params
    finally:
        manager.close()
    _log.info("Averaged parameters of steps %s from %s", chosen, directory)
    return jax.tree.map(lambda s, a: (s / last_n).astype(a.dtype), total, abstract_params)
