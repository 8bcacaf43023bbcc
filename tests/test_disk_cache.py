"""The data cache's entries: built once under a lock, renamed into place whole, checked on every open.

Faults: a builder killed with SIGKILL mid-build leaves nothing a later open uses; two builders at once make
one entry; a truncated or altered file is found by its size or SHA-256 and the entry rebuilt with a
warning; a root where nothing can be written falls back to the given folder and says so.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from transformer_jax.data import disk_cache
from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import DiskFullError

SPEC = {"format": 1, "data": "abc"}


def _build(text: str, log=None):
    def build(folder):
        (folder / "payload.bin").write_text(text)
        if log is not None:
            log.append(folder.name)
        return {"count": len(text)}

    return build


def test_an_entry_is_built_once_then_read_and_named_by_its_spec(tmp_path):
    builds = []
    entry, manifest = disk_cache.open_or_build(
        tmp_path, "kind", SPEC, _build("hello", builds), fallback=None, what="the test entry"
    )
    assert (
        entry == tmp_path / "kind" / disk_cache.spec_key(SPEC)
        and (entry / "payload.bin").read_text() == "hello"
    )
    assert manifest["count"] == 5 and manifest["spec"] == SPEC and manifest["files"]["payload.bin"][0] == 5
    again, manifest_again = disk_cache.open_or_build(
        tmp_path, "kind", SPEC, _build("other", builds), fallback=None, what="the test entry"
    )
    assert again == entry and manifest_again == manifest and len(builds) == 1  # a hit: not built again
    other, _ = disk_cache.open_or_build(
        tmp_path,
        "kind",
        {**SPEC, "data": "abd"},
        _build("other", builds),
        fallback=None,
        what="the test entry",
    )
    assert other != entry and len(builds) == 2 and (other / "payload.bin").read_text() == "other"


@pytest.mark.parametrize("damage", ["truncate", "same_size", "manifest"])
def test_a_damaged_entry_is_moved_aside_and_rebuilt_with_one_warning(tmp_path, caplog, damage):
    entry, _ = disk_cache.open_or_build(
        tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry"
    )
    payload = entry / "payload.bin"
    if damage == "truncate":
        payload.write_text("hel")
    elif damage == "same_size":
        payload.write_text("jello")  # only the checksum tells
    else:
        (entry / disk_cache.MANIFEST).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        rebuilt, _ = disk_cache.open_or_build(
            tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry"
        )
    assert rebuilt == entry and payload.read_text() == "hello"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = {
        "truncate": "payload.bin has 3 bytes, the manifest says 5",
        "same_size": "payload.bin does not match its SHA-256",
        "manifest": "manifest.json is unreadable",
    }
    assert (
        f"the entry in {entry} is damaged ({expected[damage]}" in warning and "building it again" in warning
    )
    assert len(list((tmp_path / "kind").glob(f"{entry.name}.damaged-*"))) == 1


_BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from transformer_jax.data import disk_cache

    root, log, pause = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

    def build(folder):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        (folder / "payload.bin").write_text("half")
        time.sleep(pause)  # the test kills the process here, or a second builder waits meanwhile
        (folder / "payload.bin").write_text("whole")
        return {}

    entry, _ = disk_cache.open_or_build(root, "kind", {"format": 1}, build, fallback=None, what="the entry")
    print((entry / "payload.bin").read_text())
""")


