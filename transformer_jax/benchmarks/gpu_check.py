"""The first job on a new GPU: one command, about ten minutes, one table of numbers.

    python -m transformer_jax.benchmarks.gpu_check [--out=gpu_check] [--multi30k_dir=data/multi30k]
        [--train_minutes=2] [--quick] [--only=3,4]

Six steps, in order; each runs in its own process under a time box (a hang or a crash in one, such as
a cuDNN fault, is that step's red row, and the next step runs):

  1. devices: the device kind, count and memory; driver, CUDA and cuDNN versions; JAX and its libraries.
  2. matmul peak: bfloat16 and float32 ``size^3`` matmuls (``timing.matmul_peak``), best and median.
  3. fused attention (``model/fused_attention.py``: cuDNN on a GPU) against dense attention computed in
     float32 on the same bfloat16 inputs: values and the gradients of query, key and value, for the
     encoder's padding mask, the decoder's causal + padding mask and cross-attention (query and key
     lengths differ), a padded example with no key at all among them. Each error is
     max|fused - reference| / max|reference|, within ``VALUE_TOLERANCE`` and ``GRADIENT_TOLERANCE``.
  4. the preflight (``preflight.py``) of configs/wmt14_en_de_base.py in bfloat16, fused and dense: step
     time, non-pad target tokens/s, MFU, compiled memory.
  5. a short real run: the paper's base model on Multi30k (prepared beforehand into ``--multi30k_dir``)
     in bfloat16 with fused attention, through the training loop for ``--train_minutes`` after its first
     logged steps (then stopped as a preemption stops a run: a checkpoint is saved), its loss going down;
     then the test set
     decoded greedily and with the config's beam, and scored, through evaluate.py's code.
  6. the projection of configs/wmt14_en_de_base.py's ``train.num_steps`` on this device from step 4,
     beside the paper's 12 hours on 8 P100s.

Each row is "pass", "fail" (with the reason), or "not run" (with the reason: a step this device cannot
run, or one left out with ``--only``). Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``, each
step's output to ``<out>/logs/``, step 5's workdir to ``<out>/train``. Exits 1 if a step failed.

``--quick`` runs every step with tiny shapes (the tiny model, the synthetic task), on a CPU in about a
minute: what CI runs. Without it, a machine whose JAX found no accelerator fails step 1 and runs none of
the others. Nothing is read from the network; everything is written under ``--out``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from transformer_jax.runtime import errors
from transformer_jax.runtime.errors import ConfigError

STEPS = ("devices", "matmul_peak", "fused_attention", "preflight", "train", "projection")
TITLES = {"devices": "devices", "matmul_peak": "matmul peak", "fused_attention": "fused attention",
          "preflight": "preflight bf16", "train": "train and decode", "projection": "100k-step projection"}
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
# bfloat16 keeps 8 bits of mantissa (relative step 2^-8 = 3.9e-3): a fused kernel's error against a float32
# reference is a few of those; a wrong mask or scale is of order 1.
VALUE_TOLERANCE = 2e-2
GRADIENT_TOLERANCE = 3e-2
# Seconds each step may take before its process is killed (full run; --quick: QUICK_TIME_BOX each).
TIME_BOXES = {"devices": 120, "matmul_peak": 180, "fused_attention": 240, "preflight": 480,
              "train": 420, "projection": 120}  # train: plus --train_minutes
QUICK_TIME_BOX = 240
GB = 1e9
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Options:
    out: str = "gpu_check"  # folder of the JSON, the Markdown, the logs and step 5's workdir
    quick: bool = False  # tiny shapes: every step on a CPU in about a minute
    multi30k_dir: str = "data/multi30k"  # step 5's data, prepared beforehand
    train_minutes: float = 2.0  # step 5's training, counted from its first logged steps (compiled by then)
    configs_dir: str = ""  # the project's configs/ ("": the checkout's, else ./configs)
    time_boxes: dict | None = None  # {step: seconds}, overriding TIME_BOXES / QUICK_TIME_BOX

    def time_box(self, name: str) -> float:
        if self.time_boxes and name in self.time_boxes:
            return self.time_boxes[name]
        if self.quick:
            return QUICK_TIME_BOX
        return TIME_BOXES[name] + (60 * self.train_minutes if name == "train" else 0)

    def config_path(self, name: str) -> str:
        for folder in ([self.configs_dir] if self.configs_dir else
                       [os.path.join(_ROOT, "configs"), os.path.join(os.getcwd(), "configs")]):
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
        raise errors.MissingFileError(f"no configs/{name} (looked in {self.configs_dir or _ROOT} and the "
                                      "current folder); run from a checkout of this project")


@dataclasses.dataclass
class Row:
    """One step's line of the table, and its numbers."""

    index: int
    name: str
    status: str  # PASS, FAIL or NOT_RUN
    summary: str  # one line: the numbers, or what went wrong
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def title(self) -> str:
        return TITLES[self.name]


