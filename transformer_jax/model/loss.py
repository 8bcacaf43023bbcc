"""The loss and the metrics of section 5.4, shared by training and scoring.

``cross_entropy_sums`` is the label-smoothed cross-entropy over non-pad targets;
``chunked_cross_entropy_sums`` the same sums without ever holding the whole float32[batch, length, vocab]
logits (training's ``train.loss_chunk_tokens``); ``eval_step`` a deterministic forward pass to those sums.
Metrics are sums with a token count beside them (``num_tokens``), normalized only when logged
(``summarize``), so padding never biases a loss.
``accumulate_metrics`` adds them on the device, so the host reads them only at log intervals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import ensemble
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer


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
    # reduction is cheap on a CPU, where argmax's (value, index) reduction is not (docs/benchmarks.md).
    correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return {
        "loss": jnp.sum(smoothed * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "num_tokens": jnp.sum(weights),
    }


def chunk_length(length: int, rows: int, chunk_tokens: int) -> int:
    """Target positions per chunk of the chunked loss: ``chunk_tokens // rows``, in [1, length]
    (``length`` when ``chunk_tokens`` is 0: one chunk, the whole sequence)."""
    if not chunk_tokens:
        return length
    return max(1, min(length, chunk_tokens // rows))


def chunked_cross_entropy_sums(hidden: jax.Array, targets: jax.Array, label_smoothing: float, *,
                               logits_fn: Callable[[jax.Array], jax.Array], chunk_length: int) -> dict:
    """``cross_entropy_sums(logits_fn(hidden), targets, label_smoothing)``, a chunk of positions at a time.

    The logits of one chunk, float32[batch, chunk_length, vocab], are all that exists at once: a scan
    over the chunks adds their sums, and ``jax.checkpoint`` makes the backward pass recompute each
    chunk's logits rather than keep them (one more output projection: 1/3 more of its FLOPs). The
    sums equal the full loss's up to float reassociation; so do the gradients.

    Args:
      hidden: float[batch, length, d_model], the decoder output (``Transformer.hidden``).
      targets: int[batch, length]; PAD_ID marks padding. The length is padded with PAD_ID (weight 0) to
        a multiple of ``chunk_length``.
      logits_fn: float[batch, n, d_model] -> float32[batch, n, vocab] (``Transformer.logits``).
    """
    batch, length = targets.shape
    num_chunks = -(-length // chunk_length)
    pad = num_chunks * chunk_length - length
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=PAD_ID)

    def chunks(x):  # [B, C * c, ...] -> [C, B, c, ...]
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk_length, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def chunk_sums(h, t):
        return cross_entropy_sums(logits_fn(h), t, label_smoothing)

    def add(total, chunk):
        return jax.tree.map(jnp.add, total, chunk_sums(*chunk)), None

    zeros = {k: jnp.zeros((), jnp.float32) for k in ("loss", "nll", "correct", "num_tokens")}
    sums, _ = jax.lax.scan(add, zeros, (chunks(hidden), chunks(targets)))
    return sums


def eval_step(params, batch: dict, *, model: Transformer, label_smoothing: float) -> dict:
    """Metric sums of a deterministic forward pass (dropout off). Pure.

    Args:
      params: the model parameters, or an ``ensemble.Ensemble`` (scored by its mean distribution).
      batch: {"inputs": int32[batch, src_len], "targets": int32[batch, tgt_len]}.
    """
    logits = ensemble.apply(params, lambda p: model.apply({"params": p}, batch["inputs"], batch["targets"]))
    return cross_entropy_sums(logits, batch["targets"], label_smoothing)


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


def token_log_probs(params, inputs: jax.Array, targets: jax.Array, *, model: Transformer) -> jax.Array:
    """float32[batch, tgt_len]: log P(targets[b, t] | inputs[b], targets[b, :t]) of a deterministic
    forward pass (teacher forcing), for int32[batch, src_len] inputs and int32[batch, tgt_len] targets;
    the values at PAD targets are meaningless. ``params`` may be an ``ensemble.Ensemble`` (its mean
    distribution). Pure."""
    logits = ensemble.apply(params, lambda p: model.apply({"params": p}, inputs, targets))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


@functools.lru_cache(maxsize=8)
def make_token_log_probs(model_config: ModelConfig) -> Callable[..., jax.Array]:
    """The jitted :func:`token_log_probs` of the deterministic model: ``fn(params, inputs, targets)``."""
    model = Transformer(model_config.replace(deterministic=True, decode=False))
    return jax.jit(functools.partial(token_log_probs, model=model))
