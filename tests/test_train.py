"""End-to-end tests of the training loop: outputs, resume, profiling, NaN and config typos (kill -9,
SIGTERM and the workdir lock: test_faults.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny import TRAIN, TRAINED, config_with, saved_state

from transformer_jax import run_config
from transformer_jax.checkpoints import restore
from transformer_jax.runtime import provenance, timing
from transformer_jax.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# No evaluation during or after training, for the tests that check only the training itself.
QUICK = {"eval_every_steps": 0, "eval_bleu_examples": 0, "final_eval_split": ""}


def tiny_config(**overrides):
    return config_with({**TRAIN, **overrides})


def _params(workdir, step):
    """(params, data state) saved at ``step`` in ``workdir`` by a run of the tiny config."""
    return saved_state(tiny_config(), workdir, step)


def _run_train(workdir, *flags, timeout=300):
    cmd = [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={workdir}", *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(trained_run):
    """The uninterrupted 6-step run of ``tiny.TRAINED`` (TRAIN, averaging its last 3 checkpoints) that the
    other tests compare against; read only."""
    workdir, final = trained_run
    return Path(workdir), final


def test_run_writes_metrics_tensorboard_checkpoints_and_final_report(uninterrupted):
    workdir, final = uninterrupted
    assert final["step"] == 6
    for key in ("dev_nll", "dev_ppl", "dev_bleu", "test_sacrebleu", "test_tokenized_bleu",
                "test_multi30k_bleu", "test_sacrebleu_copy_baseline", "test_sacrebleu_lexicon_baseline"):
        assert np.isfinite(final[key]), key
    assert final["averaged_steps"] == [2, 4, 6]  # final_average_last=3: the final model is their mean
    written = json.loads((workdir / "final.json").read_text())
    assert written["test_sacrebleu"] == final["test_sacrebleu"]
    # Where it ran: provenance.json's history (one start), every field read (test_provenance.py checks them).
    assert written["provenance"] == json.loads((workdir / "provenance.json").read_text())
    record = written["provenance"]["first"]
    assert written["provenance"]["resumes"] == [] and set(record) == set(provenance.collect())
    assert record["config_sha256"] == provenance.config_hash(run_config.build_run_config(
        config_with(TRAINED)).saved)
    assert record["matmul_peak"] == "unknown: config.peak_tflops_per_device set the MFU denominator"
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    for r in train_records:
        assert r["train_tokens_per_sec"] > 0 and 0 < r["train_mfu"] < 1 and r["train_ppl"] > 1
        assert r["train_peak_tflops"] == 1.0  # the config's (measuring it: test_mfu_peak_is_...)
    assert any("dev_nll" in r for r in records)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tensorboard"))
    assert sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit()) == [2, 4, 6]
    assert (workdir / "tokenizer").is_dir()


def test_mfu_peak_is_the_configs_or_else_measured():
    assert loop._peak_flops(2.5) == (2.5e12, None)
    measured, peak = loop._peak_flops(0.0)
    assert 1e9 < measured < 1e16  # a real FLOP/s figure for this device, whatever it is
    assert measured == peak.best_flops


def test_an_mfu_above_one_says_once_that_the_measured_peak_was_low(tmp_path, monkeypatch, capsys):
    """A peak measured on a busy machine (here: a matmul peak of 1 kFLOP/s) makes the MFU read above 1 at
    every log: one line says why, with the config field that sets the peak."""
    low = timing.Peak(best_flops=1e3, median_flops=1e3, dtype="float32", size=2048, repeats=10)
    monkeypatch.setattr(timing, "matmul_peak", lambda **kwargs: low)
    config = tiny_config(**{**QUICK, "train.num_steps": 4, "peak_tflops_per_device": 0.0,
                            "checkpoint_every_steps": 0})
    loop.train_and_evaluate(run_config.build_run_config(config), str(tmp_path / "busy"))
    records = [json.loads(line) for line in (tmp_path / "busy" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("train_mfu", 0) > 1] == [2, 4]
    said = [line for line in capsys.readouterr().out.splitlines() if "is above 1" in line]
    assert len(said) == 1 and said[0].startswith("MFU ")
    assert ("the matmul peak measured at start-up (1e-09 TFLOP/s) is below what the train step did" in said[0]
            and "Set config.peak_tflops_per_device" in said[0])


def test_resume_continues_bitwise_and_profiling_changes_nothing(tmp_path, uninterrupted, capsys,
                                                                 monkeypatch):
    workdir_full, _ = uninterrupted
    workdir = tmp_path / "resumed"
    # Profiling steps 2-3 must not change the numbers compared with the uninterrupted run below.
    first = tiny_config(**{"train.num_steps": 4, **QUICK, "profile_start_step": 2, "profile_num_steps": 2})
    loop.train_and_evaluate(run_config.build_run_config(first), str(workdir))
    traces = [f for _, _, files in os.walk(workdir / "profile") for f in files]
    assert any(f.endswith(".xplane.pb") for f in traces), traces
    capsys.readouterr()
    first_record = json.loads((workdir / "provenance.json").read_text())["first"]
    # The resume runs on a "new host": its record is appended, the first start's is kept as it was.
    monkeypatch.setattr(provenance, "cpu_model", lambda: "Another CPU")
    loop.train_and_evaluate(run_config.build_run_config(tiny_config(**QUICK)), str(workdir))
    assert "Resuming from step 4" in capsys.readouterr().out  # not a fresh run with the same seed
    history = json.loads((workdir / "provenance.json").read_text())
    assert history["first"] == first_record
    (resume,) = history["resumes"]
    assert resume["changed"] == {"cpu": {**first_record["cpu"], "model": "Another CPU"},  # and the config:
                                 "config_sha256": provenance.config_hash(run_config.build_run_config(
                                     tiny_config(**QUICK)).saved)}  # no profiling, 6 steps
    # Only the remaining steps were computed (and logged): each log step appears once.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [2, 4, 6]
    resumed, data_resumed = _params(workdir, 6)
    full, data_full = _params(workdir_full, 6)
    assert data_resumed == data_full
    for a, b in zip(resumed, full, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_preempted_run_averages_the_checkpoints_of_an_uninterrupted_one(tmp_path, uninterrupted,
                                                                          monkeypatch, capsys):
    """SIGTERM at step 3 (off the every-2-steps schedule) forces a save there; the resumed run's final model
    is still the mean of steps 2, 4 and 6, and its final report is the uninterrupted run's, number for
    number. evaluate.py averages the same steps."""
    _, reference = uninterrupted
    workdir = tmp_path / "preempted"

    class StopAtStep3(loop.PreemptionGuard):
        def should_stop(self, step: int) -> bool:
            return step == 3 or super().should_stop(step)

    monkeypatch.setattr(loop, "PreemptionGuard", StopAtStep3)
    run = run_config.build_run_config(config_with(TRAINED))
    assert loop.train_and_evaluate(run, str(workdir)) == {"preempted": True, "step": 3}
    monkeypatch.undo()
    assert sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit()) == [2, 3]
    final = loop.train_and_evaluate(run, str(workdir))
    assert "Resuming from step 3" in capsys.readouterr().out
    assert final["averaged_steps"] == [2, 4, 6]
    per_run = ("train_seconds", "provenance")  # when and where it ran
    assert {k: v for k, v in final.items() if k not in per_run} == {
        k: v for k, v in reference.items() if k not in per_run}
    assert sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit()) == [2, 4, 6]
    assert restore.steps_to_average(restore.restore_workdir(str(workdir)), 3) == [2, 4, 6]


def test_non_finite_values_stop_with_the_step_and_keep_the_last_good_checkpoint(tmp_path):
    workdir = tmp_path / "nan"
    first = tiny_config(**{"train.num_steps": 4, **QUICK})
    loop.train_and_evaluate(run_config.build_run_config(first), str(workdir))
    config = tiny_config(**{"train.learning_rate_scale": 1e30, "train.num_steps": 8, **QUICK})
    with pytest.raises(FloatingPointError, match=r"step [5-8]\b.*The last good checkpoint is step 4 in"):
        loop.train_and_evaluate(run_config.build_run_config(config), str(workdir))
    saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
    assert saved == [2, 4]  # real files, nothing non-finite written after them
    for step in saved:
        params, _ = _params(workdir, step)
        assert all(np.all(np.isfinite(p)) for p in params)


def test_typo_in_a_config_override_fails(tmp_path):
    result = _run_train(tmp_path / "typo", "--config.train.num_stpes=3")
    assert result.returncode != 0
    assert "num_stpes" in result.stderr
