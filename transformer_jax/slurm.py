"""Slurm batch scripts that survive their time limit: ``python -m transformer_jax.slurm`` for a training run.

    python -m transformer_jax.slurm --workdir=runs/base --ntasks=8 --time=24:00:00 \\
        --sbatch_option=--gpus-per-task=1 --submit -- --config=configs/wmt14_en_de_base.py

writes ``<workdir>/train.sbatch`` (and with ``--submit`` submits it and prints the job id). The script runs
``srun python train.py [--multiprocess] ...``, one process per task. Every script this project writes (this
one and the sweep's array, ``sweep/launchers.py``) handles the time limit the same way:

- ``#SBATCH --signal=B:USR1@S``: Slurm warns the batch shell S seconds before the limit;
- the shell sends SIGTERM to the run, which saves a checkpoint at its next step and exits 0;
- unless the run's done-file exists (``final.json`` of a training run, ``result.json`` of a sweep row),
  the script calls ``scontrol requeue`` on its own job: ``#SBATCH --requeue`` lets it, and
  ``--open-mode=append`` keeps every attempt's output in one log. The job comes back with the same id
  and resumes from the checkpoint.

``scancel`` is not the time limit: Slurm sends SIGTERM (then SIGKILL after its KillWait), the run saves
if it has the time, and the job is not requeued; resubmitting resumes from the last checkpoint.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence

from absl import flags

from transformer_jax.runtime import errors

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SIGNAL_SECONDS = 300  # time to save a checkpoint before the limit; Slurm may warn up to 60 s early

# What the batch shell does after the #SBATCH header. {command} runs in the background so that the USR1 trap
# runs at once (bash runs traps only between commands); {stop} sends the run SIGTERM; {done} is a test that
# holds when the run has nothing left to do.
_BODY = """\
set -uo pipefail
cd {repo}
{setup}echo "attempt $((${{SLURM_RESTART_COUNT:-0}} + 1)) of job $SLURM_JOB_ID on $(hostname) at $(date -Is)"
time_limit=0
trap 'time_limit=1; echo "time limit in sight: stopping the run to requeue it"; {stop}' USR1
{command} &
run=$!
status=0
while true; do  # wait returns when a trapped signal arrives, so wait until the run has ended
  wait "$run"; status=$?
  kill -0 "$run" 2>/dev/null || break
done
if [ "$time_limit" = 1 ] && ! {done}; then
  echo "requeueing job $SLURM_JOB_ID: it resumes from its last checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""


def batch_script(*, header: Sequence[str], command: str, done: str, signal_seconds: int,
                 stop: str = 'kill -TERM "$run"', comments: Sequence[str] = (), setup: str = "") -> str:
    """An sbatch script that runs ``command`` and requeues itself at the time limit until ``done`` holds.

    Args:
      header: ``#SBATCH`` options (without the prefix), e.g. ``("--job-name=x", "--time=1:00:00")``.
      command: the shell command to run (already quoted).
      done: a shell test, e.g. ``[ -f runs/x/final.json ]``, true when nothing is left to run.
      signal_seconds: how long before the time limit the run is told to save and stop.
      stop: the shell command that sends the run SIGTERM (``$run`` is the PID of ``command``).
      comments: lines written as ``# ...`` after the header.
      setup: shell lines run before the command (e.g. variables that ``command`` and ``done`` use).
    """
    options = [*header, "--requeue", "--open-mode=append", f"--signal=B:USR1@{signal_seconds}"]
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options),
             f"# {signal_seconds} s before the time limit the run saves a checkpoint and the job requeues "
             "itself;", "# it resumes from that checkpoint. scancel stops it for good.",
             *(f"# {line}" for line in comments)]
    body = _BODY.format(repo=shlex.quote(REPO_ROOT), setup=setup + "\n" if setup else "", command=command,
                        stop=stop, done=done)
    return "\n".join(lines) + "\n" + body