class StepFailed(Exception):
    """A step ran and its result is wrong: ``summary`` says how; ``details`` holds its numbers."""

    def __init__(self, summary: str, details: dict | None = None):
        super().__init__(summary)
        self.details = details or {}


class NotRun(Exception):
    """The step cannot run here; the message says why."""


# Step 1 ------------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    """Installed versions of JAX, its plugins and the libraries the project trains with."""
    names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-dtypes", "sacrebleu",
             "sentencepiece"]
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-cuda", "jax-rocm", "libtpu", "nvidia-cudnn", "nvidia-cuda-runtime")):
            names.append(name)
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _cuda_versions() -> dict[str, str]:
    """The CUDA runtime, cuDNN and driver versions the loaded CUDA plugin reports, where it says."""
    try:
        from jax._src.lib import cuda_versions  # not public API: read where it exists
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    out = {}
    for key, getter in (("cuda_runtime", "cuda_runtime_get_version"), ("cudnn", "cudnn_get_version"),
                        ("cuda_driver_api", "cuda_driver_get_version")):
        with contextlib.suppress(Exception):
            value = getattr(cuda_versions, getter)()
            out[key] = _cuda_version_string(int(value), cudnn=key == "cudnn")
    return out


def _cuda_version_string(value: int, *, cudnn: bool) -> str:
    """12080 -> "12.8"; cuDNN 90800 -> "9.8.0" (cuDNN 9 counts major * 10000)."""
    if cudnn:
        major, rest = divmod(value, 10000 if value >= 10000 else 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"
    major, rest = divmod(value, 1000)
    return f"{major}.{rest // 10}"


def _nvidia_smi() -> dict[str, str]:
    """Driver version, name and memory from nvidia-smi, if it is installed (10 s at most)."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode or not first:
        return {}
    driver, name, memory = ([p.strip() for p in first[0].split(",")] + ["", "", ""])[:3]
    return {"driver": driver, "nvidia_smi_name": name, "nvidia_smi_memory": memory}


def _backend() -> str:
    return jax.default_backend()


def step_devices(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.runtime import devices as devices_lib

    devs = jax.devices()
    device = devs[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    details = {"platform": device.platform, "backend": _backend(), "device_kind": device.device_kind,
               "device_count": len(devs), "process_count": jax.process_count(),
               "memory_bytes": limit, "python": platform.python_version(), "versions": _versions(),
               **_cuda_versions(), **_nvidia_smi()}
    with contextlib.suppress(Exception):
        details["environment"] = jax.print_environment_info(return_string=True)
    memory = f"{limit / GB:.1f} GB each" if limit else "no memory statistics"
    stack = ", ".join(f"{k} {details[k]}" for k in ("driver", "cuda_runtime", "cudnn") if details.get(k))
    v = details["versions"]
    summary = (f"{len(devs)} x {device.device_kind} ({device.platform}), {memory}"
               + (f"; {stack}" if stack else "") + f"; jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, "
               f"flax {v.get('flax')}, optax {v.get('optax')}, orbax {v.get('orbax-checkpoint')}")
    if details["backend"] == "cpu":
        if options.quick:
            return summary + "; no accelerator: --quick runs every step on the CPU", details
        try:
            devices_lib.check_platform("gpu")
        except ConfigError as e:
            raise StepFailed(f"{summary}; {e}", details) from e
    return summary, details


def _need_accelerator(options: Options, earlier: dict[str, Row]) -> None:
    """NotRun when step 1 found no accelerator and this is not --quick: the numbers would not be a GPU's."""
    backend = earlier.get("devices", Row(0, "devices", NOT_RUN, "")).details.get("backend")
    if not options.quick and backend == "cpu":
        raise NotRun("JAX found no accelerator (step 1); fix step 1, or run with --quick to check the CPU "
                     "path")


# Step 2 ------------------------------------------------------------------------------------------------


def step_matmul_peak(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.runtime import timing

    _need_accelerator(options, earlier)
    size, repeats = (256, 3) if options.quick else (8192, 10)
    details, parts = {}, []
    for dtype in ("bfloat16", "float32"):
        peak = timing.matmul_peak(repeats, size=size, dtype=dtype)
        details[dtype] = peak.record()
        parts.append(f"{dtype} {peak.best_flops / 1e12:.3g} TFLOP/s (median {peak.median_flops / 1e12:.3g})")
    return f"{size}^3, best of {repeats}: " + "; ".join(parts), details


# Step 3 ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    q_len: int
    kv_len: int
    causal: bool  # the decoder's self-attention: causal=True with the padding mask


def attention_cases(quick: bool) -> tuple[tuple[int, int, int], list[AttentionCase]]:
    """((batch, heads, head_dim), the cases). Full: even lengths (cuDNN's masked kernel takes even ones only),
    head size 64 as the base model. Quick: small distinct sizes."""
    if quick:
        return (3, 5, 16), [AttentionCase("encoder self, padding", 7, 7, False),
                            AttentionCase("decoder self, causal + padding", 9, 9, True),
                            AttentionCase("cross, padding", 5, 11, False)]
    return (4, 8, 64), [AttentionCase("encoder self, padding", 256, 256, False),
                        AttentionCase("decoder self, causal + padding", 256, 256, True),
                        AttentionCase("cross, padding", 192, 256, False)]


def _padding_mask(batch: int, kv_len: int) -> np.ndarray:
    """bool[batch, 1, 1, kv_len]: the first example has every key, the last none, others in between."""
    lengths = np.linspace(kv_len, 0, batch).round().astype(int)
    lengths[1:-1] = np.maximum(lengths[1:-1], 1)
    return (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def compare_attention(case: AttentionCase, batch: int, heads: int, head_dim: int, implementation: str, *,
                      seed: int = 0) -> dict:
    """Errors of fused attention (bfloat16) and of dense attention in bfloat16, both against dense attention
    in float32 ("highest" matmul precision) on the same bfloat16 inputs: values and the three gradients."""
    from transformer_jax.model import attention, fused_attention

    rng = np.random.default_rng(seed)
    shapes = [(batch, case.q_len, heads, head_dim), (batch, case.kv_len, heads, head_dim),
              (batch, case.kv_len, heads, head_dim), (batch, case.q_len, heads, head_dim)]
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    mask = jnp.asarray(_padding_mask(batch, case.kv_len))
    dense_mask = attention.combine_masks(mask, attention.causal_mask(case.q_len)) if case.causal else mask

    def value_and_grads(fn, dtype, *arrays):
        *args, cotangent = (x.astype(dtype) for x in arrays)
        out, pullback = jax.vjp(fn, *args)
        return (out, *pullback(cotangent))

    dense = lambda a, b, c: attention.dot_product_attention(a, b, c, dense_mask)
    fused_fn = lambda a, b, c: fused_attention.fused_attention(a, b, c, mask, causal=case.causal,
                                                               implementation=implementation)
    with jax.default_matmul_precision("highest"):
        reference = jax.jit(functools.partial(value_and_grads, dense, jnp.float32))(q, k, v, d_out)
    dense_bf16 = jax.jit(functools.partial(value_and_grads, dense, jnp.bfloat16))(q, k, v, d_out)
    fused = jax.jit(functools.partial(value_and_grads, fused_fn, jnp.bfloat16))(q, k, v, d_out)
    names = ("values", "d_query", "d_key", "d_value")
    return {"case": case.name, "q_len": case.q_len, "kv_len": case.kv_len,
            "kernel": fused_attention.kernel_for(implementation, case.q_len, case.kv_len, True),
            "fused": {n: _relative_error(g, w) for n, g, w in zip(names, fused, reference, strict=True)},
            "dense_bf16": {n: _relative_error(g, w) for n, g, w in zip(names, dense_bf16, reference,
                                                                         strict=True)}}


def step_fused_attention(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.model import fused_attention

    _need_accelerator(options, earlier)
    (batch, heads, head_dim), cases = attention_cases(options.quick)
    implementation = fused_attention.implementation_for("bfloat16", head_dim)
    results = [compare_attention(c, batch, heads, head_dim, implementation) for c in cases]
    worst = lambda key, names: max(r[key][n] for r in results for n in names)
    grads = ("d_query", "d_key", "d_value")
    details = {"implementation": implementation, "batch": batch, "heads": heads, "head_dim": head_dim,
               "value_tolerance": VALUE_TOLERANCE, "gradient_tolerance": GRADIENT_TOLERANCE, "cases": results,
               "describe": fused_attention.describe("bfloat16", head_dim)}
    kernels = sorted({r["kernel"] for r in results})
    summary = (f"{'/'.join(kernels)}, bf16, {len(results)} masks: worst error values "
               f"{worst('fused', ['values']):.2g} (tol {VALUE_TOLERANCE:g}), gradients "
               f"{worst('fused', grads):.2g} (tol {GRADIENT_TOLERANCE:g}); dense bf16 itself "
               f"{worst('dense_bf16', ['values']):.2g} / {worst('dense_bf16', grads):.2g}")
    if implementation != "cudnn" and _backend() == "gpu":
        summary += f"; cuDNN not used: {details['describe']}"
    bad = [f"{r['case']}: {n} {r['fused'][n]:.3g} > {tol:g}" for r in results
           for names, tol in ((["values"], VALUE_TOLERANCE), (grads, GRADIENT_TOLERANCE))
           for n in names if not r["fused"][n] <= tol]
    if bad:
        raise StepFailed(f"fused attention differs from dense: {'; '.join(bad[:3])}"
                         + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "") + f" [{summary}]", details)
    return summary, details


# Step 4 ------------------------------------------------------------------------------------------------

# --quick: the preflight's run on a tiny model of the default config.
QUICK_PREFLIGHT = ["--config.data.vocab_size=120", "--config.data.tokens_per_batch=256",
                   "--config.data.length_buckets=(8,16)", "--config.data.max_len=16",
                   "--config.model.d_model=32", "--config.model.d_ff=64",
                   "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
                   "--config.model.num_decoder_layers=1", "--config.train.num_steps=100000"]


def _preflight_run(options: Options, impl: str):
    from transformer_jax import run_config

    overrides = [f"--config.model.attention_impl={impl}", "--config.model.dtype=bfloat16",
                 "--config.platform=any"]
    if options.quick:
        config, _ = run_config.load_config(options.config_path("default.py"), QUICK_PREFLIGHT + overrides)
    else:
        config, _ = run_config.load_config(options.config_path("wmt14_en_de_base.py"), overrides)
    return run_config.build_run_config(config, environment=False)


def step_preflight(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.benchmarks import preflight

    _need_accelerator(options, earlier)
    pf_options = preflight.Options(repeats=2 if options.quick else 5, peak_repeats=1 if options.quick else 10)
    details, parts, failed = {}, [], []
    for impl in ("fused", "dense"):
        lines = []
        try:
            record = preflight.preflight(_preflight_run(options, impl), pf_options, say=_collect(lines))
        except Exception as e:  # one kernel failing still leaves the other's numbers
            details[impl] = {"error": errors.short_error(e), "lines": lines}
            failed.append(f"{impl}: {errors.short_error(e, 200)}")
            continue
        details[impl] = {**record, "lines": lines}
        compiled = record.get("compiled_bytes")
        parts.append(f"{impl} {record['step_seconds']:.3g} s/step, {record['tokens_per_second']:,.0f} tok/s, "
                     f"MFU {record['mfu']:.1%}" + (f", {compiled / GB:.2f} GB" if compiled else ""))
    first = next((details[i] for i in ("fused", "dense") if "step_seconds" in details[i]), None)
    shape = (f" (batch of {first['grad_accum_steps']} x {first['micro_rows']} rows at the "
             f"{first['length']}-token bucket, peak {first['peak_tflops']:.3g} TFLOP/s)") if first else ""
    summary = "; ".join(parts) + shape
    if failed:
        raise StepFailed("; ".join(failed) + (f" [{summary}]" if parts else ""), details)
    return summary, details


def _collect(lines: list[str]) -> Callable[[str], None]:
    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    return say


# Step 5 ------------------------------------------------------------------------------------------------

# The paper's base model on Multi30k, in bfloat16 with fused attention; stopped --train_minutes after its
# first logged steps. Two length buckets: two train programs to compile, and few decoding ones.
BASE_ON_MULTI30K = ["--config.data.length_buckets=(32,64)", "--config.data.tokens_per_batch=8192",
                    "--config.model.d_model=512", "--config.model.d_ff=2048", "--config.model.num_heads=8",
                    "--config.model.num_encoder_layers=6", "--config.model.num_decoder_layers=6",
                    "--config.model.dropout_rate=0.1", "--config.train.num_steps=100000",
                    "--config.train.warmup_steps=800", "--config.train.cooldown_steps=0",
                    "--config.train.learning_rate_scale=1.0", "--config.log_every_steps=50"]
# --quick: a tiny model on the synthetic task for 30 steps.
QUICK_TRAIN = ["--config.data.synthetic_train_size=400", "--config.data.synthetic_dev_size=16",
               "--config.data.synthetic_test_size=16", "--config.data.vocab_size=120",
               "--config.data.tokens_per_batch=512", "--config.data.length_buckets=(32,)",
               "--config.data.max_len=32", "--config.data.synthetic_max_words=12",
               "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
               "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
               "--config.train.num_steps=30", "--config.train.warmup_steps=5", "--config.log_every_steps=10",
               "--config.final_beam_size=2", "--config.peak_tflops_per_device=1.0"]
COMMON_TRAIN = ["--config.model.dtype=bfloat16", "--config.model.attention_impl=fused",
                "--config.platform=any",
                "--config.eval_every_steps=0", "--config.eval_bleu_examples=0", "--config.final_eval_split=",
                "--config.checkpoint_every_steps=0", "--config.checkpoint_every_minutes=0",
                "--config.final_average_last=1"]


def _train_config(options: Options, workdir: str):
    from transformer_jax import run_config

    cache = [f"--config.data.cache_dir={os.path.join(os.path.abspath(options.out), 'data_cache')}"]
    if options.quick:
        return run_config.load_config(options.config_path("default.py"), QUICK_TRAIN + COMMON_TRAIN)[0]
    folder = os.path.abspath(options.multi30k_dir)
    if not all(os.path.isfile(os.path.join(folder, f"{split}.{lang}"))
               for split in ("train", "val", "test") for lang in ("en", "de")):
        raise StepFailed(f"no Multi30k in --multi30k_dir={options.multi30k_dir} (train/val/test .en/.de): "
                         "prepare it before going offline: python -m transformer_jax.data.prepare multi30k "
                         f"--dir={options.multi30k_dir}")
    overrides = [f"--config.data.dir={folder}"] + cache + BASE_ON_MULTI30K + COMMON_TRAIN
    return run_config.load_config(options.config_path("multi30k.py"), overrides)[0]


@contextlib.contextmanager
def _stop_after(seconds: float | None, started: Callable[[], bool]):
    """Sends this process SIGTERM ``seconds`` after ``started()`` turns true (polled each second): the
    training loop then saves a checkpoint and stops, as when a cluster preempts it."""
    done = threading.Event()

    def countdown():
        while not done.wait(1.0) and not started():
            pass
        if not done.wait(seconds):
            os.kill(os.getpid(), signal.SIGTERM)

    if seconds:
        threading.Thread(target=countdown, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _losses(workdir: str) -> list[tuple[int, float]]:
    rows = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if "train_loss" in row:
                    rows.append((row["step"], row["train_loss"]))
    return rows


def step_train(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax import run_config
    from transformer_jax.evaluation import workdir_scoring
    from transformer_jax.training import loop

    _need_accelerator(options, earlier)
    workdir = os.path.join(os.path.abspath(options.out), "train")
    config = _train_config(options, workdir)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run each time
    run = run_config.build_run_config(config)
    started = time.time()
    with _stop_after(None if options.quick else 60 * options.train_minutes, lambda: bool(_losses(workdir))):
        final = loop.train_and_evaluate(run, workdir)
    train_seconds = time.time() - started
    losses = _losses(workdir)
    details = {"workdir": workdir, "steps": final.get("step"), "train_seconds": train_seconds,
               "losses": losses, "model": dataclasses.asdict(run.model)}
    if not final.get("step"):
        raise StepFailed(f"no training step finished in {train_seconds:.0f} s (see the log)", details)
    scores = {}
    for name, beam in (("greedy", 1), ("beam", None)):  # None: the config's final_beam_size and alpha
        result = workdir_scoring.evaluate_workdir(workdir, split="test", beam_size=beam, average_last=0,
                                                  output_dir=os.path.join(workdir, f"eval-{name}"),
                                                  overwrite=True)
        scores[name] = {k: result.get(k) for k in ("sacrebleu", "multi30k_bleu", "tokenized_bleu", "ppl",
                                                   "beam_size", "alpha")}
    details["test"] = scores
    beam_size = run.eval.final_beam_size
    first, last = (losses[0], losses[-1]) if losses else ((0, float("nan")), (0, float("nan")))
    summary = (f"{final['step']:,} steps in {train_seconds:.0f} s ({run.model.d_model}-wide, "
               f"{run.model.num_encoder_layers}+{run.model.num_decoder_layers} layers): loss "
               f"{first[1]:.3g} at step {first[0]} -> {last[1]:.3g} at step {last[0]}; test BLEU greedy "
               f"{scores['greedy']['sacrebleu']:.1f}, beam {beam_size} {scores['beam']['sacrebleu']:.1f} "
               f"(sacreBLEU), test PPL {scores['greedy']['ppl']:.3g}")
    if len(losses) < 2 or not last[1] < first[1]:
        raise StepFailed(f"the training loss did not go down: {summary}", details)
    return summary, details


# Step 6 ------------------------------------------------------------------------------------------------


def step_projection(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax import run_config
    from transformer_jax.data.batching import bucket_batch_sizes
    from transformer_jax.evaluation import paper
    from transformer_jax.model import flops

    _need_accelerator(options, earlier)
    measured = earlier.get("preflight", Row(0, "preflight", NOT_RUN, "")).details
    impl = next((i for i in ("fused", "dense") if "step_seconds" in measured.get(i, {})), None)
    if impl is None:
        raise NotRun("it projects step 4's measured step, and step 4 measured none")
    config, _ = run_config.load_config(options.config_path("wmt14_en_de_base.py"), ["--config.platform=any"])
    run = run_config.build_run_config(config, environment=False)
    paper_hours, hardware = paper.TRAINING_HOURS["base"], paper.TRAINING_HARDWARE
    record = measured[impl]
    count = record["device_count"]
    if options.quick:  # step 4 measured a tiny model: scale the base model's FLOPs by its FLOP/s
        length = sorted(run.data.length_buckets)[len(run.data.length_buckets) // 2]
        rows = bucket_batch_sizes([length], run.data.tokens_per_batch, 1)[0]
        achieved = record["mfu"] * record["peak_tflops"] * 1e12 * count
        step_seconds = flops.train_step_flops(run.model, rows, length, length) / achieved
        how = f"estimated from the tiny model's {achieved / 1e12:.3g} TFLOP/s ({impl})"
    else:
        step_seconds = record["step_seconds"]
        how = f"measured: {impl} attention, {step_seconds:.3g} s a step"
    hours = step_seconds * run.train.num_steps / 3600
    details = {"num_steps": run.train.num_steps, "attention_impl": impl, "step_seconds": step_seconds,
               "hours": hours, "device_count": count, "paper_hours": paper_hours, "paper_hardware": hardware,
               "paper_step_seconds": paper.STEP_SECONDS["base"], "quick": options.quick}
    for other in ("fused", "dense"):
        if other != impl and "projected_hours" in measured.get(other, {}) and not options.quick:
            details[f"hours_{other}"] = measured[other]["projected_hours"]
    from transformer_jax.benchmarks.preflight import duration

    summary = (f"{run.train.num_steps:,} steps of {config.name}: {duration(hours * 3600)} on {count} "
               f"device(s) ({how}); the paper: {duration(paper_hours * 3600)} on {hardware} "
               f"({paper.STEP_SECONDS['base']} s a step); x{paper_hours / hours:.2g} the paper's speed")
    return summary, details


STEP_FUNCTIONS: dict[str, Callable[[Options, dict[str, Row]], tuple[str, dict]]] = {
    "devices": step_devices, "matmul_peak": step_matmul_peak, "fused_attention": step_fused_attention,
    "preflight": step_preflight, "train": step_train, "projection": step_projection}


# Running the steps ---------------------------------------------------------------------------------------


class _TimeBoxExceeded(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """In-process time box (main thread only): raises _TimeBoxExceeded when Python next runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TimeBoxExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_step(name: str, options: Options, earlier: dict[str, Row]) -> Row:
    """Runs one step in this process; every outcome is a Row (an exception is a "fail" with one line)."""
    index = STEPS.index(name) + 1
    started = time.time()
    try:
        with _alarm(options.time_box(name)):
            summary, details = STEP_FUNCTIONS[name](options, earlier)
        row = Row(index, name, PASS, summary, details=details)
    except StepFailed as e:
        row = Row(index, name, FAIL, str(e), details=e.details)
    except NotRun as e:
        row = Row(index, name, NOT_RUN, str(e))
    except _TimeBoxExceeded:
        row = Row(index, name, FAIL, f"did not finish within its {options.time_box(name):g} s time box")
    except Exception as e:  # noqa: BLE001 - the check reports every failure and goes on
        row = Row(index, name, FAIL, errors.short_error(e))
    row.seconds = time.time() - started
    return row


def _rows_to_json(rows: dict[str, Row]) -> dict:
    return {name: dataclasses.asdict(row) for name, row in rows.items()}


def _rows_from_json(data: dict) -> dict[str, Row]:
    return {name: Row(**row) for name, row in data.items()}


def _log_path(options: Options, name: str) -> str:
    return os.path.join(options.out, "logs", f"{STEPS.index(name) + 1}-{name}.log")


def run_isolated(name: str, options: Options, earlier: dict[str, Row]) -> Row:
    """Runs one step in a child process, killed at its time box; its output goes to ``<out>/logs/``."""
    index, box = STEPS.index(name) + 1, options.time_box(name)
    os.makedirs(os.path.join(options.out, "logs"), exist_ok=True)
    earlier_path = os.path.join(options.out, "logs", f"earlier-{index}.json")
    result_path = os.path.join(options.out, "logs", f"{index}-{name}.json")
    with open(earlier_path, "w") as f:
        json.dump(_rows_to_json(earlier), f, default=str)
    with contextlib.suppress(FileNotFoundError):
        os.remove(result_path)
    command = [sys.executable, "-m", "transformer_jax.benchmarks.gpu_check", f"--step={name}",
               f"--out={options.out}", f"--multi30k_dir={options.multi30k_dir}",
               f"--train_minutes={options.train_minutes}", f"--quick={options.quick}",
               f"--configs_dir={options.configs_dir}", f"--earlier={earlier_path}", f"--result={result_path}"]
    started = time.time()
    with open(_log_path(options, name), "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 stdin=subprocess.DEVNULL)
        try:
            code = child.wait(timeout=box)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return Row(index, name, FAIL, f"did not finish within its {box:g} s time box (killed); its "
                       f"output: {_log_path(options, name)}", seconds=time.time() - started)
    seconds = time.time() - started
    if os.path.exists(result_path):
        with open(result_path) as f:
            row = Row(**json.load(f))
        row.seconds = seconds
        return row
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return Row(index, name, FAIL, f"the step's process ended with {how} and no result: "
               f"{_last_line(_log_path(options, name))} (all of it: {_log_path(options, name)})",
               seconds=seconds)


def _last_line(path: str) -> str:
    """What a crashed step's output says: its first line that names an error (a fatal LLVM, CUDA or
    Python error prints one before the stack dumps), else its last line."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        named = [line for line in lines if re.search(r"\b(ERROR|Error|error|Check failed|Aborted)\b", line)]
        return (named or lines or ["(no output)"])[0 if named else -1][:300]
    return "(no output)"


def run_checks(options: Options, *, only: tuple[str, ...] = STEPS, isolate: bool = True,
               say: Callable[[str], None] = print) -> list[Row]:
    """Runs the steps in order (each in its own process unless ``isolate`` is False); writes the JSON and
    the Markdown; returns the rows. A step not in ``only`` is a "not run" row that says so."""
    os.makedirs(options.out, exist_ok=True)
    rows: dict[str, Row] = {}
    for index, name in enumerate(STEPS, 1):
        if name not in only:
            rows[name] = Row(index, name, NOT_RUN, "left out by --only")
        else:
            say(f"[{index}/{len(STEPS)}] {TITLES[name]} (time box {options.time_box(name):g} s) ...")
            rows[name] = (run_isolated if isolate else run_step)(name, options, rows)
        row = rows[name]
        say(f"[{index}/{len(STEPS)}] {row.title}: {row.status.upper()} ({row.seconds:.1f} s) {row.summary}")
    write_reports(list(rows.values()), options)
    return list(rows.values())


# The report ----------------------------------------------------------------------------------------------


def header(rows: list[Row], options: Options) -> str:
    device = next((r.details for r in rows if r.name == "devices" and r.details), {})
    what = (f"{device.get('device_count')} x {device.get('device_kind')}, jax "
            f"{device.get('versions', {}).get('jax')}" if device else "device unknown (step 1 did not run)")
    return (f"gpu_check{' --quick' if options.quick else ''}: {what}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def table(rows: list[Row]) -> str:
    """The plain-text table: one line per step."""
    width = max(len(r.title) for r in rows)
    lines = [f" #  {'step':<{width}}  {'status':<7}  {'seconds':>7}  result"]
    for r in rows:
        lines.append(f" {r.index}  {r.title:<{width}}  {r.status:<7}  {r.seconds:7.1f}  {r.summary}")
    return "\n".join(lines)


def markdown(rows: list[Row], options: Options) -> str:
    out = [f"# {header(rows, options)}", "", "| # | step | status | seconds | result |",
           "|---|---|---|---:|---|"]
    out += [f"| {r.index} | {r.title} | {r.status} | {r.seconds:.1f} | {r.summary.replace('|', '/')} |"
            for r in rows]
    out += ["", f"Each step's output: `{os.path.join(options.out, 'logs')}/`.", ""]
    for r in rows:
        shown = {k: v for k, v in r.details.items() if k not in ("environment", "lines", "model")}
        if shown:
            out += [f"## {r.index}. {r.title}", "", "```json", json.dumps(shown, indent=1, default=str),
                    "```", ""]
    return "\n".join(out)


def write_reports(rows: list[Row], options: Options) -> tuple[str, str]:
    """``<out>/gpu_check.json`` and ``<out>/gpu_check.md``; returns their paths."""
    json_path, md_path = (os.path.join(options.out, f"gpu_check.{ext}") for ext in ("json", "md"))
    document = {"header": header(rows, options), "quick": options.quick, "all_passed": all_passed(rows),
                "steps": [dataclasses.asdict(r) for r in rows]}
    for path, text in ((json_path, json.dumps(document, indent=1, default=str)),
                       (md_path, markdown(rows, options))):
        with open(path + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(path + ".tmp", path)
    return json_path, md_path


def all_passed(rows: list[Row]) -> bool:
    return not any(r.status == FAIL for r in rows)


# The command -----------------------------------------------------------------------------------------------

def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.gpu_check`` (defined when it runs, not on
    import)."""
    flags.DEFINE_string("out", Options.out, "Folder of gpu_check.json, gpu_check.md, logs/ and train/.",
                        flag_values=flag_values)
    flags.DEFINE_bool("quick", False, "Tiny shapes: every step on a CPU (CI).", flag_values=flag_values)
    flags.DEFINE_string("multi30k_dir", Options.multi30k_dir, "Step 5's data, made beforehand by python -m "
                        "transformer_jax.data.prepare multi30k --dir=DIR (not needed with --quick).",
                        flag_values=flag_values)
    flags.DEFINE_float("train_minutes", Options.train_minutes, "Step 5's training time, from its first "
                       "logged steps (compiled by then).", flag_values=flag_values)
    flags.DEFINE_list("only", [], "Run only these steps (numbers 1-6 or names); the others are 'not run' "
                      "rows.", flag_values=flag_values)
    flags.DEFINE_string("configs_dir", "", "The project's configs/ (default: the checkout's).",
                        flag_values=flag_values)
    # Internal: the parent runs each step as `--step=NAME --earlier=FILE --result=FILE`.
    flags.DEFINE_enum("step", None, list(STEPS), "Internal: run this one step and write --result.",
                      flag_values=flag_values)
    flags.DEFINE_string("earlier", None, "Internal: the rows of the steps before --step (JSON).",
                        flag_values=flag_values)
    flags.DEFINE_string("result", None, "Internal: where --step writes its row (JSON).",
                        flag_values=flag_values)


def _parse_only(values: list[str]) -> tuple[str, ...]:
    if not values:
        return STEPS
    chosen = []
    for value in values:
        name = STEPS[int(value) - 1] if value.isdigit() and 1 <= int(value) <= len(STEPS) else value
        if name not in STEPS:
            raise ConfigError(f"--only={','.join(values)}: expected step numbers 1-{len(STEPS)} or names of "
                              f"{', '.join(STEPS)}; got {value!r}")
        chosen.append(name)
    return tuple(chosen)


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    values = flags.FLAGS
    if values.train_minutes <= 0:
        raise ConfigError(f"--train_minutes={values.train_minutes}: expected minutes > 0, e.g. 2")
    options = Options(out=values.out, quick=values.quick, multi30k_dir=values.multi30k_dir,
                      train_minutes=values.train_minutes, configs_dir=values.configs_dir)
    if values.step:  # a child: one step, its row written for the parent
        from transformer_jax.runtime import compile_cache

        compile_cache.enable(os.path.join(os.path.abspath(options.out), "xla_cache"))  # a rerun compiles less
        earlier = {}
        if values.earlier:
            with open(values.earlier) as f:
                earlier = _rows_from_json(json.load(f))
        row = run_step(values.step, options, earlier)
        with open(values.result + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(row), f, default=str)
        os.replace(values.result + ".tmp", values.result)
        return
    only = _parse_only(values.only)
    rows = run_checks(options, only=only, say=lambda line: print(line, flush=True))
    print()
    print(header(rows, options))
    print(table(rows))
    json_path, md_path = (os.path.join(options.out, f"gpu_check.{ext}") for ext in ("json", "md"))
    print(f"\nwritten: {json_path}, {md_path}; each step's output in {os.path.join(options.out, 'logs')}/")
    if not all_passed(rows):
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
