"""Trains the Transformer: `python train.py [--config=configs/X.py] [--workdir=DIR] [--config.key=value]`.

With no flags it trains the embedded default (configs/default.py, a synthetic task) into ./workdir.
Running it again on a workdir that holds checkpoints resumes. All logic is in transformer_jax.training.loop.
The whole config and every input file are checked first; a user error (bad field, missing file) prints
two lines and exits 1 (TRANSFORMER_JAX_TRACEBACK=1 shows the traceback).
"""

import os

import jax
from absl import flags, logging

from transformer_jax import run_config
from transformer_jax.model import fused_attention
from transformer_jax.runtime import devices, errors, sharding
from transformer_jax.training import loop

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")
_CONFIG = run_config.define_config_file(
    "config", _DEFAULT_CONFIG, "Training config file (ml_collections).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdir", "Directory for checkpoints, tokenizer, metrics.")
_MULTIPROCESS = flags.DEFINE_bool(
    "multiprocess", False,
    "Join a multi-process job first (jax.distributed.initialize: TPU pods, Slurm's srun, or the "
    "JAX_COORDINATOR_* environment variables; CPU processes all-reduce through gloo).")


def main(argv):
    if _MULTIPROCESS.value:
        sharding.initialize_multiprocess()
    logging.set_verbosity(logging.WARNING)
    notice = devices.check_platform(_CONFIG.value.get("platform", "any"))  # before any work
    if notice:
        print(notice, flush=True)
    run = run_config.build_run_config(_CONFIG.value)  # every field and input file, checked once
    if run.model.attention_impl == "fused" and jax.process_index() == 0:  # cuDNN or, and why, XLA
        print(fused_attention.describe(run.model.dtype, run.model.d_k), flush=True)
    loop.train_and_evaluate(run, _WORKDIR.value)


if __name__ == "__main__":
    errors.run_main(main)
