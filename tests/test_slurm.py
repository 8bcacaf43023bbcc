"""Training and sweeps under a real Slurm (a one-node cluster on this machine, ``tests/local_slurm.py``).

- a 2-process ``srun`` training job equals a 1-process, 2-device run bit for bit, and evaluate.py scores it;
- a Table 3 sweep submitted as an array gives the same report as the local launcher; a task cancelled
  mid-row resumes from its checkpoint when the array is submitted again, and finished rows are skipped;
- a train.py job and a sweep task with a 1-minute time limit are warned, save, requeue themselves and
  finish, bit for bit equal to the uninterrupted run, each step logged once.

Where Slurm is missing they skip with one line saying how to enable them; under CI they must run.
Slurm checks time limits every 30 s from the controller's start, so each test starts its own cluster
(under a second): the first warning then comes at most 30 s into a job.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest
from conftest import with_test_xla_flags
from local_slurm import LocalSlurm, unavailable_reason

from transformer_jax.checkpoints import restore
from transformer_jax.data.synthetic import SyntheticSource
from transformer_jax.sweep import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

# A tiny model, ~5 ms a step on one CPU device.
TINY_FLAGS = {
    "data.synthetic_train_size": 400, "data.synthetic_dev_size": 16, "data.synthetic_test_size": 16,
    "data.vocab_size": 120, "data.tokens_per_batch": 512, "data.length_buckets": "(64,)",
    "model.d_model": 16, "model.d_ff": 24, "model.num_heads": 2,
    "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
    "train.warmup_steps": 2, "train.num_steps": 40, "peak_tflops_per_device": 1.0,
    "log_every_steps": 10, "checkpoint_every_steps": 10, "checkpoint_every_minutes": 0.0,
    "eval_every_steps": 0, "eval_bleu_examples": 0, "final_eval_split": "",
}
# Table 3's cpu scale shrunk to the same size (one layer a side), for the sweeps (and a train.py job of the
# same row).
SWEEP_OVERRIDES = ["model.d_model=16", "model.d_ff=32", "model.d_k=4", "model.d_v=4", "model.num_heads=2",
                   "model.num_encoder_layers=1", "model.num_decoder_layers=1",
                   "data.synthetic_train_size=300", "data.synthetic_dev_size=12", "data.vocab_size=120",
                   "data.tokens_per_batch=512", "data.length_buckets=(64,)", "train.warmup_steps=5",
                   "peak_tflops_per_device=1.0"]


@pytest.fixture
def slurm(tmp_path):
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must run the Slurm tests: .ci/run installs slurm-wlm)")
        pytest.skip(reason)
    cluster = LocalSlurm(str(tmp_path / "slurm")).start(cpus=4)  # a 2-task job beside a 1-task one
    yield cluster
    cluster.stop()


def _run(command, env, background: bool = False):
    """Runs ``command`` from the repository root (or starts it, with ``background``)."""
    if background:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")  # see _log_text
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _job_fields(cluster, job: str) -> list[dict]:
    """``scontrol show job`` of ``job`` (of every task of an array) as dicts of its fields."""
    out = _run(["scontrol", "show", "job", job, "--oneliner"], cluster.env).stdout
    return [dict(field.split("=", 1) for field in line.split() if "=" in field)
            for line in out.splitlines() if line.strip()]


# Slurm's final job states; any other (PENDING, RUNNING, SIGNALING, REQUEUED, ...) is still on its way.
ENDED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE")


def _wait_for(cluster, job: str, timeout: float = 900) -> list[dict]:
    """Waits until every task of ``job`` has ended; returns their fields.

    A loaded 2-core machine can need a dozen requeues of 25-55 s each for a time-limit test.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        tasks = _job_fields(cluster, job)
        if tasks and all(t["JobState"] in ENDED_STATES for t in tasks):
            return tasks
        time.sleep(1)
    raise AssertionError(f"job {job} still running after {timeout} s: {_job_fields(cluster, job)}")


def _params(workdir) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(restore.restore_workdir(str(workdir)).params)]


def _assert_bitwise_equal(workdir, reference) -> None:
    ours, theirs = _params(workdir), _params(reference)
    assert len(ours) == len(theirs) > 10
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def _logged_steps(workdir) -> list[int]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if '"train_loss"' in line]


