"""``jax.lax.top_k`` over a vocabulary, in two short passes: beam search's per-row candidates.

Beam search keeps each decoder row's best 2K tokens every step (``decode._beam_step``): a top-k over
[rows, vocab]. XLA:CPU's top-k custom call sorts its way through every row, a large share of a beam
step at the Multi30k model's vocabulary. Two smaller top-ks give the same result in less than half the
time (docs/benchmarks.md):

1. Split each row into chunks of ``size`` entries and take the k chunks with the largest maxima.
2. Take the top k of those k * size entries.

Exact, ties included. Take the entries in ``top_k``'s order (value descending, then index ascending).
Every chunk ranked before an entry's chunk (a larger maximum, or an equal maximum at a lower index)
holds an entry that comes before it: its maximum, at a lower index if equal. An entry among the first k
is preceded by at most k - 1 others, so its chunk is among the first k chunks. Step 2 reads the chosen
chunks in index order, so its ties also fall to the lower index.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array

# Below this many chunks a row is short enough for one top-k.
_MIN_CHUNKS_PER_K = 4


def chunk_size(width: int, k: int) -> int | None:
    """The chunk length for rows of ``width`` entries, or None when one top-k is as cheap.

    Both passes sort about ``width / size + k * size`` entries, least at ``size = sqrt(width / k)``; a
    divisor of ``width`` within a factor 2 of that avoids padding the rows.
    """
    best = math.sqrt(width / k)
    if width < _MIN_CHUNKS_PER_K * k * best:
        return None
    divisors = [d for d in range(max(1, math.ceil(best / 2)), math.floor(2 * best) + 1) if width % d == 0]
    return min(divisors, key=lambda d: abs(d - best)) if divisors else max(1, round(best))


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """``jax.lax.top_k(x, k)`` of float[rows, width] without NaN: the same values and int32 indices.

    Returns:
      float[rows, k] the k largest entries of each row, largest first, and int32[rows, k] their
      indices (the lower index first among equal values).
    """
    rows, width = x.shape
    size = chunk_size(width, k)
    if size is None:
        return jax.lax.top_k(x, k)
    chunks = -(-width // size)
    if chunks * size != width:  # -inf padding comes after every entry: lower value or higher index
        x = jnp.pad(x, ((0, 0), (0, chunks * size - width)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, chunks, size)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=2), k)  # [rows, k] chunk indices
    best = jnp.sort(best, axis=1)  # index order, for the ties of step 2
    candidates = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(rows, k * size)
    values, where = jax.lax.top_k(candidates, k)  # [rows, k]
    index = jnp.take_along_axis(best, where // size, axis=1) * size + where % size
    return values, index.astype(jnp.int32)
