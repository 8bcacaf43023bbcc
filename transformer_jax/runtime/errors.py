"""Errors a user can fix, and how entry points show them.

``UserError``: a problem the user can fix (a config field, a flag, a data file, a workdir, a
checkpoint). Entry points print its message in one or two lines, with no traceback, and exit 1; a
real bug (any other exception) still shows its traceback. ``TRANSFORMER_JAX_TRACEBACK=1`` in the
environment shows the full traceback for user errors too.

The subclasses also derive from the built-in exception a library caller would expect, so
``except ValueError`` / ``except FileNotFoundError`` keep working.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app

from transformer_jax.runtime import disk, host_memory

TRACEBACK_ENV = "TRANSFORMER_JAX_TRACEBACK"


class UserError(Exception):
    """A problem the user can fix; entry points print its message in one or two lines, no traceback."""


class ConfigError(UserError, ValueError):
    """A config field or command-line flag has a bad value; the message names the field or flag."""


class DataError(UserError, ValueError):
    """A data file is malformed; the message names the file (and the line)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the run needs does not exist; the message names it."""


class DiskFullError(UserError, OSError):
    """A write failed for lack of disk space (or quota); the message names the filesystem and what is kept."""


class WorkdirBusyError(UserError, RuntimeError):
    """Another run holds the workdir; the message names its pid and host."""


def disk_full_message(error: OSError) -> str:
    """One line for an ``OSError(ENOSPC)`` nothing else explained: the file and the filesystem."""
    where = error.filename or os.getcwd()
    return (f"no space left on device writing {where}: {disk.describe_filesystem(str(where))} is full. "
            "Free some space (or point --workdir elsewhere) and run the same command again")


def short_error(error: BaseException, limit: int = 300) -> str:
    """One line naming the exception type, for logs and error messages (tensorstore errors run to pages)."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(error).__name__}: {text}"


def show_tracebacks() -> bool:
    """True when ``TRANSFORMER_JAX_TRACEBACK`` is set to anything but "", "0" or "false"."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def short_errors(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """``main`` with a ``UserError`` shown as ``error: <message>`` on stderr and exit status 1.

    The message is put on one line. An ``OSError`` for a full disk (ENOSPC, EDQUOT) that nothing
    turned into a ``DiskFullError`` is shown the same way, naming the file and its filesystem.
    """

    def wrapped(argv: list[str]) -> Any:
        try:
            return main(argv)
        except Exception as e:
            full = isinstance(e, OSError) and not isinstance(e, UserError) and disk.is_disk_full(e)
            if show_tracebacks() or not (isinstance(e, UserError) or full):
                raise
            message = disk_full_message(e) if full else (" ".join(str(e).split()) or type(e).__name__)
            print(f"error: {message}", file=sys.stderr)
            print(f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
            sys.exit(1)

    wrapped.__doc__ = main.__doc__
    return wrapped


def run_main(main: Callable[[list[str]], Any]) -> None:
    """``absl.app.run(main)`` for every entry point: the one opening all ``main`` functions share.

    Before ``main`` runs: glibc's malloc keeps freed memory (``host_memory``, before jax starts its
    threads) and stray positional arguments are a usage error. User errors print one or two lines and
    exit 1 (see the module docstring).
    """

    def opened(argv: list[str]) -> Any:
        host_memory.keep_freed_memory()
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        return main(argv)

    opened.__doc__ = main.__doc__
    app.run(short_errors(opened))