def _sweep_overrides(num_steps: int) -> list[str]:
    return [*SWEEP_OVERRIDES, f"train.num_steps={num_steps}", f"checkpoint_every_steps={num_steps // 10}",
            f"log_every_steps={num_steps // 10}"]


def _sweep(workdir, num_steps: int, *flags, env=None, background=False):
    """``python -m transformer_jax.sweep`` over Table 3's cpu scale, shrunk to ~25 ms a step."""
    return _run([sys.executable, "-m", "transformer_jax.sweep", "--grid=table3", "--scale=cpu",
                 "--base_seeds=1", f"--workdir={workdir}", f"--python={sys.executable}",
                 *(f"--override={o}" for o in _sweep_overrides(num_steps)), *flags],
                env or dict(os.environ), background)


def _submitted_job(result) -> str:
    assert result.returncode == 0, result.stderr[-2000:]
    return re.search(r"job (\d+)", result.stdout).group(1)


def _train_job(cluster, workdir, flags, *options) -> str:
    """Submits ``python -m transformer_jax.slurm`` (a train.py job into ``workdir``); returns its id."""
    return _submitted_job(_run([sys.executable, "-m", "transformer_jax.slurm", f"--workdir={workdir}",
                                f"--python={sys.executable}", "--submit", *options, "--", *flags],
                               cluster.env))


def _report_numbers(workdir) -> list[dict]:
    """The report's rows without its wall-clock times."""
    return [{k: v for k, v in row.items() if k != "wall_seconds"}
            for row in report.build_report(str(workdir))["rows"]]


def _run_pid(workdir) -> int | None:
    """The PID of the ``train.py`` process training into ``workdir`` (not the ``srun`` that started it)."""
    wanted = [b"train.py", f"--workdir={workdir}".encode()]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if args[0] == sys.executable.encode() and all(w in args for w in wanted):
            return int(entry)
    return None


@pytest.mark.slow
def test_sweep_array_equals_local_and_resumes_a_cancelled_row(slurm, tmp_path):
    rows = (100, "--rows=D-drop0.0")  # num_steps (~3 s), and the rows (with base)
    array, local = tmp_path / "array", tmp_path / "local"
    job = _submitted_job(_sweep(array, *rows, "--launcher=slurm", "--submit", env=slurm.env))
    # Task 1 (D-drop0.0) is cancelled once its first checkpoint is saved; its run is held meanwhile
    # (SIGSTOP), so the cancel lands mid-row however fast it trains.
    first_checkpoint = array / "D-drop0.0" / "checkpoints" / "10"
    deadline = time.time() + 300
    while not first_checkpoint.exists() and time.time() < deadline:
        time.sleep(0.02)
    run = _run_pid(array / "D-drop0.0")
    os.kill(run, signal.SIGSTOP)
    assert _run(["scancel", f"{job}_1"], slurm.env).returncode == 0
    os.kill(run, signal.SIGCONT)
    # The reference, meanwhile: started now, it finds both rows' training programs compiled.
    local_run = _sweep(local, *rows, "--launcher=local", background=True)
    tasks = {t["ArrayTaskId"]: t for t in _wait_for(slurm, job)}
    assert tasks["1"]["JobState"] == "CANCELLED" and tasks["0"]["JobState"] == "COMPLETED"
    assert (array / "base" / "result.json").exists() and not (array / "D-drop0.0" / "result.json").exists()

    job2 = _submitted_job(_sweep(array, *rows, "--launcher=slurm", "--submit", env=slurm.env))
    assert all(t["JobState"] == "COMPLETED" for t in _wait_for(slurm, job2))
    assert local_run.wait(timeout=600) == 0, local_run.stdout.read()[-2000:]
    assert "done already" in _log_text(array / f"slurm-{job2}_0.out")
    resumed = re.findall(r"Resuming from step (\d+)", _log_text(array / "D-drop0.0" / "train.log"))
    assert resumed and int(resumed[-1]) >= 10
    assert _report_numbers(array) == _report_numbers(local)
    assert all(row["status"] == "done" for row in _report_numbers(array))


