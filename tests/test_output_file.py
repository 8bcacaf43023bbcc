"""The claim on a set of outputs (``output_file.claim``, evaluate.py's ``claimed_outputs``): one holder at a
time, a killed holder's claim taken over by exactly one of the runs racing for it, with real processes and
with every interleaving of two claimants at the claim's system calls."""

import builtins
import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from transformer_jax.evaluation import evaluate_args
from transformer_jax.runtime import output_file
from transformer_jax.runtime.errors import ConfigError, UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dead_claim(tmp_path, name: str = "dev-6") -> str:
    """The stem of outputs whose claim file a killed run left (its pid no longer runs on this host)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".{name}.claim").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    return str(tmp_path / name)


# One racer: waits for the start file, claims the outputs, says so and holds them for a while.
_RACER = """
import os, sys, time
from transformer_jax.evaluation import evaluate_args
from transformer_jax.runtime.errors import UserError
stem, start = sys.argv[1], sys.argv[2]
while not os.path.exists(start):
    time.sleep(0.001)
try:
    with evaluate_args.claimed_outputs(stem, overwrite=True):
        print("claimed", flush=True)
        time.sleep(2)
except UserError as e:
    print("refused:", e, flush=True)
"""


def test_of_processes_racing_for_a_killed_runs_claim_exactly_one_gets_it(tmp_path):
    stem = _dead_claim(tmp_path)
    start = str(tmp_path / "start")
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, stem, start], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(6)]
    time.sleep(1.0)  # all started and spinning on the start file
    open(start, "w").close()
    outputs = [racer.communicate(timeout=120) for racer in racers]
    said = [out.strip() for out, _ in outputs]
    assert all(racer.returncode == 0 for racer in racers), [err for _, err in outputs]
    assert sum(line == "claimed" for line in said) == 1, said
    assert all(line == "claimed" or line.startswith("refused: another evaluate.py (pid ") for line in said)
    assert os.listdir(tmp_path) == ["start"]  # the claim is gone with its holder


# The calls at which a second claimant may run between the first's steps: whatever the claim does
# (create, read, remove or rename the claim file, lock it), the second must not also get the outputs.
_CALLS = [("os", "open"), ("os", "remove"), ("os", "rename"), ("os", "stat"), ("os", "fstat"),
          ("fcntl", "flock"), ("builtins", "open")]


@pytest.mark.parametrize("module, call", _CALLS, ids=[f"{m}.{c}" for m, c in _CALLS])
def test_a_second_claimant_arriving_at_any_step_of_a_takeover_is_refused(tmp_path, monkeypatch, module, call):
    """The first run takes over a killed run's claim; the second arrives at the first's first call of
    ``module.call`` (it claims, and holds what it got until the end). At most one of them may hold the
    outputs at once, and the claim is left to nobody."""
    stem = _dead_claim(tmp_path)
    target = {"os": os, "fcntl": fcntl, "builtins": builtins}[module]
    original, second, fired = getattr(target, call), contextlib.ExitStack(), []

    def second_arrives(*args, **kwargs):
        if not fired:
            fired.append(True)
            try:
                second.enter_context(evaluate_args.claimed_outputs(stem, overwrite=True))
                fired.append("claimed")
            except UserError:
                fired.append("refused")
        return original(*args, **kwargs)

    holders = []
    with second:
        monkeypatch.setattr(target, call, second_arrives)
        try:
            with evaluate_args.claimed_outputs(stem, overwrite=True):
                holders.append("first")
                monkeypatch.undo()
        except UserError:
            pass
        monkeypatch.undo()
        if "claimed" in fired:
            holders.append("second")
    if fired:
        assert len(holders) <= 1, holders
    assert len(holders) >= 1, holders  # nobody refused without a live holder
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".claim")]


def test_a_live_holder_is_named_and_its_claim_survives_the_refusal(tmp_path):
    stem = str(tmp_path / "dev-6")
    with evaluate_args.claimed_outputs(stem, overwrite=False):
        with pytest.raises(UserError) as error:
            with evaluate_args.claimed_outputs(stem, overwrite=False):
                pytest.fail("claimed twice")
        holder = f"(pid {os.getpid()} on {socket.gethostname()})"
        assert str(error.value).startswith(f"another evaluate.py {holder} is writing {stem}.txt and .json")
        assert os.path.exists(tmp_path / ".dev-6.claim")
    assert os.listdir(tmp_path) == []


def test_a_filesystem_without_locks_runs_unclaimed_with_a_warning(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with output_file.claim(str(tmp_path / ".out.claim")):
        pass
    assert "two runs writing the same outputs at once are not detected" in caplog.text


@contextlib.contextmanager
def unwritable_folders(tmp_path):
    """``[(folder, what the one-line error says of it)]`` for output folders that cannot be made or written:
    one under a file; one on a read-only tmpfs (as root where mount works), else in a folder without write
    permission (not as root, which writes anyway)."""
    (tmp_path / "a_file").write_text("x")
    cases = [(str(tmp_path / "a_file" / "out"), f"{tmp_path / 'a_file'} is a file, not a folder")]
    point = tmp_path / "read_only"
    point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(point)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    if mounted:
        cases.append((str(point / "out"), "cannot write there (Read-only file system)"))
    elif os.geteuid() != 0:
        point.chmod(0o555)
        cases.append((str(point / "out"), "cannot write there (Permission denied)"))
    try:
        yield cases
    finally:
        if mounted:
            subprocess.run(["umount", str(point)])


def test_an_output_folder_that_cannot_be_written_is_one_line_naming_the_flag(tmp_path):
    with unwritable_folders(tmp_path) as cases:
        for folder, reason in cases:
            with pytest.raises(ConfigError) as error:
                output_file.check_folder(folder, flag="--out")
            assert str(error.value) == f"--out={folder}: {reason}; choose another --out"
    output_file.check_folder(str(tmp_path / "new" / "out"), flag="--out")  # made, parents included
    assert os.listdir(tmp_path / "new" / "out") == []  # the probe is gone


def test_a_stop_signal_waits_for_the_end_of_the_held_block():
    written = []
    with pytest.raises(KeyboardInterrupt):
        with output_file.stop_signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            written.append("first")
            os.kill(os.getpid(), signal.SIGINT)  # a second one while held: still one delivery
            written.append("second")
    assert written == ["first", "second"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler from before again
