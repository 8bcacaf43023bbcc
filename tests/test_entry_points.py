"""Every entry point, given one bad input, prints one ``error:`` line (and at most a hint) and no traceback.

Each row of ``BAD_INPUTS`` is (entry point, arguments, text the error line must contain). A new command
joins by adding its rows (``python -m transformer_jax.<name>`` for a package with ``__main__``, or a
script path). The inputs fail during validation, before anything compiles or trains.

Each command runs in a process of its own, with its own exit status, stdout and stderr: a fork of one
Python process (``Commands``) that imported jax and the libraries the entry points share once, so a row
takes a fraction of a second instead of the seconds of those imports. The entry point itself is imported
in the fork, as ``python -m`` / ``python script.py`` would, and the shared imports are checked once to
print nothing.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from transformer_jax.runtime import errors
from transformer_jax.training.workdir_lock import WorkdirLock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "<tmp>/missing_workdir"  # replaced by a path under the test's tmp_path
TINY_TRAIN = ("--config.data.synthetic_train_size=60", "--config.data.synthetic_dev_size=4",
              "--config.data.synthetic_test_size=4")

BAD_INPUTS = [
    ("train.py", ("--config.train.num_stepz=5",), "--config.train.num_stepz: the config has no field "
     "'num_stepz'; did you mean 'num_steps'?"),
    ("train.py", ("--config=configs/default.py", "--config.modle.d_model=8"), "did you mean 'model'?"),
    ("train.py", ("--config=no/such/config.py",), "--config=no/such/config.py: no such config file"),
    ("train.py", ("--config=configs/table3.py:nope",), "unknown Table 3 row 'nope'"),
    ("train.py", ("--config.train.num_steps=many",), "--config.train.num_steps=many"),
    ("train.py", ("--config.data.tokens_per_batch=1",), "config.data.tokens_per_batch=1 is smaller than "
     "one row of the smallest length bucket"),
    ("train.py", ("--config.data.tokens_per_batch=40",), "longest length bucket used (64 tokens"),
    ("train.py", ("stray",), "unexpected arguments ['stray']"),
    ("train.py", ("--config.data.length_buckets=(16,32)", "--config.data.length_buckets=(16,48)"),
     "the largest bucket is 48"),  # the last of a repeated tuple override, not the two joined
    ("evaluate.py", (f"--workdir={MISSING}",), f"{MISSING}: no such directory"),
    ("evaluate.py", ("--average_last=-1", "--workdir=."), "--average_last=-1"),
    ("transformer_jax.inspect", (f"--workdir={MISSING}", "--sentence= "), "--sentence is empty"),
    ("transformer_jax.inspect", (f"--workdir={MISSING}", "--sentence=Hi"), MISSING),
    ("transformer_jax.sweep", ("--grid=model.num_headz=1,2", "--launcher=print"),
     "did you mean 'num_heads'?"),
    ("transformer_jax.sweep", ("report",), "report needs --workdir"),
    ("transformer_jax.data.prepare", ("wmt99", "--dir=/tmp/unused"), "unknown data set 'wmt99'"),
    ("transformer_jax.benchmarks", ("--train_presets=nope",), "--train_presets"),
    ("transformer_jax.benchmarks.train_step", ("--presets=nope",), "nope"),
    ("transformer_jax.translate", (f"--workdir={MISSING}",), MISSING),
    ("transformer_jax.translate", ("--beam_size=0", "--workdir=."), "--beam_size=0"),
    ("transformer_jax.translate", ("--threads=2", "--workdir=."),
     "--threads applies to --engine=ctranslate2"),
    ("transformer_jax.translate", ("--engine=ctranslate2", "--threads=-1", "--workdir=."), "--threads=-1"),
    ("transformer_jax.export", (f"--workdir={MISSING}",), MISSING),
    ("transformer_jax.export", ("--quantization=int4",), "int4"),
    ("evaluate.py", ("--quantization=int8", "--workdir=."), "--quantization applies to --engine=ctranslate2"),
]


# Reads one request a line, [entry, args, environment, timeout]; answers [exit status, stdout, stderr]
# (kept in files in the folder argv[1] names).
SERVER = textwrap.dedent("""
    import gc, json, os, runpy, signal, sys
    import jax, transformer_jax.run_config, transformer_jax.training.loop  # what every entry point imports
    streams = {1: os.path.join(sys.argv[1], "stdout"), 2: os.path.join(sys.argv[1], "stderr")}
    gc.freeze()  # the forks' collections skip these objects (no copy of their pages at exit)
    print("ready", flush=True)
    for line in sys.stdin:
        entry, args, env, timeout = json.loads(line)
        pid = os.fork()
        if pid == 0:  # from here on this process is `python entry args`: it exits as that would
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in streams.items():
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.environ.clear()
            os.environ.update(env)
            signal.alarm(timeout)  # SIGALRM ends a command that hangs
            sys.argv = [entry, *args]
            if entry.endswith(".py"):
                runpy.run_path(entry, run_name="__main__")
            else:
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
            sys.exit(0)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps([status, *(open(path).read() for path in streams.values())]), flush=True)
