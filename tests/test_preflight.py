"""Tests for transformer_jax.benchmarks.preflight: the first command on a new machine, on a tiny config."""

import dataclasses
import functools
import types

import jax
import numpy as np
import pytest
from absl import flags
from test_entry_points import Commands
from tiny import config_with

from transformer_jax import run_config
from transformer_jax.benchmarks import preflight, train_step
from transformer_jax.model import fused_attention
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import Transformer
from transformer_jax.runtime import host_memory
from transformer_jax.runtime.errors import ConfigError
from transformer_jax.training import steps

TINY = {"data.vocab_size": 120, "data.tokens_per_batch": 512, "data.max_len": 48,
        "data.length_buckets": (16, 32, 48), "model.d_model": 18, "model.d_ff": 22, "model.num_heads": 3,
        "model.num_encoder_layers": 1, "model.num_decoder_layers": 1, "train.num_steps": 7}
QUICK = dict(repeats=1, peak_repeats=1)


def _run(**overrides):
    return run_config.build_run_config(config_with({**TINY, **overrides}), environment=False)


def _preflight(run, **options):
    lines = []
    record = preflight.preflight(run, preflight.Options(**{**QUICK, **options}), say=lines.append)
    return record, lines


def test_the_command_reports_device_peak_step_memory_and_projection_on_a_small_config():
    overrides = [f"--config.{key}={value}" for key, value in TINY.items()]
    with Commands() as commands:
        result = commands.run("transformer_jax.benchmarks.preflight", *overrides, "--config.platform=gpu",
                              "--repeats=1", "--peak_repeats=1")
        wrong = commands.run("transformer_jax.benchmarks.preflight", *overrides, "--length=40")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    assert wrong.stderr.splitlines()[0] == ("error: --length=40 is not a bucket of "
                                            "config.data.length_buckets (16, 32, 48)")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "platform: train.py would stop here: config.platform='gpu'" in out  # and it measures anyway
    assert "attention: dense (model.attention_impl)\n" in out  # no cuDNN to suggest on a CPU
    for expected in ("devices: 1 x cpu", "matmul peak (float32, 2048^3)", "at the 32-token bucket",
                     "grad_accum_steps=1: micro-batch 16 x 32 tokens", "non-pad target tokens/s", "MFU",
                     "a 16-token bucket's step", "a 48-token bucket's step", "peak memory",
                     "projected: train.num_steps=7 x"):
        assert expected in out, (expected, out)


def test_the_numbers_agree_with_the_batch_and_the_memory_budget_raises_accumulation_timed_in_part():
    run = _run()
    first, lines = _preflight(run, memory_budget_gb=100.0)
    assert (first["length"], first["grad_accum_steps"], first["micro_rows"]) == (32, 1, 16)
    batch = preflight.padded_batch(16, 32, 16, 120)
    non_pad = np.count_nonzero(batch["targets"] != PAD_ID)
    assert first["tokens_per_second"] * first["step_seconds"] == pytest.approx(non_pad)
    assert first["projected_hours"] == pytest.approx(first["step_seconds"] * 7 / 3600)
    assert first["paper_hours"] is None and 0 < first["mfu"] < 1

    budget = 0.9 * first["compiled_bytes"]  # the whole batch no longer fits
    second, lines = _preflight(run, memory_budget_gb=budget / preflight.GB, measure_micro_batches=1)
    k = second["grad_accum_steps"]
    assert k >= 2 and second["compiled_bytes"] <= budget and k * second["micro_rows"] == 16
    assert any("grad_accum_steps=1:" in line and "over the" in line for line in lines)
    # one micro-batch of k timed, and scaled to the whole step
    assert second["measured_micro_batches"] == 1
    assert second["step_seconds"] == pytest.approx(k * second["measured_seconds"])
    assert any(f"1 of {k} micro-batches timed" in line for line in lines)


def test_no_micro_batch_that_fits_is_one_line():
    with pytest.raises(ConfigError, match="no micro-batch fits the memory budget") as error:
        _preflight(_run(**{"data.tokens_per_batch": 48}), memory_budget_gb=1e-6)  # one row of 32, over
    assert "\n" not in str(error.value)


def test_a_padded_batch_has_the_lengths_of_its_bucket():
    batch = preflight.padded_batch(50, 32, 16, 120)
    for tokens in batch.values():
        lengths = np.count_nonzero(tokens != PAD_ID, axis=1)
        assert lengths.min() > 16 and lengths.max() <= 32
        assert np.all(tokens[np.arange(32)[None, :] >= lengths[:, None]] == PAD_ID)  # padding at the end


def _paper_run(config: str, *overrides: str) -> run_config.RunConfig:
    return run_config.build_run_config(run_config.load_config(config, overrides)[0], environment=False)


@pytest.mark.parametrize("config, hours", [("configs/wmt14_en_de_base.py", 12),
                                           ("configs/wmt14_en_de_big.py", 84),
                                           ("configs/wmt14_en_fr_big.py", 84), ("configs/table3.py:base", 12),
                                           ("configs/default.py", None)])
def test_the_paper_hours_for_the_paper_models(config, hours):
    reference_hours, note = preflight.paper_hours(_paper_run(config))
    assert reference_hours == hours
    assert (note.startswith("; the paper: ") and "s a step" in note) if hours else note == ""


@pytest.mark.parametrize("config, override, named", [
    ("configs/wmt14_en_de_base.py", "--config.model.num_encoder_layers=2",
     "model.num_encoder_layers=2 (paper: 6)"),
    ("configs/wmt14_en_fr_big.py", "--config.model.dropout_rate=0.3", "model.dropout_rate=0.3 (paper: 0.1)"),
    ("configs/table3.py:base", "--config.train.warmup_steps=400", "train.warmup_steps=400 (paper: 4000)")])
