"""Tests for transformer_jax.evaluation.curves: reading metrics.jsonl and drawing the PNG."""

import json
import os
import subprocess
import sys

import pytest

from transformer_jax.evaluation import curves
from transformer_jax.runtime.errors import MissingFileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_metrics(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_read_curves_keeps_only_dev_rows_in_minutes_since_the_first_row(tmp_path):
    _write_metrics(tmp_path, [
        {"step": 50, "time": 1000.0, "train_loss": 5.0},
        {"step": 100, "time": 1090.0, "dev_loss": 4.0, "dev_bleu": 3.5},
        {"step": 150, "time": 1180.0, "train_loss": 3.0},
        {"step": 200, "time": 1300.0, "dev_loss": 3.0, "dev_bleu": 9.25},
    ])
    got = curves.read_curves(str(tmp_path))
    assert got["dev_bleu"] == [(1.5, 3.5), (5.0, 9.25)]
    assert got["dev_loss"] == [(1.5, 4.0), (5.0, 3.0)]


def test_missing_metrics_is_a_user_error(tmp_path):
    with pytest.raises(MissingFileError, match="metrics.jsonl"):
        curves.read_curves(str(tmp_path))


def test_cli_writes_a_png(tmp_path):
    _write_metrics(tmp_path / "run", [{"step": 1, "time": 0.0, "dev_loss": 2.0, "dev_bleu": 1.0},
                                      {"step": 2, "time": 60.0, "dev_loss": 1.0, "dev_bleu": 2.0}])
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, "-m", "transformer_jax.evaluation.curves",
                           f"--workdirs={tmp_path / 'run'}",
                           f"--out={out}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_other_metrics_such_as_dev_f1(tmp_path):
    _write_metrics(tmp_path / "run", [{"step": 50, "time": 30.0, "train_loss": 5.0},
                                      {"step": 750, "time": 150.0, "dev_loss": 2.0, "dev_f1": 41.5}])
    got = curves.read_curves(str(tmp_path / "run"), ["dev_f1"])
    assert got == {"dev_f1": [(2.0, 41.5)]}
    out = tmp_path / "f1.png"
    assert curves.plot_curves([str(tmp_path / "run")], ["run"], str(out), ["dev_f1"]) == str(out)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
