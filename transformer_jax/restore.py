"""Reading a trained model back from a ``train.py`` workdir: its config, tokenizer and parameters.

The steps run in the order the data flows: the saved run config (JSON, no arrays) -> the tokenizer ->
the ModelConfig -> the abstract TrainState -> the arrays. Evaluation and inspection start here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from transformer_jax import data as data_lib
from transformer_jax.checkpoint import Checkpointer
from transformer_jax.model import ModelConfig
from transformer_jax.run_config import model_config_from
from transformer_jax.train_state import TrainState, abstract_train_state, make_optimizer


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


def abstract_state_for(config: ml_collections.ConfigDict, model_config: ModelConfig) -> TrainState:
    """The shapes and dtypes of the TrainState a run with ``config`` saves (params and Adam moments)."""
    return abstract_train_state(model_config, make_optimizer(config, model_config.d_model))


def load_workdir_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> data_lib.Tokenizer:
    """The tokenizer ``train.py`` wrote into ``workdir/tokenizer``."""
    if not os.path.isdir(os.path.join(workdir, "tokenizer")):
        raise FileNotFoundError(f"no tokenizer in {workdir}/tokenizer; is {workdir} a train.py workdir?")
    return data_lib.load_or_train_tokenizer(config.data, workdir)


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """Reads the config, tokenizer and parameters of ``workdir`` (by default its latest good step).

    Raises:
      FileNotFoundError: ``workdir`` holds no checkpoint or no tokenizer.
    """
    ckpt = Checkpointer(checkpoint_dir(workdir), save_every_steps=None, save_every_minutes=None,
                        read_only=True)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}; train first with train.py")
        config = ml_collections.ConfigDict(ckpt.restore_config(step))
        tokenizer = load_workdir_tokenizer(config, workdir)
        model_config = model_config_from(config, tokenizer.vocab_size)
        target = abstract_state_for(config, model_config)
        state, _, _, restored_step = ckpt.restore(target, step)
        return Restored(config, tokenizer, model_config, state.params, int(restored_step),
                        ckpt.directory, target)
    finally:
        ckpt.close()