def _text_corpus(folder) -> None:
    """The synthetic task's splits written as text files, for the text source."""
    source = SyntheticSource(train_size=400, dev_size=16, test_size=16, seed=0)
    folder.mkdir()
    for split, prefix in (("train", "train"), ("dev", "val"), ("test", "test")):
        pairs = source.pairs(split)
        for lang, side in (("en", 0), ("de", 1)):
            (folder / f"{prefix}.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))


@pytest.mark.slow
def test_srun_two_processes_equal_two_devices(slurm, tmp_path):
    """On a text corpus: the job's two processes make one data cache entry (the other waits for it) and
    both map it."""
    _text_corpus(tmp_path / "data")
    flags = [f"--config.{k}={v}" for k, v in TINY_FLAGS.items()] + [
        "--config.data.source=text", f"--config.data.dir={tmp_path / 'data'}"]
    job_dir, reference = tmp_path / "job", tmp_path / "reference"
    env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_PLATFORMS="cpu")
    single = _run([sys.executable, "train.py", f"--workdir={reference}", *flags,  # first: the job's processes
                   f"--config.data.cache_dir={tmp_path / 'reference_cache'}"], env)  # then find some of its
    assert single.returncode == 0, single.stderr[-2000:]  # programs compiled
    job = _train_job(slurm, job_dir, [*flags, f"--config.data.cache_dir={tmp_path / 'job_cache'}"],
                     "--ntasks=2")
    (task,) = _wait_for(slurm, job)
    log = _log_text(job_dir / f"slurm-{job}.out")
    assert task["JobState"] == "COMPLETED" and "2 devices, 2 processes" in log, log[-3000:]
    assert log.count("train pairs encoded into") == 1, log[-3000:]  # one build, by one of the two
    assert log.count("train pairs mapped from") == 1, log[-3000:]  # the other waited, then mapped it
    assert len([p for p in (tmp_path / "job_cache" / "encoded").iterdir() if p.is_dir()]) == 1

    _assert_bitwise_equal(job_dir, reference)  # each process fed its own rows, as the two devices did
    assert _logged_steps(job_dir) == [10, 20, 30, 40]  # process 0 alone writes metrics
    assert sorted(os.listdir(job_dir / "checkpoints")) == sorted(os.listdir(reference / "checkpoints"))
    scored = _run([sys.executable, "evaluate.py", f"--workdir={job_dir}", "--split=dev", "--beam_size=1"],
                  dict(os.environ, JAX_PLATFORMS="cpu"))
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert (job_dir / "eval" / "dev-40.json").exists()


def _log_text(path) -> str:
    """A run's log. A run stopped mid-write can end it inside a multi-byte character (a progress bar's
    block), which is replaced."""
    return path.read_text(errors="replace")


def _requeues(cluster, job: str, log) -> int:
    """How often ``job`` requeued itself; checks that it completed and that Slurm counted the same."""
    (task,) = _wait_for(cluster, job)
    text = _log_text(log)
    assert task["JobState"] == "COMPLETED", text[-3000:]
    requeues = text.count("requeueing job")
    assert int(task["Restarts"]) == requeues, text[-3000:]
    return requeues


def _resumed_from(log) -> list[int]:
    return [int(s) for s in re.findall(r"Resuming from step (\d+)", _log_text(log))]


def _hold_until_warned(runs: dict, when_held: Callable[[], object], timeout: float = 600) -> None:
    """Pauses each run (SIGSTOP) once it has saved a checkpoint, until its job's log shows Slurm's time-limit
    warning, then lets it go on (SIGCONT). ``runs``: {workdir: the job's log}. Calls ``when_held`` once,
    when every run is held or warned.

    A paused run is mid-run when the warning comes, however fast it trains, and spends no CPU while Slurm's
    30-s check comes round; the SIGTERM the warning sends waits for it. A run warned before its first
    checkpoint is left alone.
    """
    held, warned, deadline = {}, set(), time.time() + timeout
    while len(warned) < len(runs) and time.time() < deadline:
        for workdir, log in runs.items():
            if workdir in warned:
                continue
            if log.exists() and "time limit in sight" in _log_text(log):
                with contextlib.suppress(KeyError, ProcessLookupError):
                    os.kill(held.pop(workdir), signal.SIGCONT)
                warned.add(workdir)
            elif workdir not in held and any(n.isdigit() for n in _listdir(workdir / "checkpoints")):
                if pid := _run_pid(workdir):
                    os.kill(pid, signal.SIGSTOP)
                    held[workdir] = pid
        if when_held and len(held) + len(warned) == len(runs):
            when_held()
            when_held = None
        time.sleep(0.05)
    assert len(warned) == len(runs), f"no time-limit warning after {timeout} s in {list(runs.values())}"


