"""Tests for transformer_jax.model.transformer: shapes, validation, parameter counts and causal properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_params

from transformer_jax.model import positions
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig, param_count
from transformer_jax.model.transformer import Transformer

VOCAB, SRC_LEN, TGT_LEN, BATCH = 37, 7, 9, 3


def _tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, d_k=5, d_v=7,
                  num_encoder_layers=2, num_decoder_layers=2, max_len=16, deterministic=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def _tokens(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(4, VOCAB, size=shape), jnp.int32)


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(_tiny(), 0)  # drawn in NumPy: the init itself is checked by the tests that call it


def test_output_shape_and_dtype(tiny_params):
    logits = Transformer(_tiny()).apply({"params": tiny_params}, _tokens(0, (BATCH, SRC_LEN)),
                                        _tokens(1, (BATCH, TGT_LEN)))
    assert logits.shape == (BATCH, TGT_LEN, VOCAB) and logits.dtype == jnp.float32
    encoded = Transformer(_tiny()).apply({"params": tiny_params}, _tokens(0, (BATCH, SRC_LEN)),
                                         method=Transformer.encode)
    assert encoded.shape == (BATCH, SRC_LEN, 15)


def test_bfloat16_compute_keeps_float32_params_and_logits(tiny_params):
    cfg = _tiny(dtype="bfloat16")
    params = jax.eval_shape(lambda key: model_lib.init_params(cfg, rng=key), jax.random.key(0))  # dtypes
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    logits = Transformer(cfg).apply({"params": tiny_params}, _tokens(0, (BATCH, SRC_LEN)),
                                    _tokens(1, (BATCH, TGT_LEN)))
    assert logits.dtype == jnp.float32
    full = Transformer(_tiny()).apply({"params": tiny_params}, _tokens(0, (BATCH, SRC_LEN)),
                                      _tokens(1, (BATCH, TGT_LEN)))
    np.testing.assert_allclose(logits, full, atol=0.1)  # same function, bf16 rounding only


@pytest.mark.parametrize("overrides", [{}, {"position_encoding": "learned"}, {"norm_style": "pre"}])
def test_param_count_formula_matches_initialized_model(overrides):
    cfg = _tiny(**overrides)
    params = jax.eval_shape(lambda key: model_lib.init_params(cfg, rng=key), jax.random.key(1))  # sizes
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(cfg)


def test_base_param_count_by_hand():
    d, d_ff, vocab, n = 512, 2048, 37000, 6
    attention = 4 * d * d  # W^Q, W^K, W^V, W^O; 8 heads x 64 = 512, no biases
    ffn = d * d_ff + d_ff + d_ff * d + d
    encoder_layer = attention + ffn + 2 * (2 * d)
    decoder_layer = 2 * attention + ffn + 3 * (2 * d)
    expected = n * encoder_layer + n * decoder_layer + vocab * d
    assert expected == 63_045_632
    assert param_count(ModelConfig(vocab_size=vocab)) == expected


@pytest.mark.parametrize("fields, message", [
    (dict(d_model=500, num_heads=8), "d_model=500 is not divisible by num_heads=8"),
    (dict(d_model=0), "d_model must be a positive integer, got 0"),
    (dict(d_ff=-3), "d_ff must be a positive integer, got -3"),
    (dict(num_encoder_layers=0), "num_encoder_layers must be a positive integer"),
    (dict(dropout_rate=1.0), r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(dropout_rate=-0.1), r"dropout_rate must be in \[0, 1\)"),
    (dict(position_encoding="xpos"), "position_encoding must be one of .* got 'xpos'"),
    (dict(position_encoding="alibi", attention_impl="blockwise"), "only attention_impl='dense'"),
    (dict(position_encoding="relative", attention_impl="fused"), "only attention_impl='dense'"),
    (dict(position_encoding="relative", max_relative_position=0), "max_relative_position must be"),
    (dict(position_encoding="rotary", d_k=5, d_v=5), "d_k must be even"),
    (dict(norm_style="sandwich"), "norm_style must be one of"),
    (dict(ffn_activation="tanh"), "ffn_activation must be one of .*'gelu_sigmoid'.* got 'tanh'"),
    (dict(attention_init="xavier"), "attention_init must be one of .* got 'xavier'"),
    (dict(dtype="float16"), "dtype must be one of"),
])
def test_config_validation_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=VOCAB, **fields)


def test_explicit_head_sizes_allow_indivisible_d_model():
    cfg = ModelConfig(vocab_size=VOCAB, d_model=500, num_heads=8, d_k=64, d_v=32)
    assert (cfg.d_k, cfg.d_v) == (64, 32)


def test_sinusoidal_table_matches_the_formula():
    table = positions.sinusoidal_table(11, 6)
    pos, i = 7, 1
    np.testing.assert_allclose(table[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 6)), atol=1e-6)
    np.testing.assert_allclose(table[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 6)), atol=1e-6)


MATRIX_FANS = {"query": (64, 4 * 16), "key": (64, 4 * 16), "value": (64, 4 * 8), "out": (4 * 8, 64)}
# flax's default axes on [d_model, h, d_k] and [h, d_v, d_model]: fan_in axis -2, fan_out -1, times the rest.
NARROW_FANS = {"query": (4 * 64, 16 * 64), "key": (4 * 64, 16 * 64), "value": (4 * 64, 8 * 64),
               "out": (8 * 4, 64 * 4)}


@pytest.mark.parametrize("attention_init, attention_fans",
                         [("matrix", MATRIX_FANS), ("narrow", NARROW_FANS)])
def test_every_kernel_draws_from_glorot_uniform_with_its_fans(attention_init, attention_fans):
    """With "matrix", W^Q, W^K, W^V [d_model, h, d_k] and W^O [h, d_v, d_model] are the paper's
    d_model x (h * d_k) and (h * d_v) x d_model matrices split by head, so Glorot's bound
    sqrt(6 / (fan_in + fan_out)) takes those fans, as for the 2-D feed-forward kernels."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=64, d_ff=96, num_heads=4, d_k=16, d_v=8,
                      num_encoder_layers=1, num_decoder_layers=1, max_len=16, attention_init=attention_init)
    # The "rbg" PRNG: any uniform bits do, and its program compiles much faster than threefry's.
    params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, rng=jax.random.key(0, impl="rbg"))
    fans = {**attention_fans, "wi": (64, 96), "wo": (96, 64)}
    checked = 0
    for path, kernel in jax.tree_util.tree_leaves_with_path(params):
        names = [key.key for key in path]
        name = names[-2] if names[-1] == "kernel" else names[-1]
        if name not in fans:
            continue
        bound = np.sqrt(6.0 / sum(fans[name]))
        kernel = np.asarray(kernel)
        assert np.abs(kernel).max() <= bound, names
        # U(-b, b) has variance b^2 / 3; 2,048 or more draws estimate it within a few percent.
        np.testing.assert_allclose(kernel.var(), bound**2 / 3, rtol=0.12, err_msg=str(names))
        checked += 1
    assert checked == 3 * 4 + 2 * 2  # 3 attention modules of 4 kernels, 2 feed-forward blocks of 2


