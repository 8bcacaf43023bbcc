"""Tests for transformer_jax.training.workdir_lock: one run per workdir, stale and killed holders."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from transformer_jax.training import workdir_lock
from transformer_jax.training.workdir_lock import WorkdirLock


def _lock_file(workdir) -> dict:
    with open(os.path.join(workdir, ".lock")) as f:
        return json.load(f)


def test_workdir_lock_writes_pid_and_releases(tmp_path):
    with WorkdirLock(str(tmp_path)):
        assert _lock_file(tmp_path)["pid"] == os.getpid()
        with pytest.raises(RuntimeError, match=rf"pid {os.getpid()}"):  # a second run in this process too
            WorkdirLock(str(tmp_path)).acquire()
    assert not os.path.exists(tmp_path / ".lock")
    with WorkdirLock(str(tmp_path / "sub"), enabled=False):  # e.g. process_index() != 0
        assert not os.path.exists(tmp_path / "sub" / ".lock")


def test_workdir_lock_refused_while_holder_is_alive(tmp_path):
    holder = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / ".lock").write_text(json.dumps({"pid": holder.pid, "hostname": os.uname().nodename}))
        with pytest.raises(RuntimeError, match=rf"pid {holder.pid}\b.*alive"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    # Now the pid is dead: the lock is stale and taken over.
    with WorkdirLock(str(tmp_path)):
        assert _lock_file(tmp_path)["pid"] == os.getpid()


def test_workdir_lock_flock_holder_then_kill_9(tmp_path, caplog):
    # A child holds the flock but wrote a dead pid, so only the flock can refuse us. Then kill -9 it.
    child_code = textwrap.dedent(
        """
        import fcntl, json, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": os.getpid(), "hostname": os.uname().nodename}).encode())
        print("locked", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", child_code, str(tmp_path / ".lock")], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline().strip() == b"locked"
        with pytest.raises(RuntimeError, match=rf"pid {child.pid}\b.*holds the lock"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with caplog.at_level(logging.WARNING, logger=workdir_lock.__name__):
        with WorkdirLock(str(tmp_path)):
            assert _lock_file(tmp_path)["pid"] == os.getpid()
    assert any(f"dead pid {child.pid}" in r.getMessage() for r in caplog.records)


def test_workdir_lock_takes_over_stale_lock(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead.pid, "hostname": os.uname().nodename}))
    with caplog.at_level(logging.WARNING, logger=workdir_lock.__name__):
        with WorkdirLock(str(tmp_path)):
            assert _lock_file(tmp_path)["pid"] == os.getpid()
    assert any("stale lock" in r.getMessage() and str(dead.pid) in r.getMessage() for r in caplog.records)


def _lock_from_another_node(workdir, monkeypatch, **slurm) -> None:
    """A ``.lock`` written under Slurm on node-a by a process that is gone (its flock with it); this process
    runs on node-b."""
    (workdir / ".lock").write_text(json.dumps({"pid": 4242, "hostname": "node-a", **slurm}))
    monkeypatch.setattr(workdir_lock.socket, "gethostname", lambda: "node-b")


def _fake_squeue(tmp_path, monkeypatch, state: str) -> None:
    """``squeue`` on PATH that reports ``state`` for any job ("" for a job Slurm no longer knows)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    unknown = 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{f'echo {state}' if state else unknown}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_lock(tmp_path, monkeypatch, caplog):
    """A node failure or an overrun save leaves the lock naming the old node; the job's next attempt (same
    job id, a higher restart count) on another node takes it over, with a message."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _lock_from_another_node(workdir, monkeypatch, slurm_job_id="77", slurm_restart_count=0)
    with caplog.at_level(logging.WARNING, logger=workdir_lock.__name__):
        with WorkdirLock(str(workdir)):
            assert _lock_file(workdir) | {"time": 0} == {
                "pid": os.getpid(), "hostname": "node-b", "time": 0, "slurm_job_id": "77",
                "slurm_restart_count": 1}
    assert any("attempt 1 of Slurm job 77 on node-a" in r.getMessage() for r in caplog.records), caplog.text
    # The same attempt on another node (or no Slurm record) cannot be checked: refused.
    _lock_from_another_node(workdir, monkeypatch, slurm_job_id="77", slurm_restart_count=1)
    with pytest.raises(RuntimeError, match="pid 4242 on node-a"):
        WorkdirLock(str(workdir)).acquire()
    monkeypatch.delenv("SLURM_JOB_ID")
    _lock_from_another_node(workdir, monkeypatch, slurm_job_id="77", slurm_restart_count=0)
    with pytest.raises(RuntimeError, match="another host"):
        WorkdirLock(str(workdir)).acquire()


@pytest.mark.parametrize("state, taken", [("", True), ("COMPLETED", True), ("PENDING", True),
                                          ("RUNNING", False), ("COMPLETING", False)])
def test_a_lock_of_another_slurm_job_is_taken_over_once_that_job_stopped(tmp_path, monkeypatch, state, taken):
    """A resubmitted job (a new job id) asks Slurm whether the holder's job still runs."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    _fake_squeue(tmp_path, monkeypatch, state)
    _lock_from_another_node(workdir, monkeypatch, slurm_job_id="77", slurm_restart_count=0)
    if taken:
        with WorkdirLock(str(workdir)):
            assert _lock_file(workdir)["slurm_job_id"] == "78"
    else:
        with pytest.raises(RuntimeError, match=rf"pid 4242 on node-a .*Slurm job 77 is {state}"):
            WorkdirLock(str(workdir)).acquire()
