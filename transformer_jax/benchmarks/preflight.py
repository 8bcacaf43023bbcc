"""What this machine will do with a config: the first command to run on a new device (a few minutes).

    python -m transformer_jax.benchmarks.preflight --config=configs/wmt14_en_de_base.py [--config.key=value]
        [--length=L] [--grad_accum_steps=K] [--memory_budget_gb=G] [--measure_micro_batches=N]

For the config as train.py would run it, it prints:
  * whether train.py would start here (``config.platform``) and which attention kernel the model takes;
  * the device kind, count and memory, and the matmul peak measured in the model's compute dtype;
  * the train step at the config's own batch (``data.tokens_per_batch`` at one length bucket, random
    tokens padded within the bucket as real batches are): its time, non-pad target tokens per second and
    MFU, with gradient accumulation raised (doubled) from the config's until the compiled step fits the
    memory budget; the compiled step's memory and the peak the device reports;
  * ``train.num_steps`` projected from it, beside the paper's hours where the model and recipe are the
    paper's base or big model's (with an override, the fields that differ instead).

Nothing is read from disk, so the data need not be prepared. The step is the library's
(``steps.make_train_step``, as ``train_step.py`` times it) on one device, with that device's share of the
global batch (1 / device count). With ``train.loss_chunk_tokens`` its loss takes the chunk training takes,
which is computed from the global micro-batch's rows, not the device's (``loss_chunk_tokens_for``). The
projection assumes data parallelism scales linearly and leaves out evaluation and checkpoints.
``--measure_micro_batches=N`` times a step of N micro-batches only and scales it to the whole batch (for a
slow device such as a CPU; the optimizer update is then counted k / N times).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics

import jax
import numpy as np
from absl import flags, logging

from transformer_jax import run_config
from transformer_jax.benchmarks import train_step
from transformer_jax.data.batching import bucket_batch_sizes
from transformer_jax.evaluation import paper, paper_tables
from transformer_jax.model import flops, fused_attention
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.loss import chunk_length
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.runtime import devices, errors, host_memory, timing
from transformer_jax.runtime.errors import ConfigError
from transformer_jax.training import train_state

GB = 1e9
_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "configs", "default.py")


@dataclasses.dataclass(frozen=True)
class Options:
    """The preflight's own settings (its flags)."""

    length: int = 0  # the length bucket measured; 0: the config's middle bucket
    grad_accum_steps: int = 0  # the first accumulation tried; 0: the config's train.grad_accum_steps
    memory_budget_gb: float = 0.0  # 0: 90% of the device's memory (half the available host memory on a CPU)
    measure_micro_batches: int = 0  # 0: time the whole step; N: time N micro-batches and scale
    repeats: int = 3  # timed steps after one warm-up; the median is used
    peak_repeats: int = 10  # timed runs of the matmul peak


def device_memory(device) -> tuple[int | None, int | None]:
    """(the device's memory limit, its peak bytes in use so far) from ``memory_stats()``; None where the
    platform has no such statistics (the CPU)."""
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit"), stats.get("peak_bytes_in_use")


def memory_budget(options: Options, device) -> float | None:
    """Bytes a compiled step may use: the flag, else 90% of the device's limit, else half the available host
    memory (a CPU: MemAvailable, or a cgroup limit's room, ``host_memory.available_memory``); None when
    nothing says."""
    if options.memory_budget_gb:
        return options.memory_budget_gb * GB
    limit, _ = device_memory(device)
    if limit:
        return 0.9 * limit
    available = host_memory.available_memory()
    return None if available is None else 0.5 * available[0]


def loss_chunk_tokens_for(loss_chunk_tokens: int, length: int, global_micro_rows: int,
                          device_micro_rows: int) -> int:
    """The ``loss_chunk_tokens`` that gives one device's micro-batch of ``device_micro_rows`` rows the
    chunk training takes. Inside training's jitted step the loss sees the global micro-batch, so its chunk
    is ``loss.chunk_length(length, global_micro_rows, loss_chunk_tokens)`` positions; 0 stays 0."""
    if not loss_chunk_tokens:
        return 0
    return device_micro_rows * chunk_length(length, global_micro_rows, loss_chunk_tokens)


