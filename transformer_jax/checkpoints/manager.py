"""Checkpoints: the orbax manager, saving only finite states, resuming past damaged steps.

A checkpoint directory holds one sub-directory per step (``<directory>/<step>/``) with four orbax items:

* ``state``  - the training state, any JAX pytree (``TrainState`` with step, params, opt_state, rng);
  arrays are restored against an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``), so
  they come back laid out on the current mesh. Typed PRNG keys (``jax.random.key``) are stored as such.
* ``data``   - the data iterator's state, a small JSON dict, so a resumed run sees the batches it would have.
* ``config`` - the run config as JSON, so ``evaluate.py`` can rebuild the model before restoring any arrays.
* ``integrity`` - JSON: per array its shape, dtype and checksum (``integrity.state_digest``), hashes
  of the other two items, and the caller's metadata (train.py: the tokenizer's sha256).

Restoring (listing steps, falling back past damaged ones) is ``reader.CheckpointReader``, which
:class:`Checkpointer` extends with saving; averaging the last N checkpoints (paper section 6.1) is in
``averaging.py``.

Robustness: a state holding NaN/inf is never saved (``NonFiniteStateError``). A save killed mid-way
(``kill -9``, preemption) leaves ``<step>.orbax-checkpoint-tmp*`` directories; :class:`Checkpointer` deletes
them on start. A damaged latest checkpoint is skipped with a warning and the previous step is used
(``reader.py``). (The workdir lock is in ``workdir_lock.py``, the SIGTERM handling in ``preemption.py``.)

A full disk: an asynchronous save fails in the background and orbax reports it only at the next save or
at ``wait_until_finished``. Either way (and for a synchronous failure inside ``save``) the partial
``<step>.orbax-checkpoint-tmp`` directory is removed and ``DiskFullError`` names the filesystem, the step
that could not be saved and the last good checkpoint, which a rerun with space resumes from. Orbax's own
log lines about that failure are dropped (the error says it once). Once the first checkpoint's size is
known, a filesystem with room for fewer than ``SPACE_WARNING_CHECKPOINTS`` more is warned about once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints.integrity import NonFiniteStateError
from transformer_jax.checkpoints.reader import (
    CONFIG_ITEM,
    DATA_ITEM,
    INTEGRITY_ITEM,
    STATE_ITEM,
    CheckpointReader,
)
from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import DiskFullError, MissingFileError, short_error

_log = logging.getLogger(__name__)

# Orbax writes a save into "<step>.orbax-checkpoint-tmp" (older releases: "...-tmp-<timestamp>") and renames
# it to "<step>" when the save is complete, so any name containing this suffix is an unfinished save.
TMP_DIR_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
# Warn once when the free space holds fewer checkpoints than this (the size is known after the first save).
SPACE_WARNING_CHECKPOINTS = 3


class _QuietOrbax(logging.Filter):
    """Drops orbax log records that mean nothing to a user, or that an error of ours already says.

    Orbax logs (through absl) a traceback for a failed background save from each of three threads, and
    notes on every read-only manager ("Given directory is read only"); the Checkpointer reports the first
    as ``DiskFullError`` and the second is what ``read_only=True`` asked for.
    """

    def __init__(self, only_orbax: bool = True):
        super().__init__()
        self.only_orbax = only_orbax

    def filter(self, record: logging.LogRecord) -> bool:
        if self.only_orbax and "/orbax/" not in record.pathname.replace(os.sep, "/"):
            return True
        if record.levelno <= logging.WARNING and "read only" in str(record.msg):
            return False
        error = record.exc_info[1] if record.exc_info else None
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to drop
            return True
        return not (disk.is_disk_full(error) or disk.is_disk_full(Exception(message)))


def _closed_loop_callback(unraisable: Any) -> bool:
    """A tensorstore write finishing after orbax's ``asyncio.run`` returned (after a failed save)."""
    value = unraisable.exc_value
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def quiet_orbax_logs() -> None:
    """Installs ``_QuietOrbax`` on the absl logger, which orbax logs through, and drops the
    "Event loop is closed" callbacks a failed save leaves behind, one traceback per array (idempotent)."""
    for name, only_orbax in (("absl", True), ("asyncio", False)):  # asyncio: "Task exception was never
        logger = logging.getLogger(name)                            # retrieved" for each failed array write
        if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
            logger.addFilter(_QuietOrbax(only_orbax))
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not _closed_loop_callback(unraisable):
            previous(unraisable)

    hook._drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


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


