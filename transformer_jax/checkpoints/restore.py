"""Reading a trained model back from a ``train.py`` workdir: its config, tokenizer and parameters.

The steps run in the order the data flows: the saved run config (JSON, no arrays) -> the RunConfig ->
the tokenizer -> the abstract parameters -> the arrays. Evaluation, inspection and averaging start here,
and read the parameters alone (an orbax partial restore): no optimizer is built and no Adam moment is
read, a third of the bytes of the whole saved state.

Nothing here trains or writes a tokenizer: the checkpoint records the SHA-256 of the ``spm.model`` it was
trained with, and a missing or different file is an error naming both (``TokenizerMismatchError``). The
same checks guard a training run that resumes a workdir (``check_workdir``), together with the model
config: a resume with another model fails with the fields that differ, before any array is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.integrity import (
    CheckpointMismatchError,
    TokenizerMismatchError,
    first_few,
    model_differences,
    run_time_differences,
)
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.data.config import DataConfig
from transformer_jax.data.text_form import text_form_of
from transformer_jax.data.tokenizer import Tokenizer, tokenizer_file
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.run_config import RunConfig, run_config_from_saved
from transformer_jax.runtime.errors import ConfigError, MissingFileError


@dataclasses.dataclass(frozen=True)
class Restored:
    """A trained model read back from a ``train.py`` workdir.

    Attributes:
      run: the run's RunConfig (its ``model.vocab_size`` is the tokenizer's: ``data.vocab_size``).
      tokenizer: the run's SentencePiece tokenizer.
      params: the parameters.
      step: the checkpoint step.
      checkpoint_dir: where the checkpoints are (for averaging).
      abstract_params: the parameters' shapes and dtypes (the restore target).
    """

    run: RunConfig
    tokenizer: Any
    params: Any
    step: int
    checkpoint_dir: str
    abstract_params: Any

    @property
    def model_config(self) -> ModelConfig:
        return self.run.model


def checkpoint_dir(workdir: str) -> str:
    """Where ``train.py`` keeps the checkpoints of ``workdir``."""
    return os.path.join(workdir, "checkpoints")


def has_checkpoints(workdir: str) -> bool:
    """Whether ``workdir`` holds a finished checkpoint step (a directory named by its step number)."""
    path = checkpoint_dir(workdir)
    return os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path))


def abstract_params(model_config: ModelConfig) -> Any:
    """The shapes and dtypes of the parameters of ``model_config`` (no optimizer, nothing computed)."""
    return jax.eval_shape(lambda rng: init_params(model_config, rng=rng), jax.random.PRNGKey(0))


def load_workdir_tokenizer(data: DataConfig, workdir: str,
                           expected_sha256: str | None = None) -> data_lib.Tokenizer:
    """The tokenizer ``train.py`` wrote into ``workdir/tokenizer``; never trains one.

    Raises:
      MissingFileError: ``workdir/tokenizer/spm.model`` does not exist.
      TokenizerMismatchError: its SHA-256 is not ``expected_sha256`` (the checkpoint's), or its vocabulary
        size is not ``data.vocab_size``.
    """
    path = tokenizer_file(workdir)
    if not path.is_file():
        raise MissingFileError(
            f"{path} is missing; the checkpoints in {checkpoint_dir(workdir)} need the tokenizer they were "
            "trained with (a retrained one numbers the tokens differently). Restore that file.")
    tokenizer = Tokenizer.from_file(path, text_form=text_form_of(data))
    if expected_sha256 and tokenizer.sha256 != expected_sha256:
        raise TokenizerMismatchError(
            f"{path} (sha256 {tokenizer.sha256[:12]}...) is not the tokenizer the checkpoints in "
            f"{checkpoint_dir(workdir)} were trained with (sha256 {expected_sha256[:12]}...). Restore the "
            "original file, or train in a new workdir.")
    if tokenizer.vocab_size != data.vocab_size:
        raise TokenizerMismatchError(
            f"{path} has {tokenizer.vocab_size} tokens but the run config says data.vocab_size="
            f"{data.vocab_size}; restore the original file, or train in a new workdir.")
    return tokenizer


def check_same_model(saved_config: dict, run: RunConfig, where: str) -> list[str]:
    """Raises CheckpointMismatchError listing the shape- or meaning-deciding model / vocabulary fields in
    which ``run`` differs; returns the run-time fields it changes (``integrity.RUN_TIME_FIELDS``)."""
    differences = model_differences(saved_config, dict(run.saved))
    if differences:
        raise CheckpointMismatchError(
            f"the model config differs from the one saved in {where}: {first_few(differences, 8, '; ')}. "
            "Use the saved values to resume, or another workdir to train a new model.")
    return run_time_differences(saved_config, dict(run.saved))


def check_workdir(ckpt: CheckpointReader, run: RunConfig, workdir: str) -> str | None:
    """Before a training run resumes ``workdir``: its model config and tokenizer must be the saved ones.

    Reads only JSON (no arrays, nothing compiled). Returns the saved tokenizer's SHA-256 (None when the
    workdir holds no checkpoint, or one older than the hash).
    """
    if ckpt.latest_step() is None:
        return None
    step, saved_config, metadata = ckpt.saved_info()
    changed = check_same_model(saved_config, run, f"checkpoint step {step} in {ckpt.directory}")
    if changed and jax.process_index() == 0:
        print(f"Resuming step {step} with changed settings that keep the parameters: "
              f"{first_few(changed, 8, '; ')}")
    expected = metadata.get("tokenizer_sha256")
    load_workdir_tokenizer(run.data, workdir, expected)
    return expected


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """Reads the config, tokenizer and parameters of ``workdir`` (by default its latest good step).

    Only the parameters are read from the checkpoint; a damaged newest step falls back to the previous
    good one, with a warning naming it.

    Raises:
      FileNotFoundError: ``workdir`` holds no checkpoint or no tokenizer.
      TokenizerMismatchError: the tokenizer is not the one the checkpoint was trained with.
      CheckpointMismatchError: the saved arrays do not fit the saved config's model (e.g. the code changed).
    """
    if not os.path.isdir(checkpoint_dir(workdir)):
        raise MissingFileError(f"no checkpoint in {checkpoint_dir(workdir)}; train first with train.py")
    reader = CheckpointReader(checkpoint_dir(workdir))
    if reader.latest_step() is None:
        raise MissingFileError(f"no checkpoint in {reader.directory}; train first with train.py")
    _, saved_config, metadata = reader.saved_info(step)
    run = run_config_from_saved(saved_config)
    tokenizer = load_workdir_tokenizer(run.data, workdir, metadata.get("tokenizer_sha256"))
    target = abstract_params(run.model)
    params, restored_step = reader.restore_params(target, step)
    return Restored(run, tokenizer, params, int(restored_step), reader.directory, target)


def steps_to_average(restored: Restored, average_last: int, *, from_config: bool = False) -> list[int]:
    """The ``average_last`` newest checkpoint steps up to ``restored.step``, oldest first.

    Saves forced by a preemption, off the schedule, are left out (``CheckpointReader.averageable_steps``),
    as in training's final report: a run stopped and resumed averages what an uninterrupted one does.
    ``from_config``: ``average_last`` is the run's ``final_average_last`` (evaluate.py's default), which
    the error then names, with how to score fewer.
    """
    available = CheckpointReader(restored.checkpoint_dir).averageable_steps(restored.step)
    if len(available) < average_last:
        given = (f"--average_last={average_last} (the default: the run's final_average_last)" if from_config
                 else f"--average_last={average_last}")
        fix = (f"; pass --average_last=1 to score step {restored.step} alone" if from_config else "")
        raise ConfigError(f"{given} needs {average_last} checkpoints up to step {restored.step} in "
                          f"{restored.checkpoint_dir}; found {len(available)}: {available}{fix}")
    return available[-average_last:]


def averaged_params(restored: Restored, average_last: int, *,
                    from_config: bool = False) -> tuple[Any, list[int]]:
    """(parameters, steps): the mean of the ``average_last`` checkpoints ending at ``restored.step``
    (``steps_to_average``; ``from_config`` as there), or for ``average_last`` 0 or 1 ``restored.params``."""
    if average_last <= 1:
        return restored.params, [restored.step]
    steps = steps_to_average(restored, average_last, from_config=from_config)
    return average_checkpoints(restored.checkpoint_dir, restored.abstract_params, steps), steps
