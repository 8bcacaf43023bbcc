"""Disk space: recognising a full disk in any library's error, and naming the filesystem of a path.

A full disk reaches us in several shapes: ``OSError(ENOSPC)`` from Python, and from tensorstore (which
orbax writes arrays with) a ``ValueError`` whose text reads ``RESOURCE_EXHAUSTED: ... No space left on
device [os_error_code='28']``, sometimes chained under another exception. ``is_disk_full`` looks at the
whole chain. A disk quota (``EDQUOT``) counts as full: the fix is the same.
"""

from __future__ import annotations

import errno
import os
import shutil

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded",
               *(f"os_error_code='{code}'" for code in _FULL_ERRNOS))


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an exception it was raised from or during, says the disk (or quota) is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        text = str(error)
        if any(t in text for t in _FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def mount_point(path: str) -> str:
    """The mount point of the filesystem holding ``path`` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _fs_type(mount: str) -> str | None:
    try:
        with open("/proc/self/mounts") as f:
            types = [line.split()[2] for line in f if len(line.split()) > 2 and line.split()[1] == mount]
    except OSError:
        return None
    return types[-1] if types else None  # the last mount at a point is the visible one


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem holding ``path``."""
    return shutil.disk_usage(mount_point(path)).free


def describe_filesystem(path: str, *, space: bool = True) -> str:
    """``"the <type> filesystem mounted at <mount point> (<free> free of <size>)"`` for ``path``."""
    mount = mount_point(path)
    kind = _fs_type(mount)
    return f"the {kind + ' ' if kind else ''}filesystem mounted at {mount}" + (
        f" ({describe_space(mount)})" if space else "")


def describe_space(path: str) -> str:
    """``"<free> free of <size>"`` (binary units) for the filesystem holding ``path``."""
    try:
        usage = shutil.disk_usage(mount_point(path))
    except OSError as e:
        return f"its size is unknown: {e}"
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"


def directory_bytes(path: str) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks, like ``du``)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return total
