"""Shared by the end-to-end tests: the default config with overrides, locked like train.py locks it."""

import json
import math

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
from transformer_jax.training import train_state

# The MFU denominator of test runs: without it every run first times eleven 2048^3 matmuls.
TEST_PEAK = {"peak_tflops_per_device": 1.0}


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