def test_an_override_of_the_model_or_recipe_names_what_differs_instead_of_the_paper_hours(config, override,
                                                                                         named):
    reference_hours, note = preflight.paper_hours(_paper_run(config, override))
    assert reference_hours is None and "\n" not in note
    assert note.startswith("; no paper hours beside it, as this is not the paper's ") and note.endswith(named)


def test_durations_read_as_a_person_reads_them():
    assert [preflight.duration(s) for s in (42, 750, 12 * 3600, 3.5 * 86400)] == [
        "42 s", "12.5 min", "12 h", "3.5 days"]


def test_every_flag_has_a_helpful_description():
    values = flags.FlagValues()
    preflight.define_flags(values)
    assert set(values) == {f.name for f in dataclasses.fields(preflight.Options)}  # a flag per option
    for name in values:
        assert len(values[name].help) >= 25, f"--{name}: {values[name].help!r}"


@pytest.mark.parametrize("chunk_tokens, length, global_rows, devices", [
    (64, 32, 16, 8), (64, 32, 16, 1), (5, 32, 16, 8), (4096, 48, 10, 2), (0, 32, 16, 8), (100, 7, 9, 3)])
def test_one_devices_loss_chunk_is_the_one_training_takes_from_the_global_micro_batch(
        chunk_tokens, length, global_rows, devices):
    device_rows = global_rows // devices
    tokens = preflight.loss_chunk_tokens_for(chunk_tokens, length, global_rows, device_rows)
    assert steps.chunk_length(length, device_rows, tokens) == steps.chunk_length(length, global_rows,
                                                                                 chunk_tokens)


@pytest.mark.parametrize("accumulation, chunk", [(1, 4), (2, 8)])
def test_the_preflights_step_over_8_devices_takes_trainings_loss_chunk(monkeypatch, accumulation, chunk):
    """Training's jitted step sees the global micro-batch (16 rows of 32 at the 32-token bucket, split k
    ways), so 64 loss tokens make chunks of 64 // (16 / k) positions; each of 8 devices holds 2 / k rows
    of it, and the preflight's one-device step must take the same chunk, not 64 // (2 / k)."""
    chunks = []
    real = steps.chunk_length
    monkeypatch.setattr(steps, "chunk_length", lambda *args: chunks.append(real(*args)) or chunks[-1])
    run = _run(**{"train.loss_chunk_tokens": 64, "train.grad_accum_steps": accumulation})
    tx = train_step._optimizer()
    state = jax.eval_shape(lambda: train_step.fresh_state(run.model, tx))
    training = functools.partial(steps.train_step, model=Transformer(run.model), tx=tx, label_smoothing=0.1,
                                 grad_accum_steps=accumulation, loss_chunk_tokens=64)
    jax.eval_shape(training, state, preflight.padded_batch(16, 32, 16, 120))
    assert chunks == [chunk]  # training's
    real_step = train_step.one_device_step

    class Traced:  # traces the preflight's real step; compiling it would add nothing here
        def __init__(self, *args, **kwargs):
            self.step = real_step(*args, **kwargs)

        def lower(self, *args):
            self.step.lower(*args)
            return types.SimpleNamespace(compile=lambda: types.SimpleNamespace(memory_analysis=lambda: None))

    monkeypatch.setattr(train_step, "one_device_step", Traced)
    lines = []
    fit = preflight._fit(run, 32, 16, preflight.Options(), None, 8, lines.append)
    assert (fit.micro_rows, fit.loss_chunk_length, chunks[1:]) == (2 // accumulation, chunk, [chunk])
    assert f"micro-batch {2 // accumulation} x 32 tokens, loss chunk {chunk} positions" in lines[0]


def test_a_cpus_memory_budget_is_half_the_available_host_memory_not_the_free(monkeypatch):
    monkeypatch.setattr(host_memory, "available_memory", lambda: (10 * 2**30, "MemAvailable"))
    assert preflight.memory_budget(preflight.Options(), jax.devices("cpu")[0]) == 5 * 2**30
    assert preflight.memory_budget(preflight.Options(memory_budget_gb=3), jax.devices("cpu")[0]) == 3e9


@pytest.mark.parametrize("scheme, suggested", [("sinusoidal", True), ("learned", True), ("rotary", True),
                                               ("none", True), ("alibi", False), ("relative", False)])
def test_the_fused_kernel_is_suggested_only_where_the_model_takes_it(monkeypatch, scheme, suggested):
    """As on a GPU where cuDNN would serve the head size: ALiBi and relative positions add to the logits,
    which ModelConfig refuses with attention_impl='fused', so the preflight does not suggest it."""
    monkeypatch.setattr(fused_attention, "implementation_for", lambda *args, **kwargs: "cudnn")
    cfg = ModelConfig(vocab_size=11, d_model=48, num_heads=3, dtype="bfloat16", position_encoding=scheme)
    line = preflight.attention_line(cfg)
    assert line.startswith("attention: dense (model.attention_impl)")
    assert ("attention_impl=fused would run cuDNN's flash attention here" in line) == suggested, line
    assert preflight.accepts_fused(cfg) == suggested
    if suggested:
        cfg.replace(attention_impl="fused")  # what it suggests, ModelConfig takes
    else:
        with pytest.raises(ValueError, match="adds to the attention logits"):
            cfg.replace(attention_impl="fused")
    unequal = ModelConfig(vocab_size=11, d_model=48, num_heads=3, d_k=16, d_v=8, dtype="bfloat16")
    assert "fused" not in preflight.attention_line(unequal)  # one head size for keys and values
