"""How the data cache builds an entry in other processes, and how such a build ends under faults.

A build of a corpus over ``corpora.SMALL_BYTES`` runs in a builder process started as a fresh interpreter
(``python -c``, running ``cache_build.main``), never by re-importing the caller's ``__main__``: a script
without an ``if __name__ == "__main__"`` guard builds as well as train.py does. The builder hands row
ranges (chunks) to a ``WorkerPool`` of spawned workers, one chunk per worker at a time, so it always knows
which worker holds which chunk.

Faults:
- a worker that dies (SIGKILL from the out-of-memory killer) names its chunk in one line on stderr and the
  chunk is encoded again in a new worker; a second death of the same chunk ends the build with one line
  (``WorkerDiedError``). A builder that dies ends the run the same way. Either way the entry's lock is
  released, and the chunks finished so far stay on disk for the next start.
- SIGTERM, SIGINT or SIGUSR1 during a build (``stopping``), to the run or to its whole process group, stop
  the build within seconds: the workers ignore the signals and the builder stops them. The run prints one
  line and exits 0, as training does in its other phases; a signal that comes while the run waits for
  another process's build stops the wait the same way. The handler the run had before (training's
  ``PreemptionGuard``) is told of every signal as it comes, so a signal that came as the entry was finished
  stops the run after its set-up.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tqdm

from transformer_jax.data import disk_cache
from transformer_jax.runtime import errors
from transformer_jax.runtime.errors import UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SIGUSR1: the Slurm time-limit warning
STOP_GRACE_SECONDS = 10.0  # a builder told to stop is killed after this (it stops within a second or so)
# The builder's program: its __main__ is no file, so its spawned workers import no main module either.
_BUILDER = "import sys; from transformer_jax.data import cache_build; cache_build.main(sys.argv[1:])"
DISK_FULL_STATUS = 75  # the builder's exit status when the disk is too full for its reply
_POLL_SECONDS = 0.25  # how often a waiting process looks for a signal or a dead worker


class BuildStopped(Exception):
    """A stop signal ended a build; ``detail`` says what it keeps."""

    def __init__(self, signum: int, detail: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.detail = signum, detail


class WorkerDiedError(UserError, RuntimeError):
    """A build's worker or builder process died (most often the out-of-memory killer's SIGKILL)."""


def die_with_parent(parent: int | None = None) -> None:
    """Has the kernel end this process when its parent dies (Linux), so that a build whose run was killed
    does not go on in the background; ``parent``: the pid the parent had, in case it died already."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (linux/prctl.h)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def how_it_died(exitcode: int | None) -> str:
    """Words for a dead process's exit code, naming the out-of-memory killer's signal as the likely cause."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"was killed by {name}{' (most likely the out-of-memory killer)' if name == 'SIGKILL' else ''}"
    return f"exited with status {exitcode}"


# ----------------------------------------------------------------------------- in the builder: workers

_stop_signal: list[int] = []  # the stop signal this builder process received, if any


def stop_signal() -> int | None:
    """The stop signal this builder process received, or None."""
    return _stop_signal[0] if _stop_signal else None


def _worker_main(conn: Any) -> None:
    for signum in STOP_SIGNALS:  # the builder decides when its workers stop
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent()
    if (start_up := _receive(conn)) is None:
        return
    try:
        initializer, initargs = start_up
        initializer(*initargs)
        failed = None
    except Exception as e:
        failed = e
    while (message := _receive(conn)) is not None:
        function, task = message
        try:
            if failed is not None:
                raise failed
            reply = (True, function(task))
        except Exception as e:
            reply = (False, _picklable(e))
        conn.send(reply)


def _receive(conn: Any) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _picklable(error: Exception) -> Exception:
    """``error`` if it is a user error that survives pickling, an ``OSError(ENOSPC)`` naming its file for a
    full disk (which the data cache reports in one line), else a RuntimeError holding its traceback."""
    if disk_cache.is_full(error) and not isinstance(error, UserError):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(error, "filename", None))
    if isinstance(error, UserError):
        with contextlib.suppress(Exception):
            pickle.loads(pickle.dumps(error))
            return error
    return RuntimeError("a data cache worker process failed:\n" + "".join(traceback.format_exception(error)))


class WorkerPool:
    """``processes`` spawned workers, each running ``initializer(*initargs)`` once, then tasks one at a time.

    ``run`` yields ``(index, result)`` as tasks finish. A worker that dies is replaced and its task tried
    once more; a task whose worker dies twice raises ``WorkerDiedError``, naming the task by ``labels`` and
    ending with ``hint``. A stop signal (``stop_signal``) raises ``BuildStopped``. Leaving the pool (``with``)
    ends every worker, at once if a task was still running.
    """

    def __init__(self, processes: int, initializer: Callable[..., None], initargs: tuple, *, hint: str = ""):
        self._context = multiprocessing.get_context("spawn")
        self._initializer, self._initargs, self._hint = initializer, initargs, hint
        self._processes = processes
        if hasattr(signal, "pthread_sigmask"):  # the resource tracker's default SIGUSR1 action would end it
            from multiprocessing import resource_tracker

            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            try:
                resource_tracker.ensure_running()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self._workers: list[tuple[Any, Any]] = []
        for _ in range(processes):
            self._start()

    def _start(self) -> tuple[Any, Any]:
        """A new worker. Its start-up data (a corpus's line offsets: 72 MB at WMT's size) goes through its
        own connection, not through spawn's start-up pipe: a process killed while it reads that pipe leaves
        the parent blocked writing it (the parent keeps the pipe's read end open until it has written
        all). A worker that dies while it reads its connection closes it, and the send ends."""
        conn, child_conn = self._context.Pipe()
        process = self._context.Process(target=_worker_main, daemon=True, args=(child_conn,))
        process.start()
        child_conn.close()
        with contextlib.suppress(OSError):  # it died: found when it is given a task
            conn.send((self._initializer, self._initargs))
        self._workers.append((process, conn))
        return process, conn

    def run(self, function: Callable[[Any], Any], tasks: Sequence[Any],
            labels: Sequence[str]) -> Iterator[tuple[int, Any]]:
        queue, busy, deaths = collections.deque(range(len(tasks))), {}, collections.Counter()
        idle = list(self._workers)
        while queue or busy:
            while idle and queue:
                worker, index = idle.pop(), queue.popleft()
                try:
                    worker[1].send((function, tasks[index]))
                    busy[worker] = index
                except OSError:  # it died while it started or waited
                    queue.appendleft(index)
                    message = f"a worker process {how_it_died(self._bury(worker))} before it took a task"
                    deaths[None] += 1  # None: no task
                    if deaths[None] > self._processes:  # as many as the pool has: new ones would die too
                        raise WorkerDiedError(f"{message}, {deaths[None]} times; {self._hint}".rstrip("; ")
                                              ) from None
                    tqdm.tqdm.write(f"data: {message}; starting another", file=sys.stderr)
                    idle.append(self._start())
            waitables = [w[1] for w in busy] + [w[0].sentinel for w in busy]
            multiprocessing.connection.wait(waitables, timeout=_POLL_SECONDS)
            if (signum := stop_signal()) is not None:
                raise BuildStopped(signum)
            for worker in list(busy):
                process, conn = worker
                if conn.poll():
                    if (reply := _receive(conn)) is None:  # the pipe closed: the worker is gone
                        process.join(STOP_GRACE_SECONDS)
                elif process.is_alive():
                    continue
                else:
                    reply = None
                index = busy.pop(worker)
                if reply is not None:
                    idle.append(worker)
                    ok, value = reply
                    if not ok:
                        raise value
                    yield index, value
                    continue
                deaths[index] += 1
                message = f"the worker process reading {labels[index]} {how_it_died(self._bury(worker))}"
                if deaths[index] > 1:
                    raise WorkerDiedError(f"{message}, twice; {self._hint}".rstrip("; "))
                tqdm.tqdm.write(f"data: {message}; reading it again in a new worker", file=sys.stderr)
                idle.append(self._start())
                queue.appendleft(index)

    def _bury(self, worker: tuple[Any, Any]) -> int | None:
        """Leaves out the dead ``worker``; returns its exit code."""
        process, conn = worker
        if process.is_alive():
            process.kill()
        process.join()
        conn.close()
        self._workers.remove(worker)
        return process.exitcode

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for process, conn in self._workers:
            if exc_info[0] is None:
                with contextlib.suppress(OSError):
                    conn.send(None)
            else:
                process.kill()
        for process, conn in self._workers:
            process.join(STOP_GRACE_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()


def in_order(results: Iterator[tuple[int, Any]]) -> Iterator[Any]:
    """The results of ``WorkerPool.run`` in the order of their tasks."""
    waiting, following = {}, 0
    for index, result in results:
        waiting[index] = result
        while following in waiting:
            yield waiting.pop(following)
            following += 1


def main(argv: Sequence[str]) -> None:
    """The builder process: runs the pickled request in ``argv[0]`` and writes the outcome beside it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: _stop_signal.append(signum))
    with open(argv[0], "rb") as f:
        parent, path = pickle.load(f)
        die_with_parent(parent)
        sys.path[:] = path  # the caller's modules, so that what it pickled can be read
        function, args, reply = pickle.load(f)
    try:
        outcome = {"result": function(*args)}
    except BuildStopped as e:
        outcome = {"stopped": e.signum, "detail": e.detail}
    except Exception as e:  # a bug's traceback is in the error the run raises (or replaces)
        outcome = {"error": _picklable(e)}
    partial = Path(f"{reply}.tmp")
    try:
        with open(partial, "wb") as f:
            pickle.dump(outcome, f)
        disk_cache.share(partial, partial.parent)
        os.replace(partial, reply)
    except OSError as e:
        if not disk_cache.is_full(e):
            raise
        sys.exit(DISK_FULL_STATUS)  # the run says it in one line
    finally:
        partial.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- in the run


