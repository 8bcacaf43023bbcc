"""The fault matrix of issue 12: each fault, then a check that nothing was lost and the message is right.

The shared tiny model (``tiny.TRAIN``), 6 steps, a checkpoint every step. The shared uninterrupted run
(``trained_run``) is the reference; faults that need a real process (kill -9, SIGTERM, exit codes) run
train.py / evaluate.py as subprocesses, the others run in-process; all share the compiled programs of the
reference. Assertions are on facts (steps, fields, files), not prose.
"""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny import TEST_PEAK, TRAIN, config_with, saved_state

from transformer_jax import run_config
from transformer_jax.checkpoints import integrity, restore
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.data import load_or_train_tokenizer
from transformer_jax.runtime.errors import MissingFileError
from transformer_jax.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = TRAIN["train.num_steps"]
# TRAIN's data, model and optimizer (the reference's compiled programs), every step logged and saved.
FAULT = {
    **TEST_PEAK, **TRAIN, "log_every_steps": 1, "eval_every_steps": 0, "eval_bleu_examples": 0,
    "checkpoint_every_steps": 1, "checkpoint_keep": 20, "final_eval_split": "",
}


def train(workdir, **overrides):
    run = run_config.build_run_config(config_with({**FAULT, **overrides}))
    return loop.train_and_evaluate(run, str(workdir))