def _builder(tmp_path, pause: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(tmp_path / "root"), str(tmp_path / "builds.log"), str(pause)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_for_build_start(tmp_path, count: int = 1) -> None:
    deadline = time.time() + 60
    log = tmp_path / "builds.log"
    while not (log.exists() and len(log.read_text().split()) >= count) and time.time() < deadline:
        time.sleep(0.02)


def test_a_build_killed_mid_way_leaves_nothing_that_a_later_open_uses(tmp_path):
    victim = _builder(tmp_path, pause=60)
    _wait_for_build_start(tmp_path)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    folder = tmp_path / "root" / "kind"
    key = disk_cache.spec_key({"format": 1})
    assert not (folder / key).exists() and len(list(folder.glob(f"{key}.tmp-*"))) == 1  # the half build
    survivor = _builder(tmp_path, pause=0)
    assert survivor.communicate(timeout=60)[0].strip() == "whole" and survivor.returncode == 0
    assert not list(folder.glob(f"{key}.tmp-*"))  # the dead builder's leftovers are gone
    assert len((tmp_path / "builds.log").read_text().split()) == 2


def test_two_builders_at_once_make_one_entry(tmp_path):
    first = _builder(tmp_path, pause=1.5)
    _wait_for_build_start(tmp_path)  # the first holds the lock, mid-build
    second = _builder(tmp_path, pause=0)
    assert first.communicate(timeout=60)[0].strip() == "whole"
    assert second.communicate(timeout=60)[0].strip() == "whole"
    assert len((tmp_path / "builds.log").read_text().split()) == 1  # the second waited, then read it


def test_an_unwritable_root_falls_back_to_the_given_folder_and_says_so(tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    root = tmp_path / "a_file" / "cache"  # under a file: nothing can be made there, even as root
    with caplog.at_level(logging.WARNING):
        entry, _ = disk_cache.open_or_build(
            root, "kind", SPEC, _build("hello"), fallback=tmp_path / "workdir", what="the entry"
        )
    assert entry.parent == tmp_path / "workdir" / "kind"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert (
        f"The data cache {root / 'kind'} is not writable" in warning and str(tmp_path / "workdir") in warning
    )
    assert f"({tmp_path / 'a_file'} is a file, not a folder)" in warning
    with pytest.raises(disk_cache.CacheError, match="set config.data.cache_dir"):
        disk_cache.open_or_build(root, "kind", SPEC, _build("hello"), fallback=None, what="the entry")


def test_a_whole_entry_is_read_where_nothing_can_be_written(tmp_path, monkeypatch):
    entry, _ = disk_cache.open_or_build(
        tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry"
    )
    monkeypatch.setattr(disk_cache, "_writable", lambda folder: "Read-only file system")
    assert (
        disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("other"), fallback=None, what="the entry")[0]
        == entry
    )


def test_the_root_is_the_config_field_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "env"))
    assert disk_cache.cache_root("") == tmp_path / "env"
    assert disk_cache.cache_root(str(tmp_path / "field")) == tmp_path / "field"
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_root("") == tmp_path / "xdg" / "transformer_jax"


def test_file_hashes_follow_the_content(tmp_path):
    path = tmp_path / "train.en"
    path.write_text("a\n")
    first = disk_cache.file_sha256(path)
    os.utime(path, ns=(1, 1))
    path.write_text("b\n")
    assert disk_cache.file_sha256(path) != first
    assert json.dumps(disk_cache.spec_key(SPEC)) == json.dumps(
        disk_cache.spec_key(dict(reversed(SPEC.items())))
    )


# ----------------------------------------------------------------------------- a damaged manifest


def _manifest_with(entry, change) -> None:
    path = entry / disk_cache.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, expected", [
    (lambda m: m.update(dtype="uint36"), "does not match its own SHA-256"),
    (lambda m: m.update(count="5"), "does not match its own SHA-256"),  # a wrong type
    (lambda m: m.pop("dtype"), "does not match its own SHA-256"),  # a missing key
    (lambda m: m.pop("files"), "lists no files"),
    (lambda m: m["files"].update({"payload.bin": ["5", m["files"]["payload.bin"][1]]}), "malformed file"),
    (lambda m: m["files"].update({"../x": [1, "0" * 64]}), "malformed file"),
    (lambda m: m.update(spec={"format": 0}), "another entry's"),
    (lambda m: m.clear(), "lists no files"),
], ids=["uint36", "wrong_type", "missing_key", "no_files", "size_a_string", "a_path", "another_spec",
        "empty"])
