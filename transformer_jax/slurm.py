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
  and resumes from the checkpoint. Where the done-file exists, the warning came as the run finished: the
  job ends COMPLETED (exit 0), whatever the status of the run it stopped while exiting.

``scancel`` is not the time limit: Slurm sends SIGTERM (then SIGKILL after its KillWait), the run saves
if it has the time, and the job is not requeued; resubmitting resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import Sequence

from absl import flags

from transformer_jax.runtime import disk, errors

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
if [ "$time_limit" = 1 ]; then
  if {done}; then  # the stop reached a run that had finished and was exiting: nothing is lost
    echo "the run finished before the time limit"
  else
    echo "requeueing job $SLURM_JOB_ID: it resumes from its last checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  fi
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


def sbatch_value(value: str) -> str:
    """``value`` double-quoted for an ``#SBATCH`` line: unquoted, sbatch ends a value at a space, and a ``#``
    starts a comment."""
    return f'"{value}"'


def output_option(directory: str, pattern: str) -> str:
    """``--output`` for Slurm's log ``<directory>/<pattern>`` (``pattern`` may hold ``%j``...): quoted, with a
    ``%`` of ``directory`` doubled so that Slurm does not expand it."""
    return f"--output={sbatch_value(os.path.join(directory.replace('%', '%%'), pattern))}"


def check_sbatch_path(path: str, what: str = "--workdir") -> None:
    """Refuses a path an ``#SBATCH`` line cannot carry (a double quote, a backslash, a line break)."""
    bad = [repr(c) for c in ('"', "\\", "\n", "\r") if c in path]
    if bad:
        raise errors.ConfigError(f"{what}={path!r}: a Slurm job's folder cannot contain {' or '.join(bad)} "
                                 "(sbatch's #SBATCH lines cannot carry them); choose another path")


_TASKS_PER_NODE = re.compile(r"--ntasks-per-node(?:=|\s+)(\d+)$")
_TASK_COUNT = re.compile(r"(--ntasks|--ntasks-per-gpu)(=|\s|$)|-n(\s*\d|$)")


def _processes(ntasks: int | None, nodes: int | None, sbatch_options: Sequence[str]) -> tuple[list, bool]:
    """The ``#SBATCH`` task lines, and whether the job runs more than one process (``--multiprocess``).

    ``--ntasks-per-node`` may come as an sbatch option (with ``--nodes``); without ``--ntasks`` no
    ``--ntasks`` line is written, as sbatch would obey it over ``--ntasks-per-node``.
    """
    per_node = None
    for option in sbatch_options:
        option = option.strip()
        if m := _TASKS_PER_NODE.match(option):
            per_node = int(m.group(1))
        elif _TASK_COUNT.match(option):
            raise errors.ConfigError(
                f"--sbatch_option={option}: give the number of processes as this command's --ntasks (or "
                "--nodes with --sbatch_option=--ntasks-per-node=N), so that the script starts train.py "
                "with --multiprocess when there are several")
    if per_node is None or ntasks is not None:
        ntasks = ntasks or 1
        return [f"--ntasks={ntasks}"], ntasks > 1 or (nodes or 1) > 1
    return [], per_node > 1 or (nodes or 1) > 1


def train_script(workdir: str, train_args: Sequence[str], *, ntasks: int | None = None,
                 nodes: int | None = None, time: str | None = None,
                 signal_seconds: int = DEFAULT_SIGNAL_SECONDS, sbatch_options: Sequence[str] = (),
                 python: str = "python") -> str:
    """The batch script of one training run into ``workdir`` (``train.py`` flags in ``train_args``).

    ``ntasks`` processes (default 1, or ``--nodes`` times an ``--ntasks-per-node`` in ``sbatch_options``).
    """
    workdir = os.path.abspath(workdir)
    check_sbatch_path(workdir)
    tasks, multi = _processes(ntasks, nodes, sbatch_options)
    command = ["srun", python, "train.py", *(["--multiprocess"] if multi else []), *train_args,
               f"--workdir={workdir}"]
    header = [f"--job-name={sbatch_value('train-' + os.path.basename(workdir))}",
              output_option(workdir, "slurm-%j.out"), *tasks, *([f"--nodes={nodes}"] if nodes else []),
              *([f"--time={time}"] if time else []), *sbatch_options]
    # srun takes a SIGTERM of its own as "abort the step" and kills the tasks; scancel --signal passes
    # SIGTERM to the tasks themselves, which save and exit.
    return batch_script(header=header, command=shlex.join(command),
                        done=f"[ -f {shlex.quote(os.path.join(workdir, 'final.json'))} ]",
                        signal_seconds=signal_seconds, stop='scancel --signal=TERM "$SLURM_JOB_ID"')


def write_script(path: str, text: str) -> str:
    """Writes ``text`` to ``path`` (executable), replacing it atomically; returns ``path``.

    Raises a one-line ``UserError`` where the folder cannot be written (the job's log could not be either).
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as e:
        if disk.is_disk_full(e):
            raise
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise errors.UserError(f"cannot write {path}: {e.strerror or e} ({e.filename or path}). The script "
                               "and Slurm's log go into the workdir: choose a --workdir you can write, on "
                               "storage every node sees") from None
    return path


def check_interpreter(python: str) -> None:
    """Refuses a ``--python`` path (one with a ``/``, from the checkout when relative) that does not exist;
    a bare name (``python``) is looked up on the node, in its ``PATH``."""
    if "/" not in python:
        return
    path = os.path.join(REPO_ROOT, python)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise errors.ConfigError(f"--python={python}: no such interpreter ({path} is not an executable "
                                 "file); give the interpreter of the compute nodes, e.g. "
                                 "--python=.venv/bin/python")


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
    flags.DEFINE_integer("ntasks", None, "Processes (one per GPU or host; default 1, or --nodes times "
                         "--sbatch_option=--ntasks-per-node=N); > 1 adds --multiprocess.")
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
    if (f.ntasks is not None and f.ntasks < 1) or f.signal_seconds < 1:
        raise errors.ConfigError(f"--ntasks and --signal_seconds must be >= 1, got {f.ntasks} and "
                                 f"{f.signal_seconds}")
    train_args = argv[1:]
    if any(a.startswith("--workdir") for a in train_args):
        raise errors.ConfigError("give the workdir as this command's --workdir, not after --")
    text = train_script(f.workdir, train_args, ntasks=f.ntasks, nodes=f.nodes, time=f.time,
                        signal_seconds=f.signal_seconds, sbatch_options=f.sbatch_option, python=f.python)
    if f.submit:
        check_interpreter(f.python)
    path = write_script(os.path.join(os.path.abspath(f.workdir), "train.sbatch"), text)
    if f.submit:
        print(f"Submitted {path}: job {submit(path)}")
    else:
        print(f"Wrote {path}. Submit it with:\n  sbatch {path}")
    return 0


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, takes_args=True)  # the arguments after -- go to train.py