def test_future_target_perturbation_leaves_earlier_logits_bit_identical(tiny_params):
    model = Transformer(_tiny())
    inputs, targets = _tokens(2, (BATCH, SRC_LEN)), np.array(_tokens(3, (BATCH, TGT_LEN)))
    base = np.asarray(model.apply({"params": tiny_params}, inputs, jnp.asarray(targets)))
    t = 5  # decoder input position t+1 holds target t, so logits up to t must not move
    perturbed = targets.copy()
    perturbed[:, t:] = (perturbed[:, t:] + 7) % VOCAB
    moved = np.asarray(model.apply({"params": tiny_params}, inputs, jnp.asarray(perturbed)))
    np.testing.assert_array_equal(moved[:, : t + 1], base[:, : t + 1])
    assert not np.allclose(moved[:, t + 1:], base[:, t + 1:])


def test_decoder_receptive_field_has_no_gradient_from_the_future(tiny_params):
    model = Transformer(_tiny())
    inputs, targets = _tokens(4, (BATCH, SRC_LEN)), _tokens(5, (BATCH, TGT_LEN))
    _, state = model.apply({"params": tiny_params}, inputs, targets, mutable=["perturbations"])
    position = 4

    def logit_sum_at_position(perturbations):
        logits = model.apply({"params": tiny_params, "perturbations": perturbations},
                             inputs, targets)
        return logits[:, position].sum()

    grads = jax.jit(jax.grad(logit_sum_at_position))(state["perturbations"])
    grad = np.asarray(grads["decoder"]["embedded"])  # [B, T, d_model], w.r.t. decoder inputs
    assert np.all(grad[:, position + 1:] == 0.0)
    assert np.all(np.abs(grad[:, : position + 1]).sum(-1) > 0)


