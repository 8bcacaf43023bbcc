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
