"""A one-node Slurm cluster on this machine, for the tests that run jobs under a real scheduler.

Needs Debian's ``slurm-wlm`` (``apt-get install -y slurm-wlm``) and root, as in CI; it needs neither systemd
nor munge (``auth/none``). Everything lives in one folder: ``slurm.conf``, the daemons' state, spool, logs
and PIDs, on free loopback ports. By hand:

    python tests/local_slurm.py start /tmp/slurm    # prints the SLURM_CONF line to export
    SLURM_CONF=/tmp/slurm/slurm.conf sbatch ...
    python tests/local_slurm.py stop /tmp/slurm

The tests use the ``slurm`` fixture (``tests/conftest.py``), which skips with one line where Slurm is
missing and fails, never skips, where ``CI`` is set.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

from transformer_jax.runtime import errors

DAEMONS = ("slurmctld", "slurmd")
INSTALL_HINT = "install Slurm to run them: apt-get install -y slurm-wlm (as root)"


def _which(command: str) -> str | None:
    """``command``'s path; the daemons live in /usr/sbin, which a user's PATH may lack."""
    return shutil.which(command) or shutil.which(command, path="/usr/sbin:/usr/bin")


def unavailable_reason() -> str | None:
    """Why a local cluster cannot start here, or None."""
    missing = [d for d in (*DAEMONS, "sbatch", "srun", "scontrol") if _which(d) is None]
    if missing:
        return f"Slurm tests skipped: {', '.join(missing)} not found; {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "Slurm tests skipped: the local cluster's slurmd must run as root"
    return None


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_conf(folder: str, cpus: int) -> str:
    """Writes ``<folder>/slurm.conf`` for one node with ``cpus`` CPUs; returns its path."""
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = _free_ports(2)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    lines = [
        "ClusterName=local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",  # trust CPUs= below, even where it is more than the cores
        "SlurmUser=root",
        "SlurmdUser=root",
        "KillWait=30",
        "AuthInfo=cred_expire=5",  # a requeued job may start again after 6 s (default: 121 s)
        "MinJobAge=600",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd.log",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    path = os.path.join(folder, "slurm.conf")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


class LocalSlurm:
    """``start()`` a one-node cluster in ``folder``; ``env`` points Slurm's commands at it; ``stop()``."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.conf = os.path.join(self.folder, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._procs: list[subprocess.Popen] = []

    def start(self, cpus: int | None = None, timeout: float = 60.0) -> LocalSlurm:
        """Starts the daemons; the node offers ``cpus`` CPUs (default: this machine's)."""
        os.makedirs(self.folder, exist_ok=True)
        write_conf(self.folder, cpus or os.cpu_count())
        for daemon in DAEMONS:
            with open(os.path.join(self.folder, f"{daemon}.out"), "w") as log:
                self._procs.append(subprocess.Popen(
                    [_which(daemon), "-D", "-f", self.conf], env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if state.returncode == 0 and state.stdout.strip() in ("idle", "mix", "alloc"):
                return self
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the local Slurm cluster did not come up; see {self.folder}/slurmctld.log "
                           f"and slurmd.log")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs = []


def main(argv: list[str]) -> int:
    """``start FOLDER`` (prints the SLURM_CONF to export) or ``stop FOLDER``."""
    if len(argv) != 3 or argv[1] not in ("start", "stop"):
        raise errors.UserError(f"expected start FOLDER or stop FOLDER, got {argv[1:]}")
    folder = os.path.abspath(argv[2])
    if argv[1] == "start":
        if reason := unavailable_reason():
            raise errors.UserError(reason)
        cluster = LocalSlurm(folder).start()
        cluster._procs = []  # left running in their own sessions; `stop` ends them by their PID files
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    for daemon in reversed(DAEMONS):
        pid_file = os.path.join(folder, f"{daemon}.pid")
        if os.path.exists(pid_file):
            with open(pid_file) as f, contextlib.suppress(ProcessLookupError):
                os.kill(int(f.read().strip()), signal.SIGTERM)
    return 0


if __name__ == "__main__":
    errors.run_main(main, takes_args=True)