def start(script, workdir, *, cold=False, **overrides) -> subprocess.Popen:
    """Starts ``script`` on ``workdir`` with the run's compilation cache. ``cold``: without it, so its
    programs compile as on a first run; for a phase that must still be running when its signal is sent
    after a sign it began (a cached final evaluation can end before then)."""
    flags = [f"--config.{k}={v}" for k, v in {**FAULT, **overrides}.items()] if script == "train.py" else []
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR="") if cold else None
    return subprocess.Popen([sys.executable, os.path.join(REPO, script), f"--workdir={workdir}", *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")  # a progress bar's character can be split by a line of stdout


def finish(proc, timeout=300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def wait_for(condition, proc, what, timeout=240, poll=0.02) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.py ended before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(poll)
    raise AssertionError(f"no {what} after {timeout}s")


def kill(proc, signum) -> None:
    proc.send_signal(signum)
    proc.wait(timeout=300)


def saved_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def state_at(workdir, step):
    """(params as NumPy arrays, data-iterator state) saved at ``step``."""
    return saved_state(config_with(FAULT), workdir, step)


def assert_same_as_reference(workdir, reference, step=STEPS):
    params, data_state = state_at(workdir, step)
    ref_params, ref_data_state = state_at(reference, step)
    assert data_state == ref_data_state
    for a, b in zip(params, ref_params, strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise


def train_rows(workdir) -> list[int]:
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r["step"] for r in rows if "train_loss" in r]


def resumed_from(output: str) -> int | None:
    marker = "Resuming from step "
    return int(output.split(marker)[1].split()[0]) if marker in output else None


@pytest.fixture(scope="module")
def reference(trained_run):
    """The uninterrupted 6-step run of TRAIN (``tiny.TRAINED``: checkpoints 2, 4 and 6); read only."""
    workdir = Path(trained_run[0])
    assert saved_steps(workdir) == [2, 4, STEPS]
    return workdir


def copy_of(reference, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(reference, workdir)
    return workdir


# ------------------------------------------------------------------------------------------------ kill -9
@pytest.mark.slow
def test_kill_9_at_startup_mid_training_and_mid_save_then_resume_bitwise(tmp_path, reference):
    workdir = tmp_path / "killed"
    long_run = {"train.num_steps": 100000}
    proc = start("train.py", workdir, **long_run)  # 1. startup: holding the lock, nothing saved yet
    wait_for(lambda: (workdir / ".lock").exists(), proc, "the workdir lock")
    kill(proc, signal.SIGKILL)
    proc = start("train.py", workdir, **long_run)  # 2. mid-training, after checkpoint 2
    wait_for(lambda: 2 in saved_steps(workdir), proc, "checkpoint 2")
    kill(proc, signal.SIGKILL)
    proc = start("train.py", workdir, **long_run)  # 3. mid-save: an unfinished orbax directory exists
    wait_for(lambda: glob.glob(f"{workdir}/checkpoints/*.orbax-checkpoint-tmp*"), proc, "a save in progress")
    kill(proc, signal.SIGKILL)
    before = max(saved_steps(workdir))
    assert 2 <= before < STEPS, saved_steps(workdir)

    out = finish(start("train.py", workdir))
    assert resumed_from(out) == before, out[-2000:]  # a real resume, from the newest finished save
    assert saved_steps(workdir)[-1] == STEPS and not glob.glob(f"{workdir}/checkpoints/*tmp*")
    assert train_rows(workdir) == list(range(1, STEPS + 1))  # each step logged once: redone rows purged
    assert_same_as_reference(workdir, reference)


# ------------------------------------------------------------------------------------------------ SIGTERM
@pytest.mark.slow
def test_sigterm_in_each_phase_exits_zero_and_loses_nothing_and_a_live_run_holds_the_workdir(tmp_path):
    workdir = tmp_path / "sigterm"
    proc = start("train.py", workdir, **{"train.num_steps": 100000})  # setup: tokenizer, init, compile
    wait_for(lambda: (workdir / ".lock").exists(), proc, "the workdir lock", poll=0.005)
    kill(proc, signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM during setup" in out and "no checkpoint" in out, out[-2000:]
    assert saved_steps(workdir) == []

    proc = start("train.py", workdir, **{"train.num_steps": 100000})  # the training loop
    wait_for(lambda: 2 in saved_steps(workdir), proc, "checkpoint 2")
    second = start("train.py", workdir)  # refused while the first one lives
    out = finish(second)
    assert second.returncode != 0 and f"pid {proc.pid}" in out, out[-3000:]
    kill(proc, signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    step = int(out.split("Preempted: saved a checkpoint at step ")[1].split()[0])
    assert step >= 2 and saved_steps(workdir)[-1] == step

    final = {"train.num_steps": step + 1, "final_eval_split": "test"}  # the final evaluation
    proc = start("train.py", workdir, cold=True, **final)
    wait_for(lambda: step + 1 in saved_steps(workdir), proc, f"checkpoint {step + 1}")
    kill(proc, signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    assert resumed_from(out) == step
    assert "SIGTERM during the final evaluation" in out and f"checkpoint step {step + 1} is saved" in out
    assert saved_steps(workdir)[-1] == step + 1
    assert train_rows(workdir) == list(range(1, step + 2))


# ---------------------------------------------------------------------------------------- poisoned update
@pytest.mark.slow
def test_overflow_in_the_update_saves_nothing_and_a_sane_rerun_continues(tmp_path, reference, capsys):
    workdir = tmp_path / "poisoned"
    train(workdir, **{"train.num_steps": 5})
    # The loss and gradients of step 6 are finite; the update itself overflows (Adam's step ~1e45).
    proc = start("train.py", workdir, **{"train.num_steps": 8, "train.learning_rate_scale": 1e45})
    out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "step 6" in out and "The last good checkpoint is step 5" in out, out[-2000:]
    assert "Traceback" not in out and "cannot schedule new futures" not in out
    assert saved_steps(workdir) == [1, 2, 3, 4, 5]  # real files, each finite
    for step in saved_steps(workdir):
        assert all(np.isfinite(p).all() for p in state_at(workdir, step)[0]), step

    capsys.readouterr()
    train(workdir)
    assert resumed_from(capsys.readouterr().out) == 5
    assert train_rows(workdir) == list(range(1, STEPS + 1))
    assert_same_as_reference(workdir, reference)


# ------------------------------------------------------------------------------------------------ bit flip
def test_a_bit_flip_is_detected_by_evaluation_and_training(tmp_path, reference, caplog, capsys):
    workdir = copy_of(reference, tmp_path)
    # 64 bytes at each of 31 places in the first half of every data file of the step (each keeps its size).
    # The arrays fill about the first half of an OCDBT data file here, in an order that varies between
    # runs; bytes past them are never read at restore. Every file is hit because evaluation reads only
    # the parameters, which may sit in a file of their own. Depending on what a flip hits, it is caught by
    # the saved checksums or already by tensorstore's read (a broken chunk); either way the step must be
    # reported damaged and skipped. The checksum path alone is pinned in test_checkpoint.py.
    for path in glob.glob(f"{workdir}/checkpoints/{STEPS}/state/**/d/*", recursive=True):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            for offset in range(size // 64, size // 2, max(size // 64, 1)):
                f.seek(offset)
                chunk = f.read(64)
                f.seek(offset)
                f.write(bytes(b ^ 0x5A for b in chunk))

    previous = saved_steps(reference)[-2]
    with caplog.at_level(logging.WARNING):
        assert restore.restore_workdir(str(workdir)).step == previous  # evaluate.py's path
    assert any(f"step {STEPS}" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    train(workdir)  # resumes from the previous step and recomputes the damaged one
    assert resumed_from(capsys.readouterr().out) == previous
    assert glob.glob(f"{workdir}/checkpoints/{STEPS}.damaged-*")
    assert_same_as_reference(workdir, reference)


# ----------------------------------------------------------------------------------------------- tokenizer
def test_a_missing_or_different_tokenizer_is_an_error_and_never_retrained(tmp_path, reference):
    workdir = copy_of(reference, tmp_path)
    model = workdir / "tokenizer" / "spm.model"
    original = model.read_bytes()
    model.unlink()
    proc = start("evaluate.py", workdir)
    out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert str(model) in out and "Traceback" not in out
    with pytest.raises(MissingFileError, match="spm.model"):
        train(workdir, **{"train.num_steps": STEPS + 1})
    assert not model.exists() and saved_steps(workdir)[-1] == STEPS  # nothing trained, nothing written

    other = load_or_train_tokenizer(config_with({**FAULT, "data.synthetic_train_size": 300}).data,
                                    str(tmp_path / "other"))
    assert other.sha256 != restore.Tokenizer(original).sha256
    shutil.copy(other.model_path, model)
    for attempt in (lambda: restore.restore_workdir(str(workdir)), lambda: train(workdir)):
        with pytest.raises(integrity.TokenizerMismatchError, match=r"spm\.model.*sha256"):
            attempt()
    model.write_bytes(original)
    assert restore.restore_workdir(str(workdir)).step == STEPS


# ------------------------------------------------------------------------------------------ model config
def test_a_changed_model_config_names_the_fields_and_damages_nothing(tmp_path, reference, caplog):
    workdir = copy_of(reference, tmp_path)
    with caplog.at_level(logging.WARNING), pytest.raises(integrity.CheckpointMismatchError) as e:
        train(workdir, **{"model.d_model": 24, "model.num_heads": 4})
    message = str(e.value)
    assert "model.d_model: saved 18, new 24" in message and "model.num_heads: saved 3, new 4" in message
    assert "d_ff" not in message
    assert saved_steps(workdir) == saved_steps(reference)
    assert not glob.glob(f"{workdir}/checkpoints/*damaged*")
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]


def test_a_resume_may_change_how_steps_compute_but_not_what_the_parameters_are(tmp_path, reference,
                                                                                capsys):
    """dtype, the attention kernel and dropout keep every parameter's shape and meaning: allowed, named."""
    workdir = copy_of(reference, tmp_path)
    changes = {"model.dtype": "bfloat16", "model.attention_impl": "blockwise", "model.dropout_rate": 0.3}
    saved = {"model": {"d_model": 16, "dtype": "float32", "attention_impl": "dense", "dropout_rate": 0.1},
             "data": {"vocab_size": 64}}
    new = {"model": {"d_model": 16, **{k.split(".")[1]: v for k, v in changes.items()}},
           "data": {"vocab_size": 64}}
    assert integrity.model_differences(saved, new) == []
    assert integrity.run_time_differences(saved, new) == [
        "model.attention_impl: saved 'dense', new 'blockwise'", "model.dropout_rate: saved 0.1, new 0.3",
        "model.dtype: saved 'float32', new 'bfloat16'"]
    run = run_config.build_run_config(config_with({**FAULT, **changes}))
    restore.check_workdir(CheckpointReader(restore.checkpoint_dir(str(workdir))), run, str(workdir))
    out = capsys.readouterr().out
    assert f"Resuming step {STEPS} with changed settings that keep the parameters: " in out
    assert "model.dtype: saved 'float32', new 'bfloat16'" in out


def test_the_init_alone_may_differ_on_resume_even_when_the_saved_config_predates_it():
    new = {"model": {"d_model": 16, "attention_init": "matrix"}, "data": {"vocab_size": 64}}
    for saved_model in ({"d_model": 16}, {"d_model": 16, "attention_init": "narrow"}):
        assert integrity.model_differences({"model": saved_model, "data": {"vocab_size": 64}}, new) == []
    assert integrity.model_differences({"model": {"d_model": 32}, "data": {"vocab_size": 64}}, new) == [
        "model.d_model: saved 32, new 16"]
