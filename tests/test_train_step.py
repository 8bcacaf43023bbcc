"""Tests for steps.py and train_state.py: loss, schedule, train step, accumulation, sharded step."""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import with_test_xla_flags
from jax.sharding import NamedSharding, PartitionSpec
from tiny import random_params

from transformer_jax.model import loss
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.runtime import sharding
from transformer_jax.training import loop, steps, train_state

VOCAB, BATCH, SRC_LEN, TGT_LEN = 32, 8, 7, 5


def _reference_smoothed_ce(logits, targets, eps):
    """-sum_i q_i log p_i with an explicit smoothed one-hot q, over non-pad positions (NumPy, f64)."""
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    vocab = logits.shape[-1]
    q = np.full(logits.shape, eps / vocab)
    np.put_along_axis(q, np.asarray(targets)[..., None], 1 - eps + eps / vocab, axis=-1)
    per_token = -(q * logp).sum(-1)
    weights = np.asarray(targets) != PAD_ID
    nll = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    return (per_token * weights).sum(), (nll * weights).sum(), weights.sum()


def test_label_smoothed_loss_matches_explicit_one_hot_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, VOCAB)).astype(np.float32) * 3
    targets = rng.integers(1, VOCAB, size=(3, 5))
    targets[0, 3:] = 0
    targets[2, 1:] = 0
    for eps in (0.0, 0.1, 0.3):
        sums = loss.cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), eps)
        want_loss, nll, count = _reference_smoothed_ce(logits, targets, eps)
        np.testing.assert_allclose(sums["loss"], want_loss, rtol=1e-5)
        np.testing.assert_allclose(sums["nll"], nll, rtol=1e-5)
        assert float(sums["num_tokens"]) == count == 15 - 2 - 4
        argmax_hits = (logits.argmax(-1) == targets) & (targets != PAD_ID)  # no ties in random logits
        assert float(sums["correct"]) == argmax_hits.sum()


def test_a_target_tied_for_the_largest_logit_counts_as_correct():
    logits = jnp.array([[[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0]]])
    sums = loss.cross_entropy_sums(logits, jnp.array([[1, 2, 3]]), 0.0)
    assert float(sums["correct"]) == 2.0  # both tied maxima count; the smaller logit does not


def test_loss_ignores_padding_positions():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 4, VOCAB)), jnp.float32)
    targets = jnp.array([[5, 6, 0, 0]])
    a = loss.cross_entropy_sums(logits, targets, 0.1)
    b = loss.cross_entropy_sums(logits.at[:, 2:].multiply(100.0), targets, 0.1)
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)


def test_learning_rate_schedule_is_the_papers_formula():
    schedule = train_state.learning_rate_schedule(512, 4000)
    for step in (1, 100, 4000, 10_000, 100_000):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        np.testing.assert_allclose(schedule(step - 1), expected, rtol=1e-5)
    assert float(schedule(3999)) > float(schedule(3998)) and float(schedule(4001)) < float(schedule(4000))


def test_cooldown_ramps_the_last_steps_linearly_to_zero():
    d_model, warmup, num_steps, cooldown = 128, 100, 1000, 200
    paper = train_state.learning_rate_schedule(d_model, warmup)
    schedule = train_state.learning_rate_schedule(d_model, warmup, num_steps=num_steps,
                                                  cooldown_steps=cooldown)
    for count in (0, 99, 500, 799, 800):  # before the cooldown (count = updates already taken)
        np.testing.assert_allclose(schedule(count), paper(count), rtol=1e-6)
    # Update k of the cooldown (count = 800 + k) runs at (200 - k) / 200 of the paper's rate.
    for count, fraction in ((850, 150 / 200), (900, 0.5), (999, 1 / 200), (1000, 0.0), (1200, 0.0)):
        np.testing.assert_allclose(schedule(count), fraction * paper(count), rtol=1e-5, atol=1e-12)


# One model, optimizer, batch and mesh layout for every step below, on one device and in the sharded
# subprocess: the tests share their compiled programs. Vocabulary, d_ff and heads divide by the model axis.
CONFIG = ModelConfig(vocab_size=VOCAB, d_model=16, d_ff=24, num_heads=4, num_encoder_layers=1,
                     num_decoder_layers=1, dropout_rate=0.0, max_len=16)
RULES = (("batch", "data"), ("length", None), ("embed", None), ("heads", "model"), ("kv", None),
         ("mlp", "model"), ("vocab", "model"))
TX = optax.adam(1e-2)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(4, VOCAB, size=(BATCH, SRC_LEN)).astype(np.int32)
    targets = rng.integers(4, VOCAB, size=(BATCH, TGT_LEN)).astype(np.int32)
    inputs[1, 4:] = 0
    targets[2, 2:] = 0
    targets[:, -1] = np.where(targets[:, -1] > 0, 1, 0)
    return {"inputs": inputs, "targets": targets}


def _one_device_mesh():
    return sharding.make_mesh((1, 1), jax.devices()[:1])


