"""Tests for transformer_jax.runtime.sharding: mesh shapes, rule validation, logical names -> specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from transformer_jax.model import axes
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.runtime import sharding

RULES = (("batch", "data"), ("length", None), ("embed", None), ("heads", "model"), ("kv", None),
         ("mlp", "model"), ("vocab", "model"))


def test_mesh_shape_resolution():
    assert sharding.resolve_mesh_shape((-1, 1), 8) == (8, 1)
    assert sharding.resolve_mesh_shape((-1, 2), 8) == (4, 2)
    assert sharding.resolve_mesh_shape((2, -1), 8) == (2, 4)
    with pytest.raises(ValueError, match="not divisible"):
        sharding.resolve_mesh_shape((-1, 3), 8)
    with pytest.raises(ValueError, match="needs 6 devices, found 8"):
        sharding.resolve_mesh_shape((3, 2), 8)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.resolve_mesh_shape((-1, -1), 8)
    with pytest.raises(ValueError, match="2 entries"):
        sharding.resolve_mesh_shape((8,), 8)


def test_mesh_has_automatic_data_and_model_axes():
    mesh = sharding.make_mesh((-1, 1))
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("rules, message", [
    ((("batch",),), "pair"),
    ((("batsh", "data"),), "unknown logical axis 'batsh'"),
    ((("batch", "pipeline"),), "mesh axes are"),
])
def test_bad_rules_are_rejected_with_the_offending_entry(rules, message):
    with pytest.raises(ValueError, match=message):
        sharding.rules_from_config(rules)


def test_rules_accept_every_model_axis_name():
    rules = sharding.rules_from_config(tuple((name, None) for name in axes.ALL))
    assert [name for name, _ in rules] == list(axes.ALL)


def test_model_parameters_map_to_the_mesh_axes_their_rules_name():
    cfg = ModelConfig(vocab_size=13, d_model=12, d_ff=20, num_heads=3, num_encoder_layers=1,
                      num_decoder_layers=1, max_len=16)
    tokens = jnp.ones((1, 5), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens, tokens))["params"]
    mesh = sharding.make_mesh((1, 1), jax.devices()[:1])
    shardings = sharding.logical_to_sharding(boxed, mesh, sharding.rules_from_config(RULES))
    attention = shardings["decoder"]["layer_0"]["self_attention"]
    assert attention["query"].spec == PartitionSpec(None, "model", None)  # [embed, heads, kv]
    assert attention["out"].spec == PartitionSpec("model", None, None)  # [heads, kv, embed]
    assert shardings["shared_embedding"]["embedding"].spec == PartitionSpec("model", None)  # [vocab, embed]
    fsdp = sharding.rules_from_config(tuple((n, "data" if n == "embed" else a) for n, a in RULES))
    fsdp_shardings = sharding.logical_to_sharding(boxed, mesh, fsdp)
    assert fsdp_shardings["shared_embedding"]["embedding"].spec == PartitionSpec("model", "data")


def test_global_batch_keeps_values_and_splits_rows_over_data():
    mesh = sharding.make_mesh((-1, 1))
    rows = 3 * jax.device_count()
    local = {"inputs": np.arange(rows * 5, dtype=np.int32).reshape(rows, 5)}
    batch = sharding.global_batch(local, mesh)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])
    assert batch["inputs"].sharding.spec == PartitionSpec("data")
