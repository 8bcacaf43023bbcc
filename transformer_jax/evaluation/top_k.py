"""``jax.lax.top_k`` over a vocabulary, in two short passes: beam search's per-row candidates.

Beam search keeps each decoder row's best 2K tokens every step (``decode._beam_step``): a top-k over
[rows, vocab]. XLA:CPU's top-k custom call sorts its way through every row, and at 1,480 rows x 8,000
tokens it cost 37 ms, about a fifth of the Multi30k model's beam step. The same result from two smaller
top-ks (measured at that shape, with the shift by the row maximum in both: 37 -> 15 ms):

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


def top_k(x: Array, k: int, *, banned: Array | None = None, max_banned: int = 0,
          fill: float = -math.inf) -> tuple[Array, Array]:
    """``jax.lax.top_k(where(banned, fill, x), k)`` of float[rows, width] without NaN: the same values
    and int32 indices.

    ``banned`` (bool[width], the same for every row, at most ``max_banned`` entries True) is applied to
    the candidates of step 2 only, so the masked [rows, width] array is never written (at beam search's
    2,960 x 8,000 that copy cost as much as the top-k). Step 1 ranks each chunk by an upper bound of
    its masked maximum: its unmasked maximum, raised to ``fill`` if it holds a banned entry. The bound is
    exact except for the at most ``max_banned`` chunks that hold a banned entry, so step 1 keeps ``k +
    max_banned`` chunks: before the chunk of an entry among the first k there are at most k - 1 chunks
    ranked by their exact maxima (the argument above) and the overrated ones.

    Returns:
      float[rows, k] the k largest entries of each row, largest first, and int32[rows, k] their
      indices (the lower index first among equal values).
    """
    rows, width = x.shape
    if banned is None:
        max_banned = 0
    size = chunk_size(width, k + max_banned)
    if size is None:
        return jax.lax.top_k(x if banned is None else jnp.where(banned[None, :], fill, x), k)
    chunks = -(-width // size)
    kept_chunks = k + max_banned
    if chunks * size != width:  # -inf padding comes after every entry: lower value or higher index
        x = jnp.pad(x, ((0, 0), (0, chunks * size - width)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, chunks, size)
    chunk_max = jnp.max(blocks, axis=2)  # [rows, chunks]
    if banned is not None:
        banned = jnp.pad(banned, (0, chunks * size - width)).reshape(chunks, size)
        chunk_max = jnp.where(jnp.any(banned, axis=1)[None], jnp.maximum(chunk_max, fill), chunk_max)
    _, best = jax.lax.top_k(chunk_max, kept_chunks)  # [rows, kept_chunks] chunk indices
    best = jnp.sort(best, axis=1)  # index order, for the ties of step 2
    candidates = jnp.take_along_axis(blocks, best[:, :, None], axis=1)  # [rows, kept_chunks, size]
    if banned is not None:
        candidates = jnp.where(banned[best], fill, candidates)
    values, where = jax.lax.top_k(candidates.reshape(rows, kept_chunks * size), k)  # [rows, k]
    index = jnp.take_along_axis(best, where // size, axis=1) * size + where % size
    return values, index.astype(jnp.int32)
