"""A result file written whole or not at all, and checked before the work that fills it.

``OutputFile(path)`` checks at once that ``path`` can be written (its folder exists and takes files, it is
not a folder itself) by creating an empty temporary file beside it (``.<name>.<pid>.tmp``; one left by a
killed process is removed the next time); ``write(text)`` fills that file,
flushes it to disk and renames it over ``path``. A crash at any point leaves the previous ``path``, or
none, never a partial one. ``write_stdout`` is the same contract's half that stdout allows: a full disk
or a closed pipe is one line, not a traceback. ``claim`` holds a set of outputs for one process at a time.
``check_folder`` checks an output folder (a command's ``--out``) before any work. ``stop_signals_held``
holds SIGINT and SIGTERM back while files that belong together are written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import ConfigError, DiskFullError, UserError

_log = logging.getLogger(__name__)


class OutputFile:
    """``with OutputFile(path, flag="--output") as out: ...; out.write(text)``.

    Raises ConfigError (one line) on entry when ``path`` is a folder, its folder is missing, or the folder
    takes no new file (read-only filesystem, no permission). Leaving the block without ``write``, or by
    an exception, removes the temporary file and keeps ``path`` as it was.
    """

    def __init__(self, path: str, *, flag: str = "--output"):
        self.path, self.flag = path, flag
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ConfigError(f"{flag}={path} is a folder; expected a file path, e.g. {flag}={path}/out.txt")
        if not os.path.isdir(folder):
            raise ConfigError(f"{flag}={path}: the folder {folder} does not exist; create it first")
        _remove_orphans(folder, os.path.basename(path))
        self._tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            os.close(os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except OSError as e:
            self._tmp = None
            raise ConfigError(f"{flag}={path}: cannot write in {folder} ({e.strerror}); choose another "
                              "path") from None

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()

    def discard(self) -> None:
        """Removes the temporary file, if it is still there."""
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._tmp)
            self._tmp = None

    def write(self, text: str) -> None:
        """Writes ``text`` (UTF-8) to ``path`` atomically; DiskFullError names ``path``'s filesystem."""
        try:
            with open(self._tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp, self.path)
            self._tmp = None
        except OSError as e:
            self.discard()
            if disk.is_disk_full(e):
                raise DiskFullError(
                    f"no space left writing {self.flag}={self.path}: {disk.describe_filesystem(self.path)} "
                    "ran out of space; nothing was written (an earlier file there is kept). Free some "
                    f"space or choose another {self.flag}") from None
            raise