class _Stopping:
    """The stop signals' handlers of one ``stopping`` block; see there."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.building = False
        self.previous: dict[int, Any] = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        previous = self.previous.get(signum)
        if self._passes_on(previous):
            previous(signum, frame)
        if not self.building:  # waiting for another process's build, or reading an entry
            raise BuildStopped(signum)

    @staticmethod
    def _passes_on(previous: Any) -> bool:
        return callable(previous) and previous is not signal.default_int_handler


_active: list[_Stopping] = []


@contextlib.contextmanager
def stopping(what: str, *, enabled: bool = True) -> Iterator[None]:
    """Within this block a stop signal ends the build (``run_builder``) or the wait for another process's
    build: one line on stdout, then ``SystemExit(0)``. A handler the process had before (training's
    ``PreemptionGuard``) is told of every signal too; without one (the default action), a signal that came
    as the entry was finished ends the run after the block in the same way. Off the main thread, or with
    ``enabled`` False, the block changes nothing."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = _Stopping()
    for signum in STOP_SIGNALS:
        state.previous[signum] = signal.signal(signum, state.handle)
    _active.append(state)
    try:
        yield
    except BuildStopped as e:
        _restore(state)
        doing = "building" if state.building else "waiting for another process that builds"
        kept = f": {e.detail}" if e.detail else ""
        errors.print_line(f"Stopped by {signal.Signals(e.signum).name} while {doing} {what}{kept}. Run the "
                          "same command again to go on.")
        raise SystemExit(0) from None
    finally:
        _restore(state)
    previous = state.previous.get(state.signum)
    if state.signum is not None and not _Stopping._passes_on(previous) and previous != signal.SIG_IGN:
        name = signal.Signals(state.signum).name
        errors.print_line(f"Stopped by {name} once {what} was whole, in the data cache. Run the same command "
                          "again to go on.")
        raise SystemExit(0)


