"""Tests for transformer_jax.model.fused_attention (``attention_impl="fused"``) against the dense path.

On this CPU the fused path runs ``jax.nn.dot_product_attention`` with ``implementation="xla"``; the cuDNN
kernel takes the same arguments on a GPU (not run here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_params

from transformer_jax.evaluation import ctranslate2_engine, decode
from transformer_jax.inspect import forward
from transformer_jax.model import attention, fused_attention
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer

# Distinct odd sizes so that a transposition cannot pass (one head size: keys and values share it).
BATCH, HEADS, Q_LEN, KV_LEN, HEAD_DIM = 3, 5, 7, 11, 9
TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, SRC_LEN, TGT_LEN = 37, 7, 9


def _inputs(q_len=Q_LEN, kv_len=KV_LEN, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    return (normal(BATCH, q_len, HEADS, HEAD_DIM), normal(BATCH, kv_len, HEADS, HEAD_DIM),
            normal(BATCH, kv_len, HEADS, HEAD_DIM), normal(BATCH, q_len, HEADS, HEAD_DIM))


def _value_and_grads(fn, query, key, value, d_out):
    out, pullback = jax.vjp(fn, query, key, value)
    return out, pullback(d_out)


def _padding_mask(kv_len=KV_LEN):
    """bool[batch, 1, 1, kv_len]: example 0 keeps 4 keys, example 1 none (every query all-masked)."""
    lengths = np.array([4, 0, kv_len])
    return (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]


@functools.partial(jax.jit, static_argnames=("causal", "fused"))
def _both(query, key, value, d_out, mask, *, causal, fused):
    """(dense out, dense grads), (fused out, fused grads): one compiled program per case."""
    dense_mask = mask
    if causal:
        dense_mask = attention.combine_masks(mask, attention.causal_mask(query.shape[1]))
    dense = _value_and_grads(lambda q, k, v: attention.dot_product_attention(q, k, v, dense_mask),
                             query, key, value, d_out)
    return dense, _value_and_grads(lambda q, k, v: fused(q, k, v, mask, causal=causal),
                                   query, key, value, d_out)


def _check(mask, *, causal, fused=fused_attention.fused_attention):
    """Asserts fused == dense (attention.dot_product_attention) for values and gradients."""
    query, key, value, d_out = _inputs(*((Q_LEN, Q_LEN) if causal else ()))
    (want_out, want_grads), (got_out, got_grads) = _both(query, key, value, d_out, mask, causal=causal,
                                                         fused=fused)
    np.testing.assert_allclose(got_out, want_out, **TOL)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    return got_out


@pytest.mark.parametrize("case", ["no mask", "padding", "causal", "causal and padding"])
def test_fused_equals_dense_in_values_and_gradients(case):
    causal = case.startswith("causal")
    mask = _padding_mask(Q_LEN if causal else KV_LEN) if "padding" in case else None
    out = _check(mask, causal=causal)
    if mask is not None:  # example 1 has no key: zero output, as the dense path gives
        np.testing.assert_array_equal(out[1], 0.0)


def test_per_query_mask_and_a_fully_masked_query_row():
    mask = np.ones((BATCH, 1, Q_LEN, KV_LEN), bool)
    mask[0, 0, 2] = False  # one query of example 0 sees nothing
    mask[2, 0, :, 5:] = False
    out = _check(mask, causal=False)
    np.testing.assert_array_equal(out[0, 2], 0.0)


def test_a_dropped_mask_is_caught():
    """Planted bug: the kernel called without the mask. The comparison must fail."""
    def dropped_mask(query, key, value, mask, *, causal):
        return fused_attention.fused_attention(query, key, value, None, causal=causal)

    with pytest.raises(AssertionError):
        _check(_padding_mask(), causal=False, fused=dropped_mask)


def test_the_raw_kernel_averages_a_fully_masked_row_which_the_wrapper_zeroes():
    """jax.nn.dot_product_attention alone gives a query with no key the mean of the values; the wrapper's
    zeroing is what makes it equal the dense path."""
    def raw(query, key, value, mask, *, causal):
        mask = jnp.broadcast_to(mask, (mask.shape[0], 1, query.shape[1], key.shape[1]))
        return jax.nn.dot_product_attention(query, key, value, mask=mask, implementation="xla")

    with pytest.raises(AssertionError):
        _check(_padding_mask(), causal=False, fused=raw)


def test_fused_refuses_two_head_sizes_and_a_per_head_mask():
    query, key, value, _ = _inputs()
    with pytest.raises(ValueError, match="one head size"):
        fused_attention.fused_attention(query, key, value[..., :4])
    with pytest.raises(ValueError, match="mask must be"):
        fused_attention.fused_attention(query, key, value, jnp.ones((BATCH, HEADS, Q_LEN, KV_LEN), bool))


@pytest.mark.parametrize("dtype, head_dim, backend, want", [
    ("bfloat16", 64, "gpu", "cudnn"), ("float16", 128, "gpu", "cudnn"),
    ("float32", 64, "gpu", "xla"), ("bfloat16", 60, "gpu", "xla"), ("bfloat16", 256, "gpu", "xla"),
    ("bfloat16", 64, "cpu", "xla"), ("bfloat16", 64, "tpu", "xla")])
def test_cudnn_only_where_it_serves(dtype, head_dim, backend, want):
    assert fused_attention.implementation_for(dtype, head_dim, backend) == want
    line = fused_attention.describe(dtype, head_dim, backend)
    assert ("cuDNN flash attention" in line) == (want == "cudnn") and "\n" not in line
    if dtype == "float32":
        assert "set model.dtype=bfloat16" in line


@pytest.mark.parametrize("q_len, kv_len, masked, want", [
    (64, 48, True, "cudnn"), (64, 49, False, "cudnn"), (63, 48, True, "xla"), (64, 47, True, "xla")])
def test_a_masked_cudnn_call_with_an_odd_length_takes_xla(q_len, kv_len, masked, want):
    assert fused_attention.kernel_for("cudnn", q_len, kv_len, masked) == want
    assert fused_attention.kernel_for("xla", q_len, kv_len, masked) == "xla"


# ------------------------------------------------------------------------------------------- the model
def _tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, num_encoder_layers=1,
                  num_decoder_layers=1, max_len=32, deterministic=True)
    return ModelConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def params():
    return random_params(_tiny(), 3, unit_embedding=True)


def _batch():
    rng = np.random.default_rng(5)
    inputs = rng.integers(4, VOCAB, size=(BATCH, SRC_LEN)).astype(np.int32)
    inputs[0, 4:] = PAD_ID
    inputs[1, :] = PAD_ID  # an all-padding source: every cross-attention query is fully masked
    targets = rng.integers(4, VOCAB, size=(BATCH, TGT_LEN)).astype(np.int32)
    return jnp.asarray(inputs), jnp.asarray(targets)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(cfg, params, inputs, targets):
    def loss(p):
        logits = Transformer(cfg).apply({"params": p}, inputs, targets)
        return jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(targets, VOCAB)), logits
    return jax.value_and_grad(loss, has_aux=True)(params)


def test_model_fused_equals_dense_logits_and_parameter_gradients(params):
    inputs, targets = _batch()
    (want_loss, want_logits), want_grads = _loss_and_grads(_tiny(), params, inputs, targets)
    (got_loss, got_logits), got_grads = _loss_and_grads(_tiny(attention_impl="fused"), params, inputs,
                                                        targets)
    np.testing.assert_allclose(got_logits, want_logits, **TOL)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got_grads, want_grads)


def test_model_cached_decoding_with_fused_equals_the_dense_forward(params):
    inputs, targets = _batch()
    full = jax.jit(Transformer(_tiny()).apply)({"params": params}, inputs, targets)
    cfg = _tiny(attention_impl="fused")
    model = Transformer(cfg)
    cache = jax.jit(lambda i: model.apply({"params": params}, model.apply(
        {"params": params}, i, method=Transformer.encode), TGT_LEN, method=Transformer.init_cache))(inputs)
    step = jax.jit(lambda c, tokens: Transformer(cfg.replace(decode=True)).apply(
        {"params": params}, None, inputs, tokens, c, method=Transformer.decode))
    decoder_inputs, steps = model_lib.shift_right(targets), []
    for t in range(TGT_LEN):
        logits, cache = step(cache, decoder_inputs[:, t:t + 1])
        steps.append(logits[:, 0])
    np.testing.assert_allclose(np.stack(steps, axis=1), full, **TOL)


def test_beam_search_with_fused_equals_dense(params):
    inputs, _ = _batch()
    search = functools.partial(decode.beam_search, params, inputs=inputs, beam_size=3, max_extra_len=6,
                               return_all_beams=True, compact=False)
    want_tokens, want_scores = search(_tiny())
    got_tokens, got_scores = search(_tiny(attention_impl="fused"))
    np.testing.assert_array_equal(got_tokens, want_tokens)
    np.testing.assert_allclose(got_scores, want_scores, **TOL)


# ------------------------------------------------------------------- every surface that reads the option
@pytest.mark.parametrize("fields, message", [
    (dict(d_k=5, d_v=3), "one head size for keys and values, got d_k=5 and d_v=3"),
    (dict(attention_witness=True), "never forms the attention weights"),
    (dict(attention_dropout_rate=0.1), "attention_dropout_rate > 0"),
])
def test_config_refuses_what_fused_cannot_serve(fields, message):
    with pytest.raises(ValueError, match=message):
        _tiny(attention_impl="fused", **fields)


def test_inspect_reads_maps_from_a_fused_model_through_the_dense_path(params):
    inputs, targets = _batch()
    got = forward.attention_records(params, _tiny(attention_impl="fused"), np.asarray(inputs),
                                    np.asarray(targets))
    want = forward.attention_records(params, _tiny(), np.asarray(inputs), np.asarray(targets))
    for kind in want:
        for g, w in zip(got[kind], want[kind], strict=True):
            np.testing.assert_array_equal(g.weights, w.weights)


def test_export_takes_a_fused_model():
    ctranslate2_engine.check_exportable(_tiny(attention_impl="fused"))  # the same function: no error


def test_resume_may_switch_to_fused_with_a_notice():
    from transformer_jax.checkpoints import integrity
    saved, new = {"model": {"attention_impl": "dense"}}, {"model": {"attention_impl": "fused"}}
    assert integrity.model_differences(saved, new) == []
    assert integrity.run_time_differences(saved, new) == ["model.attention_impl: saved 'dense', new 'fused'"]


def test_the_paper_comparison_counts_a_fused_bfloat16_run_as_the_paper_row():
    from configs import wmt14_en_de_base
    from transformer_jax import run_config
    from transformer_jax.evaluation import paper_tables
    config = wmt14_en_de_base.get_config()
    config.model.attention_impl, config.model.dtype = "fused", "bfloat16"
    run = run_config.build_run_config(config, environment=False)
    assert paper_tables.paper_differences(paper_tables.paper_reference("wmt14_en_de_base", "test"), run) == []
