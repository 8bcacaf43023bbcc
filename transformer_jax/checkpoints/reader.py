"""Reading checkpoints back: listing steps, restoring a state or its parameters, past damaged steps.

``CheckpointReader`` never writes: ``evaluate.py``, averaging and inspection read through it, beside a
training run that may be writing the same directory, and the training ``manager.Checkpointer`` reads
through one too (it alone renames damaged steps aside). A step directory holds four orbax items
(``manager.py`` describes them).

Restoring checks the saved shapes against the target before any array is read (another model's arrays
raise ``CheckpointMismatchError``, which is not damage), then verifies every array's checksum and the
hashes of the JSON items. With no step given, a damaged newest step (truncated files, missing metadata,
changed arrays) is skipped with a warning and the previous one is used; a step deleted while it is read
(``max_to_keep`` of a running trainer) is skipped for the newest that exists.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp

from transformer_jax.checkpoints import integrity as checks
from transformer_jax.checkpoints import orbax_workarounds
from transformer_jax.checkpoints.integrity import (
    CheckpointMismatchError,
    DamagedCheckpointError,
    NoUsableCheckpointError,
)
from transformer_jax.runtime.errors import MissingFileError, short_error
from transformer_jax.runtime.sharding import with_default_sharding

_log = logging.getLogger(__name__)

STATE_ITEM, DATA_ITEM, CONFIG_ITEM, INTEGRITY_ITEM = "state", "data", "config", "integrity"
# Step directories are named by the step alone ("<directory>/<step>"), as orbax's CheckpointManager names
# them by default; unfinished saves ("<step>.orbax-checkpoint-tmp") and other names are never listed.
STEP_NAMES = ocp.path.step.standard_name_format()
# The metadata key (in the ``integrity`` item) of a save forced by SIGTERM / SIGINT off the schedule: it is
# there to resume from, and is neither averaged (unless asked for) nor counted among the kept steps.
PREEMPTION_SAVE = "preemption_save"


class CheckpointReader:
    """Lists and restores the steps of the checkpoint directory ``directory`` without writing to it.

    It holds nothing but the directory's name: every listing reads the directory afresh (so steps that a
    running trainer saves or deletes meanwhile are seen), and every read opens its own orbax
    ``Checkpointer``, so a read of the whole state and one of the parameters alone can follow each other.

    Raises:
      MissingFileError: ``directory`` does not exist.
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(self.directory):
            raise MissingFileError(f"checkpoint directory {self.directory} does not exist")

    # ----------------------------------------------------------------------------------------------- listing
    def all_steps(self) -> list[int]:
        """The finished checkpoint steps, ascending."""
        return sorted(metadata.step for metadata in STEP_NAMES.find_all(self.directory))

    def latest_step(self) -> int | None:
        """The newest finished step, or None if there is none. Not checked for damage; :meth:`restore` is."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def is_preemption_save(self, step: int) -> bool:
        """Whether ``step`` was saved because the run was stopped, off the save schedule (a step whose
        integrity item cannot be read counts as scheduled: reading it for averaging then fails, naming it)."""
        try:
            integrity = self._read_integrity(step) or {}
        except Exception:  # damaged or being deleted
            return False
        return (integrity.get("metadata") or {}).get(PREEMPTION_SAVE) is True

    def averageable_steps(self, end: int) -> list[int]:
        """The steps up to ``end`` that averaging may take, ascending: the scheduled saves, and ``end``.

        A save forced by a preemption is left out (unless it is ``end`` itself), so that a run that was
        stopped and resumed averages the same steps as one that ran through.
        """
        return [s for s in self.all_steps() if s == end or (s < end and not self.is_preemption_save(s))]

    def _require_step(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise MissingFileError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}")

    def _removed(self, step: int) -> bool:
        return not os.path.isdir(os.path.join(self.directory, str(step)))

    # --------------------------------------------------------------------------------------- reading a step
    def _read_items(self, step: int, **items: ocp.args.CheckpointArgs) -> dict[str, Any]:
        """The named orbax items of ``step``, read with their restore arguments.

        A read that fails leaves the step's other reads in flight; orbax has closed the event loop that
        awaited them, and each ends on it with an unraisable "Event loop is closed" traceback, printed after
        the one-line error of a damaged step. Those, and only those, are dropped.
        """
        orbax_workarounds.drop_closed_loop_callbacks()
        path = os.path.join(self.directory, str(step))
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            return dict(checkpointer.restore(path, args=ocp.args.Composite(**items)))

    def _read_integrity(self, step: int) -> dict | None:
        """The ``integrity`` item of ``step``; None for checkpoints written before it existed."""
        if not os.path.isdir(os.path.join(self.directory, str(step), INTEGRITY_ITEM)):
            return None
        integrity = self._read_items(step, **{INTEGRITY_ITEM: ocp.args.JsonRestore()})[INTEGRITY_ITEM]
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

    def read_state(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """``(state, data_state, config)`` of ``step``, every array checked against its saved checksum."""
        integrity = self.check_shapes(step, abstract_state)
        restored = self._read_items(step, **{
            STATE_ITEM: ocp.args.StandardRestore(with_default_sharding(abstract_state)),
            DATA_ITEM: ocp.args.JsonRestore(), CONFIG_ITEM: ocp.args.JsonRestore()})
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

    def read_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of ``step`` (an orbax partial restore): no optimizer moments are read.

        ``abstract_params`` is the ``params`` sub-tree of the saved state's structure. Checksums of the
        arrays read are verified as in :meth:`read_state`.
        """
        integrity = self.check_shapes(step, abstract_params, prefix="params")
        target = {"params": with_default_sharding(abstract_params)}
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = self._read_items(step, **{STATE_ITEM: ocp.args.PyTreeRestore(
            target, restore_args=restore_args, partial_restore=True)})[STATE_ITEM]
        if integrity is not None and integrity.get("format") == checks.DIGEST_FORMAT:
            checks.verify_digest(integrity["arrays"], restored)
        return restored["params"]

    # --------------------------------------------------------------------------------- the newest good step
    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict, int]:
        """Restores ``(state, data_state, config, step)``.

        Args:
          abstract_state: the state's structure: a pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding`` for
            sharded arrays, e.g. from ``jax.eval_shape`` plus the mesh's shardings) or of real arrays.
          step: the step to restore; None: the newest step that restores cleanly (:meth:`read_good_step`).

        Raises:
          FileNotFoundError: no checkpoints, or ``step`` is not among them.
          CheckpointMismatchError: the saved arrays have other shapes than ``abstract_state`` (not damage).
          RuntimeError: the explicitly requested ``step`` is damaged, or (step None) no step restores; the
            message names the directory, the steps tried and their errors.
        """
        (state, data_state, config), step, _ = self.read_good_step(
            lambda s: self.read_state(s, abstract_state), step, "abstract_state")
        return state, data_state, config, step

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """``(params, step)``: the parameters alone (:meth:`read_params`), with :meth:`restore`'s fallback."""
        params, step, _ = self.read_good_step(
            lambda s: self.read_params(s, abstract_params), step, "abstract_params")
        return params, step

    def read_good_step(self, read: Callable[[int], Any], step: int | None,
                       target_name: str) -> tuple[Any, int, list[int]]:
        """``(read(step), step, damaged)``; with ``step`` None, the newest step that reads.

        Newer steps that fail to read are skipped, each with a warning naming the directory, the step and
        the error, and returned in ``damaged`` (newest first); a step deleted while read is skipped silently
        but for a note. An explicitly requested ``step`` that fails raises (``damaged`` is then empty).
        ``target_name`` is the argument of the caller that the final error suggests checking.
        """
        if step is not None:
            self._require_step(step)
            try:
                return read(step), step, []
            except CheckpointMismatchError:
                raise
            except Exception as e:  # damage, one line for the user (TRANSFORMER_JAX_TRACEBACK=1: all)
                raise DamagedCheckpointError(
                    f"checkpoint step {step} in {self.directory} could not be restored ({short_error(e)}); "
                    f"available steps: {self.all_steps()}. Choose another step, or leave the step out for "
                    "the newest one that restores"
                ) from e

        if not self.all_steps():
            raise MissingFileError(f"no checkpoints to restore in {self.directory}")
        tried: list[int] = []
        errors: list[tuple[int, Exception]] = []
        while candidates := [s for s in self.all_steps() if s not in tried]:
            candidate = candidates[-1]
            tried.append(candidate)
            try:
                return read(candidate), candidate, [s for s, _ in errors]
            except CheckpointMismatchError:
                raise
            # Damage shows up as ValueError, OSError, JSONDecodeError, tensorstore or checksum errors.
            except Exception as e:
                if self._removed(candidate):
                    _log.warning("Checkpoint step %d in %s was removed while it was read (a running trainer "
                                 "keeps only its newest checkpoints); taking the newest one that exists",
                                 candidate, self.directory)
                    continue
                _log.warning(
                    "Checkpoint step %d in %s is damaged and was skipped (%s); trying an older step",
                    candidate, self.directory, short_error(e))
                errors.append((candidate, e))
        details = "; ".join(f"step {s}: {short_error(e, 200)}" for s, e in errors)
        raise NoUsableCheckpointError(
            f"no checkpoint in {self.directory} could be restored (tried steps {tried}): "
            f"{details}. If every step fails the same way, check that {target_name} matches the saved state "
            "(model config)."
        ) from (errors[0][1] if errors else None)

    def saved_info(self, step: int | None = None) -> tuple[int, dict, dict]:
        """``(step, config, metadata)`` of ``step`` (default: the newest step whose config reads); no arrays.

        ``metadata`` is what the Checkpointer's ``save`` was given (empty for checkpoints older than the
        integrity item).
        """
        if step is not None:
            self._require_step(step)
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise MissingFileError(f"no checkpoints to read a config from in {self.directory}")
        errors = []
        for candidate in candidates:
            try:
                config = self._read_items(candidate, **{CONFIG_ITEM: ocp.args.JsonRestore()})[CONFIG_ITEM]
                if not isinstance(config, dict):
                    raise ValueError(f"expected a JSON object, got {type(config).__name__}")
                integrity = self._read_integrity(candidate) or {}
                return candidate, config, dict(integrity.get("metadata", {}))
            except Exception as e:
                if step is not None:
                    raise DamagedCheckpointError(
                        f"config of checkpoint step {step} in {self.directory} could not be read "
                        f"({short_error(e)}); available steps: {self.all_steps()}"
                    ) from e
                if self._removed(candidate):
                    continue  # removed by a running trainer while we read it
                _log.warning(
                    "Config of checkpoint step %d in %s is damaged (%s); trying an older step",
                    candidate, self.directory, short_error(e))
                errors.append(f"step {candidate}: {short_error(e, 200)}")
        raise NoUsableCheckpointError(f"no readable config in {self.directory}: {'; '.join(errors)}")