def _restore(state: _Stopping) -> None:
    if state in _active:
        _active.remove(state)
        for signum, handler in state.previous.items():
            signal.signal(signum, handler)


def run_builder(function: Callable[..., Any], *args: Any, folder: Path) -> Any:
    """``function(*args)`` in a builder process (a fresh interpreter, whose memory goes back to the system
    when it ends); its user errors come back raised, a stop signal as ``BuildStopped``. ``folder`` holds
    the request and the reply while it runs."""
    state = _active[-1] if _active else None
    if state is not None:
        state.building = True
    disk_cache.make_dirs(folder)
    tag = disk_cache.process_tag()
    request, reply = folder / f"request-{tag}.pickle", folder / f"reply-{tag}.pickle"
    reply.unlink(missing_ok=True)
    with open(request, "wb") as f:
        pickle.dump((os.getpid(), sys.path), f)
        pickle.dump((function, args, reply), f)
    disk_cache.share(request, folder)
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (package_root,
                                                                      os.environ.get("PYTHONPATH")))))
    process = subprocess.Popen([sys.executable, "-c", _BUILDER, str(request)], env=env,
                               stdin=subprocess.DEVNULL)
    told = None
    try:
        while process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_POLL_SECONDS)
            if state is not None and state.signum is not None and process.poll() is None:
                if told is None:
                    told = time.monotonic()
                    process.send_signal(signal.SIGTERM)  # a signal to this process alone reaches it too
                elif time.monotonic() - told > STOP_GRACE_SECONDS:
                    process.kill()  # e.g. inside SentencePiece's training, which checks for nothing
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        request.unlink(missing_ok=True)
    outcome = pickle.loads(reply.read_bytes()) if reply.is_file() else {}
    reply.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a build that keeps nothing there (the tokenizer's) leaves nothing
        folder.rmdir()
    if "result" in outcome:  # whole, whatever came meanwhile (``stopping`` passes a signal on)
        return outcome["result"]
    signum = outcome.get("stopped") or (state.signum if state is not None else None)
    if signum:
        raise BuildStopped(signum, outcome.get("detail"))
    if "error" in outcome:
        raise outcome["error"]
    if process.returncode == DISK_FULL_STATUS:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(reply))
    raise WorkerDiedError(f"the data cache's builder process {how_it_died(process.returncode)}; the chunks "
                          "it finished are kept, and the same command goes on from them")

