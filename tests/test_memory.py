"""Tests for training/memory.py: the step-memory estimate, the host check, out-of-memory as one line."""

import os

import jax
import pytest
from test_entry_points import Commands
from tiny import TRAIN, config_with

from transformer_jax import run_config
from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime import errors
from transformer_jax.training import loop, memory, steps

# Distinct odd sizes: d_k = d_v = 3, so a head/key/value or source/target mix-up changes the count.
TINY = ModelConfig(vocab_size=11, d_model=6, d_ff=10, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                   dropout_rate=0.0, max_len=16)
ROWS, SRC_LEN, TGT_LEN = 4, 5, 7


def _tiny(**kwargs) -> memory.StepMemory:
    return memory.train_step_memory(TINY, **{"rows": ROWS, "src_len": SRC_LEN, "tgt_len": TGT_LEN, **kwargs})


def test_the_estimate_of_a_tiny_step_by_hand():
    m = _tiny()
    # Logits: 3 float32 copies of [4 rows, 7 positions, 11 words].
    assert m.logits == 3 * 4 * (4 * 7 * 11) == 3696
    # Per attention and query position: 4 maps x 2 heads x kv_len, Q K V and heads 2 x (3+3+3+3) = 24,
    # 4 x d_model = 24; the FFN 3 x 10 + 24. Encoder (5 positions): 5 x (8 x 5 + 24 + 24) + 5 x 54 = 710.
    # Decoder (7): self 7 x (8 x 7 + 48) = 728, cross 7 x (8 x 5 + 48) = 616, FFN 7 x 54 = 378.
    # Embeddings: 2 x d_model per position, 12 positions: 144. Total 2576 float32 per row, 4 rows.
    assert memory.activation_elements(TINY, SRC_LEN, TGT_LEN, "cpu") == (872, 816, 888)
    assert m.activations == 4 * 4 * (710 + 728 + 616 + 378 + 144) == 41216
    # 830 parameters (304 encoder layer, 460 decoder layer, 66 embedding), float32; 2 copies of
    # gradients (the gradients and the update), 2 Adam moments.
    assert (m.parameters, m.gradients, m.optimizer) == (3320, 6640, 6640)
    assert m.total == 61512


def test_dropout_and_blockwise_attention_change_the_count_as_documented():
    # Dropout keeps 2 x d_model per sub-layer and position: 2 sub-layers x 5 + 3 x 7 = 31 per row.
    dropout = memory.train_step_memory(TINY.replace(dropout_rate=0.1), rows=ROWS, src_len=SRC_LEN,
                                       tgt_len=TGT_LEN)
    assert dropout.activations - _tiny().activations == 4 * 4 * 12 * 31
    # Blockwise attention keeps blocks of 2 keys, not every key: 8 x (5 - 2) fewer per encoder position.
    blockwise = memory.train_step_memory(TINY.replace(attention_impl="blockwise", attention_block_size=2),
                                         rows=ROWS, src_len=SRC_LEN, tgt_len=TGT_LEN)
    maps = 5 * 8 * (5 - 2) + 7 * 8 * (7 - 2) + 7 * 8 * (5 - 2)
    assert _tiny().activations - blockwise.activations == 4 * 4 * maps


def test_doubling_the_batch_doubles_activations_and_logits_and_accumulation_halves_them():
    one, two = _tiny(), _tiny(rows=2 * ROWS)
    assert (two.activations, two.logits) == (2 * one.activations, 2 * one.logits)
    assert (two.parameters, two.optimizer) == (one.parameters, one.optimizer)
    accumulated = _tiny(rows=2 * ROWS, grad_accum_steps=2)
    assert (accumulated.activations, accumulated.logits) == (one.activations, one.logits)
    assert accumulated.gradients == 3 * one.parameters  # the running sum of the micro-batches' gradients
    data_parallel = _tiny(rows=2 * ROWS, data_parallel=2)
    assert (data_parallel.activations, data_parallel.logits) == (one.activations, one.logits)


def test_loss_chunks_bound_the_logits_by_the_chunk():
    chunked = _tiny(loss_chunk_tokens=8)  # 8 tokens over 4 rows: 2 positions of 7 at a time
    assert chunked.logits == 3 * 4 * (4 * 2 * 11)
    assert chunked.activations == _tiny().activations


def test_bfloat16_halves_the_arrays_off_the_cpu_only():
    bf16 = TINY.replace(dtype="bfloat16")
    on_cpu = memory.train_step_memory(bf16, rows=ROWS, src_len=SRC_LEN, tgt_len=TGT_LEN, platform="cpu")
    on_gpu = memory.train_step_memory(bf16, rows=ROWS, src_len=SRC_LEN, tgt_len=TGT_LEN, platform="gpu")
    assert on_cpu == _tiny()  # XLA's CPU computes bfloat16 in float32
    assert on_cpu.activations - on_gpu.activations == 2 * 4 * (816 + 888)  # the maps stay float32


# Fused attention with cuDNN's head size (d_k = 8) and blocks of 2 keys, so that a call without maps
# (cuDNN: a block's keys) and one with them (XLA: every key) count differently at these lengths.
FUSED = TINY.replace(d_model=16, d_k=8, d_v=8, attention_impl="fused", dtype="bfloat16",
                     attention_block_size=2)


def _maps(cfg, src_len, tgt_len, platform):
    return memory.activation_elements(cfg, src_len, tgt_len, platform)[0]


@pytest.mark.parametrize("case, cfg, platform", [
    ("a TPU", FUSED, "tpu"), ("a CPU", FUSED, "cpu"), ("float32", FUSED.replace(dtype="float32"), "gpu"),
    ("head size 12", FUSED.replace(d_k=12, d_v=12), "gpu"), ("head size 136", FUSED.replace(d_k=136, d_v=136),
                                                                "gpu")])
