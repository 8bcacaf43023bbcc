"""The memory a train step needs, estimated from the config before anything compiles.

``train_step_memory`` counts, per device, the bytes of one compiled train step (``steps.train_step``) on
a batch of ``rows`` x (``src_len``, ``tgt_len``) positions; ``largest_step_memory`` takes the largest
over a run's length buckets. The count has five parts:

- logits: the float32 logits and what the loss and its gradient hold beside them: 3 arrays of
  [rows, tgt_len, vocab] per micro-batch (with ``train.loss_chunk_tokens``, of one chunk's positions);
- activations: per position and layer, what the forward pass keeps for the backward pass and the
  backward pass's working set: for each attention 4 score-sized float32 maps h x kv_len (scores,
  masked exponentials, weights, their gradient; with blockwise attention, and with fused attention
  where cuDNN runs it, one block's keys instead: ``holds_maps``), Q, K, V and the heads' output
  h (2 d_k + 2 d_v), and 4 d_model-sized arrays per sub-layer (its input, output, residual sum and
  norm); the FFN's 3 d_ff; dropout's 2 d_model (mask and output) per sub-layer when P_drop > 0;
- parameters (float32), gradients (the gradients and the update: 2 copies; 3 with gradient
  accumulation, whose running sum is a third) and Adam's 2 moments.

Parameters, heads, the FFN's inner size and the vocabulary are divided over the mesh's 'model' axis
(the default logical axis rules), rows over its 'data' axis and over ``grad_accum_steps``. On a CPU,
XLA computes bfloat16 in float32, so ``platform="cpu"`` counts 4 bytes for either dtype.

It counts every buffer the step may hold at once, so it errs high: an upper bound a user can plan with
(measured against XLA's buffer assignment of the compiled CPU step in docs/benchmarks.md).

``check_host_memory`` refuses, in one line, a CPU run whose step this host cannot hold (the memory
available is ``runtime.host_memory``'s; ``TRANSFORMER_JAX_MEMORY_CHECK=off`` skips the check);
``out_of_memory_error`` turns an accelerator's RESOURCE_EXHAUSTED into the same kind of line.
"""

from __future__ import annotations

import dataclasses

import jax

from transformer_jax.data.batching import bucket_batch_sizes
from transformer_jax.model import fused_attention
from transformer_jax.model.config import ModelConfig, param_count
from transformer_jax.model.loss import chunk_length
from transformer_jax.runtime import host_memory, sharding
from transformer_jax.runtime.errors import OutOfMemoryError

GIB = 2**30
LOGIT_COPIES = 3  # float32 [positions, vocab] arrays the loss and its gradient hold at once
MAP_COPIES = 4  # float32 score-sized arrays per attention: scores, masked exponentials, weights, gradient
SUBLAYER_D_MODEL_COPIES = 4  # a sub-layer's input, output, residual sum and layer norm
DROPOUT_D_MODEL_COPIES = 2  # a dropout's mask and output
FFN_D_FF_COPIES = 3  # the FFN's pre-activation, the activation's output and its gradient
EMBED_D_MODEL_COPIES = 2  # per side: the scaled embedding and the position sum

# What reduces a step's memory, for the messages below.
KNOBS = ("raise train.grad_accum_steps (2 halves the logits and activations), lower "
         "data.tokens_per_batch, or set train.loss_chunk_tokens (e.g. 4096: the loss computes the logits "
         "a chunk at a time)")
