"""Fused scaled dot-product attention: ``jax.nn.dot_product_attention``, cuDNN on a GPU, XLA elsewhere.

The same function as ``attention.dot_product_attention`` (softmax(Q K^T / sqrt(d_k), masked) V), handed
to JAX's fused kernel: with ``implementation="cudnn"`` cuDNN's flash attention on an NVIDIA GPU (it never
writes the [q_len, kv_len] weights to memory, and with ``causal`` skips the upper triangle), with
``"xla"`` the plain XLA program, which runs anywhere and is what the CPU tests check.

What cuDNN takes, and so when ``implementation_for`` picks it (NVIDIA's support matrix for the fused
kernel): an NVIDIA GPU, bfloat16 (or float16) inputs, one head size for keys and values (d_k == d_v) that
is a multiple of 8 and at most 128 (the backward pass on Ampere; 256 on Hopper). Anything else takes
``"xla"``; ``describe`` says which in one line. A mask reaches cuDNN as an additive bias, with which its
training kernel takes even lengths only, so a masked call with an odd length also takes ``"xla"``
(``kernel_for``; the decoder's causal self-attention has no mask, and the WMT buckets are even).

Same masks as the dense path (True = may attend). JAX's kernels fill masked logits with a large negative
number, not -inf, so a query with no allowed key would average all the values; this wrapper zeroes that
query's output, so it is zero (with zero gradients), as in ``attention.masked_softmax``. The weights are
never formed, so there is no attention witness, no attention map and no dropout on the weights here
(``ModelConfig`` refuses those with ``attention_impl="fused"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

IMPLEMENTATIONS = ("xla", "cudnn")
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128  # the backward pass on Ampere (Hopper takes 256)


def implementation_for(dtype: str, head_dim: int, backend: str | None = None) -> str:
    """``"cudnn"`` where cuDNN's fused kernel serves this compute ``dtype`` and ``head_dim`` on ``backend``
    (default: JAX's default backend), else ``"xla"``."""
    backend = backend or jax.default_backend()
    if (backend == "gpu" and dtype in CUDNN_DTYPES and head_dim % 8 == 0
            and head_dim <= CUDNN_MAX_HEAD_DIM):
        return "cudnn"
    return "xla"


def describe(dtype: str, head_dim: int, backend: str | None = None) -> str:
    """One line: which kernel ``attention_impl="fused"`` runs here, and why not cuDNN when it does not."""
    backend = backend or jax.default_backend()
    if implementation_for(dtype, head_dim, backend) == "cudnn":
        return f"fused attention: cuDNN flash attention ({dtype}, head size {head_dim})"
    if backend != "gpu":
        why = f"the backend is {backend}, cuDNN needs an NVIDIA GPU"
    elif dtype not in CUDNN_DTYPES:
        why = f"cuDNN takes bfloat16 or float16, the model computes in {dtype} (set model.dtype=bfloat16)"
    else:
        why = f"cuDNN takes head sizes that are multiples of 8 up to {CUDNN_MAX_HEAD_DIM}, got {head_dim}"
    return f"fused attention: XLA, not cuDNN ({why})"


def kernel_for(implementation: str, q_len: int, kv_len: int, masked: bool) -> str:
    """The kernel a call runs: ``implementation``, except a masked cuDNN call with an odd length (XLA)."""
    if implementation == "cudnn" and masked and (q_len % 2 or kv_len % 2):
        return "xla"
    return implementation


def fused_attention(query: Array, key: Array, value: Array, mask: Array | None = None, *,
                    causal: bool = False, implementation: str = "xla") -> Array:
    """softmax(Q K^T / sqrt(d_k), masked) V through ``jax.nn.dot_product_attention``.

    Args:
      query: float[batch, q_len, num_heads, d_k].
      key: float[batch, kv_len, num_heads, d_k].
      value: float[batch, kv_len, num_heads, d_k] (d_v must equal d_k).
      mask: bool[batch|1, 1, q_len|1, kv_len], True = may attend, or None.
      causal: query i also may not attend to keys after i (q_len == kv_len).
      implementation: ``"xla"`` or ``"cudnn"`` (see ``implementation_for``).

    Returns:
      float[batch, q_len, num_heads, d_k], in the inputs' dtype; zero for a query with no allowed key.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"fused attention has one head size for keys and values, got d_k={query.shape[-1]}"
                         f" and d_v={value.shape[-1]}")
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1):
        raise ValueError(f"mask must be [batch|1, 1, q_len|1, kv_len], got shape {mask.shape}")
    q_len, kv_len = query.shape[1], key.shape[1]
    if mask is not None:  # cuDNN adds the mask as a bias, which must span [q_len, kv_len]
        mask = jnp.broadcast_to(mask, (mask.shape[0], 1, q_len, kv_len))
    out = jax.nn.dot_product_attention(
        query, key, value, mask=mask, is_causal=causal,
        implementation=kernel_for(implementation, q_len, kv_len, mask is not None))  # [B, Q, H, D]
    if mask is None:  # causal alone leaves every query its own key
        return out
    visible = mask & jnp.tril(jnp.ones((q_len, kv_len), bool))[None, None] if causal else mask
    any_key = jnp.any(visible, axis=-1)  # [B|1, 1, Q]
    return jnp.where(jnp.transpose(any_key, (0, 2, 1))[..., None], out, jnp.zeros((), out.dtype))