def padded_batch(rows: int, length: int, shorter: int, vocab_size: int, *, seed: int = 0) -> dict:
    """{"inputs", "targets"}: int32[rows, length], random ids >= 4 over a length drawn uniformly from
    (shorter, length] per row and side, then PAD: a batch of the bucket ``length`` as the data makes it."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("inputs", "targets"):
        tokens = rng.integers(PAD_ID + 4, vocab_size, size=(rows, length))
        lengths = rng.integers(min(shorter, length - 1) + 1, length + 1, size=(rows, 1))
        out[name] = np.where(np.arange(length)[None, :] < lengths, tokens, PAD_ID).astype(np.int32)
    return out


def compiled_bytes(compiled) -> int | None:
    """What a compiled program holds at its peak: arguments + outputs - donated + temporaries."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


@dataclasses.dataclass
class _Fit:
    grad_accum_steps: int  # k: micro-batches of the whole step
    measured_micro_batches: int  # n <= k: micro-batches of the timed program
    micro_rows: int  # rows of one micro-batch on this device
    loss_chunk_length: int  # target positions per chunk of the loss, as training's; 0: no chunks
    compiled: object
    compiled_bytes: int | None
    batch: dict  # the timed program's, on the device


def accepts_fused(cfg: ModelConfig) -> bool:
    """Whether ``ModelConfig`` takes ``attention_impl='fused'`` for this model (it refuses, e.g., position
    schemes that add to the logits, and d_k != d_v)."""
    try:
        cfg.replace(attention_impl="fused")
    except ValueError:
        return False
    return True


def attention_line(cfg: ModelConfig) -> str:
    """The preflight's attention line: the kernel the model runs, and the fused kernel where cuDNN would
    serve it here and the model can take it."""
    if cfg.attention_impl == "fused":
        return "attention: " + fused_attention.describe(cfg.dtype, cfg.d_k)
    could = fused_attention.implementation_for(cfg.dtype, cfg.d_k) == "cudnn" and accepts_fused(cfg)
    return f"attention: {cfg.attention_impl} (model.attention_impl)" + (
        "; attention_impl=fused would run cuDNN's flash attention here" if could else "")


