"""Shared by the end-to-end tests: the default config with overrides, locked like train.py locks it, and
the one trained tiny run that the tests which only read a trained workdir share."""

import fcntl
import json
import math
import os
import shutil

import jax
import numpy as np

from configs import default as default_config
from transformer_jax import data as data_lib
from transformer_jax import run_config
from transformer_jax.checkpoints import restore
from transformer_jax.checkpoints.manager import Checkpointer
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.model import transformer as model_lib
from transformer_jax.runtime import sharding
from transformer_jax.training import loop, train_state

# The MFU denominator of test runs: without it every run first times eleven 2048^3 matmuls.
TEST_PEAK = {"peak_tflops_per_device": 1.0}

# The tiny translation run of the end-to-end tests (also passed to train.py as --config.key=value). Distinct
# layer counts and an odd head count, so that a kind/layer/head mix-up changes what is counted or drawn.
TRAIN = {
    "data.synthetic_train_size": 400, "data.synthetic_dev_size": 16, "data.synthetic_test_size": 16,
    "data.vocab_size": 120, "data.tokens_per_batch": 512,
    "data.length_buckets": (64,),  # one padded length: one training program to compile
    "model.d_model": 18, "model.d_ff": 22, "model.num_heads": 3,
    "model.num_encoder_layers": 2, "model.num_decoder_layers": 1,
    "train.num_steps": 6, "train.warmup_steps": 2, "log_every_steps": 2, "eval_every_steps": 4,
    "eval_bleu_examples": 4, "checkpoint_every_steps": 2, "checkpoint_every_minutes": 0.0,
    "final_eval_split": "test", "final_beam_size": 2,
}
# The shared run (``trained_run``): TRAIN, its final model the mean of its checkpoints 2, 4 and 6.
TRAINED = {**TRAIN, "final_average_last": 3}


def config_with(overrides: dict):
    """configs/default.py with ``TEST_PEAK`` and ``{"section.field": value}`` overrides applied, locked."""
    config = default_config.get_config()
    overrides = {**TEST_PEAK, **overrides}
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    config.lock()
    return config


def saved_state(config, workdir, step: int):
    """(params as a flat list of NumPy arrays, data-iterator state) that ``train.py`` saved at ``step``."""
    run = run_config.build_run_config(config, environment=False)
    schedule = train_state.schedule_from_config(run.train, run.model.d_model)
    mesh = sharding.make_mesh((1, 1), jax.devices()[:1])
    state, _ = train_state.create_train_state(
        run.model, train_state.make_optimizer(run.train, schedule), mesh, (), seed=0)
    target = train_state.abstract_state(state)
    reader = CheckpointReader(restore.checkpoint_dir(str(workdir)))
    state, data_state, _, restored = reader.restore(target, step)
    assert restored == step
    return [np.asarray(x) for x in jax.tree.leaves(state.params)], data_state


def untrained_workdir(config, workdir: str, steps=(1,)) -> dict:
    """A train.py-shaped ``workdir`` without training: the tokenizer, and at each of ``steps`` a
    checkpoint of the initial state with every parameter multiplied by the step (so an average of
    checkpoints is known). Returns {step: params as NumPy arrays}."""
    data_lib.load_or_train_tokenizer(config.data, workdir)  # the workdir's tokenizer file
    run = run_config.build_run_config(config)
    mesh = sharding.make_mesh((1, 1), jax.devices()[:1])
    schedule = train_state.schedule_from_config(run.train, run.model.d_model)
    state, _ = train_state.create_train_state(
        run.model, train_state.make_optimizer(run.train, schedule), mesh, (), seed=0)
    saved = {}
    with Checkpointer(restore.checkpoint_dir(workdir), save_every_steps=None,
                      save_every_minutes=None) as ckpt:
        for step in steps:
            scaled = state.replace(step=state.step + step,
                                   params=jax.tree.map(lambda p, s=step: p * s, state.params))
            saved[step] = jax.tree.map(np.asarray, scaled.params)
            ckpt.save(step, scaled, data_state={}, config=json.loads(config.to_json_best_effort()),
                      force=True)
    return saved


def random_params(cfg, seed: int, *, unit_embedding: bool = False):
    """Parameters of ``Transformer(cfg)`` in the model's own tree (shapes from tracing ``init_params``;
    nothing is compiled), drawn from NumPy: float32 kernels N(0, 1 / fan_in) with fan_in all axes but the
    last, and LayerNorm scales, offsets and FFN biases away from 1 and 0. ``unit_embedding``: the
    embedding N(0, 1), which makes the logits wide (an untrained model's outputs then run long)."""
    shapes = jax.eval_shape(lambda key: model_lib.init_params(cfg, rng=key), jax.random.key(0))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape)
        if leaf.ndim > 1 and not (unit_embedding and path[-1].key == "embedding"):
            noise /= math.sqrt(math.prod(leaf.shape[:-1]))
        elif leaf.ndim == 1 and path[-1].key == "scale":
            noise = 1.0 + 0.5 * noise
        elif leaf.ndim == 1:
            noise = 0.5 * noise
        return noise.astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def trained_run(run_dir: str) -> tuple[str, dict]:
    """(``<run_dir>/trained``, its final metrics): a train.py run of ``TRAINED``, trained by the first
    process of a test run that asks (the others wait on a file lock, then read it)."""
    path, final_path = os.path.join(run_dir, "trained"), os.path.join(run_dir, "trained_final.json")
    with open(os.path.join(run_dir, "trained.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not os.path.exists(final_path):
            shutil.rmtree(path, ignore_errors=True)  # left by a process that died building it
            final = loop.train_and_evaluate(run_config.build_run_config(config_with(TRAINED)), path)
            with open(final_path + ".tmp", "w") as f:
                json.dump(final, f)
            os.replace(final_path + ".tmp", final_path)
    with open(final_path) as f:
        return path, json.load(f)


def listing(top: str) -> list[tuple[str, int, int]]:
    """(path under ``top``, size, modification time in ns) of every file under ``top``, sorted."""
    return sorted((os.path.relpath(os.path.join(folder, name), top), stat.st_size, stat.st_mtime_ns)
                  for folder, _, names in os.walk(top) for name in names
                  for stat in [os.stat(os.path.join(folder, name))])