def check_folder(path: str, *, flag: str) -> None:
    """Makes the folder ``path`` (and its parents) where missing, and a file in it that is removed at once.

    Raises ConfigError, one line naming ``flag``, when it cannot: a file where a folder should be, a
    read-only filesystem, no permission. Commands that fill a folder call it before any work.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        folder = Path(os.path.abspath(path))
        a_file = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{a_file} is a file, not a folder" if a_file else f"cannot write there ({e.strerror or e})"
        raise ConfigError(f"{flag}={path}: {reason}; choose another {flag}") from None


def process_is_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (another user's live process is not gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


class ClaimHeldError(UserError):
    """Another live process holds the claim; ``holder`` is what it wrote there ({} while it writes)."""

    def __init__(self, path: str, holder: dict):
        super().__init__(f"{path} is held by pid {holder.get('pid', '?')} on {holder.get('host', '?')}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def claim(path: str) -> Iterator[None]:
    """``with claim(path): ...``: this process holds ``path`` until the block ends; ClaimHeldError if a
    live process holds it.

    The claim is an exclusive ``flock`` on the file ``path``, which holds the holder's pid and host for
    the message. The kernel drops the lock when its process dies (kill -9 included), so a claim left by a
    killed run is taken over by whoever locks it first: the takeover is one atomic ``flock``, and of any
    number of runs racing for a dead claim exactly one gets it. The file is removed, still locked, when
    the block ends; a run that locked a file removed or replaced meanwhile tries again. Where the
    filesystem takes no locks, the block runs unclaimed, with a warning.
    """
    fd = _lock(path)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.remove(path)  # while locked: a waiter that opened this file sees it gone and retries
            os.close(fd)


def _lock(path: str) -> int | None:
    """An open descriptor holding ``flock(path)`` with this process's pid and host written in, or None
    where the filesystem takes no locks."""
    for _ in range(100):  # each retry means another run released or replaced the file meanwhile
        try:
            fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), True
        except PermissionError:  # another user's claim file: flock needs only a read-only descriptor
            fd, writable = os.open(path, os.O_RDONLY), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ClaimHeldError(path, _read_holder(path)) from None
        except OSError as e:  # ENOLCK, EINVAL, EOPNOTSUPP: a filesystem without locks
            os.close(fd)
            _log.warning("cannot lock %s (%s): two runs writing the same outputs at once are not detected "
                         "on this filesystem", path, e.strerror or e)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same and not writable:
            os.remove(path)  # locked, so no one else holds it: made again as ours on the next try
            same = False
        if not same:
            os.close(fd)
            continue
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return fd
    raise UserError(f"could not claim {path}: it was replaced 100 times while being locked; try again")


def _read_holder(path: str) -> dict:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):  # being written, or gone
        return {}


def _remove_orphans(folder: str, name: str) -> None:
    """Removes ``.<name>.<pid>.tmp`` files whose process is gone (a run killed with -9 leaves one)."""
    for entry in os.listdir(folder):
        pid = entry.removeprefix(f".{name}.").removesuffix(".tmp")
        orphan = entry.startswith(f".{name}.") and entry.endswith(".tmp") and pid.isdigit()
        if orphan and process_is_gone(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Holds SIGINT and SIGTERM back within the block (a few quick writes): the first that arrives meanwhile
    goes to the handler from before as the block ends, so that files which belong together appear together
    or not at all. A no-op outside the main thread (Python takes signals there only) and where a handler
    was set outside Python (it could not be put back)."""
    stops = (signal.SIGINT, signal.SIGTERM)
    if (threading.current_thread() is not threading.main_thread()
            or any(signal.getsignal(signum) is None for signum in stops)):
        yield
        return
    arrived: list[int] = []
    before = {signum: signal.signal(signum, lambda received, frame: arrived.append(received))
              for signum in stops}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def write_stdout(text: str) -> None:
    """Writes ``text`` (UTF-8) to stdout, every byte or a one-line UserError.

    Python's buffered stdout loses data without a word when a file fills up partway (the kernel takes part
    of a write and Python drops the rest), so the bytes go to file descriptor 1 with ``os.write``, each
    write's count checked, and a regular file is flushed to disk (``fsync``: a filesystem that reports a
    full disk or a quota late reports it there). A full disk, a closed pipe or any other write error is
    one line naming the output.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # a stream without a descriptor (a test's capture)
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        sys.stdout.flush()  # anything printed before goes first
        data = memoryview(text.encode("utf-8"))
        while data:
            data = data[os.write(fd, data):]
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fsync(fd)
    except OSError as e:
        target = "standard output"
        with contextlib.suppress(OSError):
            target += f" ({os.readlink('/proc/self/fd/1')})"
        if disk.is_disk_full(e):
            raise DiskFullError(f"no space left writing to {target}; the output is incomplete. Redirect it "
                                "to a filesystem with space, or pass --output (written whole or not at "
                                "all)") from None
        if e.errno == errno.EPIPE:
            raise UserError(f"{target} was closed before the output was written") from None
        raise UserError(f"could not write to {target} ({e.strerror or e}); the output is incomplete. "
                        "Pass --output to write a file whole or not at all") from None


def refuse_the_input(output_path: str, input_path: str | None, *, flag: str = "--output",
                     input_flag: str = "--input") -> None:
    """ConfigError when ``output_path`` is the input file (stdin when ``input_path`` is None): the same
    file by device and inode, also through a symbolic or hard link. Replacing it would lose the input."""
    try:
        out = os.stat(output_path)
        src = os.stat(input_path) if input_path is not None else os.fstat(sys.stdin.fileno())
    except (OSError, ValueError):  # no such output yet, or no input file to compare
        return
    if stat.S_ISREG(out.st_mode) and (out.st_dev, out.st_ino) == (src.st_dev, src.st_ino):
        given = f"{input_flag}={input_path}" if input_path is not None else "standard input"
        raise ConfigError(f"{flag}={output_path} is the input file ({given}); writing there would replace "
                          f"the input. Choose another {flag}")
