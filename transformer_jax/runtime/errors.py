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
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

import tqdm
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


class OutOfMemoryError(UserError, MemoryError):
    """A train step needs more memory than the host or device has; the message names the estimate,
    what is available and the config fields that reduce it (``training/memory.py``)."""


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


# The exit status of a command stopped by Ctrl-C, as a shell gives one that SIGINT killed (128 + 2).
INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT


def short_errors(main: Callable[[list[str]], Any], *, interrupted: str = "") -> Callable[[list[str]], Any]:
    """``main`` with a ``UserError`` shown as ``error: <message>`` on stderr and exit status 1.

    The message is put on one line. An ``OSError`` for a full disk (ENOSPC, EDQUOT) that nothing
    turned into a ``DiskFullError`` is shown the same way, naming the file and its filesystem. Ctrl-C
    (SIGINT's ``KeyboardInterrupt``, once the ``with`` blocks it passed through have cleaned up) is one
    line on stderr, ``Stopped by SIGINT (Ctrl-C)`` and ``interrupted`` (what was kept), and the process
    ends at once with exit status ``INTERRUPTED_EXIT_STATUS``.
    """

    def wrapped(argv: list[str]) -> Any:
        try:
            return main(argv)
        except KeyboardInterrupt:
            if show_tracebacks():
                raise
            print_line(f"Stopped by SIGINT (Ctrl-C){'; ' + interrupted if interrupted else '.'}",
                       file=sys.stderr)
            sys.stdout.flush()
            # Not sys.exit: the interpreter's shutdown can crash (SIGSEGV) under XLA work still running in
            # its threads; what the with blocks hold was released as the interrupt passed through them.
            os._exit(INTERRUPTED_EXIT_STATUS)
        except Exception as e:
            full = isinstance(e, OSError) and not isinstance(e, UserError) and disk.is_disk_full(e)
            if show_tracebacks() or not (isinstance(e, UserError | app.UsageError) or full):
                raise
            print_error(disk_full_message(e) if full else (" ".join(str(e).split()) or type(e).__name__))

    wrapped.__doc__ = main.__doc__
    return wrapped


def print_line(message: str, file: TextIO | None = None) -> None:
    """Prints ``message`` on a line of its own to ``file`` (stdout by default) and flushes it: a progress bar
    drawn on the terminal (tqdm, which leaves the cursor at the end of its line) is cleared first and drawn
    again below it."""
    file = file or sys.stdout
    tqdm.tqdm.write(message, file=file)
    file.flush()