def test_fused_attention_that_xla_runs_holds_every_map(case, cfg, platform):
    dense = cfg.replace(attention_impl="dense")
    assert _maps(cfg, 6, 8, platform) == _maps(dense, 6, 8, platform), case


def test_fused_attention_that_cudnn_runs_holds_a_blocks_maps_except_masked_odd_lengths():
    per_key = memory.MAP_COPIES * FUSED.num_heads  # 8 float32 per query position and key
    # Even lengths: cuDNN everywhere, 2 keys per query position (6 encoder, 8 + 8 decoder positions).
    assert _maps(FUSED, 6, 8, "gpu") == per_key * 2 * (6 + 8 + 8)
    # An odd source: the encoder's self-attention (5 x 5) and the cross-attention (8 x 5) are masked, so
    # XLA runs them, with every key; the decoder's causal self-attention has no mask and stays on cuDNN.
    assert _maps(FUSED, 5, 8, "gpu") == per_key * (5 * 5 + 8 * 2 + 8 * 5)
    # An odd target: the cross-attention (7 x 6, masked) on XLA; the encoder (6 x 6) and the causal
    # self-attention (7 x 7, no mask) on cuDNN.
    assert _maps(FUSED, 6, 7, "gpu") == per_key * (6 * 2 + 7 * 2 + 7 * 6)
    assert memory.holds_maps(FUSED, 7, 7, False, "gpu") is False
    assert memory.holds_maps(FUSED, 7, 7, True, "gpu") is True


def _run(**overrides):
    return run_config.build_run_config(config_with({**TRAIN, **overrides}), environment=False)


def test_the_largest_step_is_taken_over_the_buckets_the_run_uses():
    batching = {"data.length_buckets": (16, 32, 48, 64), "data.tokens_per_batch": 2048}
    run = _run(**batching)
    largest = memory.largest_step_memory(run, device_count=1, platform="cpu")
    assert (largest.rows, largest.tgt_len) == (32, 64)  # the attention maps grow with the length
    assert largest == memory.train_step_memory(run.model, rows=32, src_len=64, tgt_len=64, platform="cpu")
    two = memory.largest_step_memory(_run(**batching, **{"train.grad_accum_steps": 2}), device_count=1,
                                     platform="cpu")
    assert (two.activations, two.logits) == (largest.activations // 2, largest.logits // 2)
    data_parallel = memory.largest_step_memory(run, device_count=4, platform="cpu")  # mesh (-1, 1): 4 x 1
    assert data_parallel.activations == largest.activations // 4


def test_a_host_that_cannot_hold_the_step_stops_the_run_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_host_memory", lambda: (2**20, "MemAvailable"))
    workdir = tmp_path / "w"
    with pytest.raises(errors.OutOfMemoryError) as caught:
        loop.train_and_evaluate(_run(), str(workdir))
    message = str(caught.value)
    assert "\n" not in message
    need = memory.largest_step_memory(_run())
    assert f"needs about {memory.gib(need.total)} per device" in message
    assert "this host has 0.000977 GiB available (MemAvailable)" in message
    for knob in ("train.grad_accum_steps", "data.tokens_per_batch", "train.loss_chunk_tokens"):
        assert knob in message
    assert not workdir.exists()  # refused before the workdir, the tokenizer or the data


def test_the_check_is_skipped_with_transformer_jax_memory_check_off(monkeypatch):
    monkeypatch.setattr(memory, "available_host_memory", lambda: (2**20, "MemAvailable"))
    with pytest.raises(errors.OutOfMemoryError, match="set TRANSFORMER_JAX_MEMORY_CHECK=off to skip"):
        memory.check_host_memory(_run())
    monkeypatch.setenv("TRANSFORMER_JAX_MEMORY_CHECK", "off")
    assert memory.check_host_memory(_run()) == memory.largest_step_memory(_run())


def test_a_host_that_holds_the_step_passes(monkeypatch):
    monkeypatch.setattr(memory, "available_host_memory", lambda: (2**40, "MemAvailable"))
    assert memory.check_host_memory(_run()) == memory.largest_step_memory(_run())


def test_the_available_memory_is_read_from_this_host():
    available, where = memory.available_host_memory()
    assert 0 < available and (where == "MemAvailable" or where.startswith("the memory limit of cgroup /"))


def test_an_out_of_memory_step_becomes_one_line(tmp_path, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED, at compile time or at the first step, as an accelerator raises it."""
    def raising_step(*args, **kwargs):
        def step(state, batch):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes.")
        return step

    monkeypatch.setattr(steps, "make_train_step", raising_step)
    with pytest.raises(errors.OutOfMemoryError) as caught:
        loop.train_and_evaluate(_run(), str(tmp_path / "w"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("out of device memory in the train step on a 8 x 64-token batch (estimated ")
    for knob in ("train.grad_accum_steps", "data.tokens_per_batch", "train.loss_chunk_tokens", "model.dtype"):
        assert knob in message
    assert message.endswith("XLA said: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 "
                            "bytes.")
    assert isinstance(caught.value.__cause__, jax.errors.JaxRuntimeError)


def test_only_resource_exhausted_is_out_of_memory():
    assert memory.is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert not memory.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert not memory.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED"))


def test_train_py_refuses_a_batch_no_host_holds_before_any_work(tmp_path):
    with Commands() as commands:
        result = commands.run("train.py", f"--workdir={tmp_path / 'w'}",
                              "--config.data.tokens_per_batch=1000000000")  # ~12 TB of logits
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: the largest train step needs about ")
    assert "GiB available" in lines[0] and "train.grad_accum_steps" in lines[0]
    assert not os.path.exists(tmp_path / "w")
