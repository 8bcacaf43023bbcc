"""Checkpoints: the orbax manager, saving only finite states, resuming past damaged steps.

A checkpoint directory holds one sub-directory per step (``<directory>/<step>/``) with four orbax items:

* ``state``  - the training state, any JAX pytree (``TrainState`` with step, params, opt_state, rng);
  arrays are restored against an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``), so
  they come back laid out on the current mesh. Typed PRNG keys (``jax.random.key``) are stored as such.
* ``data``   - the data iterator's state, a small JSON dict, so a resumed run sees the batches it would have.
* ``config`` - the run config as JSON, so ``evaluate.py`` can rebuild the model before restoring any arrays.
* ``integrity`` - JSON: per array its shape, dtype and checksum (``integrity.state_digest``), hashes
  of the other two items, and the caller's metadata (train.py: the tokenizer's sha256).

Reading (listing steps, restoring, falling back past damaged ones) is ``reader.CheckpointReader``, which
stands alone for evaluation; :class:`Checkpointer`, training's writer, reads through one. Averaging the
last N checkpoints (paper section 6.1) is in ``averaging.py``.

Robustness: a state holding NaN/inf is never saved (``NonFiniteStateError``). A save killed mid-way
(``kill -9``, preemption) leaves ``<step>.orbax-checkpoint-tmp*`` directories; :class:`Checkpointer` deletes
them on start. A damaged latest checkpoint is skipped with a warning and the previous step is used
(``reader.py``); on resume the Checkpointer renames it ``<step>.damaged-<time>``. (The workdir lock is in
``workdir_lock.py``, the SIGTERM handling in ``preemption.py``.)

A full disk: an asynchronous save fails in the background and orbax reports it only at the next save or
at ``wait_until_finished``. Either way (and for a synchronous failure inside ``save``) the partial
``<step>.orbax-checkpoint-tmp`` directory is removed and ``DiskFullError`` names the filesystem, the step
that could not be saved and the last good checkpoint, which a rerun with space resumes from. Orbax's own
reports of that failure are dropped (the error says it once; see ``orbax_workarounds.py``). Once the first
checkpoint's size is known, a filesystem with room for fewer than ``SPACE_WARNING_CHECKPOINTS`` more is
warned about once.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints import orbax_workarounds
from transformer_jax.checkpoints.integrity import NonFiniteStateError
from transformer_jax.checkpoints.reader import (
    CONFIG_ITEM,
    DATA_ITEM,
    INTEGRITY_ITEM,
    PREEMPTION_SAVE,
    STATE_ITEM,
    STEP_NAMES,
    CheckpointReader,
)
from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import DiskFullError, short_error

_log = logging.getLogger(__name__)

# Orbax writes a save into "<step>.orbax-checkpoint-tmp" (older releases: "...-tmp-<timestamp>") and renames
# it to "<step>" when the save is complete, so any name containing this suffix is an unfinished save.
TMP_DIR_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
# A damaged step directory "<step>" is renamed to "<step>.damaged-<unix time>", which orbax does not list.
DAMAGED_SUFFIX = ".damaged"
# Warn once when the free space holds fewer checkpoints than this (the size is known after the first save).
SPACE_WARNING_CHECKPOINTS = 3


def _now() -> float:
    """Seconds on a monotonic clock (a function so tests can replace it)."""
    return time.monotonic()


class _KeepScheduled:
    """Orbax's retention policy for the Checkpointer: keeps the newest ``n`` scheduled saves (all with
    ``n`` None) and the newest step, whatever it is; a preemption save (``is_preemption``) that a newer
    step replaced is dropped, and never counts among the ``n``."""

    def __init__(self, n: int | None, is_preemption):
        self.n, self.is_preemption = n, is_preemption

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        del context
        steps = [info.step for info in checkpoints]
        scheduled = sorted(s for s in steps if not self.is_preemption(s))
        kept = set(scheduled if self.n is None else scheduled[max(0, len(scheduled) - self.n):])
        kept.add(max(steps, default=None))
        return [s in kept for s in steps]


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


class Checkpointer:
    """Saves ``(state, data_state, config)`` at training steps in ``directory``, and resumes from it.

    Saves are asynchronous by default: :meth:`save` returns once the arrays are copied off the device, and the
    files are written in the background (the next :meth:`save`, :meth:`wait` or :meth:`close` waits for it).
    Reads go through ``self.reader`` (a :class:`CheckpointReader`); :meth:`restore` adds what only the
    writer may do: renaming damaged steps aside.

    Args:
      directory: the checkpoint directory (created if missing); steps live in ``<directory>/<step>/``.
      save_every_steps: :meth:`should_save` is True at positive multiples of this step count; None disables.
      save_every_minutes: :meth:`should_save` is True once this many minutes passed since the last save (or
        since this object was created); None disables. The paper saved every 10 minutes.
      max_to_keep: keep only the newest this many steps (None keeps all). Must be >= the number you average.
      async_save: write files in a background thread.
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
        self.save_every_steps = save_every_steps
        self.save_every_minutes = save_every_minutes
        self.directory = os.path.abspath(os.fspath(directory))

        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            removed = _remove_tmp_dirs(self.directory)
            if removed:
                _log.warning(
                    "Removed %d unfinished checkpoint save(s) left by an interrupted run in %s: %s",
                    len(removed), self.directory, ", ".join(removed))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoints.manager.cleanup")

        orbax_workarounds.install()
        self.reader = CheckpointReader(self.directory)
        # Saves forced by a preemption, off the schedule: kept out of max_to_keep (see _KeepScheduled).
        self._preemption_saves = {s for s in self.reader.all_steps() if self.reader.is_preemption_save(s)}
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_KeepScheduled(max_to_keep, self._preemption_saves.__contains__),
            step_name_format=STEP_NAMES, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending_step: int | None = None  # the step of a save that may still be writing
        self._failed = False  # a save failed: orbax re-raises it at every wait, so close() swallows it
        self._space_checked = False
        # The newest step saved or resumed from: :meth:`should_save` never saves at or below it.
        self._last_saved_step: int | None = self.reader.latest_step()
        # "Since the last save" starts at construction: the first timed save comes one interval into the run.
        self._last_save_time = _now()

    # ------------------------------------------------------------------------------------------------ reading
    def all_steps(self) -> list[int]:
        """The finished steps on disk, after any background save ended (a failed one raises, as in wait)."""
        self.wait()
        return self.reader.all_steps()

    def averageable_steps(self, end: int) -> list[int]:
        """``CheckpointReader.averageable_steps``, after any background save ended: the scheduled saves up
        to ``end``, and ``end``."""
        self.wait()
        return self.reader.averageable_steps(end)

    def last_good_message(self, steps: list[int] | None = None) -> str:
        """"The last good checkpoint is step N in DIR" naming a step that exists, or "There is no ...".

        For messages of other errors: a failed background save is logged here, not raised.
        """
        if steps is None:
            try:
                self.wait()
            except Exception as e:
                _log.warning("A background checkpoint save failed: %s", short_error(e))
            steps = self.reader.all_steps()
        if not steps:
            return f"There is no checkpoint in {self.directory} yet."
        return f"The last good checkpoint is step {steps[-1]} in {self.directory}."

    def restore(self, abstract_state: Any) -> tuple[Any, dict, dict, int]:
        """Resumes: ``(state, data_state, config, step)`` of the newest step that restores cleanly.

        As ``CheckpointReader.restore`` with ``step`` None; the damaged newer steps it skipped are then
        renamed ``<step>.damaged-<time>`` (only once an older step restored: if all fail, the cause is more
        likely the target than the files), so that the resumed run can save those steps again.
        """
        (state, data_state, config), step, damaged = self.reader.read_good_step(
            lambda s: self.reader.read_state(s, abstract_state), None, "abstract_state")
        self._quarantine(damaged)
        # The newest step still on disk: a damaged one moved aside no longer holds back the saves after
        # ``step`` (one that could not be moved still exists, and orbax would not write it again).
        self._last_saved_step = max([step, *self.reader.all_steps()])
        return state, data_state, config, step

    def _quarantine(self, steps: list[int]) -> None:
        """Renames damaged step directories out of orbax's view, so the resumed run can save those steps."""
        if not steps:
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
                    _log.warning("Could not move damaged checkpoint %s aside: %s", src, short_error(e))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoints.manager.quarantine")
        self._manager.reload()

    # ------------------------------------------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        """True if ``step`` is due: a positive multiple of ``save_every_steps``, or ``save_every_minutes`` up.

        A step at or below the last saved (or restored-from) step is never due. With several processes the
        time-based decision is process 0's, broadcast to all, because hosts' clocks differ and all must save
        at the same step; that broadcast is a host sync, so it happens only every ``time_check_every`` steps.
        """
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

    def save(self, step: int, state: Any, *, data_state: dict, config: dict, force: bool = False,
             metadata: dict | None = None, preemption: bool = False) -> bool:
        """Starts saving ``state``, ``data_state`` and ``config`` as ``step`` if it is due (or ``force``).

        Before saving, one jitted pass over ``state`` computes its checksums and counts non-finite values
        (``integrity.state_digest``); ``metadata`` (a JSON dict) is stored beside them. ``preemption``: a
        save forced off the schedule because the run stops; it is marked so, kept only until a newer step
        is saved, never counted in ``max_to_keep``, and not averaged (``averageable_steps``).

        Returns True if a save was started, False if it was not due or ``step`` is already saved. Call it
        every step, or after :meth:`should_save`. All processes must call it together.

        Raises:
          NonFiniteStateError: ``state`` holds NaN or inf; nothing is saved, and the message names the
            step, the arrays and the last good checkpoint that exists.
        """
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            _log.info(
                "Checkpoint for step %d already exists in %s; not saving it again", step, self.directory)
            return False
        digest = checks.state_digest(state)
        bad = checks.nonfinite_arrays(digest)
        if bad:
            raise NonFiniteStateError(
                f"the state after step {step} holds NaN/inf in {len(bad)} of {len(digest)} arrays "
                f"({checks.first_few(bad)}); "
                f"it was not saved. {self.last_good_message()} Lower the learning rate "
                "(train.learning_rate_scale) or check the data, then run again to resume from it.")
        integrity = {
            "format": checks.DIGEST_FORMAT,
            "arrays": {p: {k: d[k] for k in ("h", "shape", "dtype")} for p, d in digest.items()},
            "data_sha256": checks.json_sha256(dict(data_state)),
            "config_sha256": checks.json_sha256(dict(config)),
            "metadata": {**(metadata or {}), **({PREEMPTION_SAVE: True} if preemption else {})},
        }
        args = ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state), DATA_ITEM: ocp.args.JsonSave(dict(data_state)),
            CONFIG_ITEM: ocp.args.JsonSave(dict(config)), INTEGRITY_ITEM: ocp.args.JsonSave(integrity)})
        self.wait()  # the previous save's failure belongs to its own step (orbax would raise it here)
        if preemption:  # before orbax's retention policy sees the step
            self._preemption_saves.add(step)
        try:
            started = bool(self._manager.save(step, args=args, force=True))
        except Exception as e:
            self._save_failed(step, e)
        if started:
            self._last_save_time = _now()
            self._last_saved_step = step
            self._pending_step = step
            _log.info("Saving checkpoint for step %d to %s", step, self.directory)
        return started

    def wait(self) -> None:
        """Blocks until any background save has been written.

        Raises:
          DiskFullError: that save ran out of space (its partial directory is removed).
        """
        if self._failed:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._save_failed(self._pending_step, e)
        finished, self._pending_step = self._pending_step, None
        if finished is not None:
            self._check_space(finished)

    def _save_failed(self, step: int | None, error: Exception) -> None:
        """Raises ``DiskFullError`` for a save of ``step`` that ran out of space, else ``error`` itself."""
        self._failed = True
        self._pending_step = None
        if not disk.is_disk_full(error):
            raise error
        orbax_workarounds.join_commit_threads()  # the other items' writes may still be running
        if jax.process_index() == 0:
            _remove_tmp_dirs(self.directory)
        steps = self.reader.all_steps()
        self._last_saved_step = steps[-1] if steps else None
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        raise DiskFullError(
            f"the disk is full: {what} could not be saved, "
            f"{disk.describe_filesystem(self.directory, space=False)} ran out of space (its partial files "
            f"were removed: {disk.describe_space(self.directory)} now). "
            f"{self.last_good_message(steps)} Free some space (or lower checkpoint_keep, or use a workdir on "
            "a larger disk) and run the same command again to resume from it.") from error

    def _check_space(self, step: int) -> None:
        """Once, after the first finished save: warns if the disk holds fewer than a few more like it."""
        if self._space_checked or jax.process_index() != 0:
            return
        self._space_checked = True
        path = os.path.join(self.directory, str(step))
        if not os.path.isdir(path):
            return
        size, free = disk.directory_bytes(path), disk.free_bytes(self.directory)
        if size and free < SPACE_WARNING_CHECKPOINTS * size:
            _log.warning(
                "Low disk space: %s has room for %d more checkpoint(s) of %s (step %d); a run keeps "
                "writing new ones before deleting old ones. Free some space or lower checkpoint_keep.",
                disk.describe_filesystem(self.directory), free // size, disk.human_bytes(size), step)

    def close(self) -> None:
        """Waits for background saves and releases orbax's resources (also when a save failed)."""
        try:
            self.wait()
        finally:
            if self._failed:  # orbax raises the failure again from its close; it was reported once
                try:
                    self._manager.close()
                except Exception as e:
                    _log.info("Closing after a failed save: %s", short_error(e))
            else:
                self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        try:  # also on an exception: finish the save in flight (then the original error propagates)
            self.close()
        except Exception as e:
            if exc_type is None:
                raise
            _log.warning("Closing the checkpointer of %s failed: %s", self.directory,
                         str(e) if isinstance(e, DiskFullError) else short_error(e))
