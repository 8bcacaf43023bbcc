"""The training state and the optimizer of section 5.3: ``TrainState``, Adam with the warmup schedule.

``create_train_state`` initializes the state directly into its shardings (from the logical axis rules);
``abstract_state`` gives its shapes, dtypes and shardings, the target for restoring a checkpoint.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import INIT_LENGTH, Transformer
from transformer_jax.run_config import TrainConfig
from transformer_jax.runtime import sharding


@struct.dataclass
class TrainState:
    """Everything a step changes. ``rng`` is a raw uint32[2] key, so checkpoints store it as is."""

    step: jax.Array  # int32[], optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2]; dropout uses fold_in(rng, step)


def learning_rate_schedule(d_model: int, warmup_steps: int, scale: float = 1.0, *, num_steps: int = 0,
                           cooldown_steps: int = 0):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (equation 3), step from 1.

    With ``cooldown_steps`` > 0 the last ``cooldown_steps`` of ``num_steps`` updates also multiply it by
    a linear ramp from 1 down to 0 (reached after update ``num_steps``), which a fixed budget favours.
    The schedule takes ``count``, the number of updates already taken.
    """

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        rate = scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)
        if cooldown_steps:
            remaining = num_steps - jnp.asarray(count, jnp.float32)
            rate = rate * jnp.clip(remaining / cooldown_steps, 0.0, 1.0)
        return rate

    return schedule


def schedule_from_config(train: TrainConfig, d_model: int):
    """``learning_rate_schedule`` with the fields of ``config.train``: the run's one schedule."""
    return learning_rate_schedule(d_model, train.warmup_steps, train.learning_rate_scale,
                                  num_steps=train.num_steps, cooldown_steps=train.cooldown_steps)


def make_optimizer(train: TrainConfig, schedule) -> optax.GradientTransformation:
    """Adam with the paper's betas and epsilon over ``schedule``; optional global-norm clipping."""
    adam = optax.adam(schedule, b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps)
    if train.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(train.max_grad_norm), adam)
    return adam


def _init_state_fn(model_config: ModelConfig, tx: optax.GradientTransformation):
    """rng -> TrainState whose params (and Adam moments) carry their logical axis names (boxed)."""
    model = Transformer(model_config.replace(deterministic=True, decode=False))

    def init(rng):
        params_rng, dropout_rng = jax.random.split(rng)
        dummy = jnp.ones((1, INIT_LENGTH), jnp.int32)
        boxed = model.init(params_rng, dummy, dummy)["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=boxed, opt_state=tx.init(boxed),
                          rng=dropout_rng)

    return init


def create_train_state(model_config: ModelConfig, tx: optax.GradientTransformation, mesh, rules, *,
                       seed: int) -> tuple[TrainState, Any]:
    """Initializes the TrainState directly into its shardings; returns (state, state_shardings)."""
    init = _init_state_fn(model_config, tx)
    rng = jax.random.PRNGKey(seed)
    state_sharding = sharding.logical_to_sharding(jax.eval_shape(init, rng), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=state_sharding)(rng)
    return state, state_sharding


def abstract_state(state: TrainState) -> Any:
    """ShapeDtypeStructs with the shardings of ``state``: the restore target that keeps its layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
