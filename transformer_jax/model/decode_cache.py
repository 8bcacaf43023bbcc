"""The decoder's key/value cache for incremental decoding: typed pytrees with their layout in one place.

``Transformer.init_cache`` builds a :class:`DecodeCache` and ``Transformer.decode`` (decode mode) takes one
and returns it advanced by a step, so its shapes say how many positions and beams it holds. Rows are
``b * beams + k`` (beam k of example b).

Two choices made for speed (docs/benchmarks.md) decide the layout:
  * the beams of an example share one copy of its encoder keys/values (``cross_key``, ``cross_value``);
  * self-attention keys/values stay in the beam slot that wrote them and are never reordered: slot j of an
    example holds, at position t, what the hypothesis in beam row j wrote at step t, and the int32
    ``ancestry`` table says which slot holds each row's ancestor at each position. Beam search reorders
    only the table.
The self-attention buffers are position-major, [batch, heads, cache_len * beams, d] with index
``t * beams + j``: a step's keys of all beams are one contiguous block, written by one dynamic-update-slice
into the very array attention reads (no reshape between them). With a [.., beams, cache_len, ..] buffer
viewed as [.., beams * cache_len, ..], XLA:CPU copied every cache buffer 4 times per step (measured in the
compiled beam search).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class LayerCache(NamedTuple):
    """One decoder layer's cache (head-major: [batch, heads, positions, d])."""

    self_key: Array  # float[batch, heads, cache_len * beams, d_k], position-major (index t * beams + j)
    self_value: Array  # float[batch, heads, cache_len * beams, d_v], as self_key
    cross_key: Array  # float[batch, heads, src_len, d_k], the projected encoder output, shared by the beams
    cross_value: Array  # float[batch, heads, src_len, d_v]

    def write(self, key: Array, value: Array, index: Array) -> LayerCache:
        """The cache with one step's self-attention keys/values written at position ``index``.

        Args:
          key: float[batch * beams, 1, heads, d_k]; value: float[batch * beams, 1, heads, d_v].
          index: int32 scalar, the position.
        """
        rows, length, heads, _ = key.shape
        if length != 1:
            raise ValueError(f"cached decoding takes one position per call, got {length}")
        batch = self.self_key.shape[0]
        beams = rows // batch

        def write(cached: Array, new: Array) -> Array:
            new = new.reshape(batch, beams, heads, -1).transpose(0, 2, 1, 3)  # [B, H, beams, d]
            return jax.lax.dynamic_update_slice_in_dim(cached, new, index * beams, axis=2)
        return self._replace(self_key=write(self.self_key, key), self_value=write(self.self_value, value))


class DecodeCache(NamedTuple):
    """Every decoder layer's cache, the beams' ancestry and the next position.

    Properties ``batch``, ``beams`` and ``cache_len`` are read off the shapes; ``grow``, ``select`` and
    ``reorder`` return a new cache.
    """

    layers: tuple[LayerCache, ...]  # one per decoder layer
    ancestry: Array  # int32[batch * beams, cache_len]: the slot holding row r's ancestor at position t
    index: Array  # int32 scalar: the position the next step writes (the steps taken)

    @classmethod
    def create(cls, cross: Sequence[tuple[Array, Array]], cache_len: int, beams: int) -> DecodeCache:
        """An empty cache (zeros, index 0) of ``cache_len`` positions for ``beams`` rows per example.

        Args:
          cross: per decoder layer, the encoder keys float[batch, heads, src_len, d_k] and values
            float[batch, heads, src_len, d_v].
        """
        def empty(x: Array) -> Array:
            batch, heads, _, d = x.shape
            return jnp.zeros((batch, heads, cache_len * beams, d), x.dtype)
        layers = tuple(LayerCache(empty(key), empty(value), key, value) for key, value in cross)
        batch = cross[0][0].shape[0]
        return cls(layers, jnp.zeros((batch * beams, cache_len), jnp.int32), jnp.zeros((), jnp.int32))

    @property
    def batch(self) -> int:
        return self.layers[0].cross_key.shape[0]

    @property
    def beams(self) -> int:
        return self.ancestry.shape[0] // self.batch

    @property
    def cache_len(self) -> int:
        return self.ancestry.shape[1]

    def grow(self, cache_len: int) -> DecodeCache:
        """The cache with ``cache_len`` positions: self-attention buffers and ancestry zero-padded at the
        end (the new positions are masked until written, so the logits do not change)."""
        extra = cache_len - self.cache_len
        if extra < 0:
            raise ValueError(f"a cache of {self.cache_len} positions cannot grow to {cache_len}")
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra * self.beams), (0, 0)))  # position-major
        layers = tuple(layer._replace(self_key=pad(layer.self_key), self_value=pad(layer.self_value))
                       for layer in self.layers)
        return self._replace(layers=layers, ancestry=jnp.pad(self.ancestry, ((0, 0), (0, extra))))

    def select(self, examples: Array) -> DecodeCache:
        """The cache of ``examples`` int32[m] only, in that order (their beams' ancestry rows with them)."""
        take = lambda x: jnp.take(x, examples, axis=0)
        rows = (examples[:, None] * self.beams + jnp.arange(self.beams)[None, :]).reshape(-1)  # [m * beams]
        return self._replace(layers=jax.tree.map(take, self.layers),
                             ancestry=jnp.take(self.ancestry, rows, axis=0))

    def reorder(self, rows: Array) -> DecodeCache:
        """Row i continues from row ``rows[i]`` (int32[batch * beams], within its example: beam
        selection). Only the ancestry moves; the keys and values stay in their slots."""
        return self._replace(ancestry=jnp.take(self.ancestry, rows, axis=0, mode="clip"))

    def start_step(self) -> DecodeCache:
        """The cache as the step at ``index`` sees it: each row's ancestor at that position is its own
        slot (it writes there)."""
        own_slot = (jnp.arange(self.ancestry.shape[0], dtype=jnp.int32) % self.beams)[:, None]  # [rows, 1]
        return self._replace(
            ancestry=jax.lax.dynamic_update_slice_in_dim(self.ancestry, own_slot, self.index, 1))

    def key_positions(self) -> Array:
        """int32[cache_len * beams]: the position of each self-attention key slot (index ``t * beams + j``
        holds position t)."""
        return jnp.arange(self.cache_len * self.beams, dtype=jnp.int32) // self.beams

    def self_attention_mask(self) -> Array:
        """Which cached positions each beam row attends to (keys first, ``attention.decode_attention``).

        Returns:
          bool[batch, 1, cache_len * beams, beams]: position t, slot j (index ``t * beams + j``, the
          buffers' order) is allowed for beam k iff t <= index and ``ancestry[b * beams + k, t] == j``.
        """
        batch, beams, cache_len = self.batch, self.beams, self.cache_len
        slots = jnp.swapaxes(self.ancestry.reshape(batch, beams, cache_len), 1, 2)  # [B, T, K]
        written = (jnp.arange(cache_len) <= self.index)[None, :, None, None]  # [1, T, 1, 1]
        mask = (slots[:, :, None] == jnp.arange(beams)[None, None, :, None]) & written  # [B, T, J, K]
        return mask.reshape(batch, 1, cache_len * beams, beams)