ACCELERATOR_KNOBS = KNOBS.replace(", or set", ", set") + ", or model.dtype=bfloat16"


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one train step on a global batch of ``rows`` x (``src_len``, ``tgt_len``)."""

    rows: int
    src_len: int
    tgt_len: int
    logits: int
    activations: int
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.logits + self.activations + self.parameters + self.gradients + self.optimizer

    def describe(self) -> str:
        """'12.6 GiB per device for the 97 x 256-token bucket (logits 11 GiB, activations 1.5 GiB, ...)'."""
        state = self.parameters + self.gradients + self.optimizer
        return (f"{gib(self.total)} per device for the {self.rows} x {self.tgt_len}-token bucket (logits "
                f"{gib(self.logits)}, activations {gib(self.activations)}, parameters, gradients and Adam "
                f"moments {gib(state)})")


def gib(n: float) -> str:
    """Bytes as GiB: 3 significant digits, whole GiB from 1,000 on ('12.6 GiB', '36,380 GiB')."""
    return f"{n / GIB:,.0f} GiB" if n >= 1000 * GIB else f"{n / GIB:.3g} GiB"


def holds_maps(cfg: ModelConfig, q_len: int, kv_len: int, masked: bool, platform: str) -> bool:
    """Whether an attention call keeps its [q_len, kv_len] maps: dense attention, and fused attention
    wherever XLA, not cuDNN, runs it (``fused_attention.kernel_for``: on a CPU or a TPU, in float32, a
    head size that is not a multiple of 8 or over 128, a masked call with an odd length)."""
    if cfg.attention_impl != "fused":
        return cfg.attention_impl == "dense"
    implementation = fused_attention.implementation_for(cfg.dtype, cfg.d_k, platform)
    return fused_attention.kernel_for(implementation, q_len, kv_len, masked) == "xla"


def _attention(cfg: ModelConfig, q_len: int, kv_len: int, masked: bool, platform: str
               ) -> tuple[int, int, int]:
    """(float32 maps, compute-dtype arrays split over 'model', replicated ones) per query position."""
    keys = kv_len if holds_maps(cfg, q_len, kv_len, masked, platform) else min(
        kv_len, cfg.attention_block_size)  # blockwise: one block's; cuDNN: a tile's, counted as a block
    maps = MAP_COPIES * cfg.num_heads * keys
    if cfg.attention_dropout_rate > 0:
        maps += DROPOUT_D_MODEL_COPIES * cfg.num_heads * keys
    return maps, cfg.num_heads * (2 * cfg.d_k + 2 * cfg.d_v), _sublayer(cfg)


def _sublayer(cfg: ModelConfig) -> int:
    copies = SUBLAYER_D_MODEL_COPIES + (DROPOUT_D_MODEL_COPIES if cfg.dropout_rate > 0 else 0)
    return copies * cfg.d_model


def activation_elements(cfg: ModelConfig, src_len: int, tgt_len: int, platform: str
                        ) -> tuple[int, int, int]:
    """Elements kept per batch row: (float32 attention maps, split arrays, replicated arrays)."""
    maps = split = replicated = 0

    def add(positions: int, parts: tuple[int, int, int]) -> None:
        nonlocal maps, split, replicated
        maps, split, replicated = maps + positions * parts[0], split + positions * parts[1], \
            replicated + positions * parts[2]

    ffn = (0, FFN_D_FF_COPIES * cfg.d_ff, _sublayer(cfg))
    for _ in range(cfg.num_encoder_layers):
        add(src_len, _attention(cfg, src_len, src_len, True, platform))  # the source's padding mask
        add(src_len, ffn)
    for _ in range(cfg.num_decoder_layers):
        add(tgt_len, _attention(cfg, tgt_len, tgt_len, False, platform))  # causal, without a mask array
        add(tgt_len, _attention(cfg, tgt_len, src_len, True, platform))
        add(tgt_len, ffn)
    add(src_len + tgt_len, (0, 0, EMBED_D_MODEL_COPIES * cfg.d_model))
    return maps, split, replicated


def loss_positions(tgt_len: int, micro_rows: int, loss_chunk_tokens: int) -> int:
    """Target positions per row whose logits the loss holds at once: all, or one chunk's, computed from
    the global micro-batch's ``micro_rows`` as the train step computes it."""
    return chunk_length(tgt_len, micro_rows, loss_chunk_tokens)  # as the train step takes it


