"""The first three steps of ``gpu_check`` (the device itself), and what every step shares: the options,
a step's row of the table, and how a step says it failed or cannot run.

  1. devices: the device kind, count and memory; driver, CUDA and cuDNN versions; JAX and its libraries.
  2. matmul peak: bfloat16 and float32 ``size^3`` matmuls (``timing.matmul_peak``), best and median.
  3. fused attention (``model/fused_attention.py``: cuDNN on a GPU) against dense attention computed in
     float32 on the same bfloat16 inputs: values and the gradients of query, key and value, for the
     encoder's padding mask, the decoder's causal + padding mask and cross-attention (query and key
     lengths differ), a padded example with no key at all among them. Each error is
     max|fused - reference| / max|reference|, within ``VALUE_TOLERANCE`` and ``GRADIENT_TOLERANCE``.

Each step is ``step_<name>(options, earlier) -> (summary, details)``: ``earlier`` holds the rows of the
steps before it; a step raises ``StepFailed`` or ``NotRun``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

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


def need_accelerator(options: Options, earlier: dict[str, Row]) -> None:
    """NotRun when step 1 found no accelerator and this is not --quick: the numbers would not be a GPU's."""
    backend = earlier.get("devices", Row(0, "devices", NOT_RUN, "")).details.get("backend")
    if not options.quick and backend == "cpu":
        raise NotRun("JAX found no accelerator (step 1); fix step 1, or run with --quick to check the CPU "
                     "path")


# Step 2 ------------------------------------------------------------------------------------------------


def step_matmul_peak(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.runtime import timing

    need_accelerator(options, earlier)
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

    need_accelerator(options, earlier)
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