def _state():
    """The initial TrainState of CONFIG and TX on one device (a fresh one: the step donates it)."""
    state, _ = train_state.create_train_state(CONFIG, TX, _one_device_mesh(), RULES, seed=0)
    return state


@functools.cache
def _one_device_step(grad_accum_steps=1, loss_chunk_tokens=0):
    """steps.make_train_step of CONFIG and TX on a 1x1 mesh, built once per setting."""
    mesh = _one_device_mesh()
    _, state_sharding = train_state.create_train_state(CONFIG, TX, mesh, RULES, seed=0)
    return steps.make_train_step(CONFIG, TX, mesh, RULES, state_sharding, label_smoothing=0.1,
                                 grad_accum_steps=grad_accum_steps, loss_chunk_tokens=loss_chunk_tokens)


def _two_steps(grad_accum_steps=1, loss_chunk_tokens=0):
    """(params as NumPy arrays, metric sums) after two steps on ``_batch(3)``."""
    step, batch = _one_device_step(grad_accum_steps, loss_chunk_tokens), _batch(3)
    state, _ = step(_state(), batch)
    state, sums = step(state, batch)
    return jax.tree.map(np.asarray, state.params), sums


@pytest.fixture(scope="module")
def two_steps():
    return _two_steps()


def test_train_step_reduces_loss_and_counts_steps():
    step = _one_device_step()
    state, batch = _state(), _batch()
    first = None
    for _ in range(30):
        state, sums = step(state, batch)
        first = first if first is not None else float(sums["loss"] / sums["num_tokens"])
    assert int(state.step) == 30
    assert float(sums["loss"] / sums["num_tokens"]) < 0.6 * first
    assert int(sums["bad_step"]) == steps.NO_BAD_STEP


def test_gradient_accumulation_gives_the_same_update(two_steps):
    params, sums = _two_steps(grad_accum_steps=4)  # micro-batches of rows (0, 4), (1, 5), ...
    np.testing.assert_allclose(sums["loss"], two_steps[1]["loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), params, two_steps[0])


def test_non_finite_loss_reports_the_step():
    state = _state()
    state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params), step=jnp.int32(6))
    _, sums = _one_device_step()(state, _batch())
    assert int(sums["bad_step"]) == 7

    class _Ckpt:
        directory = "/tmp/ckpt"

        def latest_step(self):
            return 5

        def last_good_message(self):
            return "The last good checkpoint is step 5 in /tmp/ckpt."

    with pytest.raises(FloatingPointError, match="step 7"):
        loop._check_and_summarize(sums, _Ckpt())


def test_accumulated_metrics_keep_the_first_bad_step_and_add_the_sums():
    good = {"loss": jnp.float32(3.0), "nll": jnp.float32(2.0), "correct": jnp.float32(1.0),
            "num_tokens": jnp.float32(5.0), "bad_step": jnp.int32(steps.NO_BAD_STEP)}
    total = None
    for bad_step in (steps.NO_BAD_STEP, 9, 4, steps.NO_BAD_STEP):
        total = loss.accumulate_metrics(total, {**good, "bad_step": jnp.int32(bad_step)})
    assert int(total["bad_step"]) == 4
    summary = loss.summarize({k: v for k, v in total.items() if k != "bad_step"})
    np.testing.assert_allclose([summary["loss"], summary["nll"], summary["accuracy"]],
                               [12 / 20, 8 / 20, 4 / 20], rtol=1e-6)
    np.testing.assert_allclose(summary["ppl"], np.exp(0.4), rtol=1e-6)
    assert summary["num_tokens"] == 20


def test_compiled_step_donates_the_state():
    state = _state()
    leaf = jax.tree.leaves(state.params)[0]
    new_state, _ = _one_device_step()(state, _batch())
    assert leaf.is_deleted()  # the old buffers were handed to the new state
    assert int(new_state.step) == 1


# Two steps of CONFIG and TX on each mesh shape of 8 faked devices: sys.argv[1] is a JSON object with
# the config fields, the rules, the batch and the mesh shapes. (Sharding is by annotation only, so every
# shape runs the same code; one that splits both the batch and the heads shows it.)
SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np, optax
    from transformer_jax.runtime import sharding
    from transformer_jax.training import steps, train_state
    from transformer_jax.model.config import ModelConfig
    assert jax.device_count() == 8, jax.devices()
    args = json.loads(sys.argv[1])
    cfg = ModelConfig(**args["config"])
    rules = tuple(tuple(rule) for rule in args["rules"])
    batch = {k: np.asarray(v, np.int32) for k, v in args["batch"].items()}
    tx = optax.adam(args["learning_rate"])
    out = {}
    for shape in args["shapes"]:
        devices = jax.devices()[: shape[0] * shape[1]]
        mesh = sharding.make_mesh(tuple(shape), devices)
        state, state_sharding = train_state.create_train_state(cfg, tx, mesh, rules, seed=0)
        step = steps.make_train_step(cfg, tx, mesh, rules, state_sharding, label_smoothing=0.1)
        for _ in range(2):
            state, sums = step(state, sharding.global_batch(batch, mesh))
        wq = state.params["decoder"]["layer_0"]["self_attention"]["query"]
        out[str(tuple(shape))] = {
            "loss": float(sums["loss"]),
            "params": [np.asarray(p).ravel().tolist() for p in jax.tree.leaves(state.params)],
            "query_sharding": str(wq.sharding.spec),
        }
    json.dump(out, sys.stdout)