def train_script(workdir: str, train_args: Sequence[str], *, ntasks: int = 1, nodes: int | None = None,
                 time: str | None = None, signal_seconds: int = DEFAULT_SIGNAL_SECONDS,
                 sbatch_options: Sequence[str] = (), python: str = "python") -> str:
    """The batch script of one training run into ``workdir`` (``train.py`` flags in ``train_args``)."""
    workdir = os.path.abspath(workdir)
    multi = ntasks > 1 or (nodes or 1) > 1
    command = ["srun", python, "train.py", *(["--multiprocess"] if multi else []), *train_args,
               f"--workdir={workdir}"]
    header = [f"--job-name=train-{os.path.basename(workdir)}", f"--output={workdir}/slurm-%j.out",
              f"--ntasks={ntasks}", *([f"--nodes={nodes}"] if nodes else []),
              *([f"--time={time}"] if time else []), *sbatch_options]
    # srun takes a SIGTERM of its own as "abort the step" and kills the tasks; scancel --signal passes
    # SIGTERM to the tasks themselves, which save and exit.
    return batch_script(header=header, command=shlex.join(command),
                        done=f"[ -f {shlex.quote(os.path.join(workdir, 'final.json'))} ]",
                        signal_seconds=signal_seconds, stop='scancel --signal=TERM "$SLURM_JOB_ID"')


def write_script(path: str, text: str) -> str:
    """Writes ``text`` to ``path`` (executable), replacing it atomically; returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def submit(path: str) -> str:
    """``sbatch``s the script at ``path``; returns the job id. Raises a one-line ``UserError`` if it fails."""
    try:
        result = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    except FileNotFoundError:
        raise errors.UserError("sbatch not found: --submit needs Slurm's commands on this machine; submit "
                         f"{path} from a login node with: sbatch {path}") from None
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise errors.UserError(f"sbatch {path} failed: {reason}")
    return result.stdout.strip().split(";")[0]


def define_flags() -> None:
    """The flags of ``python -m transformer_jax.slurm``; the arguments after ``--`` go to train.py."""
    flags.DEFINE_string("workdir", None, "The run's workdir (train.py --workdir); the script and Slurm's "
                        "log (slurm-<job>.out) go there. On a cluster: storage every node sees.")
    flags.DEFINE_integer("ntasks", 1, "Processes (one per GPU or host); > 1 adds --multiprocess.")
    flags.DEFINE_integer("nodes", None, "Nodes (default: as Slurm places the tasks).")
    flags.DEFINE_string("time", None, "Time limit of each attempt, as sbatch --time (e.g. 4:00:00).")
    flags.DEFINE_integer("signal_seconds", DEFAULT_SIGNAL_SECONDS,
                         "Seconds before the time limit the run saves and the job requeues; leave room for "
                         "one checkpoint save (Slurm may send the warning up to 60 s early).")
    flags.DEFINE_multi_string("sbatch_option", [], "Extra #SBATCH line, e.g. "
                              "--sbatch_option=--gpus-per-task=1 (repeatable).")
    flags.DEFINE_string("python", "python", "Interpreter on the compute nodes, e.g. .venv/bin/python.")
    flags.DEFINE_bool("submit", False, "Also submit the script with sbatch and print the job id.")


def main(argv: list[str]) -> int:
    f = flags.FLAGS
    if not f.workdir:
        raise errors.ConfigError("--workdir is required: the run's workdir, on storage every node sees")
    if f.ntasks < 1 or f.signal_seconds < 1:
        raise errors.ConfigError(f"--ntasks and --signal_seconds must be >= 1, got {f.ntasks} and "
                                 f"{f.signal_seconds}")
    train_args = argv[1:]
    if any(a.startswith("--workdir") for a in train_args):
        raise errors.ConfigError("give the workdir as this command's --workdir, not after --")
    text = train_script(f.workdir, train_args, ntasks=f.ntasks, nodes=f.nodes, time=f.time,
                        signal_seconds=f.signal_seconds, sbatch_options=f.sbatch_option, python=f.python)
    path = write_script(os.path.join(os.path.abspath(f.workdir), "train.sbatch"), text)
    if f.submit:
        print(f"Submitted {path}: job {submit(path)}")
    else:
        print(f"Wrote {path}. Submit it with:\n  sbatch {path}")
    return 0


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, takes_args=True)  # the arguments after -- go to train.py
