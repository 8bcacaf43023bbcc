"""Reading checkpoints back: listing steps, restoring a state or its parameters, past damaged steps.

``CheckpointReader`` is the half of ``manager.Checkpointer`` that never writes a checkpoint; the
Checkpointer adds saving. A step directory holds four orbax items (``manager.py`` describes them). Restoring
checks the saved shapes against the target before any array is read (another model's arrays raise
``CheckpointMismatchError``, which is not damage), then verifies every array's checksum and the hashes of
the JSON items. With no step given, a damaged newest step (truncated files, missing metadata, changed
arrays) is skipped with a warning and the previous one is used; unless read-only, the damaged directories
are then renamed ``<step>.damaged-<time>`` so that a resumed run can save those steps again. A step
deleted while it is read (``max_to_keep`` of a running trainer) is skipped for the newest that exists.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints.integrity import CheckpointMismatchError, NoUsableCheckpointError
from transformer_jax.runtime.errors import MissingFileError, short_error
from transformer_jax.runtime.sharding import with_default_sharding

_log = logging.getLogger(__name__)

STATE_ITEM, DATA_ITEM, CONFIG_ITEM, INTEGRITY_ITEM = "state", "data", "config", "integrity"
# A damaged step directory "<step>" is renamed to "<step>.damaged-<unix time>", which orbax does not list.
DAMAGED_SUFFIX = ".damaged"


class CheckpointReader:
    """Lists and restores the steps of a checkpoint directory through an orbax ``CheckpointManager``.

    Args:
      directory: the absolute checkpoint directory; steps live in ``<directory>/<step>/``.
      manager: the orbax manager over ``directory``.
      read_only: another process may be writing (re-list before each read) and damaged steps are
        left where they are.
    """

    def __init__(self, directory: str, manager: ocp.CheckpointManager, *, read_only: bool):
        self.directory = directory
        self.read_only = read_only
        self._manager = manager
        # The newest step saved or restored from (``Checkpointer.should_save`` never saves at or below it).
        self._last_saved_step: int | None = manager.latest_step()

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

    # --------------------------------------------------------------------------------------------- restoring
    def _read_integrity(self, step: int) -> dict | None:
        """The ``integrity`` item of ``step``; None for checkpoints written before it existed."""
        if not os.path.isdir(os.path.join(self.directory, str(step), INTEGRITY_ITEM)):
            return None
        integrity = self._manager.restore(
            step, args=ocp.args.Composite(**{INTEGRITY_ITEM: ocp.args.JsonRestore()}))[INTEGRITY_ITEM]
        if not isinstance(integrity, dict) or not isinstance(integrity.get("arrays"), dict):
            raise ValueError(f"item {INTEGRITY_ITEM!r} should hold a JSON object with 'arrays'")
        return integrity

    def check_shapes(self, step: int, abstract_state: Any, prefix: str = "") -> dict | None:
        """Checks the saved shapes against ``abstract_state`` before reading arrays; returns the integrity.

        Raises:
          CheckpointMismatchError: the checkpoint holds another model's arrays (listed, saved vs expected).
        """
        integrity = self._read_integrity(step)
        if integrity is None:
            return None
        differences = checks.shape_differences(integrity["arrays"], abstract_state, prefix)
        if differences:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} holds another model's arrays "
                f"({checks.first_few(differences, 6, '; ')}). "
                "Use the model config it was trained with, or another workdir.")
        return integrity

    def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        integrity = self.check_shapes(step, abstract_state)
        target = with_default_sharding(abstract_state)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target),
                                     DATA_ITEM: ocp.args.JsonRestore(), CONFIG_ITEM: ocp.args.JsonRestore()})
        restored = self._manager.restore(step, args=args)
        data_state, config = restored[DATA_ITEM], restored[CONFIG_ITEM]
        for name, value in ((DATA_ITEM, data_state), (CONFIG_ITEM, config)):
            if not isinstance(value, dict):
                raise ValueError(f"item {name!r} should hold a JSON object, got {type(value).__name__}")
        if integrity is not None:
            if integrity.get("format") == checks.DIGEST_FORMAT:
                checks.verify_digest(integrity["arrays"], restored[STATE_ITEM])
            for name, value in ((DATA_ITEM, data_state), (CONFIG_ITEM, config)):
                if integrity.get(f"{name}_sha256") not in (None, checks.json_sha256(value)):
                    raise checks.CorruptCheckpointError(f"item {name!r} changed after the save")
        return restored[STATE_ITEM], data_state, config

    def _require_step(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise MissingFileError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}")

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
                    _log.warning("Could not move damaged checkpoint %s aside: %s", src, short_error(e))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax.checkpoints.reader.quarantine")
        self._manager.reload()

    def read_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of ``step`` (an orbax partial restore): no optimizer moments are read.

        ``abstract_params`` is the ``params`` sub-tree of the saved state's structure. Checksums of the
        arrays read are verified as in :meth:`restore`.
        """
        integrity = self.check_shapes(step, abstract_params, prefix="params")
        target = {"params": with_default_sharding(abstract_params)}
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
            target, restore_args=restore_args, partial_restore=True)}))[STATE_ITEM]
        if integrity is not None and integrity.get("format") == checks.DIGEST_FORMAT:
            checks.verify_digest(integrity["arrays"], restored)
        return restored["params"]

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict, int]:
        """Restores ``(state, data_state, config, step)``.

        Args:
          abstract_state: the state's structure: a pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding`` for
            sharded arrays, e.g. from ``jax.eval_shape`` plus the mesh's shardings) or of real arrays.
          step: the step to restore; None means the newest step that restores cleanly. A damaged newest step
            is skipped with a warning naming the directory, step and error, and (unless read-only) renamed to
            ``<step>.damaged-<time>`` once an older step restored, so the resumed run can write it again.
            A step deleted while read (a trainer's ``max_to_keep``) is skipped for the newest that exists.

        Raises:
          FileNotFoundError: no checkpoints, or ``step`` is not among them.
          CheckpointMismatchError: the saved arrays have other shapes than ``abstract_state`` (not damage).
          RuntimeError: the explicitly requested ``step`` is damaged, or (step None) no step restores; the
            message names the directory, the steps tried and their errors.
        """
        (state, data_state, config), step = self._read_good_step(
            lambda s: self._restore_step(s, abstract_state), step, "abstract_state")
        return state, data_state, config, step

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """``(params, step)``: the parameters alone (:meth:`read_params`), with :meth:`restore`'s fallback."""
        return self._read_good_step(lambda s: self.read_params(s, abstract_params), step, "abstract_params")

    def _read_good_step(self, read: Callable[[int], Any], step: int | None,
                        target_name: str) -> tuple[Any, int]:
        """``(read(step), step)``; with ``step`` None, the newest step that reads, skipping damaged ones."""
        if step is not None:
            self._require_step(step)
            try:
                value = read(step)
            except CheckpointMismatchError:
                raise
            except Exception as e:
                raise RuntimeError(
                    f"checkpoint step {step} in {self.directory} could not be restored ({short_error(e)}); "
                    f"available steps: {self.all_steps()}"
                ) from e
            self._last_saved_step = max(step, self._last_saved_step or step)
            return value, step

        if not self.all_steps():
            raise MissingFileError(f"no checkpoints to restore in {self.directory}")
        failed: list[tuple[int, Exception]] = []
        while candidates := [s for s in self.all_steps() if s not in {f for f, _ in failed}]:
            candidate = candidates[-1]
            try:
                value = read(candidate)
            except CheckpointMismatchError:
                raise
            # Damage shows up as ValueError, OSError, JSONDecodeError, tensorstore or checksum errors.
            except Exception as e:
                if not os.path.isdir(os.path.join(self.directory, str(candidate))):
                    _log.warning("Checkpoint step %d in %s was removed while it was read (a running trainer "
                                 "keeps only its newest checkpoints); taking the newest one that exists",
                                 candidate, self.directory)
                    failed.append((candidate, None))
                    continue
                _log.warning(
                    "Checkpoint step %d in %s is damaged and was skipped (%s); trying an older step",
                    candidate, self.directory, short_error(e))
                failed.append((candidate, e))
                continue
            # Only once an older step worked: if all fail the cause is more likely the target than the files.
            self._quarantine([s for s, e in failed if e is not None])
            self._last_saved_step = max(candidate, self._last_saved_step or candidate)
            return value, candidate
        errors = [(s, e) for s, e in failed if e is not None]
        details = "; ".join(f"step {s}: {short_error(e, 200)}" for s, e in errors)
        raise NoUsableCheckpointError(
            f"no checkpoint in {self.directory} could be restored (tried steps {[s for s, _ in failed]}): "
            f"{details}. If every step fails the same way, check that {target_name} matches the saved state "
            "(model config)."
        ) from (errors[0][1] if errors else None)

    def saved_info(self, step: int | None = None) -> tuple[int, dict, dict]:
        """``(step, config, metadata)`` of ``step`` (default: the newest step whose config reads); no arrays.

        ``metadata`` is what :meth:`save` was given (empty for checkpoints older than the integrity item).
        """
        if step is not None:
            self._require_step(step)
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise MissingFileError(f"no checkpoints to read a config from in {self.directory}")
        errors = []
        for candidate in candidates:
            try:
                config = self._manager.restore(
                    candidate, args=ocp.args.Composite(config=ocp.args.JsonRestore())
                )[CONFIG_ITEM]
                if not isinstance(config, dict):
                    raise ValueError(f"expected a JSON object, got {type(config).__name__}")
                integrity = self._read_integrity(candidate) or {}
                return candidate, config, dict(integrity.get("metadata", {}))
            except Exception as e:
                if step is not None:
                    raise RuntimeError(
                        f"config of checkpoint step {step} in {self.directory} could not be read "
                        f"({short_error(e)})"
                    ) from e
                if not os.path.isdir(os.path.join(self.directory, str(candidate))):
                    continue  # removed by a running trainer while we read it
                _log.warning(
                    "Config of checkpoint step %d in %s is damaged (%s); trying an older step",
                    candidate, self.directory, short_error(e))
                errors.append(f"step {candidate}: {short_error(e, 200)}")
        raise NoUsableCheckpointError(f"no readable config in {self.directory}: {'; '.join(errors)}")