def _fit(run, length: int, shorter: int, options: Options, budget: float | None, device_count: int,
         say) -> _Fit:
    """The first accumulation, from the config's (or the flag's) and doubling, whose compiled step fits."""
    cfg, tokens = run.model, run.data.tokens_per_batch
    tx = train_state.make_optimizer(run.train, train_state.schedule_from_config(run.train, cfg.d_model))
    abstract = jax.eval_shape(lambda: train_step.fresh_state(cfg, tx))
    k = start = options.grad_accum_steps or run.train.grad_accum_steps
    most = max(1, tokens // length // device_count)  # rows of this device's share of a batch
    while True:
        if k > most:
            why = (f"no micro-batch fits the memory budget of {budget / GB:.2g} GB, not even one row at "
                   f"grad_accum_steps={k // 2}" if k > start else
                   f"grad_accum_steps={k} is more than the {most} rows of this device's batch")
            fused = " or model.attention_impl=fused" if accepts_fused(cfg) else ""
            raise ConfigError(f"{why}; lower data.tokens_per_batch or grad_accum_steps, use model.dtype="
                              f"bfloat16{fused}, or raise --memory_budget_gb")
        global_rows = bucket_batch_sizes([length], tokens, device_count * k)[0]
        micro = global_rows // device_count // k  # rows of a micro-batch on this device
        n = min(options.measure_micro_batches, k) if options.measure_micro_batches else k
        batch = padded_batch(n * micro, length, shorter, cfg.vocab_size)
        chunk_tokens = loss_chunk_tokens_for(run.train.loss_chunk_tokens, length, global_rows // k, micro)
        step = train_step.one_device_step(cfg, tx, label_smoothing=run.train.label_smoothing,
                                          grad_accum_steps=n, loss_chunk_tokens=chunk_tokens)
        compiled = step.lower(abstract, batch).compile()
        used = compiled_bytes(compiled)
        fits = budget is None or used is None or used <= budget
        chunk = f", loss chunk {chunk_tokens // micro} positions" if chunk_tokens else ""
        say(f"  grad_accum_steps={k}: micro-batch {micro} x {length} tokens{chunk}, compiled step "
            f"{'?' if used is None else f'{used / GB:.2f} GB'}"
            + ("" if budget is None else f" ({'fits' if fits else 'over'} the {budget / GB:.1f} GB budget)"))
        if fits:
            return _Fit(k, n, micro, chunk_tokens // micro if chunk_tokens else 0, compiled, used,
                        jax.device_put(batch))
        k *= 2


def duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads: "40 s", "12.5 min", "7.3 h", "3.5 days"."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        value = seconds / size
        if value >= (2 if unit == "days" else 1):
            return f"{value:,.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{seconds:.3g} s"


def paper_hours(run: run_config.RunConfig) -> tuple[float | None, str]:
    """(the paper's training hours, what the projection says of them) for a config of the paper's base or
    big model: the hours only where the model and recipe are the paper's (``paper_tables.paper_differences``
    finds no field that differs), else None and the fields that differ; (None, "") for any other config."""
    mapping = paper.CONFIG_TO_PAPER.get(run.name)
    size = mapping["table2"][0] if mapping and mapping.get("table2") else run.name.removeprefix("table3/")
    if size not in paper.TRAINING_HOURS:
        return None, ""
    differences = paper_tables.paper_differences(paper_tables.paper_reference(run.name, "test"), run)
    if differences:
        return None, (f"; no paper hours beside it, as this is not the paper's {size} model and recipe: "
                      + "; ".join(differences))
    hours = paper.TRAINING_HOURS[size]
    return hours, (f"; the paper: {duration(hours * 3600)} for {size} on {paper.TRAINING_HARDWARE} "
                   f"({paper.STEP_SECONDS[size]} s a step)")


def preflight(run: run_config.RunConfig, options: Options = Options(), say=print) -> dict:
    """Measures and prints (through ``say``, one line at a time) what this machine does with ``run``;
    returns the numbers as a dict."""
    cfg, record = run.model, {}
    buckets = sorted(run.data.length_buckets)
    length = options.length or buckets[len(buckets) // 2]
    if length not in buckets:
        raise ConfigError(f"--length={length} is not a bucket of config.data.length_buckets {tuple(buckets)}")
    try:
        notice = devices.check_platform(run.loop.platform)
        say(f"platform: config.platform={run.loop.platform!r}, JAX runs on {jax.default_backend()}: train.py "
            "starts here" + (f" ({notice})" if notice else ""))
        record["train_py_starts"] = True
    except ConfigError as e:
        say(f"platform: train.py would stop here: {e}")
        record["train_py_starts"] = False
    say(attention_line(cfg))
    device, count = jax.devices()[0], jax.device_count()
    limit, _ = device_memory(device)
    budget = memory_budget(options, device)
    host = host_memory.available_memory() or (0, "unknown")
    memory = (f"{limit / GB:.1f} GB each" if limit else
              f"no device memory statistics; host memory available {host[0] / GB:.1f} GB ({host[1]})")
    say(f"devices: {count} x {device.device_kind} ({device.platform}), {memory}")
    record.update(device_kind=device.device_kind, device_count=count, device_memory_bytes=limit)

    peak = timing.matmul_peak(options.peak_repeats, dtype=cfg.dtype)
    say(f"matmul peak ({peak.label}, {peak.size}^3): {peak.best_flops / 1e12:.3g} TFLOP/s best of "
        f"{peak.repeats} (median {peak.median_flops / 1e12:.3g})")
    record["peak_tflops"] = peak.best_flops / 1e12

    shorter = max([b for b in buckets if b < length], default=0)
    say(f"train step: data.tokens_per_batch={run.data.tokens_per_batch} at the {length}-token bucket, "
        f"{cfg.dtype}, over {count} device(s); compiling:")
    fit = _fit(run, length, shorter, options, budget, count, say)
    state = train_step.fresh_state(cfg, train_state.make_optimizer(
        run.train, train_state.schedule_from_config(run.train, cfg.d_model)))
    holder = {"state": state}

    def step():
        holder["state"], sums = fit.compiled(holder["state"], fit.batch)
        return sums

    jax.block_until_ready(step())  # warm-up
    times = timing.time_calls(step, options.repeats)
    measured = statistics.median(times)
    scale = fit.grad_accum_steps / fit.measured_micro_batches
    step_seconds = measured * scale
    targets = int(np.count_nonzero(np.asarray(fit.batch["targets"]) != PAD_ID))
    tokens_per_second = targets * scale * count / step_seconds
    measured_flops = flops.train_step_flops(cfg, fit.measured_micro_batches * fit.micro_rows, length, length)
    mfu = measured_flops / measured / peak.best_flops
    how = ("" if scale == 1 else f" ({fit.measured_micro_batches} of {fit.grad_accum_steps} micro-batches "
           f"timed: {measured:.3g} s, scaled by {scale:g})")
    say(f"  step: {step_seconds:.3g} s{how}, median of {options.repeats}; "
        f"{tokens_per_second:,.0f} non-pad target tokens/s; MFU {mfu:.1%} of the measured peak")
    for other in (buckets[0], buckets[-1]):
        if other != length:
            rows = bucket_batch_sizes([other], run.data.tokens_per_batch, count)[0]
            ratio = flops.train_step_flops(cfg, rows, other, other) / flops.train_step_flops(
                cfg, fit.grad_accum_steps * fit.micro_rows * count, length, length)
            say(f"  a {other}-token bucket's step: x{ratio:.2f} these FLOPs (analytic)")
    _, device_peak = device_memory(device)
    if device_peak is not None:
        say(f"  peak device memory: {device_peak / GB:.2f} GB (memory_stats)")
    else:
        host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        say(f"  peak memory: no device statistics here; compiled step "
            f"{'?' if fit.compiled_bytes is None else f'{fit.compiled_bytes / GB:.2f} GB'}, this process's "
            f"peak resident {host_peak / GB:.2f} GB")
    hours = step_seconds * run.train.num_steps / 3600
    line = (f"projected: train.num_steps={run.train.num_steps:,} x {step_seconds:.3g} s = "
            f"{duration(hours * 3600)}")
    line += f" on {count} device(s), if data parallelism scales linearly; evaluation and checkpoints extra"
    reference_hours, reference_note = paper_hours(run)
    say(line + reference_note)
    record.update(length=length, grad_accum_steps=fit.grad_accum_steps, micro_rows=fit.micro_rows,
                  loss_chunk_length=fit.loss_chunk_length,
                  measured_micro_batches=fit.measured_micro_batches, step_seconds=step_seconds,
                  measured_seconds=measured, tokens_per_second=tokens_per_second, mfu=mfu,
                  compiled_bytes=fit.compiled_bytes, device_peak_bytes=device_peak, projected_hours=hours,
                  paper_hours=reference_hours)
    return record


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.preflight`` but ``--config``."""
    defaults = Options()
    flags.DEFINE_integer("length", defaults.length, "Length bucket of the measured step (one of "
                         "config.data.length_buckets); 0: the middle one.", flag_values=flag_values)
    flags.DEFINE_integer("grad_accum_steps", defaults.grad_accum_steps, "The first gradient accumulation "
                         "tried (doubled until the step fits the memory budget); 0: the config's.",
                         flag_values=flag_values)
    flags.DEFINE_float("memory_budget_gb", defaults.memory_budget_gb, "Memory a compiled step may use; 0: "
                       "0.9 of the device's, or half the available host memory on a CPU.",
                       flag_values=flag_values)
    flags.DEFINE_integer("measure_micro_batches", defaults.measure_micro_batches, "Time a step of this many "
                         "micro-batches and scale it to the whole batch (for a slow device); 0: the whole "
                         "step.", flag_values=flag_values)
    flags.DEFINE_integer("repeats", defaults.repeats, "Timed steps after one warm-up (the median is used).",
                         flag_values=flag_values)
    flags.DEFINE_integer("peak_repeats", defaults.peak_repeats, "Timed runs of the matmul peak (the best "
                         "is used).", flag_values=flag_values)


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    values = flags.FLAGS
    for name in ("repeats", "peak_repeats"):
        if values[name].value < 1:
            raise ConfigError(f"--{name}={values[name].value}: expected an integer >= 1")
    for name in ("length", "grad_accum_steps", "measure_micro_batches", "memory_budget_gb"):
        if values[name].value < 0:
            raise ConfigError(f"--{name}={values[name].value}: expected >= 0 (0: the default)")
    run = run_config.build_run_config(values.config, environment=False)
    options = Options(**{f.name: values[f.name].value for f in dataclasses.fields(Options)})
    preflight(run, options, say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    run_config.define_config_file("config", _DEFAULT_CONFIG, "Training config file, as train.py takes it "
                                  "(its --config.key=value overrides too).", lock_config=True)
    define_flags()
    errors.run_main(main)
