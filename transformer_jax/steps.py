"""The loss and the pure steps of section 5: label-smoothed cross-entropy, train and eval steps.

``train_step`` and ``eval_step`` are pure functions of arrays; ``make_train_step`` wraps the former in
``jax.jit`` with the state's shardings and the state donated, the one way the loop, the tests and the
benchmarks compile it.

Metrics are sums with a token count beside them (``num_tokens``), normalized only when logged
(``summarize``), so padding never biases a loss. ``accumulate_metrics`` adds them on the device, so the
host reads them only at log intervals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import axes, sharding
from transformer_jax.model import Transformer
from transformer_jax.model_config import ModelConfig
from transformer_jax.special_ids import PAD_ID
from transformer_jax.train_state import TrainState

NO_BAD_STEP = np.iinfo(np.int32).max  # "no non-finite loss seen" in the bad_step metric


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> dict:
    """Label-smoothed cross-entropy over non-pad targets, as sums (normalize late).

    With smoothed targets q = (1 - eps) onehot(y) + eps / V (Szegedy et al., the paper's [36]):
      -sum_i q_i log p_i = lse - (1 - eps) z_y - eps * mean_i z_i,   lse = logsumexp(z).
    No one-hot [batch, length, vocab] tensor and no log-softmax is materialized.

    Args:
      logits: float32[batch, length, vocab].
      targets: int[batch, length]; PAD_ID marks padding.
      label_smoothing: eps_ls.

    Returns:
      dict of float32[] sums: ``loss`` (smoothed), ``nll`` (unsmoothed, for perplexity), ``correct``
      (argmax accuracy; a target tied for the largest logit counts) and ``num_tokens``.
    """
    weights = (targets != PAD_ID).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    nll = lse - target_logit
    smoothed = (1.0 - label_smoothing) * nll + label_smoothing * (lse - jnp.mean(logits, axis=-1))
    # The target is "correct" when its logit is the largest (argmax, but a tie also counts). A max
    # reduction is cheap on a CPU, where argmax's (value, index) one took 12% of a Multi30k step (vocab 8k).
    correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {
        "loss": jnp.sum(smoothed * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "num_tokens": jnp.sum(weights),
    }


def train_step(state: TrainState, batch: dict, *, model: Transformer,
               tx: optax.GradientTransformation, label_smoothing: float,
               grad_accum_steps: int = 1) -> tuple[TrainState, dict]:
    """One optimizer update on a global batch; pure.

    The batch is split into ``grad_accum_steps`` micro-batches (rows j, j+k, j+2k, ... so that each
    stays spread over the 'data' axis); gradients of the summed loss are accumulated and divided by the
    token count of the whole batch, so the update equals the one a single large batch would give.

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
        logits = model.apply({"params": params}, micro_batch["inputs"], micro_batch["targets"],
                             rngs={"dropout": rng})
        sums = cross_entropy_sums(logits, micro_batch["targets"], label_smoothing)
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


def eval_step(params, batch: dict, *, model: Transformer, label_smoothing: float) -> dict:
    """Metric sums of a deterministic forward pass (dropout off). Pure.

    Args:
      params: the model parameters.
      batch: {"inputs": int32[batch, src_len], "targets": int32[batch, tgt_len]}.
    """
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"])
    return cross_entropy_sums(logits, batch["targets"], label_smoothing)


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
                    state_sharding, *, label_smoothing: float, grad_accum_steps: int = 1) -> TrainStepFn:
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
    """
    jitted = jax.jit(
        functools.partial(train_step, model=Transformer(model_config), tx=tx,
                          label_smoothing=label_smoothing, grad_accum_steps=grad_accum_steps),
        in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
        out_shardings=(state_sharding, None), donate_argnums=0)
    return TrainStepFn(jitted, mesh, rules)


@functools.lru_cache(maxsize=8)
def make_eval_step(model_config: ModelConfig, label_smoothing: float = 0.0) -> Callable[..., dict]:
    """The jitted ``eval_step`` of the deterministic model: ``sums = fn(params, batch)``."""
    model = Transformer(model_config.replace(deterministic=True, decode=False))
    return jax.jit(functools.partial(eval_step, model=model, label_smoothing=label_smoothing))


@jax.jit
def _add_metrics(total: dict, new: dict) -> dict:
    return {k: jnp.minimum(total[k], v) if k == "bad_step" else total[k] + v for k, v in new.items()}


def accumulate_metrics(total: dict | None, new: dict) -> dict:
    """Adds metric sums on the device in one dispatch (no host sync); ``bad_step`` keeps the first."""
    return dict(new) if total is None else _add_metrics(total, new)


def summarize(sums: dict) -> dict[str, float]:
    """Host-side normalization: per-token loss, nll, perplexity and accuracy."""
    sums = {k: float(v) for k, v in jax.device_get(sums).items()}
    n = max(sums["num_tokens"], 1.0)
    out = {"loss": sums["loss"] / n, "nll": sums["nll"] / n, "accuracy": sums["correct"] / n,
           "num_tokens": sums["num_tokens"]}
    out["ppl"] = float(np.exp(min(out["nll"], 50.0)))
    return out