def test_source_padding_is_invisible(tiny_params):
    model = Transformer(_tiny())
    inputs = np.array(_tokens(6, (BATCH, SRC_LEN)))
    inputs[:, 5:] = 0
    targets = _tokens(7, (BATCH, TGT_LEN))
    base = model.apply({"params": tiny_params}, jnp.asarray(inputs), targets)
    longer = np.concatenate([inputs, np.zeros((BATCH, 4), np.int32)], axis=1)  # more padding
    padded = model.apply({"params": tiny_params}, jnp.asarray(longer), targets)
    np.testing.assert_allclose(padded, base, atol=1e-5)


def test_dropout_is_active_only_when_not_deterministic(tiny_params):
    cfg = _tiny(deterministic=False, dropout_rate=0.3)
    inputs, targets = _tokens(8, (BATCH, SRC_LEN)), _tokens(9, (BATCH, TGT_LEN))
    run = lambda seed: Transformer(cfg).apply({"params": tiny_params}, inputs, targets,
                                               rngs={"dropout": jax.random.key(seed)})
    assert not np.allclose(run(0), run(1))
    np.testing.assert_array_equal(run(2), run(2))


def test_cached_decoding_matches_the_full_causal_forward(tiny_params):
    cfg = _tiny()
    inputs, targets = _tokens(10, (BATCH, SRC_LEN)), _tokens(11, (BATCH, TGT_LEN))
    full = Transformer(cfg).apply({"params": tiny_params}, inputs, targets)
    decoder_inputs = model_lib.shift_right(targets)
    model = Transformer(cfg)
    encoded = model.apply({"params": tiny_params}, inputs, method=Transformer.encode)
    cache = model.apply({"params": tiny_params}, encoded, TGT_LEN, method=Transformer.init_cache)
    step_model = Transformer(cfg.replace(decode=True))
    steps = []
    for t in range(TGT_LEN):
        logits, cache = step_model.apply({"params": tiny_params}, None, inputs, decoder_inputs[:, t:t + 1],
                                         cache, method=Transformer.decode)
        steps.append(logits[:, 0])
    assert int(cache.index) == TGT_LEN
    with pytest.raises(ValueError, match="decode mode"):  # a step needs its cache
        step_model.apply({"params": tiny_params}, encoded, inputs, decoder_inputs[:, :1],
                         method=Transformer.decode)
    np.testing.assert_allclose(np.stack(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_runtime_witness_passes_on_the_model(tiny_params):
    cfg = _tiny(attention_witness=True)
    logits = jax.jit(lambda p, i, t: Transformer(cfg).apply({"params": p}, i, t))(
        tiny_params, _tokens(12, (BATCH, SRC_LEN)), _tokens(13, (BATCH, TGT_LEN)))
    assert np.all(np.isfinite(np.asarray(logits)))


def test_blockwise_attention_model_matches_dense(tiny_params):
    inputs = np.array(_tokens(14, (BATCH, SRC_LEN)))
    inputs[0, 4:] = 0
    targets = _tokens(15, (BATCH, TGT_LEN))
    dense = Transformer(_tiny()).apply({"params": tiny_params}, jnp.asarray(inputs), targets)
    blockwise = jax.jit(Transformer(_tiny(attention_impl="blockwise", attention_block_size=4)).apply)(
        {"params": tiny_params}, jnp.asarray(inputs), targets)
    np.testing.assert_allclose(blockwise, dense, atol=1e-5, rtol=1e-5)


def test_blockwise_rejects_options_it_cannot_honour():
    with pytest.raises(ValueError, match="attention_witness"):
        _tiny(attention_impl="blockwise", attention_witness=True)
    with pytest.raises(ValueError, match="attention_dropout_rate"):
        _tiny(attention_impl="blockwise", attention_dropout_rate=0.1)
