"""The batch scripts of `python -m transformer_jax.slurm` and of the sweep's slurm launcher (no Slurm).

``tests/test_slurm.py`` submits such scripts to a real one-node Slurm; here only their text and the command's
errors are checked.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from transformer_jax import slurm
from transformer_jax.runtime import errors
from transformer_jax.sweep import grid, launchers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _header(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def _command(*args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """``python -m transformer_jax.slurm *args``: its exit status and the lines of its stderr."""
    done = subprocess.run([sys.executable, "-m", "transformer_jax.slurm", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, done.stderr.strip().splitlines()


def test_tasks_per_node_is_not_overridden_by_ntasks():
    """``--ntasks-per-node`` as an sbatch option decides the processes: no ``--ntasks=1`` line (which sbatch
    would obey), and more than one process per node runs with ``--multiprocess``."""
    script = slurm.train_script("/w/run", [], nodes=1, sbatch_options=["--ntasks-per-node=2"])
    header = _header(script)
    assert "--ntasks-per-node=2" in header and "--nodes=1" in header
    assert not any(re.match(r"--ntasks(=| |$)", option) for option in header), header
    assert "srun python train.py --multiprocess --workdir=/w/run" in script
    assert "--multiprocess" not in slurm.train_script("/w/run", [], sbatch_options=["--ntasks-per-node 1"])
    two_nodes = slurm.train_script("/w/run", [], nodes=2, sbatch_options=["--ntasks-per-node=1"])
    assert "--multiprocess" in two_nodes
    # With --ntasks as well, both lines go in (the total, and at most that many a node).
    both = _header(slurm.train_script("/w/run", [], ntasks=4, sbatch_options=["--ntasks-per-node=2"]))
    assert "--ntasks=4" in both and "--ntasks-per-node=2" in both
    assert "--ntasks=1" in _header(slurm.train_script("/w/run", []))  # the default: one process


@pytest.mark.parametrize("option", ["--ntasks=2", "-n 2", "--ntasks-per-gpu=1"])
def test_task_counts_as_sbatch_options_are_refused(option):
    with pytest.raises(errors.ConfigError, match="--ntasks"):
        slurm.train_script("/w/run", [], sbatch_options=[option])


def test_paths_with_a_space_a_hash_and_a_percent_are_quoted():
    """sbatch reads an unquoted ``#SBATCH`` value up to a space or a ``#``, and Slurm expands ``%`` in a log
    name: the script quotes the values and doubles a ``%`` of the workdir."""
    script = slurm.train_script("/w/my runs/exp#2 100%", [])
    header = _header(script)
    assert '--output="/w/my runs/exp#2 100%%/slurm-%j.out"' in header
    assert '--job-name="train-exp#2 100%"' in header
    assert "'--workdir=/w/my runs/exp#2 100%'" in script  # the shell command, quoted for the shell
    assert "[ -f '/w/my runs/exp#2 100%/final.json' ]" in script


@pytest.mark.parametrize("name", ['a"b', "a\\b", "a\nb"])
def test_paths_sbatch_cannot_carry_are_refused(name):
    with pytest.raises(errors.ConfigError, match="cannot contain"):
        slurm.train_script(f"/w/{name}", [])


def test_an_unwritable_workdir_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    code, err = _command(f"--workdir={tmp_path / 'afile' / 'j4'}", "--submit")
    assert code == 1 and len(err) == 2, err
    assert re.match(r"error: cannot write .*afile/j4/train.sbatch: .*--workdir", err[0]), err
    code, err = _command("--workdir=/proc/j4", "--submit")  # a read-only filesystem
    assert code == 1 and len(err) == 2 and err[0].startswith("error: cannot write /proc/j4/train.sbatch"), err


def test_submit_checks_the_interpreter(tmp_path):
    """A ``--python`` path that does not exist fails at submission, not on the node."""
    code, err = _command(f"--workdir={tmp_path / 'j'}", "--python=.venv/bin/pythno", "--submit",
                         env=dict(os.environ, PATH="/nonexistent"))  # no sbatch: it is not reached
    assert code == 1 and len(err) == 2, err
    assert err[0].startswith("error: --python=.venv/bin/pythno: no such interpreter"), err


def test_sweep_array_paths_are_quoted_and_checked(tmp_path):
    rows = grid.parse_grid("model.dropout_rate=0.0,0.1", "configs/default.py")
    workdir = str(tmp_path / "my runs" / "exp#2 %")
    script = open(launchers.launch_slurm(rows, workdir, ["python", "-m", "transformer_jax.sweep"],
                                         slurm_options=[])).read()
    header = _header(script)
    assert f'--output="{workdir.replace("%", "%%")}/slurm-%A_%a.out"' in header
    assert '--job-name="sweep-exp#2 %"' in header
    with pytest.raises(errors.ConfigError, match="cannot contain"):
        launchers.launch_slurm(rows, str(tmp_path / 'a"b'), ["python"], slurm_options=[])


def _time_limited(tmp_path, command: str) -> tuple[int, str, bool]:
    """Runs a batch script of ``command`` under bash, without Slurm: sends its shell the time-limit warning
    (USR1) once ``command`` has written ``started``. Returns the script's exit status, its output, and
    whether it asked ``scontrol`` to requeue the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol\n')
    (bin_dir / "scontrol").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.batch_script(header=["--job-name=t"], command=command, signal_seconds=35,
                                         done=f"[ -f {tmp_path}/done ]"))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7")
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=tmp_path)
    deadline = time.time() + 30
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.01)
    shell.send_signal(signal.SIGUSR1)
    output, _ = shell.communicate(timeout=60)
    return shell.returncode, output, (tmp_path / "scontrol").exists()


def test_a_run_warned_after_it_finished_ends_the_job_completed(tmp_path):
    """The warning can come while a run that has written its done-file exits; the stop then kills it. The
    job has nothing left to do: it exits 0 (Slurm's COMPLETED), not the killed run's status, and does not
    requeue."""
    status, output, requeued = _time_limited(tmp_path, f"sh -c 'touch {tmp_path}/done {tmp_path}/started; "
                                                       "exec sleep 60'")
    assert (status, requeued) == (0, False), output
    assert "finished before the time limit" in output


def test_a_run_warned_midway_requeues_its_job(tmp_path):
    status, output, requeued = _time_limited(tmp_path, f"sh -c 'touch {tmp_path}/started; exec sleep 60'")
    assert (status, requeued) == (0, True), output
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "7"]


def test_a_failed_run_without_a_warning_fails_its_job(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.batch_script(header=[], command="sh -c 'exit 3'", signal_seconds=35,
                                         done=f"[ -f {tmp_path}/done ]"))
    done = subprocess.run(["bash", str(script)], env=dict(os.environ, SLURM_JOB_ID="7"), capture_output=True,
                          timeout=60)
    assert done.returncode == 3