def _join_orbax_threads(timeout_s: float = 120.0) -> None:
    """Waits for orbax's per-item write threads, which outlive a failed save that reported its first error."""
    deadline = _now() + timeout_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax."):
            thread.join(max(0.0, deadline - _now()))


class Checkpointer(CheckpointReader):
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
        self.save_every_steps = save_every_steps
        self.save_every_minutes = save_every_minutes
        directory = os.path.abspath(os.fspath(directory))
        if read_only and not os.path.isdir(directory):
            raise MissingFileError(f"checkpoint directory {directory} does not exist (opened read-only)")

        if not read_only and jax.process_index() == 0:
            removed = _remove_tmp_dirs(directory)
            if removed:
                _log.warning(
                    "Removed %d unfinished checkpoint save(s) left by an interrupted run in %s: %s",
                    len(removed), directory, ", ".join(removed))
        if not read_only and jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoints.manager.cleanup")

        quiet_orbax_logs()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,  # what read_only sets anyway, with a warning
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        super().__init__(directory, ocp.CheckpointManager(directory, options=options), read_only=read_only)
        self._pending_step: int | None = None  # the step of a save that may still be writing
        self._failed = False  # a save failed: orbax re-raises it at every wait, so close() swallows it
        self._space_checked = False
        # "Since the last save" starts at construction: the first timed save comes one interval into the run.
        self._last_save_time = _now()

    # ----------------------------------------------------------------------------------------------- listing
    def existing_steps(self) -> list[int]:
        """The finished steps on disk now (a fresh directory listing, after any background save ended)."""
        if not self._failed:
            try:
                self._manager.wait_until_finished()
            except Exception as e:  # a failed background save: what is on disk is what counts
                self._failed = True
                _log.warning("A background checkpoint save failed: %s", short_error(e))
        return self._steps_on_disk()

    def _steps_on_disk(self) -> list[int]:
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

    def last_good_message(self, steps: list[int] | None = None) -> str:
        """"The last good checkpoint is step N in DIR" naming a step that exists, or "There is no ..."."""
        steps = self.existing_steps() if steps is None else steps
        if not steps:
            return f"There is no checkpoint in {self.directory} yet."
        return f"The last good checkpoint is step {steps[-1]} in {self.directory}."

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

    def save(self, step: int, state: Any, *, data_state: dict, config: dict, force: bool = False,
             metadata: dict | None = None) -> bool:
        """Starts saving ``state``, ``data_state`` and ``config`` as ``step`` if it is due (or ``force``).

        Before saving, one jitted pass over ``state`` computes its checksums and counts non-finite values
        (``integrity.state_digest``); ``metadata`` (a JSON dict) is stored beside them.

        Returns True if a save was started, False if it was not due or ``step`` is already saved. Call it
        every step, or after :meth:`should_save`. All processes must call it together.

        Raises:
          NonFiniteStateError: ``state`` holds NaN or inf; nothing is saved, and the message names the
            step, the arrays and the last good checkpoint that exists.
        """
        if self.read_only:
            raise ValueError(f"cannot save step {step} to {self.directory}: the Checkpointer is read-only")
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
            "metadata": dict(metadata or {}),
        }
        args = ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state), DATA_ITEM: ocp.args.JsonSave(dict(data_state)),
            CONFIG_ITEM: ocp.args.JsonSave(dict(config)), INTEGRITY_ITEM: ocp.args.JsonSave(integrity)})
        self.wait()  # the previous save's failure belongs to its own step (orbax would raise it here)
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
        _join_orbax_threads()  # the other items' writes may still be running: let them end first
        if jax.process_index() == 0:
            _remove_tmp_dirs(self.directory)
        steps = self._steps_on_disk()
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