def test_a_damaged_manifest_value_moves_the_entry_aside_and_rebuilds(tmp_path, caplog, damage, expected):
    def build(folder):
        (folder / "payload.bin").write_text("hello")
        return {"dtype": "uint16", "count": 5}

    entry, manifest = disk_cache.open_or_build(tmp_path, "kind", SPEC, build, fallback=None, what="the entry")
    _manifest_with(entry, damage)
    with caplog.at_level(logging.WARNING):
        rebuilt, again = disk_cache.open_or_build(tmp_path, "kind", SPEC, build, fallback=None,
                                                  what="the entry")
    assert rebuilt == entry and again["dtype"] == "uint16" and again["count"] == 5
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert expected in warning and "building it again" in warning
    assert len(list((tmp_path / "kind").glob(f"{entry.name}.damaged-*"))) == 1


def test_a_manifest_written_before_it_had_its_own_sha256_is_still_read(tmp_path):
    entry, _ = disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="e")
    _manifest_with(entry, lambda m: m.pop(disk_cache.SELF_SHA256))
    builds = []
    assert disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("x", builds), fallback=None,
                                    what="e")[0] == entry and not builds


# ----------------------------------------------------------------------------- faults while building


@pytest.mark.parametrize("error", [OSError("457331 requested and 12288 written"),  # numpy: no errno
                                   OSError(28, "No space left on device")])
def test_a_full_disk_during_a_build_is_one_line_naming_the_caches_filesystem(tmp_path, error):
    def build(folder):
        (folder / "src.ids").write_bytes(b"\0" * 1000)
        raise error

    with pytest.raises(DiskFullError) as info:
        disk_cache.open_or_build(tmp_path / "cache", "kind", SPEC, build, fallback=None, what="the entry")
    message = str(info.value)
    assert message.startswith(f"no space left building the entry in {tmp_path / 'cache' / 'kind'}: ")
    assert f"filesystem mounted at {disk.mount_point(str(tmp_path))} " in message and "\n" not in message
    assert "the half-written entry was removed" in message and "config.data.cache_dir" in message
    left = sorted(p.name for p in (tmp_path / "cache" / "kind").iterdir())
    assert left == [f"{disk_cache.spec_key(SPEC)}.lock"]  # no .tmp-<pid>, no .builder
    other = OSError("a build that fails otherwise")
    with pytest.raises(OSError, match="fails otherwise"):
        disk_cache.open_or_build(tmp_path / "cache", "kind", SPEC, lambda f: (_ for _ in ()).throw(other),
                                 fallback=None, what="the entry")
    assert not list((tmp_path / "cache" / "kind").glob("*.tmp-*"))


