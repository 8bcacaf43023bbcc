"""Tests for transformer_jax.evaluation.top_k: the two-pass top-k equals jax.lax.top_k exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.evaluation import top_k as top_k_lib
from transformer_jax.evaluation.decode import NEG_INF


@pytest.mark.parametrize("width, k", [(8000, 10), (8000, 8), (997, 6), (3000, 1), (40, 6)])
def test_equals_lax_top_k_with_ties_banned_and_infinite_entries(width, k):
    """Rows of few distinct values (ties everywhere), banned entries (NEG_INF), -inf entries, rows
    whose best entries share one chunk, and a tie across chunks ranked the other way: values and
    indices equal lax.top_k's, including the tie order."""
    rng = np.random.default_rng(width + k)
    x = rng.integers(0, 6, size=(12, width)).astype(np.float32)  # ties in every row
    x[1] = rng.standard_normal(width)
    x[2, : width // 2] = NEG_INF
    x[3, rng.integers(0, width, size=width // 3)] = -np.inf
    x[4] = -np.inf
    x[4, :2] = 1.0
    x[5] = 0.0
    x[5, 5 : 5 + k] = 2.0  # the k best side by side, in one or two chunks
    x[6] = rng.standard_normal(width) * 1e-3 + 1.0
    # The last chunk ranks first (its maximum is 2) but holds the k-th entry's tie at a higher index
    # than entry 0: lax.top_k takes entry 0.
    x[7] = 0.0
    x[7, 0] = 1.0
    x[7, width - k :] = [2.0] * (k - 1) + [1.0]
    x = jnp.asarray(x)
    values, index = jax.jit(top_k_lib.top_k, static_argnums=1)(x, k)
    expected_values, expected_index = jax.lax.top_k(x, k)
    assert index.dtype == jnp.int32
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(index, expected_index)


def test_chunk_size_picks_a_divisor_near_the_cheapest_and_short_rows_use_one_top_k():
    """sqrt(width / k) entries a chunk (28.3 for 8,000 / 10: the divisor 25); none for short rows;
    a prime width gets the rounded size and is padded."""
    assert top_k_lib.chunk_size(8000, 10) == 25
    assert top_k_lib.chunk_size(32000, 8) == 64
    assert top_k_lib.chunk_size(997, 6) == 13
    assert top_k_lib.chunk_size(40, 6) is None
    assert top_k_lib.chunk_size(23, 6) is None