def print_error(message: str) -> None:
    """Prints ``error: <message>`` (on one line) and the traceback hint on stderr, then exits 1."""
    print_line(f"error: {' '.join(message.split())}", file=sys.stderr)
    print_line(f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------------------------- ml_collections flags
_CONFIG_FLAGS: list[str] = []  # names of the flags defined by define_config_file
_DID_YOU_MEAN = re.compile(r"Did you mean \W*\"(\w+)\" instead of \W*\"(\w+)\"")


def config_flag_message(error: BaseException, argv: list[str], name: str = "config") -> str:
    """One line for an error ml_collections raised while loading ``--<name>`` or applying an override.

    A misspelt field (``--config.train.num_stepz=5``) names the flag and suggests the field; anything
    else keeps the last line of the library's message (it wraps errors of ``get_config`` in a traceback).
    """
    text = str(error).replace("\\n", "\n").replace("\\'", "'")

    def flag_naming(key: str) -> str | None:
        pattern = rf"^--?{name}\.(.+\.)?{re.escape(key)}(\.|=|$)"
        return next((a.split("=")[0] for a in argv if re.match(pattern, a)), None)

    if m := _DID_YOU_MEAN.search(text):
        suggestion, typo = m.groups()
        flag = flag_naming(typo)
        return (f"{flag + ': ' if flag else ''}the config has no field {typo!r}; did you mean "
                f"{suggestion!r}? (every field is in the config file; --helpfull lists the flags)")
    if isinstance(error, KeyError | AttributeError):
        key = text.strip("'\"").splitlines()[0].strip("'\"")
        flag = flag_naming(key) or f"--{name}.{key}"
        return f"{flag}: the config has no field {key!r} (every field is in the config file)"
    return f"--{name}: {last_line(text)}"


def last_line(text: str) -> str:
    """The last non-blank line of ``text`` (of a traceback a library put into its message: the error)."""
    lines = [line.strip() for line in text.strip("'\"").splitlines() if line.strip()]
    return lines[-1] if lines else text


def _config_path_in(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}=") or arg.startswith(f"-{name}="):
            return arg.split("=", 1)[1]
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _check_config_file(argv: list[str], name: str) -> None:
    """A ``--<name>=path[:argument]`` whose file is missing is one line naming the path."""
    value = _config_path_in(argv, name)
    if value is None:
        return
    path = value.split(":", 1)[0]
    if not path:
        print_error(f"--{name}= is empty; expected a config file such as configs/default.py")
    if not os.path.isfile(path):
        print_error(f"--{name}={value}: no such config file {os.path.abspath(path)}; expected a Python file "
                    "with get_config(), such as configs/default.py")


def last_override_wins(argv: list[str], name: str = "config") -> list[str]:
    """``argv`` without the ``--<name>.field=value`` overrides that a later one of the same field replaces.

    absl keeps the last value of a repeated flag, but ml_collections joins the repeats of a tuple field
    into one tuple (``--config.data.length_buckets=(32,64) --config.data.length_buckets=(64,32)`` gave
    ``(32, 64, 64, 32)``); with the earlier ones dropped, the last of every field wins, a tuple's too.
    """
    override = re.compile(rf"^--?{re.escape(name)}\.([^=]+)=")
    fields = [m.group(1) if (m := override.match(arg)) else None for arg in argv]
    last = {field: i for i, field in enumerate(fields) if field is not None}
    return [arg for i, (arg, field) in enumerate(zip(argv, fields, strict=True))
            if field is None or last[field] == i]


def note_config_flag(name: str) -> None:
    """Registers ``--<name>`` as an ml_collections config-file flag (``run_config.define_config_file``):
    ``parse_flags`` then reports a missing file and a misspelt field as one line each."""
    _CONFIG_FLAGS.append(name)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with config-file and flag errors as one ``error:`` line each; of a config
    field given twice the last value wins (``last_override_wins``)."""
    from absl import flags

    for name in _CONFIG_FLAGS:
        _check_config_file(argv, name)
        argv = last_override_wins(argv, name)
    try:
        remaining = flags.FLAGS(argv)
        for name in _CONFIG_FLAGS:  # a file that failed to load raises on first access
            value = flags.FLAGS[name].value
            error = getattr(type(value), "_ReportError", None) and object.__getattribute__(value, "_error")
            if error:
                raise error
    except flags.Error as e:
        if show_tracebacks():
            raise
        text = str(e)
        if "Traceback (most recent call last)" in text:  # get_config raised; config_flags kept its traceback
            text = f"{text.split(': Error whilst parsing', 1)[0]}: {last_line(text)}"
        print_error(f"{text} (--helpshort lists the flags)")
    except (KeyError, AttributeError, OSError, TypeError, ValueError) as e:
        if show_tracebacks() or not _CONFIG_FLAGS:
            raise
        print_error(config_flag_message(e, argv, _CONFIG_FLAGS[0]))
    return remaining


def _interrupt_again(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook`` that sends SIGINT again where Python dropped its ``KeyboardInterrupt``.

    Ctrl-C raises ``KeyboardInterrupt`` wherever the main thread is; in a garbage collector's callback
    (jax has one) or a ``__del__`` Python cannot raise it, so it prints it and goes on, and the command
    ran to its end. The signal is sent to the main thread again a moment later, from another thread, so
    that it lands once the hook and the callback have returned, also in a blocking call (and the hook
    sends it again should it land in such a callback too). Every other exception goes to ``previous``.
    """

    def hook(unraisable: Any) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            again = threading.Timer(0.05, signal.pthread_kill, args=(threading.main_thread().ident,
                                                                    signal.SIGINT))
            again.daemon = True
            again.start()
        else:
            previous(unraisable)

    return hook


def run_main(main: Callable[[list[str]], Any], *, takes_args: bool = False,
             keep_freed_memory: bool = True, interrupted: str = "") -> None:
    """``absl.app.run(main)`` for every entry point: the one opening all ``main`` functions share.

    Before ``main`` runs: unless ``keep_freed_memory`` is False (the entry points that only decode),
    glibc's malloc keeps freed memory (``host_memory``, before jax starts its threads) and, unless
    ``takes_args`` (``main`` checks them: a data set name, a subcommand), stray positional arguments
    are a usage error. User errors, flag errors (``parse_flags``) and usage errors
    print one ``error:`` line and a hint, and exit 1 (see the module docstring); Ctrl-C prints one line
    that ends with ``interrupted``, what the command kept (``short_errors``), also where it first landed
    in a garbage collector's callback (``_interrupt_again``).
    """

    def opened(argv: list[str]) -> Any:
        sys.unraisablehook = _interrupt_again(sys.unraisablehook)
        if keep_freed_memory:
            host_memory.keep_freed_memory()
        if len(argv) > 1 and not takes_args:
            raise app.UsageError(f"unexpected arguments {argv[1:]}: flags are written --name=value "
                                 "(--helpshort lists them)")
        return main(argv)

    opened.__doc__ = main.__doc__
    app.run(short_errors(opened, interrupted=interrupted), flags_parser=parse_flags)
