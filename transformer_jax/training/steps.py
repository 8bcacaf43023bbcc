"""The pure train step of section 5: one optimizer update of the label-smoothed loss (``model.loss``).

``train_step`` is a pure function of arrays; ``make_train_step`` wraps it in ``jax.jit`` with the state's
shardings and the state donated, the one way the loop, the tests and the benchmarks compile it. Its
metric sums are ``loss.cross_entropy_sums`` plus ``bad_step``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax.model import axes
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.loss import chunk_length, chunked_cross_entropy_sums, cross_entropy_sums
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer
from transformer_jax.runtime import sharding
from transformer_jax.training.train_state import TrainState

NO_BAD_STEP = np.iinfo(np.int32).max  # "no non-finite loss seen" in the bad_step metric


def train_step(state: TrainState, batch: dict, *, model: Transformer,
               tx: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int = 1, loss_chunk_tokens: int = 0) -> tuple[TrainState, dict]:
    """One optimizer update on a global batch; pure.

    The batch is split into ``grad_accum_steps`` micro-batches (rows j, j+k, j+2k, ... so that each
    stays spread over the 'data' axis); gradients of the summed loss are accumulated and divided by the
    token count of the whole batch, so the update equals the one a single large batch would give.
    With ``loss_chunk_tokens`` > 0 the loss forms the logits of at most that many target positions of a
    micro-batch at a time (``loss.chunked_cross_entropy_sums``): the same sums and gradients, less memory.

    Args:
      state: the TrainState.
      batch: {"inputs": int32[batch, src_len], "targets": int32[batch, tgt_len]}.

    Returns:
      The new state and metric sums (see ``cross_entropy_sums``) plus ``bad_step``: the step number if
      the loss or the gradients were not finite, else NO_BAD_STEP.
    """
    num_tokens = jnp.maximum(jnp.sum(batch["targets"] != PAD_ID), 1).astype(jnp.float32)
    step_rng = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params, micro_batch, rng):
        variables, inputs, targets = {"params": params}, micro_batch["inputs"], micro_batch["targets"]
        if loss_chunk_tokens:
            hidden = model.apply(variables, inputs, targets, rngs={"dropout": rng}, method=Transformer.hidden)
            sums = chunked_cross_entropy_sums(
                hidden, targets, label_smoothing,
                logits_fn=lambda h: model.apply(variables, h, method=Transformer.logits),
                chunk_length=chunk_length(targets.shape[1], targets.shape[0], loss_chunk_tokens))
        else:
            logits = model.apply(variables, inputs, targets, rngs={"dropout": rng})
            sums = cross_entropy_sums(logits, targets, label_smoothing)
        return sums["loss"] / num_tokens, sums

    grad_fn = jax.grad(loss_fn, has_aux=True)
    if grad_accum_steps == 1:
        grads, sums = grad_fn(state.params, batch, step_rng)
    else:
        def split(x):  # [B, T] -> [k, B/k, T], micro-batch j holding rows j, j+k, ...
            micro = x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:])
            return jnp.swapaxes(micro, 0, 1)

        micro_batches = jax.tree.map(split, batch)
        rngs = jax.random.split(step_rng, grad_accum_steps)

        def accumulate(carry, xs):
            micro_batch, rng = xs
            micro_batch = nn.with_logical_constraint(
                micro_batch, {k: (axes.BATCH, axes.LENGTH) for k in micro_batch})
            grads, sums = grad_fn(state.params, micro_batch, rng)
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        zeros = jax.tree.map(jnp.zeros_like, (state.params, jax.eval_shape(
            lambda: cross_entropy_sums(jnp.zeros((1, 1, 1)), jnp.zeros((1, 1), jnp.int32), 0.0))))
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro_batches, rngs))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    sums = dict(sums)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(optax.tree.norm(grads))
    sums["bad_step"] = jnp.where(finite, NO_BAD_STEP, state.step + 1)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, sums


class TrainStepFn:
    """A compiled train step: ``state, sums = step(state, batch)``; ``step.lower(state, batch)`` for AOT.

    Both run under the mesh and logical axis rules the step was built for. Built by ``make_train_step``.
    """

    def __init__(self, jitted, mesh, rules):
        self.jitted, self.mesh, self.rules = jitted, mesh, rules

    def __call__(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            return self.jitted(state, batch)

    def lower(self, state, batch):
        """``jax.jit(...).lower``: abstract or real arguments -> a Lowered (``.compile()``, costs)."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            return self.jitted.lower(state, batch)


def make_train_step(model_config: ModelConfig, tx: optax.GradientTransformation, mesh, rules,
                    state_sharding, *, label_smoothing: float, grad_accum_steps: int = 1,
                    loss_chunk_tokens: int = 0) -> TrainStepFn:
    """The compiled train step: ``state, sums = step(state, global_batch)``.

    ``train_step`` jitted with the state laid out by ``state_sharding`` (from ``create_train_state``), the
    batch split over the mesh's 'data' axis, and the state donated (its buffers are reused, so the
    caller must use the returned state).

    Args:
      model_config: the training model (dropout as configured).
      tx: the optimizer ``state.opt_state`` belongs to.
      mesh, rules: the device mesh and logical axis rules the state was created with.
      state_sharding: the TrainState's shardings.
      label_smoothing: eps_ls.
      grad_accum_steps: micro-batches per update; the global batch must divide by it.
      loss_chunk_tokens: > 0: the loss's logits are formed that many target tokens at a time.
    """
    jitted = jax.jit(
        functools.partial(train_step, model=Transformer(model_config), tx=tx,
                          label_smoothing=label_smoothing, grad_accum_steps=grad_accum_steps,
                          loss_chunk_tokens=loss_chunk_tokens),
        in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
        out_shardings=(state_sharding, None), donate_argnums=0)
    return TrainStepFn(jitted, mesh, rules)
