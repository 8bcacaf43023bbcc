"""Faults a user can fix end in one line (a ``UserError``), not a traceback: WMT through TFDS offline, a train
file that is a folder, a resume whose data changed, a sweep row whose result.json holds no scores."""

import json
import os
import subprocess
import sys

import pytest

from transformer_jax.data import sources
from transformer_jax.data.config import DataConfig
from transformer_jax.runtime import errors
from transformer_jax.runtime.errors import DataError, UserError
from transformer_jax.sweep import grid, launchers, report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(error: UserError, capsys) -> str:
    """What an entry point prints for ``error``: ``error: <one line>`` and the traceback hint."""
    def main(argv):
        raise error

    with pytest.raises(SystemExit):
        errors.short_errors(main)([])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("(set "), lines
    return lines[0]


def test_tfds_offline_is_one_line_with_the_command_that_prepares_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sources, "is_online", lambda: False)
    source = sources.TfdsSource("wmt14_translate/de-en", data_dir=str(tmp_path), src_lang="en", tgt_lang="de",
                                split_names={"train": "train", "dev": "validation", "test": "test"})
    with pytest.raises(UserError) as error:
        source.pairs("dev")
    assert isinstance(error.value, RuntimeError)  # what callers caught before
    line = _one_line(error.value, capsys)
    assert line.startswith("error: TFDS dataset 'wmt14_translate/de-en' is not prepared in ")
    assert "download_and_prepare(file_format='array_record')" in line and "tfds_data_dir" in line


def test_a_train_file_that_is_a_folder_is_one_line(tmp_path, capsys):
    for name in ("train.en", "val.en", "val.de", "test.en", "test.de"):
        (tmp_path / name).write_text("a b c\n")
    (tmp_path / "train.de").mkdir()
    config = DataConfig(source="text", dir=str(tmp_path))
    with pytest.raises(DataError) as error:
        sources.check_input_files(config)
    assert _one_line(error.value, capsys) == (
        f"error: {tmp_path / 'train.de'} is a folder; expected a file of the train split (config.data.dir, "
        ".train_prefix, .tgt_lang), one sentence per line. Fix the data.* fields or put the file there")


def test_train_py_with_a_train_file_that_is_a_folder_is_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.en", "val.en", "val.de", "test.en", "test.de"):
        (data / name).write_text("a b c\nd e f\n")
    (data / "train.de").mkdir()
    done = subprocess.run([sys.executable, "train.py", "--config=configs/default.py",
                           "--config.data.source=text", f"--config.data.dir={data}",
                           f"--workdir={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRANSFORMER_JAX_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"error: {data / 'train.de'} is a folder; expected a file of the train split" in done.stderr


def test_a_resume_whose_data_changed_is_one_line(capsys):
    from transformer_jax.data import batching

    state = {"seed": 0, "epoch": 0, "step": 0, "num_examples": 29000, "batches_per_epoch": 7}

    class Iterator:  # the state check of TrainIterator, on a stand-in with the data now
        seed, num_examples, batches_per_epoch = 0, 29001, 7
        set_state = batching.TrainIterator.set_state

    with pytest.raises(DataError) as error:
        Iterator().set_state(state)
    line = _one_line(error.value, capsys)
    assert line.startswith("error: iterator state has num_examples=29000 but this iterator has "
                           "num_examples=29001: ")
    assert "data.max_len" in line and "--workdir" in line


def test_a_sweep_result_without_scores_is_a_warning_not_a_traceback(tmp_path):
    rows = grid.table3_rows("A-heads1", "cpu", 1)
    launchers.write_manifest(str(tmp_path), grid="table3", scale="cpu", config_arg=None, rows=rows,
                             info=grid.validate_rows(rows))
    for row in rows:
        (tmp_path / row.name).mkdir()
        (tmp_path / row.name / "result.json").write_text(json.dumps(
            {"row": row.name, "step": 300, "dev_ppl": None, "dev_bleu": None, "wall_seconds": 95.0}))
    built = report.build_report(str(tmp_path))
    assert all(r["status"] == "not finished" for r in built["rows"])
    assert any("holds no scores (dev_ppl=None, dev_bleu=None: expected finite numbers" in w
               for w in built["warnings"])


# A checkpoint read that fails while other reads of the step are in flight (a damaged step): orbax closes the
# event loop that awaited them, and each ends later by scheduling its callback on that closed loop, which
# Python reports as an unraisable "Event loop is closed" traceback after the one-line error. Here the late
# callback is an object that raises so when collected, at exit.
_FAILED_READ = """
import atexit, gc, os, sys
import orbax.checkpoint as ocp
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.runtime import errors

in_flight = []

class Read:
    def __del__(self):
        raise RuntimeError("Event loop is closed")

def damaged(self, path, *args, **kwargs):
    in_flight.append(Read())
    raise ValueError("Encountered error while reading array index")

atexit.register(lambda: (in_flight.clear(), gc.collect()))
ocp.Checkpointer.restore = damaged
os.makedirs(os.path.join(sys.argv[1], "4"))
reader = CheckpointReader(sys.argv[1])

def main(argv):
    reader.read_good_step(lambda step: reader._read_items(step, state=ocp.args.JsonRestore()), 4, "state")

errors.short_errors(main)([])
"""


def test_a_damaged_step_is_one_line_without_closed_event_loop_tracebacks(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FAILED_READ, str(tmp_path / "checkpoints")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: checkpoint step 4 in {tmp_path / 'checkpoints'} could not be "
                                  "restored (ValueError: Encountered error while reading array index)")
    assert "Event loop is closed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 2, done.stderr
