"""The workdir lock: one training run per workdir at a time, released by the kernel even on kill -9."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import subprocess
import time

from transformer_jax.runtime import output_file
from transformer_jax.runtime.errors import WorkdirBusyError

_log = logging.getLogger(__name__)


# Slurm job states in which the job's processes may still run (squeue's %T); any other state (PENDING,
# REQUEUED, COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, ...) means they are gone.
_SLURM_LIVE_STATES = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING",
                      "STAGE_OUT")


def _slurm_attempt() -> dict:
    """This process's Slurm job id and restart count (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``), or {}."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"slurm_job_id": job, "slurm_restart_count": int(restarts) if restarts.isdigit() else 0}


def _slurm_job_state(job: str) -> str | None:
    """Slurm's state of ``job`` ("" once Slurm no longer knows it), or None where squeue cannot say."""
    try:
        done = subprocess.run(["squeue", "--noheader", f"--jobs={job}", "--states=all", "--format=%T"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return "" if "invalid job id" in done.stderr.lower() else None
    return done.stdout.strip().split("\n")[0].strip()


def _other_host_holder(holder: dict) -> tuple[bool, str]:
    """(whether a holder on another host is gone, why). Only Slurm can tell: an earlier attempt of this job
    (same job id, a lower restart count; Slurm runs one attempt at a time) is gone, and so is a job Slurm
    says no longer runs. Anything else is taken as alive."""
    ours, job = _slurm_attempt(), holder.get("slurm_job_id")
    restarts = holder.get("slurm_restart_count")
    if not ours or not isinstance(job, str) or not isinstance(restarts, int):
        return False, "on another host, so its liveness cannot be checked"
    attempt = f"attempt {restarts + 1} of Slurm job {job} on {holder.get('hostname')}"
    if job == ours["slurm_job_id"]:
        if restarts < ours["slurm_restart_count"]:
            return True, f"{attempt}, which this attempt replaced"
        return False, f"on another host, in this attempt of Slurm job {job}"
    state = _slurm_job_state(job)
    if state is None:
        return False, f"on another host; squeue could not say whether its Slurm job {job} still runs"
    if state in _SLURM_LIVE_STATES:
        return False, f"on another host; its Slurm job {job} is {state}"
    return True, f"{attempt}, which Slurm reports {state or 'ended'}"


class WorkdirLock:
    """Exclusive use of a workdir by one training run: ``with WorkdirLock(workdir): train(...)``.

    Writes ``<workdir>/.lock`` holding ``{"pid", "hostname", "time"}`` and holds an ``fcntl.flock`` on it,
    which the kernel drops when the process dies (even on ``kill -9``). A second run is refused with an error
    naming the holder's pid while the flock is held, or while the file names a live pid on this host (a holder
    that could not flock). A lock left by a dead process is taken over, with a log message. A holder on
    another host whose flock is gone cannot be checked; that is refused too, naming the file to delete,
    except under Slurm, where the file also names the holder's job and attempt: a lock of an earlier attempt
    of this job (a requeue, after a node failure or a save that outlasted the time limit), or of a job that
    Slurm says no longer runs, is taken over with a log message. In
    multi-host training pass ``enabled=(jax.process_index() == 0)``. A refusal is a ``WorkdirBusyError`` (a
    ``RuntimeError`` and a user error: train.py prints it in one line).
    """

    FILENAME = ".lock"

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.workdir = os.path.abspath(os.fspath(workdir))
        self.path = os.path.join(self.workdir, self.FILENAME)
        self.enabled = enabled
        self._fd: int | None = None

    def _read_holder(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096).decode("utf-8", "replace").strip()
        if not raw:
            return {}
        try:
            holder = json.loads(raw)
            return holder if isinstance(holder, dict) else {}
        except json.JSONDecodeError:
            return {"pid": int(raw)} if raw.isdigit() else {}

    def _refuse(self, holder: dict, why: str) -> WorkdirBusyError:
        pid, host = holder.get("pid", "unknown"), holder.get("hostname", "unknown host")
        return WorkdirBusyError(
            f"workdir {self.workdir} is in use by another run: pid {pid} on {host} ({why}). Stop that run "
            f"or use another workdir; if you are sure it is gone, delete {self.path}"
        )

    def acquire(self) -> None:
        if not self.enabled or self._fd is not None:
            return
        os.makedirs(self.workdir, exist_ok=True)
        hostname = socket.gethostname()
        for _ in range(10):  # retries only when the file is replaced under us (see the inode check)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read_holder(fd)
                os.close(fd)
                raise self._refuse(holder, "it holds the lock") from None
            # The holder may have unlinked the file between our open and flock: only the file at path counts.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = self._read_holder(fd)
            pid = holder.get("pid")
            if isinstance(pid, int) and pid != os.getpid():
                if holder.get("hostname", hostname) != hostname:
                    gone, why = _other_host_holder(holder)
                    if not gone:
                        os.close(fd)
                        raise self._refuse(holder, why)
                    _log.warning("Taking over lock %s left by pid %d of %s", self.path, pid, why)
                elif not output_file.process_is_gone(pid):
                    os.close(fd)
                    raise self._refuse(holder, "the process is alive")
                else:
                    _log.warning("Taking over stale lock %s left by dead pid %d on %s", self.path, pid,
                                 hostname)
            record = json.dumps({"pid": os.getpid(), "hostname": hostname, "time": time.time(),
                                 **_slurm_attempt()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return
        raise WorkdirBusyError(f"could not lock {self.path}: the file kept being replaced by another process")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(
                self.path
            )  # while still holding the flock, so no one locks the doomed file and keeps it
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