""")


class Commands:
    """Runs entry points as ``python -m entry args`` / ``python script.py args`` would, each in a fork of
    one server process that imported the shared libraries once (``SERVER``). A context manager."""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory()
        env = {k: v for k, v in os.environ.items() if k != errors.TRACEBACK_ENV}
        with open(os.path.join(self._folder.name, "server_stderr"), "w+") as stderr:
            self._server = subprocess.Popen([sys.executable, "-c", SERVER, self._folder.name], cwd=REPO,
                                            env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=stderr)
            ready = self._server.stdout.readline()
            stderr.seek(0)
            imports_said = stderr.read()
        assert ready == "ready\n" and imports_said == "", imports_said  # (each command's own imports may)

    def run(self, entry: str, *args: str, traceback: bool = False,
            timeout: int = 180) -> subprocess.CompletedProcess:
        """``entry`` (a script under the repository or a module) with ``args``, from the repository root,
        in this environment without ``TRANSFORMER_JAX_TRACEBACK`` (set to 1 with ``traceback``)."""
        env = {k: v for k, v in os.environ.items() if k != errors.TRACEBACK_ENV}
        if traceback:
            env[errors.TRACEBACK_ENV] = "1"
        self._server.stdin.write(json.dumps([entry, args, env, timeout]) + "\n")
        self._server.stdin.flush()
        answer = self._server.stdout.readline()
        assert answer, f"the command server ended: {self._server.wait()}"
        status, stdout, stderr = json.loads(answer)
        return subprocess.CompletedProcess([entry, *args], status, stdout, stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=60)
        self._folder.cleanup()


@pytest.fixture(scope="module")
def commands():
    with Commands() as server:
        yield server


def assert_one_error_line(result: subprocess.CompletedProcess, *named: str) -> str:
    """Exit status 1 (the sweep's: 2), nothing but ``error: ...`` and the hint on stderr, no traceback."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode in (1, 2), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert len(lines) == 1 or lines[1] == f"(set {errors.TRACEBACK_ENV}=1 for the traceback)", lines
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("entry,args,expected", BAD_INPUTS,
                         ids=[f"{e}:{' '.join(a)}" for e, a, _ in BAD_INPUTS])
def test_a_bad_input_is_one_error_line(entry, args, expected, tmp_path, commands):
    workdir = [] if entry != "train.py" else [f"--workdir={tmp_path / 'w'}"]
    result = commands.run(entry, *workdir, *(a.replace("<tmp>", str(tmp_path)) for a in args))
    assert_one_error_line(result, expected.replace("<tmp>", str(tmp_path)))
    assert not (tmp_path / "w").exists() and not (tmp_path / "missing_workdir").exists()  # nothing made


def test_vocab_size_beyond_the_corpus_fails_before_the_tokenizer_trains(tmp_path, commands):
    workdir = tmp_path / "w"
    result = commands.run("train.py", f"--workdir={workdir}", *TINY_TRAIN,  # more than the corpus can give,
                          "--config.data.vocab_size=20000")  # and a train step the host can hold
    line = assert_one_error_line(result, "config.data.vocab_size=20000 is too large for this training "
                                 "corpus", "pieces; set data.vocab_size well below")
    assert "SentencePiece can build" not in line  # the bound from the words, not a trained tokenizer
    assert not (workdir / "checkpoints").exists() and not (workdir / "tokenizer").exists()


def test_a_second_run_on_a_busy_workdir_is_one_error_line(tmp_path, commands):
    workdir = tmp_path / "busy"
    with WorkdirLock(str(workdir)):  # this process is the live run
        result = commands.run("train.py", f"--workdir={workdir}", *TINY_TRAIN)
    assert_one_error_line(result, f"workdir {workdir} is in use by another run: pid {os.getpid()}")


def test_evaluate_errors_come_without_orbax_warnings(tmp_path, commands):
    (tmp_path / "checkpoints").mkdir()  # read (and found empty) before the error
    result = commands.run("evaluate.py", f"--workdir={tmp_path}")
    assert_one_error_line(result, "no checkpoint")
    assert "read only" not in result.stderr and "W1" not in result.stderr
