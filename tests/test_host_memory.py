"""Tests for transformer_jax.runtime.host_memory: freed memory stays in the process (no page faults on reuse).

Each case runs in a fresh interpreter, since malloc settings are process-wide: it mallocs, touches and
frees a 256 MB block five times, and counts the minor page faults of the last four rounds.
"""

import json
import os
import subprocess
import sys

import pytest

from transformer_jax.runtime import host_memory

BLOCK_PAGES = 256 * 2**20 // 4096

SCRIPT = """
import ctypes, ctypes.util, json, resource
from transformer_jax.runtime import host_memory
configured = host_memory.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 256 * 2**20
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"configured": configured, "faults": faults}))
"""


def _run(opt_out: bool) -> dict:
    env = dict(os.environ)
    env.pop(host_memory.OPT_OUT_VARIABLE, None)
    if opt_out:
        env[host_memory.OPT_OUT_VARIABLE] = "default"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt only")
def test_freed_memory_is_reused_without_page_faults():
    kept, default = _run(opt_out=False), _run(opt_out=True)
    assert kept["configured"] and not default["configured"]
    # glibc's defaults: every round maps a fresh block and faults each of its pages in again.
    assert min(default["faults"][1:]) > BLOCK_PAGES // 2
    # Kept: the first round grows the heap; the next ones reuse it.
    assert kept["faults"][0] > BLOCK_PAGES // 2
    assert max(kept["faults"][1:]) < BLOCK_PAGES // 100


@pytest.mark.parametrize("keep", [True, False])
def test_run_main_keeps_freed_memory_unless_the_entry_point_only_decodes(monkeypatch, keep):
    from transformer_jax.runtime import errors

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("mallopt"))
    monkeypatch.setattr(errors.app, "run", lambda main, **kwargs: main(["prog"]))
    errors.run_main(lambda argv: calls.append("main"), keep_freed_memory=keep)
    assert calls == (["mallopt", "main"] if keep else ["main"])


# ---------------------------------------------------------------------- what is available: fake cgroup trees
GIB = 2**30
V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for "no limit"


def _cgroup_tree(tmp_path, version: str, own: str, levels: dict, *, mount_root: str = "/",
                 mount_point: str = "sys/fs/cgroup") -> tuple[str, str]:
    """A fake cgroup hierarchy under ``tmp_path``; returns the (/proc/self/cgroup, mountinfo) to read.

    ``own``: this process's cgroup path as /proc/self/cgroup shows it. ``levels``: {cgroup path: (limit or
    None, in use, inactive file pages, active file pages)}; every other folder on the path has no limit.
    """
    top = tmp_path / mount_point
    rel = own[len(mount_root.rstrip("/")):].strip("/")
    parts = [p for p in rel.split("/") if p]
    for depth in range(len(parts) + 1):
        folder = top.joinpath(*parts[:depth])
        folder.mkdir(parents=True, exist_ok=True)
        cgroup = (mount_root.rstrip("/") + "/" + "/".join(parts[:depth])) if depth else mount_root
        limit, used, inactive, active = levels.get(cgroup, (None, GIB, 0, 0))
        if version == "v2":
            if depth or mount_root != "/":  # the root cgroup has no memory.max
                (folder / "memory.max").write_text(f"{'max' if limit is None else limit}\n")
            (folder / "memory.current").write_text(f"{used}\n")
            (folder / "memory.stat").write_text(
                f"anon {used - inactive - active}\nfile {inactive + active}\nactive_file {active}\n"
                f"inactive_file {inactive}\nshmem 0\n")
        else:
            (folder / "memory.limit_in_bytes").write_text(f"{V1_NO_LIMIT if limit is None else limit}\n")
            (folder / "memory.usage_in_bytes").write_text(f"{used}\n")
            (folder / "memory.stat").write_text(
                f"cache {inactive + active}\nrss {used - inactive - active}\ninactive_file {inactive}\n"
                f"total_cache {inactive + active}\ntotal_inactive_file {inactive}\n"
                f"total_active_file {active}\n")
    escaped = str(top).replace(" ", "\\040")
    if version == "v2":
        proc = f"0::{own}\n"
        mounts = f"41 31 0:38 {mount_root} {escaped} rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    else:
        proc = f"9:name=systemd:/\n4:memory:{own}\n1:cpu,cpuacct:{own}\n0::/\n"
        mounts = (f"32 31 0:29 / {tmp_path}/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
                  f"35 31 0:32 {mount_root} {escaped} rw,relatime - cgroup cgroup rw,memory\n"
                  f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw\n")  # hybrid: no memory
    (tmp_path / "cgroup").write_text(proc)
    (tmp_path / "mountinfo").write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + mounts)
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


SLURM_V2_STEP = "/system.slice/slurmstepd.scope/job_12/step_0/user/task_0"


