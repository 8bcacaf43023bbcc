"""The model's hyperparameters: ``ModelConfig``, the one definition of a Transformer's shape.

Kept apart from ``transformer.py`` (the Flax modules) so that configs, the sweep grid, the parameter and FLOP
counts can build and validate a model's settings without importing Flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

# "sinusoidal" (the paper), "learned" (Table 3 row E), and beyond the paper: "rotary" (RoPE), "alibi",
# "relative" (Shaw et al. 2018) and "none". model/positions.py implements each.
POSITION_ENCODINGS = ("sinusoidal", "learned", "rotary", "alibi", "relative", "none")
# Schemes that put a bias or a relative term into the attention logits: only dense attention computes them.
LOGIT_POSITION_ENCODINGS = ("alibi", "relative")
NORM_STYLES = ("post", "pre")
# The feed-forward network's nonlinearity. "relu" is the paper's (equation 2). "gelu" is the exact erf form
# (Hugging Face's "gelu"), "gelu_tanh" its tanh approximation, "gelu_sigmoid" x * sigmoid(1.702 x) (Marian's
# "gelu"), and "swish" x * sigmoid(x) (SiLU; most OPUS-MT models).
FFN_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "gelu_sigmoid", "swish")
ATTENTION_IMPLEMENTATIONS = ("dense", "blockwise", "fused")
ATTENTION_INITS = ("matrix", "narrow")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Set by the code that runs the model, never by a config.
MODE_FIELDS = ("deterministic", "decode")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the Transformer: the one definition of a model. Frozen and validated when built.

    The defaults are the paper's base model. A run config's ``config.model`` holds exactly the fields of
    ``settable_defaults()``; the model is built as ``ModelConfig(vocab_size=v, **config.model)``.

    Derive modes with ``dataclasses.replace(config, deterministic=True)`` (evaluation) or
    ``decode=True`` (incremental decoding with a key/value cache, ``model.decode_cache``).
    """

    vocab_size: int
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    d_k: int | None = None  # None: d_model // num_heads
    d_v: int | None = None  # None: d_model // num_heads
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1  # P_drop: sub-layer outputs and embedding + position sums
    attention_dropout_rate: float = 0.0  # not in the paper; tensor2tensor used 0.0
    # The learned position table's size: its longest sequence. The other schemes take any length; for them
    # it is only the default output buffer of decoding.
    max_len: int = 256
    position_encoding: str = "sinusoidal"  # one of POSITION_ENCODINGS; "learned" is Table 3 row E
    max_relative_position: int = 16  # position_encoding="relative": distances are clipped to [-k, k]
    norm_style: str = "post"  # "post" is the paper's LayerNorm(x + Sublayer(x))
    ffn_activation: str = "relu"  # one of FFN_ACTIVATIONS; "relu" is the paper's
    # "dense" forms the weights; "blockwise": memory O(n) in length (FlashAttention-style, in JAX);
    # "fused": jax.nn.dot_product_attention, cuDNN's flash attention on a GPU in bfloat16, XLA elsewhere
    attention_impl: str = "dense"
    attention_block_size: int = 512  # query/key block of the blockwise implementation
    # Glorot fans of the head-split W^Q, W^K, W^V, W^O: "matrix" takes those of the 2-D matrix each stands
    # for (flax DenseGeneral, fairseq, tensor2tensor); "narrow" takes flax's default axes on the 3-D
    # kernel, which draws W^Q several times narrower (docs/benchmarks.md), so attention starts near uniform.
    attention_init: str = "matrix"
    dtype: str = "float32"  # compute dtype; parameters are always float32
    attention_witness: bool = False  # check every attention map at run time (debugging, slow)
    deterministic: bool = False  # no dropout
    decode: bool = False  # incremental decoding: Transformer.decode takes and returns a DecodeCache

    def __post_init__(self):
        # Resolve the per-head sizes first so the rest of the code can rely on them.
        if self.d_k is None:
            object.__setattr__(self, "d_k", self._default_head_dim("d_k"))
        if self.d_v is None:
            object.__setattr__(self, "d_v", self._default_head_dim("d_v"))
        for name in ("vocab_size", "d_model", "d_ff", "num_heads", "d_k", "d_v",
                     "num_encoder_layers", "num_decoder_layers", "max_len", "attention_block_size",
                     "max_relative_position"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        for name, allowed in (("position_encoding", POSITION_ENCODINGS),
                              ("norm_style", NORM_STYLES),
                              ("ffn_activation", FFN_ACTIVATIONS),
                              ("attention_impl", ATTENTION_IMPLEMENTATIONS),
                              ("attention_init", ATTENTION_INITS),
                              ("dtype", tuple(DTYPES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.attention_impl == "blockwise" and (self.attention_witness
                                                   or self.attention_dropout_rate > 0):
            raise ValueError(
                "attention_impl='blockwise' never forms the attention weights, so it supports neither "
                f"attention_witness=True nor attention_dropout_rate > 0; got attention_witness="
                f"{self.attention_witness}, attention_dropout_rate={self.attention_dropout_rate}")
        if self.attention_impl == "fused":
            self._check_fused()
        if self.attention_impl != "dense" and self.position_encoding in LOGIT_POSITION_ENCODINGS:
            raise ValueError(
                f"position_encoding={self.position_encoding!r} adds to the attention logits, which only "
                f"attention_impl='dense' computes; got attention_impl={self.attention_impl!r}")
        if self.position_encoding == "relative" and self.attention_dropout_rate > 0:
            raise ValueError("position_encoding='relative' adds its value term with the attention weights "
                             "before dropout, so it takes no attention dropout; got attention_dropout_rate="
                             f"{self.attention_dropout_rate}")
        if self.position_encoding == "rotary" and self.d_k % 2:
            raise ValueError(f"position_encoding='rotary' rotates pairs of dimensions, so d_k must be even, "
                             f"got d_k={self.d_k}")

    def _check_fused(self) -> None:
        """One line for each option ``jax.nn.dot_product_attention`` cannot serve."""
        if self.d_k != self.d_v:
            raise ValueError(f"attention_impl='fused' has one head size for keys and values, got "
                             f"d_k={self.d_k} and d_v={self.d_v}; use attention_impl='dense' or 'blockwise'")
        if self.attention_witness or self.attention_dropout_rate > 0:
            raise ValueError(
                "attention_impl='fused' never forms the attention weights, so it supports neither "
                f"attention_witness=True nor attention_dropout_rate > 0; got attention_witness="
                f"{self.attention_witness}, attention_dropout_rate={self.attention_dropout_rate}; use "
                "attention_impl='dense'")

    def _default_head_dim(self, name: str) -> int:
        if not isinstance(self.num_heads, int) or self.num_heads <= 0:
            raise ValueError(f"num_heads must be a positive integer, got {self.num_heads!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"set {name} explicitly or change num_heads"
            )
        return self.d_model // self.num_heads

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model takes: ``max_len`` for the learned table, else None (any length)."""
        return self.max_len if self.position_encoding == "learned" else None

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def settable_defaults(cls) -> dict[str, Any]:
        """The fields a run config sets (``config.model``), with their defaults: the paper's base model.

        ``vocab_size`` comes from the tokenizer and the modes (``MODE_FIELDS``) are set by
        the code that runs the model, so neither belongs in a config file.
        """
        return {f.name: f.default for f in dataclasses.fields(cls)
                if f.name not in ("vocab_size", *MODE_FIELDS)}


def param_count(config: ModelConfig) -> int:
    """The exact number of parameters of ``Transformer(config)``, by formula (no initialization)."""
    d, h = config.d_model, config.num_heads
    attention_params = d * h * config.d_k * 2 + d * h * config.d_v * 2  # W^Q, W^K, W^V, W^O
    ffn_params = d * config.d_ff + config.d_ff + config.d_ff * d + d
    layer_norm = 2 * d
    encoder_layer = attention_params + ffn_params + 2 * layer_norm
    decoder_layer = 2 * attention_params + ffn_params + 3 * layer_norm
    embeddings = config.vocab_size * d  # shared by source, target and the output projection
    positions = 2 * config.max_len * d if config.position_encoding == "learned" else 0
    if config.position_encoding == "relative":  # a^K [2k+1, d_k] and a^V [2k+1, d_v] per self-attention
        relative_table = (2 * config.max_relative_position + 1) * (config.d_k + config.d_v)
        positions = (config.num_encoder_layers + config.num_decoder_layers) * relative_table
    final_norms = 2 * layer_norm if config.norm_style == "pre" else 0
    return (config.num_encoder_layers * encoder_layer + config.num_decoder_layers * decoder_layer
            + embeddings + positions + final_norms)
