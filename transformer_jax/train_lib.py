"""The training recipe of section 5: state, label-smoothed loss, pure train/eval steps and the loop.

Data flow: config -> validated ModelConfig -> data iterator -> ``create_train_state`` (sharded over the
mesh by logical axis rules) -> ``jax.jit(train_step, donate_argnums=0)`` returning
``(state, metric_sums)`` -> the loop logs, evaluates and checkpoints every N steps.

Metrics are sums with a token count beside them (``num_tokens``), normalized only when logged, so
padding never biases a loss. The host reads them from the device only at log intervals.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils

from transformer_jax import checkpoint as checkpoint_lib
from transformer_jax import data as data_lib
from transformer_jax import evaluation, flops, sharding
from transformer_jax.metrics import MetricWriter
from transformer_jax.model import PAD_ID, ModelConfig, Transformer

NO_BAD_STEP = np.iinfo(np.int32).max  # "no non-finite loss seen" in the bad_step metric


@struct.dataclass
class TrainState:
    """Everything a step changes. ``rng`` is a raw uint32[2] key, so checkpoints store it as is."""

    step: jax.Array  # int32[], optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2]; dropout uses fold_in(rng, step)


# ---------------------------------------------------------------------------------------------------
# Config -> model and optimizer.


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The validated ModelConfig of a run config (raises ValueError before anything compiles)."""
    m = config.model
    return ModelConfig(
        vocab_size=vocab_size, d_model=m.d_model, d_ff=m.d_ff, num_heads=m.num_heads,
        d_k=m.d_k or None, d_v=m.d_v or None,
        num_encoder_layers=m.num_encoder_layers, num_decoder_layers=m.num_decoder_layers,
        dropout_rate=m.dropout_rate, attention_dropout_rate=m.attention_dropout_rate,
        max_len=m.max_len,
        position_encoding=m.position_encoding, norm_style=m.norm_style,
        attention_impl=m.attention_impl, dtype=m.dtype, attention_witness=m.attention_witness)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Fails fast, before any data is read or anything compiles, on a bad config."""
    data_lib.validate_data_config(config.data)
    model_config = model_config_from(config, vocab_size=config.data.vocab_size)
    if model_config.max_len < max(config.data.length_buckets):
        raise ValueError(f"model.max_len={model_config.max_len} must cover the longest length bucket "
                         f"{max(config.data.length_buckets)}")
    t = config.train
    for name in ("num_steps", "warmup_steps", "grad_accum_steps"):
        value = getattr(t, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ValueError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing!r}")
    for name in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if config.log_every_steps == 0:
        raise ValueError("log_every_steps must be positive, got 0")
    sharding.rules_from_config(config.sharding.logical_axis_rules)


def learning_rate_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (equation 3), step from 1."""

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def make_optimizer(config: ml_collections.ConfigDict, d_model: int) -> optax.GradientTransformation:
    """Adam with the paper's betas, epsilon and schedule; optional global-norm clipping."""
    t = config.train
    schedule = learning_rate_schedule(d_model, t.warmup_steps, t.learning_rate_scale)
    adam = optax.adam(schedule, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps)
    if t.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(t.max_grad_norm), adam)
    return adam


# ---------------------------------------------------------------------------------------------------
# Loss and steps.


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
      (argmax accuracy) and ``num_tokens``.
    """
    weights = (targets != PAD_ID).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    nll = lse - target_logit
    smoothed = (1.0 - label_smoothing) * nll + label_smoothing * (lse - jnp.mean(logits, axis=-1))
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
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
                micro_batch, {k: (sharding.BATCH, sharding.LENGTH) for k in micro_batch})
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
    """Metric sums of a deterministic forward pass (dropout off). Pure."""
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"])
    return cross_entropy_sums(logits, batch["targets"], label_smoothing)


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


# ---------------------------------------------------------------------------------------------------
# State creation, sharded by the logical axis rules.


def _init_state_fn(model_config: ModelConfig, tx: optax.GradientTransformation):
    """rng -> TrainState whose params (and Adam moments) carry their logical axis names (boxed)."""
    model = Transformer(model_config.replace(deterministic=True, decode=False))

    def init(rng):
        params_rng, dropout_rng = jax.random.split(rng)
        dummy = jnp.ones((1, 8), jnp.int32)
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


def abstract_train_state(model_config: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """The TrainState's shapes and dtypes (no sharding: restores onto the default device)."""
    init = _init_state_fn(model_config, tx)
    return jax.eval_shape(lambda r: nn.meta.unbox(init(r)), jax.random.PRNGKey(0))


