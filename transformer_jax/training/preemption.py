"""Preemption: SIGTERM / SIGINT become "save a checkpoint and stop at the next step", agreed across hosts.

A training run holds one guard from setup to the end, so a signal in any phase ends it cleanly (exit 0):
during setup (tokenizer, initialization, restore) it is noticed once setup is done, before the first step;
during the loop the run saves at the next step and stops; inside ``guard.interrupting()`` (the final
evaluation, which saves nothing) it raises ``Preempted`` at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax.runtime import errors

_log = logging.getLogger(__name__)


class Preempted(Exception):
    """A SIGTERM / SIGINT arrived inside ``PreemptionGuard.interrupting()``."""


class PreemptionGuard:
    """Turns SIGTERM / SIGINT into a request to save and stop: ``with PreemptionGuard() as guard: ...``.

    In the loop: ``if guard.should_stop(step): save(step, force=True); break``. The first signal only sets a
    flag (and is logged). A second one acts as without the guard (KeyboardInterrupt / termination) for a
    user who wants out now, unless it comes within ``repeat_window`` seconds of the first: that is the
    same request delivered twice (Slurm signals every process of a job, and a sweep launcher forwards
    the one it got), and it is ignored. On exit the previous handlers return.

    Several processes must stop at the same step, but a signal may reach only some hosts. With
    ``jax.process_count() > 1`` the local flags are combined by ``process_allgather`` (any host asked -> all
    stop) every ``check_every`` steps; between checks ``should_stop`` is False. That is one tiny collective
    per check, so the default is 1 for a single process (no collective at all) and 10 for several. Every
    process must call ``should_stop`` at every step. (JAX's own preemption service,
    ``multihost_utils.reached_preemption_sync_point``, is an alternative once ``jax.distributed.initialize``
    ran with it enabled.)

    Signal handlers can only be installed from the main thread; elsewhere a warning is logged and the guard
    never fires.
    """

    def __init__(
        self, *, check_every: int | None = None, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        repeat_window: float = 1.0,
    ):
        if check_every is None:
            check_every = 1 if jax.process_count() == 1 else 10
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        self.signals = tuple(signals)
        self.repeat_window = repeat_window
        self._requested_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}
        self._requested: int | None = None  # the signal number received, if any
        self._interrupting = False

    @property
    def requested(self) -> bool:
        """Whether this process received a signal (before any agreement with other processes)."""
        return self._requested is not None

    @property
    def signal_name(self) -> str | None:
        """"SIGTERM" or "SIGINT" once a signal arrived, else None."""
        return None if self._requested is None else signal.Signals(self._requested).name

    def _handle(self, signum, frame) -> None:
        if self._requested is not None:
            if time.monotonic() - self._requested_at < self.repeat_window:
                return  # the first request, delivered again
            previous = self._previous.get(signum, signal.SIG_DFL)
            self._restore_handlers()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signum)
            return
        self._requested, self._requested_at = signum, time.monotonic()
        if self._interrupting:
            raise Preempted(f"received {self.signal_name}")
        errors.print_line(f"Received {self.signal_name}: will save a checkpoint and stop at the next step "
                          "check. Send it again to quit now.", file=sys.stderr)  # below the progress bar

    @contextlib.contextmanager
    def interrupting(self):
        """Within this block a signal (or one already received) raises ``Preempted`` instead of waiting
        for a step check: for phases that save nothing, such as the final evaluation. One process only."""
        if self.requested:
            raise Preempted(f"received {self.signal_name}")
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> PreemptionGuard:
        try:
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread
            self._restore_handlers()
            _log.warning("PreemptionGuard: not in the main thread, cannot install signal handlers")
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore_handlers()

    def should_stop(self, step: int) -> bool:
        """True if the run should save and stop after ``step``; the same answer on every process."""
        if jax.process_count() == 1 and self.check_every == 1:
            return self.requested
        if step % self.check_every != 0:
            return False
        if jax.process_count() == 1:
            return self.requested
        flags = multihost_utils.process_allgather(np.asarray(self.requested, dtype=np.int32))
        return bool(np.any(flags))