def train_step_memory(cfg: ModelConfig, *, rows: int, src_len: int, tgt_len: int, grad_accum_steps: int = 1,
                      data_parallel: int = 1, model_parallel: int = 1, loss_chunk_tokens: int = 0,
                      platform: str = "cpu") -> StepMemory:
    """Bytes per device of a train step on a global batch of ``rows`` x (``src_len``, ``tgt_len``).

    Args:
      cfg: the training model (its vocab_size, dims, dtype, dropout and attention implementation).
      rows: the global batch's rows; divided over ``data_parallel`` devices and ``grad_accum_steps``.
      loss_chunk_tokens: ``train.loss_chunk_tokens`` (0: the loss holds the micro-batch's logits).
      platform: ``jax.default_backend()``: "cpu" counts bfloat16 as 4 bytes (XLA's CPU computes in f32).
    """
    micro_rows = rows // grad_accum_steps
    device_rows = max(1, micro_rows // data_parallel)
    compute = 2 if cfg.dtype == "bfloat16" and platform != "cpu" else 4
    maps, split, replicated = activation_elements(cfg, src_len, tgt_len, platform)
    activations = device_rows * (4 * maps // model_parallel + compute * split // model_parallel
                                 + compute * replicated)
    positions = loss_positions(tgt_len, micro_rows, loss_chunk_tokens)
    logits = LOGIT_COPIES * 4 * device_rows * positions * -(-cfg.vocab_size // model_parallel)
    param_bytes = 4 * param_count(cfg) // model_parallel
    gradient_copies = 2 if grad_accum_steps == 1 else 3
    return StepMemory(rows=rows, src_len=src_len, tgt_len=tgt_len, logits=logits, activations=activations,
                      parameters=param_bytes, gradients=gradient_copies * param_bytes,
                      optimizer=2 * param_bytes)


def largest_step_memory(run, *, device_count: int | None = None, platform: str | None = None) -> StepMemory:
    """The largest ``train_step_memory`` over the length buckets a ``RunConfig``'s training uses.

    A bucket of length L holds ``tokens_per_batch // L`` rows (``batching.bucket_batch_sizes``); its
    sources are counted at L too (they are padded to at most L).
    """
    device_count = jax.device_count() if device_count is None else device_count
    platform = jax.default_backend() if platform is None else platform
    data_parallel, model_parallel = sharding.resolve_mesh_shape(run.sharding.mesh_shape, device_count)
    data, train = run.data, run.train
    buckets = [b for b in data.length_buckets if b < data.max_len]
    buckets.append(min(b for b in data.length_buckets if b >= data.max_len))
    sizes = bucket_batch_sizes(buckets, data.tokens_per_batch, data_parallel * train.grad_accum_steps)
    return max((train_step_memory(run.model, rows=rows, src_len=length, tgt_len=length,
                                  grad_accum_steps=train.grad_accum_steps, data_parallel=data_parallel,
                                  model_parallel=model_parallel,
                                  loss_chunk_tokens=getattr(train, "loss_chunk_tokens", 0), platform=platform)
                for rows, length in zip(sizes, buckets, strict=True)), key=lambda m: m.total)


# ----------------------------------------------------------------------------------------- the host check
def available_host_memory() -> tuple[int, str] | None:
    """(bytes, where from): MemAvailable, or the room under a cgroup limit on this process's cgroup path
    where that is less (``host_memory.available_memory``)."""
    return host_memory.available_memory()


def check_host_memory(run) -> StepMemory:
    """On a CPU, raises ``OutOfMemoryError`` (one line) if this host cannot hold the largest train step.

    The need is ``largest_step_memory`` times this process's devices (CPU devices share the host's
    memory), against ``available_host_memory``. ``TRANSFORMER_JAX_MEMORY_CHECK=off`` skips the check
    (the estimate errs high). Returns the estimate, on any platform.
    """
    estimate = largest_step_memory(run)
    if jax.default_backend() != "cpu" or not host_memory.check_enabled():
        return estimate
    available = available_host_memory()
    need = estimate.total * jax.local_device_count()
    if available is not None and need > available[0]:
        devices = (f" x {jax.local_device_count()} CPU devices = {gib(need)}"
                   if jax.local_device_count() > 1 else "")
        raise OutOfMemoryError(
            f"the largest train step needs about {estimate.describe()}{devices}, but this host has "
            f"{gib(available[0])} available ({available[1]}); {KNOBS}; or, if it fits after all, "
            f"set {host_memory.CHECK_VARIABLE}=off to skip this check")
    return estimate


# ------------------------------------------------------------------------------------ accelerator errors
def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's out-of-memory error (at compile time or when a step allocates)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def _device_memory() -> str:
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return f"; the device has {gib(limit)}" if limit else ""


def out_of_memory_error(run, rows: int, src_len: int, tgt_len: int, error: BaseException) -> OutOfMemoryError:
    """The one line for XLA's RESOURCE_EXHAUSTED in a train step on a global batch of this shape."""
    data_parallel, model_parallel = sharding.resolve_mesh_shape(run.sharding.mesh_shape, jax.device_count())
    estimate = train_step_memory(run.model, rows=rows, src_len=src_len, tgt_len=tgt_len,
                                 grad_accum_steps=run.train.grad_accum_steps, data_parallel=data_parallel,
                                 model_parallel=model_parallel,
                                 loss_chunk_tokens=getattr(run.train, "loss_chunk_tokens", 0),
                                 platform=jax.default_backend())
    detail = " ".join(str(error).split())[:200]
    return OutOfMemoryError(
        f"out of device memory in the train step on a {rows} x {tgt_len}-token batch (estimated "
        f"{estimate.describe()}{_device_memory()}); {ACCELERATOR_KNOBS}. XLA said: {detail}")