@contextlib.contextmanager
def small_tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` (e.g. "96k") mounted at ``<tmp_path>/small`` for the block, its path yielded; the
    test skips where mounting is not allowed (it needs root)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    point = tmp_path / "small"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)]).returncode:
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)])


def test_a_real_full_tmpfs_during_a_build_names_it_and_frees_the_space(tmp_path):
    with small_tmpfs(tmp_path, "256k") as point:
        def build(folder):
            with open(folder / "src.ids", "wb") as f:
                np.zeros(457331, np.uint8).tofile(f)  # numpy's own short-write error
            return {}

        with pytest.raises(DiskFullError) as info:
            disk_cache.open_or_build(point / "cache", "encoded", SPEC, build, fallback=None,
                                     what="the encoded train split")
        assert f"the tmpfs filesystem mounted at {point} (" in str(info.value)
        assert not list((point / "cache" / "encoded").glob("*.tmp-*"))
        assert disk.free_bytes(str(point)) > 200_000  # the half-written build no longer fills it


def test_a_file_where_an_entrys_folder_should_be_is_one_line_and_leaves_no_tmp(tmp_path):
    folder = tmp_path / "kind"
    folder.mkdir()
    (folder / disk_cache.spec_key(SPEC)).write_text("not a folder")
    with pytest.raises(disk_cache.CacheError, match="is a file where the folder of the entry should be"):
        disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry")
    assert sorted(p.name for p in folder.iterdir()) == [disk_cache.spec_key(SPEC)]


def test_leftovers_are_removed_whatever_their_key_once_their_builder_is_gone(tmp_path):
    encoded, tokenizers = tmp_path / "encoded", tmp_path / "tokenizers"
    dead, held, no_lock_dead, no_lock_live = "a" * 20, "b" * 20, "c" * 20, "d" * 20
    for folder, key, pid in ((encoded, dead, 4), (tokenizers, dead, 5), (encoded, held, 6),
                             (encoded, no_lock_dead, _dead_pid()), (encoded, no_lock_live, os.getpid())):
        (folder / f"{key}.tmp-{pid}").mkdir(parents=True)
        (folder / f"{key}.tmp-{pid}" / "half.ids").write_bytes(b"\0" * 100)
        if key in (dead, held):
            (folder / f"{key}.lock").touch()
    (encoded / "keep.tmp-7").mkdir()  # not a name the cache makes
    holder = open(encoded / f"{held}.lock")  # another build of that entry is going on
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry")
    finally:
        holder.close()
    assert sorted(p.name for p in encoded.glob("*.tmp-*")) == [
        f"{held}.tmp-6", f"{no_lock_live}.tmp-{os.getpid()}", "keep.tmp-7"]
    assert not list(tokenizers.glob("*.tmp-*"))


def test_a_warm_open_removes_the_leftovers_of_builds_that_ended(tmp_path):
    entry, _ = disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="e")
    leftover = tmp_path / "kind" / f"{'a' * 20}.tmp-4"  # of an entry never built again
    leftover.mkdir()
    (leftover.with_name(f"{'a' * 20}.lock")).touch()
    assert disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("x"), fallback=None, what="e")[0] == entry
    assert not leftover.exists()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_cache_variable_and_xdg_expand_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(disk_cache.CACHE_ENV, "~/x")
    assert disk_cache.cache_root("") == tmp_path / "x"
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert disk_cache.cache_root("") == tmp_path / "xdg" / "transformer_jax"


# ----------------------------------------------------------------------------- a cache shared by users

_AS_NOBODY = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from transformer_jax.data import disk_cache

    def build(folder):
        (folder / "payload.bin").write_text(sys.argv[3])
        return {}

    entry, _ = disk_cache.open_or_build(Path(sys.argv[1]), "kind", json.loads(sys.argv[2]), build,
                                        fallback=None, what="the entry")
    print((entry / "payload.bin").read_text())
""")
NOBODY = 65534


def _shared_folder(mode: int, group: int = 0):
    """A folder under /tmp another user can reach (pytest's tmp_path is private to root)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("running as a second user needs root and setpriv")
    import tempfile

    folder = tempfile.mkdtemp(prefix="shared-cache-", dir="/tmp")
    os.chown(folder, 0, group)
    os.chmod(folder, mode)
    return Path(folder)


def _open_as_nobody(root, spec, text) -> subprocess.CompletedProcess:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
         _AS_NOBODY, str(root), json.dumps(spec), text],
        capture_output=True, text=True, timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": repo})


def test_a_second_user_builds_beside_a_lock_file_the_first_user_created():
    root = _shared_folder(0o777)
    try:
        os.makedirs(f"{root}/kind", mode=0o777)
        os.chmod(f"{root}/kind", 0o777)  # a folder both users can write, in which root's files are 0644
        entry, _ = disk_cache.open_or_build(root, "kind", SPEC, _build("by root"), fallback=None, what="e")
        shutil.rmtree(entry)  # the lock file stays, owned by root, 0644
        lock = entry.with_suffix(".lock")
        assert os.stat(lock).st_uid == 0 and not os.stat(lock).st_mode & 0o002  # nobody may not write it
        result = _open_as_nobody(root, SPEC, "by nobody")
        assert result.returncode == 0 and result.stdout.strip() == "by nobody", result.stderr[-2000:]
        assert os.stat(entry).st_uid == NOBODY
    finally:
        shutil.rmtree(root)


def test_what_the_cache_creates_in_a_group_writable_folder_is_group_writable():
    root = _shared_folder(0o2775, group=NOBODY)  # a team's folder: setgid, group-writable
    old_umask = os.umask(0o022)
    try:
        entry, _ = disk_cache.open_or_build(root / "cache", "kind", SPEC, _build("by root"), fallback=None,
                                            what="e")
        made = [Path(p) / name for p, dirs, files in os.walk(root) for name in dirs + files]
        assert len(made) >= 7  # cache, kind, the entry, its 2 files, the lock, hashes and its records
        for path in made:
            status = os.stat(path)
            assert status.st_gid == NOBODY and status.st_mode & 0o060 == 0o060, (path, oct(status.st_mode))
            if path.is_dir():
                assert status.st_mode & 0o010, path
        (entry / "payload.bin").write_text("damaged")  # the second user moves root's entry aside ...
        result = _open_as_nobody(f"{root}/cache", SPEC, "by nobody")
        assert result.returncode == 0 and result.stdout.strip() == "by nobody", result.stderr[-2000:]
        other = _open_as_nobody(f"{root}/cache", {"other": 1}, "another entry")  # ... and adds one
        assert other.returncode == 0 and other.stdout.strip() == "another entry", other.stderr[-2000:]
    finally:
        os.umask(old_umask)
        shutil.rmtree(root)


def test_a_waiter_says_who_holds_the_lock_and_again_while_it_waits(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(disk_cache, "WAIT_REPORT_SECONDS", 0.3)
    first = _builder(tmp_path, pause=2.0)
    _wait_for_build_start(tmp_path)  # the first holds the lock, mid-build
    with caplog.at_level(logging.WARNING):
        entry, _ = disk_cache.open_or_build(tmp_path / "root", "kind", {"format": 1}, _build("never"),
                                            fallback=None, what="the entry")
    assert (entry / "payload.bin").read_text() == "whole" and first.wait(timeout=60) == 0
    messages = [r.getMessage() for r in caplog.records]
    holder = f"pid {first.pid} on host {socket.gethostname()}, since "
    assert messages[0].startswith("Waiting for another process that is building the entry in ")
    assert holder in messages[0]
    assert len(messages) >= 3 and all(m.startswith("Still waiting after ") and holder in m
                                      for m in messages[1:]), messages
    assert not list(entry.parent.glob("*.builder"))  # the holder's words go with its lock


# ----------------------------------------------------------------------------- files hashed once


@pytest.fixture
def reads(monkeypatch):
    """The names of the files ``disk_cache`` opens for reading from now on, in a process that has hashed
    nothing yet (a later start)."""
    opened = []

    def counting_open(path, mode="r", *args, **kwargs):
        if "r" in mode:
            opened.append(os.path.basename(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_cache, "open", counting_open, raising=False)
    monkeypatch.setattr(disk_cache, "_hashed", {})
    return opened


def _new_process(monkeypatch, reads):
    monkeypatch.setattr(disk_cache, "_hashed", {})
    reads.clear()


def test_an_unchanged_file_is_hashed_once_for_every_later_process(tmp_path, monkeypatch, reads):
    index = tmp_path / "cache" / disk_cache.HASHES
    train = tmp_path / "train.en"
    train.write_text("a sentence\n" * 100)
    first = disk_cache.file_sha256(train, index=index)
    assert reads == ["train.en"] and not index.exists()  # written just now: may change within its tick
    monkeypatch.setattr(disk_cache, "_RACY_NS", 0)
    _new_process(monkeypatch, reads)
    assert disk_cache.file_sha256(train, index=index) == first and reads == ["train.en"]
    _new_process(monkeypatch, reads)
    assert disk_cache.file_sha256(train, index=index) == first and reads == []  # recorded: not read

    status = train.stat()
    train.write_text("b sentence\n" * 100)  # the same size, and the modification time put back
    os.utime(train, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert train.stat().st_size == status.st_size and train.stat().st_mtime_ns == status.st_mtime_ns
    _new_process(monkeypatch, reads)
    second = disk_cache.file_sha256(train, index=index)
    assert second != first and reads == ["train.en"]  # the change time tells

    train.write_text("a sentence\n" * 101)  # a changed size
    _new_process(monkeypatch, reads)
    assert disk_cache.file_sha256(train, index=index) not in (first, second) and reads == ["train.en"]

    copy = tmp_path / "copy.en"
    shutil.copy2(train, copy)
    os.replace(copy, train)  # the same bytes and times in another inode
    _new_process(monkeypatch, reads)
    disk_cache.file_sha256(train, index=index)
    assert reads == ["train.en"]


def test_a_file_written_while_it_is_hashed_is_not_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "_RACY_NS", 0)
    monkeypatch.setattr(disk_cache, "_hashed", {})
    train = tmp_path / "train.en"
    train.write_text("a\n" * 10)

    def open_then_append(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        with open(path, "a") as other:  # another process writes to it meanwhile
            other.write("b\n")
        return f

    monkeypatch.setattr(disk_cache, "open", open_then_append, raising=False)
    disk_cache.file_sha256(train, index=tmp_path / "hashes")
    assert not (tmp_path / "hashes").exists()


def test_a_warm_open_of_an_entry_reads_none_of_its_files(tmp_path, monkeypatch, reads):
    entry, manifest = disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello" * 1000),
                                               fallback=None, what="the entry")
    _new_process(monkeypatch, reads)
    assert disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("other"), fallback=None,
                                    what="the entry") == (entry, manifest)
    assert reads == []
    payload = entry / "payload.bin"
    payload.write_text("jello" * 1000)  # same size, new content: found
    _new_process(monkeypatch, reads)
    disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello" * 1000), fallback=None, what="e")
    assert "payload.bin" in reads and payload.read_text() == "hello" * 1000


def test_a_text_corpus_keeps_its_hashes_in_the_cache(tmp_path, monkeypatch, reads):
    from transformer_jax.data.corpora import TextCorpus

    monkeypatch.setattr(disk_cache, "_RACY_NS", 0)
    for name in ("train.de", "train.en"):
        (tmp_path / name).write_text("x\n")
    corpus = TextCorpus(tmp_path / "train.de", tmp_path / "train.en", hashes=tmp_path / "c" / "hashes")
    first = corpus.fingerprint()
    _new_process(monkeypatch, reads)
    assert corpus.fingerprint() == first and reads == []


# ----------------------------------------------------------------------------- shared filesystems


def test_a_filesystem_without_file_locks_is_one_line(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # NFS mounted with nolock

    monkeypatch.setattr(disk_cache.fcntl, "flock", no_locks)
    with pytest.raises(disk_cache.CacheError) as info:
        disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="the entry")
    message = str(info.value)
    assert message.startswith(f"cannot lock {tmp_path / 'kind' / disk_cache.spec_key(SPEC)}.lock: the ")
    assert "does not support file locks" in message and "-o flock" in message and "\n" not in message


def test_an_entry_another_node_made_meanwhile_is_used(tmp_path):
    """Where a lock holds only within a node (NFS with local_lock=flock), two nodes may build at once:
    the second to finish reads the first's entry instead of failing at the rename."""
    entry = tmp_path / "cache" / "kind" / disk_cache.spec_key(SPEC)

    def build(folder):
        other, _ = disk_cache.open_or_build(tmp_path / "node2", "kind", SPEC, _build("by node 2"),
                                            fallback=None, what="the entry")
        shutil.copytree(other, entry)
        (folder / "payload.bin").write_text("by node 1")
        return {}

    got, manifest = disk_cache.open_or_build(tmp_path / "cache", "kind", SPEC, build, fallback=None,
                                             what="the entry")
    assert got == entry and (entry / "payload.bin").read_text() == "by node 2" and manifest["spec"] == SPEC
    assert not list(entry.parent.glob("*.tmp-*"))


def test_chunks_go_once_their_entry_is_whole_or_after_a_week_unchanged(tmp_path):
    folder = tmp_path / "kind"
    never, recent = "a" * 20, "b" * 20
    whole, _ = disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("hello"), fallback=None, what="e")
    chunks = {key: folder / f"{key}.chunks" for key in (never, recent, whole.name)}
    for key, path in chunks.items():
        path.mkdir()
        (path / "0-7.npz").write_bytes(b"\0" * 10)
        (folder / f"{key}.lock").touch()
    week_ago = time.time() - disk_cache.CHUNKS_KEPT_SECONDS - 60
    os.utime(chunks[never], (week_ago, week_ago))  # a build stopped a week ago, never finished
    disk_cache.open_or_build(tmp_path, "kind", SPEC, _build("x"), fallback=None, what="e")
    assert [p.name for p in folder.glob("*.chunks")] == [f"{recent}.chunks"]
