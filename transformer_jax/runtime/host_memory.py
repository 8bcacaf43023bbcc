"""Host memory: what a run may still allocate here, and keeping what XLA:CPU frees for its next step.

**What is available.** ``available_memory`` is the least of /proc/meminfo's MemAvailable (free memory
plus the page cache the kernel can reclaim) and the room left under every cgroup memory limit on the
path from this process's cgroup up to the hierarchy's root (``cgroup_room``). A batch scheduler limits a
job where a step cannot see it: Slurm sets ``memory.max`` on the job's cgroup
(``/system.slice/slurmstepd.scope/job_12``), and the step's processes run in cgroups below it
(``job_12/step_0/user/task_0``), so each level is read and the tightest one counts. A cgroup's use is
its own accounting without the page cache it can reclaim, as MemAvailable counts it: on cgroup v2
``memory.current`` minus ``memory.stat``'s active_file and inactive_file, on v1
``memory.usage_in_bytes`` minus total_active_file and total_inactive_file (a corpus just read into the
cache is not in use). Where the cgroup hierarchies are mounted, and this process's folder in each, come
from /proc/self/mountinfo and /proc/self/cgroup. ``TRANSFORMER_JAX_MEMORY_CHECK=off`` turns off the
checks that use it (``check_enabled``).

**Keeping freed memory.** XLA:CPU allocates each step's temporaries (hundreds of MB at 4k tokens and an
8k vocabulary) with malloc and frees them when the step ends. glibc's defaults return that memory to the
kernel: large blocks are ``mmap``-ed and unmapped, and per-thread arenas are trimmed. The next step then
faults every page back in: page faults and kernel time that cost a large share of a training step on CPU
(measured in docs/benchmarks.md).

``keep_freed_memory`` sets glibc's ``mallopt`` so that freed memory stays in the process: one arena (the
XLA threads share the main heap), no ``mmap``-ed blocks, and no trimming. Host
memory then stays at the high-water mark of a step (a multiple of the default's resident size) instead
of being returned after every step. It must run before jax starts its threads; the entry points that
train (``errors.run_main``) call it first. Set ``TRANSFORMER_JAX_GLIBC_MALLOC=default`` to keep glibc's
defaults. Elsewhere than on glibc it does nothing.

Decoding is the exception, and its entry points (translate, evaluate.py, ``benchmarks.decoding`` and
``benchmarks.profile``) keep glibc's defaults: with one arena, beam search both compiled and ran
slower, while the train step ran faster (docs/benchmarks.md, "Measurements behind code choices").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import platform

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = -1  # M_TRIM_THRESHOLD -1 "disables trimming completely" (man 3 mallopt)
OPT_OUT_VARIABLE = "TRANSFORMER_JAX_GLIBC_MALLOC"


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory (see the module docstring); returns whether it did."""
    if os.environ.get(OPT_OUT_VARIABLE) == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))


# ------------------------------------------------------------------------------------- what is available
CHECK_VARIABLE = "TRANSFORMER_JAX_MEMORY_CHECK"  # "off": no host-memory check before a run
NO_LIMIT = 2**60  # cgroup v1 writes ~2^63 (the largest page count) for "no limit"
RECLAIMABLE = {"v2": ("active_file", "inactive_file"), "v1": ("total_active_file", "total_inactive_file")}
FILES = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}


def check_enabled() -> bool:
    """False when ``TRANSFORMER_JAX_MEMORY_CHECK`` is off (also 0, false or no): skip the memory check."""
    return os.environ.get(CHECK_VARIABLE, "").strip().lower() not in ("off", "0", "false", "no")


@dataclasses.dataclass(frozen=True)
class CgroupRoom:
    """The room under the tightest memory limit on a process's cgroup path."""

    room: int  # bytes the cgroup may still allocate: limit - used, at least 0
    limit: int  # its memory limit, bytes
    used: int  # its use, bytes, without reclaimable page cache
    cgroup: str  # its path in the hierarchy ("/system.slice/slurmstepd.scope/job_12")
    version: str  # "v1" or "v2"

    def describe(self) -> str:
        """'the memory limit of cgroup /a/job_12 (4 GiB, 1.5 GiB in use)'."""
        return (f"the memory limit of cgroup {self.cgroup} ({self.limit / 2**30:.3g} GiB, "
                f"{self.used / 2**30:.3g} GiB in use)")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _unescape(field: str) -> str:
    r"""mountinfo writes a space as \040, a tab \011, a newline \012 and a backslash \134."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(version, root in the hierarchy, mount point) of each memory cgroup hierarchy mounted."""
    found = []
    for line in (_read(mountinfo) or "").splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 1:
            continue
        options = tail[2].split(",") if len(tail) > 2 else []
        if tail[0] == "cgroup2":
            found.append(("v2", _unescape(fields[3]), _unescape(fields[4])))
        elif tail[0] == "cgroup" and "memory" in options:
            found.append(("v1", _unescape(fields[3]), _unescape(fields[4])))
    return found


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """This process's cgroup path in each version's hierarchy: {"v2": "/a/b", "v1": "/c/d"}."""
    paths = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def _usage(folder: str, version: str) -> tuple[int, int] | None:
    """(limit, use without reclaimable page cache) of one cgroup folder, or None without a limit."""
    limit_file, used_file = FILES[version]
    limit, used = _int(_read(os.path.join(folder, limit_file))), _int(_read(os.path.join(folder, used_file)))
    if limit is None or used is None or limit >= NO_LIMIT:  # v2 writes "max" for no limit
        return None
    stat = {}
    for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[name] = int(value)
    return limit, max(0, used - sum(stat.get(name, 0) for name in RECLAIMABLE[version]))


def _folders(version: str, root: str, mount_point: str, path: str) -> list[tuple[str, str]]:
    """(folder, cgroup path) from this process's cgroup up to the mount's top, the process's first."""
    root = root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return [(mount_point, root or "/")]  # a path outside the mounted part: the mount's top only
    parts = [p for p in path[len(root):].split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(mount_point, *parts[:depth])
        if os.path.isdir(folder):
            found.append((folder, root + "/" + "/".join(parts[:depth]) if depth else root or "/"))
    return found


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup",
                mountinfo: str = "/proc/self/mountinfo") -> CgroupRoom | None:
    """The least room under a memory limit on this process's cgroup path (cgroup v2 and v1), or None where
    no cgroup on it has a limit. The arguments are the files to read (a fake tree's, in tests)."""
    paths, rooms = _own_paths(proc_cgroup), []
    for version, root, mount_point in _mounts(mountinfo):
        if version not in paths:
            continue
        for folder, cgroup in _folders(version, root, mount_point, paths[version]):
            usage = _usage(folder, version)
            if usage is not None:
                limit, used = usage
                rooms.append(CgroupRoom(max(0, limit - used), limit, used, cgroup, version))
    return min(rooms, key=lambda r: r.room, default=None)


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """/proc/meminfo's MemAvailable in bytes (free memory and reclaimable page cache), or None."""
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     mountinfo: str = "/proc/self/mountinfo") -> tuple[int, str] | None:
    """(bytes, where from) that this process may still allocate: MemAvailable, or the room under a
    cgroup's limit where that is less (see the module docstring); None where neither can be read."""
    found = []
    if (available := mem_available(meminfo)) is not None:
        found.append((available, "MemAvailable"))
    if (room := cgroup_room(proc_cgroup, mountinfo)) is not None:
        found.append((room.room, room.describe()))
    return min(found, key=lambda f: f[0], default=None)