""")


def test_sharded_train_step_matches_one_device(two_steps):
    """A data and model parallel layout (2 x 4: the rows split in two, one head per device) gives the
    one-device update (this process's ``two_steps``)."""
    args = {"config": {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG)},
            "rules": RULES, "learning_rate": 1e-2, "shapes": [(2, 4)],
            "batch": {k: v.tolist() for k, v in _batch(3).items()}}
    env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, json.dumps(args)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    reference_params, reference_sums = two_steps
    assert "None, 'model', None" in results["(2, 4)"]["query_sharding"]
    for shape, result in results.items():
        np.testing.assert_allclose(result["loss"], reference_sums["loss"], rtol=1e-6, err_msg=shape)
        for a, b in zip(result["params"], jax.tree.leaves(reference_params), strict=True):
            np.testing.assert_allclose(a, b.ravel(), atol=1e-6, rtol=1e-5, err_msg=shape)


# ------------------------------------------------------------------------------------- the chunked loss
def _loss_and_grads(params, batch, *, chunk_length, rng):
    """(sums, d loss / d params) of the training loss with dropout on: full logits (chunk_length=0), or
    ``loss.chunked_cross_entropy_sums`` over chunks of ``chunk_length`` positions."""
    model = model_lib.Transformer(CONFIG.replace(dropout_rate=0.3))

    def loss_fn(p):
        variables, targets = {"params": p}, batch["targets"]
        if chunk_length:
            hidden = model.apply(variables, batch["inputs"], targets, rngs={"dropout": rng},
                                 method=model_lib.Transformer.hidden)
            sums = loss.chunked_cross_entropy_sums(
                hidden, targets, 0.1, chunk_length=chunk_length,
                logits_fn=lambda h: model.apply(variables, h, method=model_lib.Transformer.logits))
        else:
            logits = model.apply(variables, batch["inputs"], targets, rngs={"dropout": rng})
            sums = loss.cross_entropy_sums(logits, targets, 0.1)
        return sums["loss"], sums

    grads, sums = jax.jit(jax.grad(loss_fn, has_aux=True))(params)
    return jax.tree.map(np.asarray, sums), jax.tree.map(np.asarray, grads)


def test_the_chunked_loss_equals_the_full_loss_and_its_gradients():
    params = random_params(CONFIG, 1)
    batch, rng = _batch(5), jax.random.key(2)
    full_sums, full_grads = _loss_and_grads(params, batch, chunk_length=0, rng=rng)
    sums, grads = _loss_and_grads(params, batch, chunk_length=2, rng=rng)  # 3 chunks, the last padded
    for key in ("loss", "nll", "correct", "num_tokens"):
        np.testing.assert_allclose(sums[key], full_sums[key], rtol=1e-6, atol=1e-6, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads, full_grads)


def test_chunk_length_holds_chunk_tokens_per_micro_batch():
    assert loss.chunk_length(64, 8, 0) == 64  # off: the whole length
    assert loss.chunk_length(64, 8, 100) == 12  # 100 tokens over 8 rows
    assert loss.chunk_length(64, 8, 4) == 1  # at least one position
    assert loss.chunk_length(64, 8, 10**6) == 64  # at most the length


def test_the_train_step_with_loss_chunks_gives_the_same_update(two_steps):
    params, sums = _two_steps(grad_accum_steps=2, loss_chunk_tokens=8)  # micro-batches of 4 rows x 2
    np.testing.assert_allclose(sums["loss"], two_steps[1]["loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), params, two_steps[0])


def test_the_chunked_train_step_never_forms_the_whole_logits():
    """The traced step's largest float32[..., vocab] array: the whole logits without chunks; with chunks
    of 2 positions, one chunk's (not the whole logits, nor every chunk's logits kept for the backward)."""
    init = train_state._init_state_fn(CONFIG, TX)
    state = jax.eval_shape(lambda key: nn.meta.unbox(init(key)), jax.random.key(0))  # traced, not compiled
    mesh = _one_device_mesh()
    for chunk_tokens, largest in ((0, BATCH * TGT_LEN * VOCAB), (2 * BATCH, BATCH * 2 * VOCAB)):
        step = steps.make_train_step(CONFIG, TX, mesh, RULES, NamedSharding(mesh, PartitionSpec()),
                                     label_smoothing=0.1, loss_chunk_tokens=chunk_tokens)
        with jax.set_mesh(mesh):
            program = str(jax.make_jaxpr(step.jitted)(state, _batch()))
        shapes = [tuple(map(int, dims.split(","))) for dims in re.findall(r"f32\[([\d,]+)\]", program)]
        assert max(np.prod(s) for s in shapes if s[-1] == VOCAB) == largest, chunk_tokens
