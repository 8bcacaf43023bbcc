"""Where a result was made: the code, the packages, the machine and the numerics settings of a run.

A score moves with the host as well as with the seed (the XLA CPU backend takes another floating-point path
on another instruction set), so every run says where it ran. ``collect`` reads one record:

- ``code``: the git commit of the checkout the package was imported from and whether its tracked files were
  changed (``dirty``), else the installed package's version;
- ``versions``: python and the packages that compute or score (``PACKAGES``);
- ``backend``, ``device_kind``, ``device_count``, ``process_count`` (the devices of every process; the
  CPU is process 0's);
- ``cpu``: its model name, the vector instruction sets it has that XLA compiles for (two hosts of one model
  name can differ there), and the cores this process may use;
- ``matmul_peak``: the peak the run measured at start-up (``timing.matmul_peak``), as GFLOP/s, the dtype (or
  the precision the multiplies ran in, such as TF32: ``Peak.label``) and the matmul's size;
- ``numerics``: the environment variables that change numerics (``XLA_FLAGS``, ``JAX_*``...) and the jax
  settings in force that do (matmul precision, x64, the PRNG);
- ``config_sha256``: a hash of the run's config (its saved JSON form), when there is one;
- ``started``: the UTC time the record was taken.

A value that cannot be read is the string ``"unknown: <why>"``, never a placeholder.

A training workdir keeps ``provenance.json`` (``record_start``): the first start's record, kept as it was,
and one entry per later start (a resume, maybe on another host after a requeue) with its time, its peak and
the fields that differ from the first record. ``final.json``, evaluate.py's outputs and each sweep row's
``result.json`` carry a copy; ``describe`` turns one into a line, and ``differences`` says in one line when a
set of results comes from more than one host kind, code version or JAX version.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from transformer_jax.runtime import timing

FILENAME = "provenance.json"
FORMAT = 1
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "sentencepiece", "sacrebleu")
# Environment variables that change what XLA computes (not where it caches or logs).
NUMERICS_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "NVIDIA_TF32_OVERRIDE")
_JAX_VARIABLES_WITHOUT_NUMERICS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_PLATFORMS",
                                   "JAX_LOG_COMPILES", "JAX_TRACEBACK_FILTERING")
# The jax settings that change results, read from jax.config as they are in force.
JAX_SETTINGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl",
                "jax_threefry_partitionable")
# Fields that do not describe the host or the code: a resume's own start time and peak.
PER_START = ("started", "matmul_peak")
# The CPU flags (/proc/cpuinfo) that change which kernels XLA's CPU backend emits: x86, then Arm.
VECTOR_ISA = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2")
UNKNOWN = "unknown"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../transformer_jax
_GIT_SECONDS = 10


def unknown(why: str) -> str:
    """The value of a field that cannot be read, with the reason."""
    return f"{UNKNOWN}: {why}"


def is_unknown(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(UNKNOWN)


def collect(*, config: Mapping[str, Any] | None = None, peak: timing.Peak | None = None,
            peak_missing: str = "not measured") -> dict[str, Any]:
    """The record of this process, now.

    Args:
      config: the run's config in its saved JSON form (``RunConfig.saved``); None: no config hash.
      peak: the ``timing.Peak`` measured at start-up, or None; then ``matmul_peak`` says ``peak_missing``.
    """
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "code": code_version(os.path.dirname(_PACKAGE_DIR)),
        "versions": {"python": platform.python_version(), **{p: package_version(p) for p in PACKAGES}},
        "backend": jax.default_backend(),
        "device_kind": kinds[0] if len(kinds) == 1 else kinds,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "cpu": {"model": cpu_model(), "vector_isa": cpu_vector_isa(), "cores": _usable_cores()},
        "matmul_peak": (unknown(peak_missing) if peak is None else
                        {"gflops": round(peak.best_flops / 1e9, 1), "dtype": peak.label, "size": peak.size}),
        "numerics": numerics_settings(),
        "config_sha256": config_hash(config) if config is not None else unknown("no run config"),
    }


def code_version(checkout: str) -> dict[str, Any]:
    """``{"commit", "dirty"}`` when ``checkout`` is the top of a git checkout, else ``{"version"}`` of the
    installed package, with ``commit`` saying why there is none (a package installed into a venv inside some
    other checkout is not that checkout's code). ``dirty``: a tracked file differs from the commit
    (untracked files do not count)."""
    try:
        top = _git(checkout, "rev-parse", "--show-toplevel").strip()
        if os.path.realpath(top) != os.path.realpath(checkout):
            raise subprocess.CalledProcessError(1, "git")
        commit = _git(checkout, "rev-parse", "HEAD").strip()
        changed = _git(checkout, "status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": bool(changed.strip())}
    except (OSError, subprocess.SubprocessError) as e:
        why = (f"{checkout} is not a git checkout" if isinstance(e, subprocess.CalledProcessError)
               else f"git could not run ({e})")
        return {"commit": unknown(why), "version": package_version("transformer_jax")}


def _git(checkout: str, *args: str) -> str:
    return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, check=True,
                          timeout=_GIT_SECONDS).stdout


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return unknown("not installed")


def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The first value of one of ``keys`` in Linux's ``/proc/cpuinfo``; None when there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    return (_cpuinfo(("model name", "Model", "cpu model")) or platform.processor()
            or unknown(f"no model name in /proc/cpuinfo or platform ({sys.platform})"))


def cpu_vector_isa() -> list[str] | str:
    """The vector instruction sets XLA's CPU backend may compile for (``VECTOR_ISA``) that this CPU has:
    two hosts with one model name can differ here, and so can their results."""
    flags = _cpuinfo(("flags", "Features"))
    if flags is None:
        return unknown(f"no CPU flags in /proc/cpuinfo ({sys.platform})")
    return [isa for isa in VECTOR_ISA if isa in flags.split()]


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 0


def numerics_settings() -> dict[str, Any]:
    """``{"environment": {...set variables...}, "jax": {...settings in force...}}``."""
    environment = {k: v for k, v in sorted(os.environ.items())
                   if k in NUMERICS_VARIABLES
                   or (k.startswith("JAX_") and k not in _JAX_VARIABLES_WITHOUT_NUMERICS)}
    return {"environment": environment,
            "jax": {name: _jax_setting(name) for name in JAX_SETTINGS}}


def _jax_setting(name: str) -> Any:
    try:
        value = getattr(jax.config, name)
    except AttributeError:
        return unknown(f"this jax ({jax.__version__}) has no {name}")
    return value if isinstance(value, (bool, int, float, type(None))) else str(value)


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 of the config's JSON form, keys sorted."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def changed_fields(first: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``record`` whose value differs from ``first``'s (the per-start ones aside)."""
    return {k: v for k, v in record.items() if k not in PER_START and first.get(k) != v}


def record_start(workdir: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """Writes ``record`` into ``<workdir>/provenance.json`` and returns the file's whole content.

    The first start's record is kept as written; each later start appends ``{"started", "matmul_peak",
    "changed"}`` to ``resumes``, ``changed`` holding the fields that differ from the first record. A file
    that does not read (a crash mid-write cannot make one: it is replaced whole) is started again, and its
    content is kept beside it as ``provenance.json.unreadable``.
    """
    path = os.path.join(workdir, FILENAME)
    history = read(path)
    if history is None:
        if os.path.exists(path):
            os.replace(path, f"{path}.unreadable")
        history = {"format": FORMAT, "first": dict(record), "resumes": []}
    else:
        history["resumes"].append({**{k: record[k] for k in PER_START},
                                   "changed": changed_fields(history["first"], record)})
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:  # whole or not at all
        json.dump(history, f, indent=1)
    os.replace(tmp, path)
    return history


def read(path: str) -> dict[str, Any] | None:
    """The provenance history at ``path``; None if it is missing or does not read as one."""
    try:
        with open(path, encoding="utf-8") as f:
            history = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(history, dict) and isinstance(history.get("first"), dict)
            and isinstance(history.get("resumes"), list)):
        return None
    return history


def latest(history: Mapping[str, Any]) -> dict[str, Any]:
    """The record in force at the last start: the first record with every resume's changes applied."""
    record = dict(history["first"])
    for resume in history["resumes"]:
        record.update(resume.get("changed", {}))
        record.update({k: resume[k] for k in PER_START if k in resume})
    return record


def _records(provenance: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every start's record of a history (``{"first", "resumes"}``), or ``[provenance]`` for one record."""
    if "first" not in provenance:
        return [dict(provenance)]
    records, current = [], dict(provenance["first"])
    records.append(dict(current))
    for resume in provenance.get("resumes", []):
        current.update(resume.get("changed", {}))
        records.append(dict(current))
    return records


def host_kind(record: Mapping[str, Any]) -> str:
    """``"<device kind> x<count>"`` on an accelerator, ``"<CPU model> (<vector ISA>), <cores> cores"`` on a
    CPU."""
    if record.get("backend") == "cpu":
        cpu = record.get("cpu", {})
        isa = cpu.get("vector_isa")
        isa_text = f" ({', '.join(isa) or 'no vector ISA'})" if isinstance(isa, list) else ""
        return f"{cpu.get('model', UNKNOWN)}{isa_text}, {cpu.get('cores', '?')} cores"
    kind = record.get("device_kind", UNKNOWN)
    kind = "+".join(kind) if isinstance(kind, list) else kind
    return f"{kind} x{record.get('device_count', '?')}"


def code_label(record: Mapping[str, Any]) -> str:
    """``"<commit[:10]>"`` (``+ changes`` when dirty), or ``"version <v>"`` outside a checkout."""
    code = record.get("code", {})
    commit = code.get("commit", UNKNOWN)
    if is_unknown(commit):
        return f"version {code.get('version', UNKNOWN)}"
    return commit[:10] + (" + changes" if code.get("dirty") else "")


def jax_label(record: Mapping[str, Any]) -> str:
    versions = record.get("versions", {})
    return f"jax {versions.get('jax', UNKNOWN)} / jaxlib {versions.get('jaxlib', UNKNOWN)}"


ASPECTS = {"host kind": host_kind, "code version": code_label, "JAX version": jax_label}


def describe(provenance: Mapping[str, Any] | str) -> str:
    """One line: where the last start ran (host kind, backend, code, JAX), for printing under a table; an
    ``"unknown: <why>"`` string is returned as it is."""
    if isinstance(provenance, str):
        return provenance
    record = latest(provenance) if "first" in provenance else dict(provenance)
    peak = record.get("matmul_peak")
    peak_text = (f", matmul peak {peak['gflops']:g} GFLOP/s {peak['dtype']}" if isinstance(peak, dict)
                 else "")
    return (f"{host_kind(record)} ({record.get('backend', UNKNOWN)}{peak_text}); code {code_label(record)}; "
            f"{jax_label(record)}")


def differences(provenances: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """One line when the named results (name -> provenance, None when the result records none) come from
    more than one host kind, code version or JAX version, listing which and the results of each; None
    when they all agree. A run resumed on another host counts under each of its hosts."""
    missing = sorted(name for name, p in provenances.items() if not p)
    parts = []
    for aspect, label in ASPECTS.items():
        names_by_value: dict[str, list[str]] = {}
        for name, provenance in provenances.items():
            for value in dict.fromkeys(label(r) for r in _records(provenance or {}) if provenance):
                names_by_value.setdefault(value, []).append(name)
        if len(names_by_value) > 1:
            parts.append(f"{len(names_by_value)} {aspect}s (" + "; ".join(
                f"{value}: {_names(names)}" for value, names in names_by_value.items()) + ")")
    sentences = ["These results come from " + ", and ".join(parts) + "."] if parts else []
    if missing and len(missing) < len(provenances):
        sentences.append(f"No provenance was recorded for {_names(missing)} (made before it was recorded).")
    if not sentences:
        return None
    return " ".join(sentences) + " Compare them with that in mind."


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