def abstract_state(state: TrainState) -> Any:
    """ShapeDtypeStructs with shardings, the restore target for orbax."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# ---------------------------------------------------------------------------------------------------
# The loop.


class Trainer:
    """Holds the compiled steps and everything the loop needs; ``train_and_evaluate`` drives it."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        validate_config(config)
        self.config, self.workdir = config, workdir
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.mesh = sharding.make_mesh(config.sharding.mesh_shape)
        self.rules = sharding.rules_from_config(config.sharding.logical_axis_rules)
        data_parallel = self.mesh.shape["data"]
        if self.process_count > 1:  # process 0 trains the shared tokenizer; the others then load it
            if self.process_index == 0:
                data_lib.load_or_train_tokenizer(config.data, workdir)
            multihost_utils.sync_global_devices("tokenizer ready")
        self.tokenizer = data_lib.load_or_train_tokenizer(config.data, workdir)
        self.model_config = model_config_from(config, self.tokenizer.vocab_size)
        self.tx = make_optimizer(config, self.model_config.d_model)
        self.train_iter = data_lib.make_train_iterator(
            config.data, self.tokenizer, seed=config.seed, process_index=self.process_index,
            process_count=self.process_count,
            batch_multiple=data_parallel * config.train.grad_accum_steps)
        self.state, self.state_sharding = create_train_state(
            self.model_config, self.tx, self.mesh, self.rules, seed=config.seed)
        train_model = Transformer(self.model_config)
        self.train_step = jax.jit(
            functools.partial(train_step, model=train_model, tx=self.tx,
                              label_smoothing=config.train.label_smoothing,
                              grad_accum_steps=config.train.grad_accum_steps),
            in_shardings=(self.state_sharding, sharding.batch_sharding(self.mesh)),
            out_shardings=(self.state_sharding, None), donate_argnums=0)
        self.schedule = learning_rate_schedule(
            self.model_config.d_model, config.train.warmup_steps, config.train.learning_rate_scale)

    def step_flops(self, batch: dict) -> float:
        b, s = batch["inputs"].shape
        t = batch["targets"].shape[1]
        return flops.train_step_flops(self.model_config, b * self.process_count, s, t)

    def evaluate_dev(self) -> dict[str, float]:
        """Dev loss / PPL over the dev split and greedy BLEU on a sample of it.

        Runs in single-process jobs only; a multi-host job is scored afterwards by ``evaluate.py``.
        """
        if self.process_count > 1:
            return {}
        cfg = self.config
        metrics = evaluation.perplexity(self.state.params, self.model_config, self._dev_batches,
                                        label_smoothing=cfg.train.label_smoothing)
        results = {f"dev_{k}": v for k, v in metrics.items()}
        if cfg.eval_bleu_examples:
            scores = evaluation.translate_and_score(
                self.state.params, self.model_config, self.tokenizer, self._dev_bleu_batches,
                beam_size=1, target_lang=cfg.data.tgt_lang)
            results["dev_bleu"] = scores["sacrebleu"]
        return results

    @functools.cached_property
    def _dev_batches(self) -> list:
        """The whole dev split, read and tokenized once per run."""
        return data_lib.make_eval_batches(self.config.data, self.tokenizer, "dev")

    @functools.cached_property
    def _dev_bleu_batches(self) -> list:
        """The dev sentences decoded for the periodic BLEU."""
        return data_lib.make_eval_batches(self.config.data, self.tokenizer, "dev",
                                          max_examples=self.config.eval_bleu_examples)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (resuming from ``workdir`` if it holds checkpoints), evaluates, and returns final metrics."""
    os.makedirs(workdir, exist_ok=True)
    is_main = jax.process_index() == 0
    with checkpoint_lib.WorkdirLock(workdir, enabled=is_main):
        return _train_locked(config, workdir, is_main)


def _train_locked(config, workdir, is_main) -> dict[str, Any]:
    started = time.time()
    trainer = Trainer(config, workdir)
    ckpt = checkpoint_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        save_every_steps=config.checkpoint_every_steps or None,
        save_every_minutes=config.checkpoint_every_minutes or None,
        max_to_keep=config.checkpoint_keep)
    config_dict = json.loads(config.to_json_best_effort())
    if ckpt.latest_step() is not None:
        state, data_state, _, step = ckpt.restore(abstract_state(trainer.state))
        trainer.state = state
        trainer.train_iter.set_state(data_state)
        logging.info("Resumed from %s at step %d", ckpt.directory, step)
        if is_main:
            print(f"Resuming from step {step} in {workdir}")
    start_step = int(jax.device_get(trainer.state.step))
    num_steps = config.train.num_steps
    writer = MetricWriter(workdir, enabled=is_main, total_steps=num_steps, initial_step=start_step)
    if is_main:
        print(f"Model: {sum(x.size for x in jax.tree.leaves(trainer.state.params)):,} parameters; "
              f"mesh {dict(trainer.mesh.shape)}; {jax.device_count()} devices, "
              f"{jax.process_count()} processes")

    sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
    preempted = profiling = False
    with jax.set_mesh(trainer.mesh), nn.logical_axis_rules(trainer.rules), \
            checkpoint_lib.PreemptionGuard() as guard:
        step = start_step
        while step < num_steps:
            if config.profile_start_step and step == config.profile_start_step:
                jax.profiler.start_trace(os.path.join(workdir, "profile"))
                profiling = True
            local = next(trainer.train_iter)
            batch = sharding.global_batch(local, trainer.mesh)
            trainer.state, step_sums = trainer.train_step(trainer.state, batch)
            step += 1
            sums = accumulate_metrics(sums, step_sums)
            interval_flops += trainer.step_flops(local)
            interval_tokens += int(np.count_nonzero(local["targets"])) * jax.process_count()
            if profiling and step == config.profile_start_step + config.profile_num_steps:
                jax.profiler.stop_trace()
                profiling = False
            if step % config.log_every_steps == 0 or step == num_steps:
                summary = _check_and_summarize(sums, ckpt)
                elapsed = time.time() - interval_start
                summary.update(
                    learning_rate=float(trainer.schedule(step - 1)),
                    tokens_per_sec=interval_tokens / elapsed,
                    mfu=interval_flops / elapsed / jax.device_count()
                    / (config.peak_tflops_per_device * 1e12),
                    steps_per_sec=(step - writer.last_step) / elapsed)
                writer.write(step, {f"train_{k}": v for k, v in summary.items()})
                sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
            if config.eval_every_steps and step % config.eval_every_steps == 0 and step < num_steps:
                writer.write(step, trainer.evaluate_dev())
                interval_start = time.time()
            stop = guard.should_stop(step)
            if stop or ckpt.should_save(step) or step == num_steps:
                if sums is not None:
                    _check_and_summarize(dict(sums), ckpt)  # never save a non-finite state
                ckpt.save(step, trainer.state, data_state=trainer.train_iter.get_state(),
                          config=config_dict, force=stop or step == num_steps)
            if stop:
                preempted = True
                break
    if profiling:  # the run ended inside the profiled range
        jax.profiler.stop_trace()
    ckpt.wait()
    if preempted:
        ckpt.close()
        writer.close()
        if is_main:
            print(f"Preempted: saved a checkpoint at step {step} in {ckpt.directory}; "
                  f"run the same command again to resume.")
        return {"preempted": True, "step": step}

    final = {"step": step, "train_seconds": time.time() - started}
    with jax.set_mesh(trainer.mesh), nn.logical_axis_rules(trainer.rules):
        final.update(trainer.evaluate_dev())
    if config.final_eval_split and jax.process_count() == 1:
        final.update(evaluation.final_report(trainer, config))
    writer.write(step, {k: v for k, v in final.items() if isinstance(v, (int, float))})
    writer.close()
    ckpt.close()
    if is_main:
        print(json.dumps({"final": final}, indent=1, default=str))
    return final


def _check_and_summarize(sums: dict, ckpt) -> dict[str, float]:
    """Host sync: raises on a non-finite loss (naming the step), else returns per-token metrics."""
    bad_step = int(jax.device_get(sums["bad_step"]))
    if bad_step != NO_BAD_STEP:
        raise FloatingPointError(
            f"non-finite training loss at step {bad_step}; stopping. The last good checkpoint is "
            f"step {ckpt.latest_step()} in {ckpt.directory}; lower the learning rate or check the data.")
    return summarize({k: v for k, v in sums.items() if k != "bad_step"})
