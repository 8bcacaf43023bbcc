"""Tests for transformer_jax.runtime.provenance: what a run records of where it ran, the history a resume
appends to, and the line a report prints when its results come from more than one host, code or JAX.

The training loop's record (a fresh run's ``final.json``, a resume on a "new host") is tested in
test_train.py; the sweep report's line here, on a faked sweep.
"""

import importlib.metadata
import json
import os
import subprocess

import jax
import pytest
from test_sweep import run
from test_sweep_report import _fake_sweep

from transformer_jax.runtime import provenance, timing

FIELDS = {"started", "code", "versions", "backend", "device_kind", "device_count", "process_count", "cpu",
          "matmul_peak", "numerics", "config_sha256"}


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}.{key}")
    else:
        yield path, tree


def test_a_record_holds_every_field_and_no_empty_value(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")  # where programs are cached: no numerics
    peak = timing.Peak(best_flops=123.4e9, median_flops=100e9, dtype="float32", size=64, repeats=2)
    record = provenance.collect(config={"seed": 3}, peak=peak)
    assert set(record) == FIELDS
    for path, value in _leaves(record):
        assert value is not None and value != "", path
    assert set(record["versions"]) == {"python", *provenance.PACKAGES}
    assert record["versions"]["jax"] == jax.__version__
    assert record["versions"]["flax"] == importlib.metadata.version("flax")
    assert record["backend"] == jax.default_backend() and record["device_count"] == jax.device_count()
    assert record["matmul_peak"] == {"gflops": 123.4, "dtype": "float32", "size": 64}
    isa = record["cpu"]["vector_isa"]
    assert set(isa) <= set(provenance.VECTOR_ISA) if isinstance(isa, list) else isa.startswith("unknown: ")
    assert record["numerics"]["environment"]["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    assert "JAX_COMPILATION_CACHE_DIR" not in record["numerics"]["environment"]
    assert record["numerics"]["jax"]["jax_default_matmul_precision"] == "highest"  # conftest's setting
    assert record["config_sha256"] == provenance.config_hash({"seed": 3})
    assert provenance.config_hash({"seed": 3}) != provenance.config_hash({"seed": 4})
    json.dumps(record)  # it is written as JSON


def test_what_cannot_be_read_says_unknown_and_why(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "_PACKAGE_DIR", str(tmp_path / "no_checkout" / "transformer_jax"))
    record = provenance.collect(peak_missing="config.peak_tflops_per_device set the MFU denominator")
    assert record["matmul_peak"] == "unknown: config.peak_tflops_per_device set the MFU denominator"
    assert record["config_sha256"] == "unknown: no run config"
    commit = record["code"]["commit"]
    assert commit.startswith("unknown: ") and "not a git checkout" in commit
    assert record["code"]["version"] == importlib.metadata.version("transformer_jax")


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_the_code_is_the_commit_and_a_changed_tracked_file_makes_it_dirty(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "model.py").write_text("x = 1\n")
    _git(tmp_path, "add", "model.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert provenance.code_version(str(tmp_path)) == {"commit": head, "dirty": False}
    (tmp_path / "model.py").write_text("x = 2\n")
    assert provenance.code_version(str(tmp_path)) == {"commit": head, "dirty": True}
    # A package installed below a checkout's top (a venv inside it) is not that checkout's code.
    (tmp_path / "venv").mkdir()
    assert provenance.code_version(str(tmp_path / "venv"))["commit"].startswith("unknown: ")


def _record(**changes):
    record = {"started": "2026-12-07T10:00:00+00:00", "code": {"commit": "a" * 40, "dirty": False},
              "versions": {"python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2"}, "backend": "cpu",
              "device_kind": "cpu", "device_count": 1, "process_count": 1,
              "cpu": {"model": "AMD EPYC", "cores": 2},
              "matmul_peak": {"gflops": 170.0, "dtype": "float32", "size": 2048},
              "numerics": {}, "config_sha256": "c" * 64}
    return {**record, **changes}


def test_a_resume_appends_what_changed_and_keeps_the_first_record(tmp_path):
    first = provenance.record_start(str(tmp_path), _record())
    assert first == {"format": 1, "first": _record(), "resumes": []}
    moved = _record(started="2026-12-07T11:00:00+00:00", cpu={"model": "Intel Xeon", "cores": 2},
                    matmul_peak={"gflops": 90.0, "dtype": "float32", "size": 2048})
    history = provenance.record_start(str(tmp_path), moved)
    assert history["first"] == _record()
    assert history["resumes"] == [{"started": moved["started"], "matmul_peak": moved["matmul_peak"],
                                   "changed": {"cpu": {"model": "Intel Xeon", "cores": 2}}}]
    assert provenance.read(str(tmp_path / provenance.FILENAME)) == history
    assert provenance.latest(history) == moved
    assert not [name for name in os.listdir(tmp_path) if name != provenance.FILENAME]  # no temporary left


def test_an_unreadable_history_is_kept_aside_and_started_again(tmp_path):
    (tmp_path / provenance.FILENAME).write_text('{"first": {"cpu"')
    history = provenance.record_start(str(tmp_path), _record())
    assert history["first"] == _record() and history["resumes"] == []
    assert (tmp_path / f"{provenance.FILENAME}.unreadable").read_text() == '{"first": {"cpu"'


def test_differences_name_each_aspect_and_its_results():
    same = {"a": _record(), "b": _record(started="later", matmul_peak=provenance.unknown("not measured"))}
    assert provenance.differences(same) is None  # a start time and a peak are not a host
    line = provenance.differences({"a": _record(), "b": _record(code={"commit": "a" * 40, "dirty": True}),
                                   "c": _record(device_kind="NVIDIA H100", backend="gpu", device_count=8)})
    assert "\n" not in line
    assert "2 host kinds (AMD EPYC, 2 cores: a, b; NVIDIA H100 x8: c)" in line
    assert "2 code versions (aaaaaaaaaa: a, c; aaaaaaaaaa + changes: b)" in line
    assert "JAX" not in line
    newer = _record(versions={"jax": "0.11.0", "jaxlib": "0.11.0"})
    line = provenance.differences({"a": _record(), "b": newer, "old": None})
    assert "2 JAX versions (jax 0.10.2 / jaxlib 0.10.2: a; jax 0.11.0 / jaxlib 0.11.0: b)" in line
    assert line.endswith("jaxlib 0.11.0: b). No provenance was recorded for old (made before it was "
                         "recorded). Compare them with that in mind.")
    assert provenance.differences({"a": _record(), "old": None}) == (
        "No provenance was recorded for old (made before it was recorded). Compare them with that in mind.")
    # One model name, two instruction sets: XLA compiles other kernels, so they are two host kinds.
    line = provenance.differences({
        "avx2": _record(cpu={"model": "AMD EPYC", "vector_isa": ["avx2", "fma"], "cores": 2}),
        "avx512": _record(cpu={"model": "AMD EPYC", "vector_isa": ["avx2", "fma", "avx512f"], "cores": 2})})
    assert ("2 host kinds (AMD EPYC (avx2, fma), 2 cores: avx2; AMD EPYC (avx2, fma, avx512f), 2 cores: "
            "avx512)") in line


def test_a_run_resumed_on_another_host_counts_under_both(tmp_path):
    provenance.record_start(str(tmp_path), _record())
    history = provenance.record_start(str(tmp_path), _record(cpu={"model": "Intel Xeon", "cores": 2}))
    line = provenance.differences({"resumed": history, "other": _record()})
    assert "2 host kinds (AMD EPYC, 2 cores: resumed, other; Intel Xeon, 2 cores: resumed)" in line
    assert provenance.describe(history) == ("Intel Xeon, 2 cores (cpu, matmul peak 170 GFLOP/s float32); "
                                            "code aaaaaaaaaa; jax 0.10.2 / jaxlib 0.10.2")
    assert provenance.describe("unknown: trained before provenance was recorded") == (
        "unknown: trained before provenance was recorded")


@pytest.mark.parametrize("changed", [{"device_kind": "TPU v5 lite", "backend": "tpu"},
                                     {"code": {"commit": "a" * 40, "dirty": True}}])
def test_the_sweep_report_names_rows_from_another_host_or_a_dirty_tree(tmp_path, capsys, changed):
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "A-heads1": (11.0, 18.0), "D-ls0.0": (10.5, 20.1)})
    for name in ("base", "A-heads1", "D-ls0.0"):
        record = _record(**changed) if name == "D-ls0.0" else _record()
        result = json.loads((tmp_path / name / "result.json").read_text())
        (tmp_path / name / "result.json").write_text(json.dumps({**result, "provenance": record}))
    assert run("report", "--workdir", str(tmp_path)) == 0
    lines = [line for line in (tmp_path / "report.md").read_text().splitlines() if "Provenance" in line]
    assert len(lines) == 1
    assert lines[0].endswith("). Compare them with that in mind.")
    assert ": base, A-heads1;" in lines[0] and lines[0].count("D-ls0.0") == 1


def test_the_sweep_report_is_silent_when_every_row_agrees_and_reads_a_rows_own_record(tmp_path):
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "A-heads1": (11.0, 18.0)})
    for name in ("base", "A-heads1"):  # rows whose launcher wrote no provenance into result.json
        provenance.record_start(str(tmp_path / name), _record())
    assert run("report", "--workdir", str(tmp_path)) == 0
    assert "Provenance" not in (tmp_path / "report.md").read_text()
    provenance.record_start(str(tmp_path / "A-heads1"), _record(versions={"jax": "0.11.0"}))
    assert run("report", "--workdir", str(tmp_path)) == 0
    assert "2 JAX versions" in (tmp_path / "report.md").read_text()
