"""Workarounds for what orbax-checkpoint does after a save fails; the Checkpointer is the only user.

When a save fails (a full disk, most often), orbax

1. logs the failure, traceback included, from each thread that saw it: the item's write thread, the
   background save thread and the finalize thread, then the other items' writes failing after them.
   The Checkpointer reports the failure once, as ``DiskFullError`` naming the step and the last good
   checkpoint; :class:`DiskFullLogFilter` drops orbax's copies of it (and no other records). So too
   asyncio's "Task exception was never retrieved" of a failed write that orbax never awaited: whether one
   is left depends on timing (a real full tmpfs printed it in about one run in ten).
2. leaves tensorstore writes running after the event loop that awaited them is closed: orbax runs each
   item's writes in ``asyncio_utils.run_sync``, which returns at the first failed write and closes its
   loop; each write still in flight then ends by scheduling its callback on that closed loop, and Python
   prints an unraisable ``RuntimeError: Event loop is closed`` traceback per array.
   :func:`drop_closed_loop_callbacks` drops those, and passes every other unraisable exception on.
3. raises from ``wait_until_finished`` (or ``save``) at the first failed item, while the other items'
   commit threads are still writing into the step's ``.orbax-checkpoint-tmp`` directory. Removing that
   directory then races the writes (a write can land after the removal), and the threads outlive the
   error that ends the program. :func:`join_commit_threads` waits for them before the directory goes.

Each is tested (``tests/test_orbax_workarounds.py``) by turning it off and showing the symptom.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from transformer_jax.runtime import disk

# Each item's commit (its writes and its metadata) runs in a thread of this class. It is private to orbax
# (orbax-checkpoint 0.12 keeps it here): where a later release moves it, no thread is recognized, and
# join_commit_threads waits for none (the race it closes is back, the program still runs).
try:
    from orbax.checkpoint._src.futures import future as orbax_future

    COMMIT_THREAD: type | None = orbax_future._SignalingThread
except (ImportError, AttributeError):
    COMMIT_THREAD = None


# Where orbax's failures are logged: its own records go through absl; a failed write task it never
# awaited is reported by asyncio when the task is collected.
LOGGERS = ("absl", "asyncio")


class DiskFullLogFilter(logging.Filter):
    """Drops the records that report a full disk: orbax's own, and asyncio's of unawaited write tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" and "/orbax/" not in record.pathname.replace(os.sep, "/"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to drop
            return True
        return not (disk.is_disk_full(error) or disk.is_disk_full(Exception(message)))


def quiet_disk_full_logs() -> None:
    """Installs :class:`DiskFullLogFilter` on the ``LOGGERS`` (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DiskFullLogFilter) for f in logger.filters):
            logger.addFilter(DiskFullLogFilter())


def is_closed_loop_callback(unraisable: Any) -> bool:
    """Whether ``unraisable`` (a ``sys.unraisablehook`` argument) is a write ending on a closed loop."""
    value = unraisable.exc_value
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def drop_closed_loop_callbacks() -> None:
    """Wraps ``sys.unraisablehook`` to drop :func:`is_closed_loop_callback` exceptions (idempotent)."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook._drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def install() -> None:
    """Installs the process-wide workarounds (1 and 2); the Checkpointer calls it when created."""
    quiet_disk_full_logs()
    drop_closed_loop_callbacks()


def join_commit_threads(timeout_s: float = 120.0) -> None:
    """Waits (at most ``timeout_s`` in all) for orbax's commit threads, still writing after a failed save.

    Their own failures (most often the same full disk) are not raised: the first one is the one reported.
    """
    if COMMIT_THREAD is None:
        return
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if isinstance(thread, COMMIT_THREAD) and thread is not threading.current_thread():
            # threading.Thread's join: the commit thread's own join raises the thread's failure.
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
