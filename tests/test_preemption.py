"""Tests for transformer_jax.training.preemption: SIGTERM / SIGINT become "save and stop", agreed by hosts."""

import os
import signal
import sys
import time

import jax
import numpy as np
import pytest
import tqdm

from transformer_jax.training import preemption
from transformer_jax.training.preemption import PreemptionGuard


def test_preemption_guard_sigterm_sets_flag_and_restores_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.should_stop(2)
    assert {s: signal.getsignal(s) for s in before} == before


def test_preemption_guard_second_signal_reaches_previous_handler():
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        with PreemptionGuard(repeat_window=0.2) as guard:
            os.kill(os.getpid(), signal.SIGINT)
            assert guard.should_stop(1) and received == []  # first Ctrl-C: only the flag
            os.kill(os.getpid(), signal.SIGINT)
            assert received == []  # within the window: the same request again (scheduler + launcher)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
            assert received == [signal.SIGINT]  # a later Ctrl-C: the handler from before the guard
        assert signal.getsignal(signal.SIGINT) is not None
    finally:
        signal.signal(signal.SIGINT, previous)


def test_preemption_guard_check_every():
    with PreemptionGuard(check_every=5) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert [s for s in range(1, 11) if guard.should_stop(s)] == [5, 10]
    with pytest.raises(ValueError, match=r"check_every.*\b0\b"):
        PreemptionGuard(check_every=0)


def test_preemption_guard_several_processes_agree(monkeypatch):
    # Pretend to be one of 2 processes; the other one received the signal, this one did not.
    gathered = []

    def fake_allgather(local_flag):
        gathered.append(int(local_flag))
        return np.array([int(local_flag), 1])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(preemption.multihost_utils, "process_allgather", fake_allgather)
    with PreemptionGuard() as guard:
        assert guard.check_every == 10
        assert [s for s in range(1, 21) if guard.should_stop(s)] == [10, 20]
    assert gathered == [0, 0]  # one collective per check step, carrying this process's (unset) flag


def test_interrupting_raises_at_once_and_only_inside_the_block():
    with PreemptionGuard() as guard:
        with pytest.raises(preemption.Preempted, match="SIGTERM"):
            with guard.interrupting():
                os.kill(os.getpid(), signal.SIGTERM)
                raise AssertionError("not interrupted")  # the handler raises before this line
        assert guard.requested and guard.signal_name == "SIGTERM"
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)  # outside the block: only the flag
        assert guard.should_stop(1)
        with pytest.raises(preemption.Preempted, match="SIGINT"):  # a signal already received
            with guard.interrupting():
                raise AssertionError("not interrupted")


def test_the_first_signals_message_is_a_line_of_its_own_below_the_progress_bar(capsys):
    """The progress bar leaves the cursor at the end of its line; the message clears it and starts a line."""
    bar = tqdm.tqdm(total=10, file=sys.stderr, mininterval=0)
    bar.update(3)
    with PreemptionGuard():
        os.kill(os.getpid(), signal.SIGTERM)
    bar.close()
    err = capsys.readouterr().err
    before, found, _ = err.partition("Received SIGTERM: will save a checkpoint")
    assert found and before.endswith(("\r", "\n")), repr(err)
