"""transformer_jax/inspect/ablation.py: zeroing exactly one head, and the rank correlation."""

import jax
import numpy as np

from transformer_jax.inspect import ablation


def test_ablated_params_zero_exactly_one_head():
    rng = np.random.default_rng(0)
    out = {"out": rng.normal(size=(3, 5, 7)).astype(np.float32),  # [h, d_v, d_model]
           "query": rng.normal(size=(7, 3, 5)).astype(np.float32)}
    params = {"encoder": {"layer_0": {"self_attention": dict(out)}},
              "decoder": {f"layer_{i}": {"self_attention": dict(out), "cross_attention": dict(out)}
                          for i in range(2)}}
    ablated = ablation.ablated_params(params, "cross", 1, 2)
    kernel = np.asarray(ablated["decoder"]["layer_1"]["cross_attention"]["out"])
    assert np.all(kernel[2] == 0) and np.array_equal(kernel[:2], out["out"][:2])
    changed = [not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ablated), strict=True)]
    assert sum(changed) == 1
    assert np.array_equal(params["decoder"]["layer_1"]["cross_attention"]["out"], out["out"])  # no mutation
    enc = ablation.ablated_params(params, "encoder_self", 0, 0)
    assert np.all(np.asarray(enc["encoder"]["layer_0"]["self_attention"]["out"])[0] == 0)
    assert enc["decoder"] is params["decoder"]  # the rest is shared, not copied


def test_spearman_by_hand():
    # ranks x: 0 1 2 3, ranks y: 1 0 3 2 -> d^2 sum = 4, rho = 1 - 6*4/(4*15) = 0.6
    np.testing.assert_allclose(ablation.spearman([1, 2, 3, 4], [20, 10, 40, 30]), 0.6, rtol=1e-12)
    np.testing.assert_allclose(ablation.spearman([1, 2, 3], [9, 5, 1]), -1.0, rtol=1e-12)
    np.testing.assert_allclose(ablation.spearman([1, float("nan"), 2, 3], [1, 5, 2, 3]), 1.0, rtol=1e-12)
    assert np.isnan(ablation.spearman([1, 2], [1, 2]))  # under 3 pairs
