"""Reading a trained model back from a ``train.py`` workdir: its config, tokenizer and parameters.

The steps run in the order the data flows: the saved run config (JSON, no arrays) -> the tokenizer ->
the ModelConfig -> the abstract TrainState -> the arrays. Evaluation and inspection start here.

Nothing here trains or writes a tokenizer: the checkpoint records the SHA-256 of the ``spm.model`` it was
trained with, and a missing or different file is an error naming both (``TokenizerMismatchError``). The
same checks guard a training run that resumes a workdir (``check_workdir``), together with the model
config: a resume with another model fails with the fields that differ, before any array is read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.integrity import (
    CheckpointMismatchError,
    TokenizerMismatchError,
    first_few,
    model_differences,
)
from transformer_jax.checkpoints.manager import Checkpointer
from transformer_jax.data.tokenizer import Tokenizer, tokenizer_file
from transformer_jax.model.config import ModelConfig
from transformer_jax.run_config import model_config_from
from transformer_jax.runtime.errors import MissingFileError
from transformer_jax.training.train_state import TrainState, abstract_train_state, make_optimizer


@dataclasses.dataclass(frozen=True)
class Restored:
    """A trained model read back from a ``train.py`` workdir.

    Attributes:
      config: the run's ml_collections config.
      tokenizer: the run's SentencePiece tokenizer.
      model_config: the run's ModelConfig.
      params: the parameters.
      step: the checkpoint step.
      checkpoint_dir: where the checkpoints are (for averaging).
      abstract_state: the restore target (shapes and dtypes of the whole TrainState).
    """

    config: Any
    tokenizer: Any
    model_config: ModelConfig
    params: Any
    step: int
    checkpoint_dir: str
    abstract_state: Any


def checkpoint_dir(workdir: str) -> str:
    """Where ``train.py`` keeps the checkpoints of ``workdir``."""
    return os.path.join(workdir, "checkpoints")


def has_checkpoints(workdir: str) -> bool:
    """Whether ``workdir`` holds a finished checkpoint step (a directory named by its step number)."""
    path = checkpoint_dir(workdir)
    return os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path))


def abstract_state_for(config: ml_collections.ConfigDict, model_config: ModelConfig) -> TrainState:
    """The shapes and dtypes of the TrainState a run with ``config`` saves (params and Adam moments)."""
    return abstract_train_state(model_config, make_optimizer(config, model_config.d_model))


def load_workdir_tokenizer(config: ml_collections.ConfigDict, workdir: str,
                           expected_sha256: str | None = None) -> data_lib.Tokenizer:
    """The tokenizer ``train.py`` wrote into ``workdir/tokenizer``; never trains one.

    Raises:
      MissingFileError: ``workdir/tokenizer/spm.model`` does not exist.
      TokenizerMismatchError: its SHA-256 is not ``expected_sha256`` (the checkpoint's), or its vocabulary
        size is not ``config.data.vocab_size``.
    """
    path = tokenizer_file(workdir)
    if not path.is_file():
        raise MissingFileError(
            f"{path} is missing; the checkpoints in {checkpoint_dir(workdir)} need the tokenizer they were "
            "trained with (a retrained one numbers the tokens differently). Restore that file.")
    tokenizer = Tokenizer.from_file(path)
    if expected_sha256 and tokenizer.sha256 != expected_sha256:
        raise TokenizerMismatchError(
            f"{path} (sha256 {tokenizer.sha256[:12]}...) is not the tokenizer the checkpoints in "
            f"{checkpoint_dir(workdir)} were trained with (sha256 {expected_sha256[:12]}...). Restore the "
            "original file, or train in a new workdir.")
    if tokenizer.vocab_size != config.data.vocab_size:
        raise TokenizerMismatchError(
            f"{path} has {tokenizer.vocab_size} tokens but the run config says data.vocab_size="
            f"{config.data.vocab_size}; restore the original file, or train in a new workdir.")
    return tokenizer


def check_same_model(saved_config: dict, config: ml_collections.ConfigDict, where: str) -> None:
    """Raises CheckpointMismatchError listing the model / vocabulary fields in which ``config`` differs."""
    differences = model_differences(saved_config, config)
    if differences:
        raise CheckpointMismatchError(
            f"the model config differs from the one saved in {where}: {first_few(differences, 8, '; ')}. "
            "Use the saved values to resume, or another workdir to train a new model.")


def check_workdir(ckpt: Checkpointer, config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """Before a training run resumes ``workdir``: its model config and tokenizer must be the saved ones.

    Reads only JSON (no arrays, nothing compiled). Returns the saved tokenizer's SHA-256 (None when the
    workdir holds no checkpoint, or one older than the hash).
    """
    if ckpt.latest_step() is None:
        return None
    step, saved_config, metadata = ckpt.saved_info()
    check_same_model(saved_config, config, f"checkpoint step {step} in {ckpt.directory}")
    expected = metadata.get("tokenizer_sha256")
    load_workdir_tokenizer(config, workdir, expected)
    return expected


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """Reads the config, tokenizer and parameters of ``workdir`` (by default its latest good step).

    Raises:
      FileNotFoundError: ``workdir`` holds no checkpoint or no tokenizer.
      TokenizerMismatchError: the tokenizer is not the one the checkpoint was trained with.
      CheckpointMismatchError: the saved arrays do not fit the saved config's model (e.g. the code changed).
    """
    if not os.path.isdir(checkpoint_dir(workdir)):
        raise MissingFileError(f"no checkpoint in {checkpoint_dir(workdir)}; train first with train.py")
    ckpt = Checkpointer(checkpoint_dir(workdir), save_every_steps=None, save_every_minutes=None,
                        read_only=True)
    try:
        if ckpt.latest_step() is None:
            raise MissingFileError(f"no checkpoint in {ckpt.directory}; train first with train.py")
        _, saved_config, metadata = ckpt.saved_info(step)
        config = ml_collections.ConfigDict(saved_config)
        tokenizer = load_workdir_tokenizer(config, workdir, metadata.get("tokenizer_sha256"))
        model_config = model_config_from(config, tokenizer.vocab_size)
        target = abstract_state_for(config, model_config)
        state, _, _, restored_step = ckpt.restore(target, step)
        return Restored(config, tokenizer, model_config, state.params, int(restored_step),
                        ckpt.directory, target)
    finally:
        ckpt.close()