def _listdir(path) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


@pytest.mark.slow
def test_jobs_requeued_at_their_time_limit_equal_an_uninterrupted_run(slurm, tmp_path):
    """A train.py job and a sweep's array task of the same row, each with a 1-minute limit, side by side;
    the local launcher runs the row uninterrupted meanwhile, from when both runs are held.

    With the warning 35 s before the limit, Slurm sends it at its first 30-s check 25 s or more into an
    attempt: 30 s into the first (the cluster started just now). Each run is held from its first
    checkpoint until then (``_hold_until_warned``), so it saves, requeues and resumes mid-run.
    """
    started = time.time()
    num_steps = 200
    job_dir, array, local = tmp_path / "job", tmp_path / "array", tmp_path / "local"
    flags = ["--config=configs/table3.py:base,cpu", *(f"--config.{o}" for o in _sweep_overrides(num_steps))]
    job = _submitted_job(_run([sys.executable, "-m", "transformer_jax.slurm", f"--workdir={job_dir}",
                               f"--python={sys.executable}", "--time=1", "--signal_seconds=35", "--submit",
                               "--", *flags], slurm.env))
    sweep_job = _submitted_job(_sweep(array, num_steps, "--rows=base", "--launcher=slurm", "--submit",
                                      "--slurm_option=--time=1", "--slurm_signal_seconds=35", env=slurm.env))
    local_runs = []  # the reference, started once both runs are held: it finds their programs compiled
    _hold_until_warned({job_dir: job_dir / f"slurm-{job}.out",
                        array / "base": array / f"slurm-{sweep_job}_0.out"},
                       lambda: local_runs.append(_sweep(local, num_steps, "--rows=base", "--launcher=local",
                                                        background=True)))
    (local_run,) = local_runs
    assert local_run.wait(timeout=600) == 0, local_run.stdout.read()[-2000:]

    requeues = _requeues(slurm, job, job_dir / f"slurm-{job}.out")
    resumed = _resumed_from(job_dir / f"slurm-{job}.out")
    assert requeues >= 1 and max(resumed, default=0) > 0
    _assert_bitwise_equal(job_dir, local / "base")
    assert _logged_steps(job_dir) == list(range(20, num_steps + 1, 20))  # each step once

    sweep_requeues = _requeues(slurm, sweep_job, array / f"slurm-{sweep_job}_0.out")
    sweep_resumed = _resumed_from(array / "base" / "train.log")
    assert sweep_requeues >= 1 and max(sweep_resumed, default=0) > 0
    _assert_bitwise_equal(array / "base", local / "base")
    assert _logged_steps(array / "base") == list(range(20, num_steps + 1, 20))
    assert _report_numbers(array) == _report_numbers(local)
    print(f"train job: {requeues} requeues, resumed from {resumed}; sweep task: {sweep_requeues} requeues, "
          f"resumed from {sweep_resumed}; {time.time() - started:.0f} s")


def test_a_job_in_a_folder_with_a_space_and_a_hash_runs_its_tasks_per_node(slurm, tmp_path):
    """``--nodes=1 --sbatch_option=--ntasks-per-node=2`` into ``my runs/exp#2``: sbatch takes the quoted
    paths, the log lands in the workdir, and both processes run, joined by ``--multiprocess``."""
    workdir = tmp_path / "my runs" / "exp#2"
    (tmp_path / "my runs" / "exp").mkdir(parents=True)  # where an unquoted '#' would send the log
    flags = [f"--config.{k}={v}" for k, v in {**TINY_FLAGS, "train.num_steps": 10}.items()]
    job = _train_job(slurm, workdir, flags, "--nodes=1", "--sbatch_option=--ntasks-per-node=2")
    (task,) = _wait_for(slurm, job)
    log = _log_text(workdir / f"slurm-{job}.out")
    assert task["JobState"] == "COMPLETED" and "2 devices, 2 processes" in log, log[-3000:]
    assert os.listdir(tmp_path / "my runs" / "exp") == [] and (workdir / "final.json").exists()