def test_slurms_limit_on_the_job_cgroup_above_the_step_counts(tmp_path):
    """Slurm limits the job's cgroup; the step's processes run in a task cgroup four levels below."""
    job = "/system.slice/slurmstepd.scope/job_12"
    files = _cgroup_tree(tmp_path, "v2", SLURM_V2_STEP, {job: (8 * GIB, 5 * GIB, 0, 0)})
    room = host_memory.cgroup_room(*files)
    assert (room.room, room.limit, room.used) == (3 * GIB, 8 * GIB, 5 * GIB)
    assert (room.cgroup, room.version) == (job, "v2")
    assert room.describe() == f"the memory limit of cgroup {job} (8 GiB, 5 GiB in use)"


def test_the_least_room_on_the_path_counts_not_the_smallest_limit(tmp_path):
    """The job's other steps use its memory too: 1 GiB left under the job's 8 GiB beats the step's 3."""
    job, step = "/system.slice/slurmstepd.scope/job_12", "/system.slice/slurmstepd.scope/job_12/step_0"
    files = _cgroup_tree(tmp_path, "v2", SLURM_V2_STEP, {job: (8 * GIB, 7 * GIB, 0, 0),
                                                         step: (4 * GIB, 1 * GIB, 0, 0)})
    assert (host_memory.cgroup_room(*files).room, host_memory.cgroup_room(*files).cgroup) == (GIB, job)
    files = _cgroup_tree(tmp_path / "b", "v2", SLURM_V2_STEP, {job: (8 * GIB, 2 * GIB, 0, 0),
                                                               step: (4 * GIB, 1 * GIB, 0, 0)})
    assert (host_memory.cgroup_room(*files).room, host_memory.cgroup_room(*files).cgroup) == (3 * GIB, step)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_reclaimable_page_cache_is_not_counted_as_in_use(tmp_path, version):
    """A corpus just read fills the cgroup's page cache: 3.5 of 4 GiB charged, 2.5 GiB of it file pages
    the kernel reclaims before it kills anything. 3 GiB are free to use, not 0.5."""
    own = "/user.slice/run"
    files = _cgroup_tree(tmp_path, version, own, {own: (4 * GIB, 7 * GIB // 2, 2 * GIB, GIB // 2)})
    room = host_memory.cgroup_room(*files)
    assert (room.room, room.used) == (3 * GIB, GIB)


def test_cgroup_v1_reads_the_processs_own_path_not_the_hierarchys_root(tmp_path):
    """Slurm's v1 layout: /slurm/uid_1000/job_12/step_0/task_0 with the limit on job_12; the root has
    none (~2^63)."""
    own, job = "/slurm/uid_1000/job_12/step_0/task_0", "/slurm/uid_1000/job_12"
    files = _cgroup_tree(tmp_path, "v1", own, {job: (6 * GIB, 2 * GIB, GIB, 0)},
                         mount_point="sys/fs/cgroup/memory")
    room = host_memory.cgroup_room(*files)
    assert (room.room, room.cgroup, room.version) == (5 * GIB, job, "v1")


def test_a_mount_of_part_of_the_hierarchy_and_a_path_with_a_space(tmp_path):
    """A container sees its own cgroup mounted at the top (mountinfo's root field is its path)."""
    own = "/docker/abc"
    files = _cgroup_tree(tmp_path, "v1", own, {own: (2 * GIB, GIB, 0, 0)}, mount_root=own,
                         mount_point="sys fs/cgroup/memory")
    room = host_memory.cgroup_room(*files)
    assert (room.room, room.cgroup) == (GIB, own)


def test_no_limit_anywhere_and_no_cgroup_files_give_none(tmp_path):
    assert host_memory.cgroup_room(*_cgroup_tree(tmp_path / "a", "v2", SLURM_V2_STEP, {})) is None
    assert host_memory.cgroup_room(*_cgroup_tree(tmp_path / "b", "v1", "/x/y", {})) is None
    assert host_memory.cgroup_room(str(tmp_path / "missing"), str(tmp_path / "missing")) is None


def test_the_available_memory_is_the_least_of_memavailable_and_the_cgroups_room(tmp_path):
    files = _cgroup_tree(tmp_path, "v2", "/a", {"/a": (4 * GIB, GIB, 0, 0)})
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  67108864 kB\nMemFree:  1048576 kB\nMemAvailable:  8388608 kB\n")
    assert host_memory.available_memory(str(meminfo), *files) == (
        3 * GIB, "the memory limit of cgroup /a (4 GiB, 1 GiB in use)")
    meminfo.write_text("MemTotal:  67108864 kB\nMemFree:  1048576 kB\nMemAvailable:  2097152 kB\n")
    assert host_memory.available_memory(str(meminfo), *files) == (2 * GIB, "MemAvailable")  # not MemFree
    assert host_memory.available_memory(str(tmp_path / "none"), *files)[0] == 3 * GIB


def test_this_hosts_available_memory_is_read():
    available, where = host_memory.available_memory()
    assert available > 0 and (where == "MemAvailable" or where.startswith("the memory limit of cgroup /"))


@pytest.mark.parametrize("value, enabled", [("", True), ("on", True), ("off", False), ("0", False),
                                            ("OFF", False), ("false", False)])
def test_the_check_is_skipped_with_the_variable(monkeypatch, value, enabled):
    monkeypatch.setenv(host_memory.CHECK_VARIABLE, value)
    assert host_memory.check_enabled() == enabled
