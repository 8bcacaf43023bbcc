"""Immutable entries on disk, built once per content and named by what made them.

The data cache holds the expensive results of the data pipeline: a shared SentencePiece model per dataset
and settings (``tokenizer.shared_tokenizer``) and each train split encoded to token ids
(``corpus_cache``). Every later run, process, requeue and sweep row on the same data maps the same files.

    <root>/<kind>/<key>/            a finished entry: its files and, last, manifest.json
    <root>/<kind>/<key>.lock        flock'ed by the one process that builds the entry
    <root>/<kind>/<key>.builder     who holds the lock: host, pid and since when (JSON), for waiters
    <root>/<kind>/<key>.tmp-<host>-<pid>  an entry being built; renamed onto <key> when whole
    <root>/<kind>/<key>.chunks/     what a build keeps for the next one until the entry is whole
                                    (``chunks_folder``: e.g. the encoded chunks of ``corpus_cache``)
    <root>/hashes/<id>.json         a file's SHA-256 with the size, times and inode it had when hashed

The root is ``data.cache_dir``, else ``$TRANSFORMER_JAX_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax``
(``~/.cache/transformer_jax``). ``key`` is a SHA-256 of the entry's ``spec``: every input that decides its
content (the data files' own SHA-256, the tokenizer's, the settings that change the ids, and a format
version), so a changed file or setting names another entry and a stale one is never read.

A file's SHA-256 is kept in ``hashes/`` (as git's index does): a file whose path, size, modification and
change times and inode are those it had when hashed is not read again, so a warm start reads neither the
train files nor the entry's own files. Any write to a file changes its times (the change time cannot be
set back), and the file is hashed again.

Faults:
- a build is written beside the entry and renamed into place, so a build killed at any point (kill -9)
  leaves only a ``.tmp-<host>-<pid>`` folder, which the next open of the cache removes, whatever its
  entry, once its builder is gone: on this host, once the lock of that entry is free or its pid runs no
  more; of another host, once the lock is free and the build has not changed for ``STALE_SECONDS`` (where
  locks hold within a node only, another node's live build holds no lock here). A build that fails (a
  full disk, a data error) removes its own;
- ``<key>.chunks`` is removed once the entry is whole (after the rename, unless another host's live build
  of the entry is seen, which then removes it), by a later open if the builder was killed before that,
  and, for an entry never finished, once it has not changed for ``CHUNKS_KEPT_SECONDS``;
- builders take the lock, so two at once make one entry (the second waits, then reads it); a waiter says
  who holds the lock, and again every ``WAIT_REPORT_SECONDS``. Where the lock holds only within a node,
  two nodes may build at once: a build that fails or finds the entry at its rename because the other
  finished first uses the other's entry;
- the manifest records every file's size and SHA-256, checked on each open, and its own SHA-256: a damaged
  entry or manifest is moved aside (``<key>.damaged-<time>``) and rebuilt, with one warning line;
- a full disk is one line naming the cache's filesystem; a file where an entry's folder should be is one
  line;
- a root where nothing can be written gives one warning line and the entry is built under the fallback
  folder (the run's workdir) instead; an entry that is already whole is read from a read-only root;
- a cache shared by a group: what it creates in a group-writable folder is group-writable too (a setgid
  folder gives it the folder's group), and a lock file another user created is opened read-only if it
  cannot be written (flock needs only that, except on NFS).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import DiskFullError, UserError
from transformer_jax.runtime.output_file import process_is_gone

CACHE_ENV = "TRANSFORMER_JAX_CACHE"
MANIFEST = "manifest.json"
HASHES = "hashes"  # the folder of the root that keeps files' SHA-256 (``file_sha256``)
SELF_SHA256 = "manifest_sha256"  # the manifest's field holding the SHA-256 of its other fields
WAIT_REPORT_SECONDS = 60.0  # a waiter says again who holds the lock this often
_HASH_BLOCK = 1 << 24  # bytes read at a time while hashing a file
_RACY_NS = 2_000_000_000  # a file changed this recently may change again within its clock tick: not kept
STALE_SECONDS = 3600.0  # another host's build that has not changed for this long is taken to be gone
CHUNKS_KEPT_SECONDS = 7 * 24 * 3600.0  # the chunks of an entry never finished, unchanged this long, go
# A build's folder; its host is left out in the names of older versions (then this host).
_LEFTOVER = re.compile(r"(?P<key>[0-9a-f]{20})\.tmp-(?:(?P<host>[A-Za-z0-9.-]+)-)?(?P<pid>\d+)")
_CHUNKS = re.compile(r"(?P<key>[0-9a-f]{20})\.chunks")
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile/save on a full disk (no errno)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CacheError(UserError, OSError):
    """The data cache cannot be used (no writable folder for a missing entry); says what to set."""


def default_root() -> Path:
    """``$TRANSFORMER_JAX_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax``, else ~/.cache/transformer_jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "transformer_jax"


def cache_root(cache_dir: str) -> Path:
    """The root a data config asks for: ``data.cache_dir``, or ``default_root()`` when it is ''."""
    return Path(cache_dir).expanduser() if cache_dir else default_root()


# ----------------------------------------------------------------------------- a shared group


def share(path: Path, folder: Path) -> None:
    """Makes ``path`` (which this process created) group-readable and -writable, and a folder
    group-searchable, where ``folder`` (its parent) is group-writable; otherwise leaves it as created."""
    with contextlib.suppress(OSError):
        if not os.stat(folder).st_mode & stat.S_IWGRP:
            return
        status = os.lstat(path)
        if status.st_uid != os.geteuid() or stat.S_ISLNK(status.st_mode):
            return
        bits = stat.S_IRGRP | stat.S_IWGRP | (stat.S_IXGRP if stat.S_ISDIR(status.st_mode) else 0)
        if status.st_mode & bits != bits:
            os.chmod(path, stat.S_IMODE(status.st_mode) | bits)


def _share_tree(top: Path, folder: Path) -> None:
    """``share`` for ``top`` (in ``folder``) and everything under it."""
    share(top, folder)
    for parent, dirs, files in os.walk(top):
        for name in dirs + files:
            share(Path(parent) / name, Path(parent))


def make_dirs(folder: Path) -> None:
    """``folder`` and its missing parents, each shared as its parent is (``share``)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            path.mkdir()
            share(path, path.parent)
    if not missing and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(folder))


def _write_small(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` whole (a file beside it renamed into place), shared as its folder is."""
    tmp = path.with_name(f"{path.name}.tmp-{process_tag()}")
    try:
        tmp.write_text(text)
        share(tmp, path.parent)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


# ----------------------------------------------------------------------------- file hashes

_hashed: dict[tuple, str] = {}  # (path, size, times, inode) -> SHA-256, for this process's lifetime


def _stamp(status: os.stat_result) -> dict[str, int]:
    """What a write to a file changes: its size, modification and change times; a new file, its inode."""
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns,
            "inode": status.st_ino}


def file_stamps(paths: list[str | os.PathLike]) -> dict[str, dict[str, int] | None]:
    """``{real path: what a write to it changes (size, times, inode)}`` of each file, None if it is
    missing: taken before a file is hashed and again after a build has read it, a write in between shows."""
    stamps = {}
    for path in paths:
        real = os.path.realpath(path)
        try:
            stamps[real] = _stamp(os.stat(real))
        except FileNotFoundError:
            stamps[real] = None
    return stamps


def _record_path(index: Path, real: str) -> Path:
    return index / f"{hashlib.sha256(real.encode()).hexdigest()[:20]}.json"


def _recorded(index: Path, real: str, stamp: dict[str, int]) -> str | None:
    """The SHA-256 ``index`` keeps for the file ``real`` as it is now (``stamp``), else None."""
    try:
        record = json.loads(_record_path(index, real).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("path") != real or any(
            record.get(field) != value for field, value in stamp.items()):
        return None
    sha = record.get("sha256")
    return sha if isinstance(sha, str) and _SHA256.fullmatch(sha) else None


def _remember(index: Path, real: str, stamp: dict[str, int], sha: str) -> None:
    """Keeps ``sha`` for ``real`` in ``index``, if it can be written (it is only a shortcut)."""
    with contextlib.suppress(OSError):
        make_dirs(index)
        _write_small(_record_path(index, real), json.dumps({"path": real, **stamp, "sha256": sha}))


def file_sha256(path: str | os.PathLike, *, index: Path | None = None) -> str:
    """The hex SHA-256 of a file's bytes, read in blocks; a file unchanged since this process last hashed
    it (same size, times and inode) is not read again, nor, with ``index`` (a folder, e.g. the cache root's
    ``hashes``), one unchanged since any process recorded it there. A file changed in the last two
    seconds is not recorded: a write within the same tick of its clock would keep its times."""
    real = os.path.realpath(path)
    stamp = _stamp(os.stat(real))
    identity = (real, *stamp.values())
    if identity not in _hashed:
        sha = _recorded(index, real, stamp) if index is not None else None
        if sha is None:
            digest = hashlib.sha256()
            with open(real, "rb") as f:
                while block := f.read(_HASH_BLOCK):
                    digest.update(block)
            sha = digest.hexdigest()
            recent = time.time_ns() - max(stamp["mtime_ns"], stamp["ctime_ns"]) < _RACY_NS
            if index is not None and not recent and _stamp(os.stat(real)) == stamp:  # not written meanwhile
                _remember(index, real, stamp, sha)
        _hashed[identity] = sha
    return _hashed[identity]


def spec_key(spec: Mapping[str, Any]) -> str:
    """The entry name of ``spec`` (JSON-able): 20 hex digits of the SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------- the manifest


def _self_sha256(manifest: Mapping[str, Any]) -> str:
    """The SHA-256 of a manifest's fields but ``SELF_SHA256``, as canonical JSON."""
    fields = {k: v for k, v in manifest.items() if k != SELF_SHA256}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _manifest_problem(manifest: Any, spec: Mapping[str, Any]) -> str | None:
    """None if ``manifest`` is well formed, is the one of ``spec`` and matches its own SHA-256 (older
    manifests have none), else what is wrong with it."""
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a JSON object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    for name, value in files.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or not (
                isinstance(value, list) and len(value) == 2 and type(value[0]) is int and value[0] >= 0
                and isinstance(value[1], str) and _SHA256.fullmatch(value[1])):
            return f"{MANIFEST} has a malformed file record {name!r}: {value!r}"
    if manifest.get("spec") != json.loads(json.dumps(dict(spec))):
        return f"{MANIFEST} is another entry's"
    if SELF_SHA256 in manifest and manifest[SELF_SHA256] != _self_sha256(manifest):
        return f"{MANIFEST} does not match its own SHA-256 (a value in it was changed)"
    return None


def _check_files(folder: Path, manifest: dict, index: Path | None) -> str | None:
    """None if every file of ``manifest`` in ``folder`` has its size and SHA-256, else what differs."""
    for name, (size, sha) in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if file_sha256(path, index=index) != sha:
            return f"{name} does not match its SHA-256"
    return None


def _read_manifest(folder: Path, spec: Mapping[str, Any], what: str, index: Path | None,
                   check: Callable[[dict], str | None] | None = None) -> tuple[dict | None, str | None]:
    """(manifest, None) for a whole entry; (None, why) for a damaged one; (None, None) when there is none.
    CacheError when something else than a folder has the entry's name."""
    if not folder.is_dir():
        if os.path.lexists(folder):
            raise CacheError(f"{folder} is a file where the folder of {what} should be; remove it (the "
                             "cache never writes a file there) and run again")
        return None, None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        problem = (_manifest_problem(manifest, spec) or (check and check(manifest))
                   or _check_files(folder, manifest, index))
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST} is unreadable ({e})"
    return (None, problem) if problem else (manifest, None)


# ----------------------------------------------------------------------------- the lock


def _open_lock(path: Path) -> int:
    """A descriptor of the lock file ``path`` (created, shared as its folder is, when missing): read-write
    where this user may write it, else read-only (another user's lock file in a shared cache)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)
    share(path, path.parent)
    return fd


def _try_lock(fd: int, path: Path) -> bool:
    """Takes the exclusive flock on ``fd`` if it is free."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise CacheError(f"cannot lock {path}: {disk.describe_filesystem(str(path), space=False)} does "
                             f"not support file locks ({e.strerror}); mount it with locks (NFS: without "
                             "'nolock'; Lustre: with '-o flock') or set config.data.cache_dir (or "
                             f"${CACHE_ENV}) to a folder on another filesystem") from None
        if e.errno != errno.EBADF:
            raise
        raise CacheError(f"cannot lock {path}: it belongs to another user and cannot be written by you, and "
                         "this filesystem (NFS) locks only files open for writing; ask its owner to make the "
                         "cache folder group-writable (chmod -R g+w) or set config.data.cache_dir (or "
                         f"${CACHE_ENV}) to a folder of your own") from None
    return True


def _holder(path: Path) -> str:
    """Who holds the lock ``path``, from the ``.builder`` file its holder wrote."""
    try:
        record = json.loads(path.with_suffix(".builder").read_text())
        host, pid, since = record["host"], int(record["pid"]), float(record["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not say who it is"
    minutes = max(0.0, time.time() - since) / 60
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
    gone = " (no longer running)" if host == socket.gethostname() and process_is_gone(pid) else ""
    return f"pid {pid} on host {host}{gone}, since {when} ({minutes:.0f} min ago)"


def _wait(fd: int, path: Path, what: str) -> None:
    """Waits for the flock on ``fd``, saying who holds it now and again every ``WAIT_REPORT_SECONDS``."""
    started = time.monotonic()
    logging.warning("Waiting for another process that is building %s in %s: %s", what, path.with_suffix(""),
                    _holder(path))
    report = started + WAIT_REPORT_SECONDS
    pause = 0.05
    while not _try_lock(fd, path):
        if time.monotonic() >= report:
            report += WAIT_REPORT_SECONDS
            logging.warning("Still waiting after %.0f min for %s: its lock %s is held by %s. If that process "
                            "is gone (a node that crashed), the filesystem frees its lock when it notices "
                            "(NFS: within its lease time, Lustre: when it evicts the node)",
                            (time.monotonic() - started) / 60, what, path, _holder(path))
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """Holds an exclusive flock on ``path`` (created), waiting for any other holder; the holder's host, pid
    and start are in ``<path>.builder`` meanwhile. Released on exit."""
    fd = _open_lock(path)
    try:
        if not _try_lock(fd, path):
            _wait(fd, path, what)
        builder = path.with_suffix(".builder")
        with contextlib.suppress(OSError):  # only words for waiters
            _write_small(builder, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                              "since": time.time()}))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                builder.unlink()
    finally:
        os.close(fd)  # releases the flock


def process_tag() -> str:
    """``<host>-<pid>`` of this process: the names of what it writes in a cache that several hosts share."""
    return f"{socket.gethostname()}-{os.getpid()}"


def chunks_folder(tmp: Path) -> Path:
    """``<kind>/<key>.chunks``: what the build in ``tmp`` (``<kind>/<key>.tmp-<host>-<pid>``) keeps for the
    next build of its entry (a stopped or failed one goes on from it), removed once the entry is whole."""
    return tmp.parent / f"{_LEFTOVER.fullmatch(tmp.name)['key']}.chunks"


def _unchanged_for(paths: list[Path], seconds: float) -> bool:
    """Whether none of ``paths`` (those that exist) was modified in the last ``seconds``."""
    newest = max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)
    return time.time() - newest > seconds


def _build_is_gone(path: Path, lock_free: bool) -> bool:
    """Whether the builder of the ``.tmp-<host>-<pid>`` folder ``path`` has ended: on this host, its lock
    is free (``lock_free``) or its pid runs no more; on another, its lock is free and neither the folder
    nor its entry's chunks changed for ``STALE_SECONDS`` (a lock may hold within a node only)."""
    match = _LEFTOVER.fullmatch(path.name)
    if match["host"] in (None, socket.gethostname()):
        return lock_free or process_is_gone(int(match["pid"]))
    return lock_free and _unchanged_for([path, path.with_name(f"{match['key']}.chunks")], STALE_SECONDS)


def _live_builds(folder: Path, key: str) -> list[Path]:
    """The ``<key>.tmp-*`` folders in ``folder`` of other hosts' builds that may still run, whose lock this
    process holds or found free (``_build_is_gone``)."""
    return [p for p in folder.glob(f"{key}.tmp-*") if _LEFTOVER.fullmatch(p.name) and p.is_dir()
            and not _build_is_gone(p, lock_free=True)]


def _chunks_done(chunks: Path) -> bool:
    """Whether ``<key>.chunks``, whose lock is free, is of no more use: its entry exists (its builder was
    killed after the rename) or it has not changed for ``CHUNKS_KEPT_SECONDS``, and no other host's build
    of the entry runs."""
    done = chunks.with_suffix("").is_dir() or _unchanged_for([chunks], CHUNKS_KEPT_SECONDS)
    return done and not _live_builds(chunks.parent, chunks.stem)


def _remove_leftovers(root: Path, own: Path | None) -> None:
    """Removes, in every kind folder of ``root``, the ``<key>.tmp-<host>-<pid>`` folders of builders that
    are gone (``_build_is_gone``; the lock of ``own`` is held by this process, any other is held while
    removing, so that no build starts meanwhile) and the ``<key>.chunks`` of entries whose lock is free
    that are whole or have not changed for ``CHUNKS_KEPT_SECONDS``."""
    with contextlib.suppress(OSError):
        for folder in [p for p in root.iterdir() if p.is_dir() and p.name != HASHES]:
            leftovers: dict[Path, list[Path]] = {}
            for path in folder.iterdir():
                match = _LEFTOVER.fullmatch(path.name) or _CHUNKS.fullmatch(path.name)
                if match and path.is_dir():
                    leftovers.setdefault(folder / f"{match['key']}.lock", []).append(path)
            for lock, paths in leftovers.items():
                builds = [p for p in paths if _LEFTOVER.fullmatch(p.name)]
                if lock == own or not lock.exists():
                    for path in builds:
                        if _build_is_gone(path, lock_free=lock == own):
                            shutil.rmtree(path, ignore_errors=True)
                    continue
                with _held_if_free(lock) as free:  # held while removing: no new build starts meanwhile
                    for path in paths if free else []:
                        if _build_is_gone(path, lock_free=True) if path in builds else _chunks_done(path):
                            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _held_if_free(lock: Path) -> Iterator[bool]:
    """Holds the flock on the existing ``lock`` if no process holds it; yields whether it does."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except PermissionError:
        fd = os.open(lock, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except OSError:  # held (or, on NFS, not lockable read-only: then left alone)
            free = False
        yield free
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- building


def _writable(folder: Path) -> str | None:
    """None if a file can be created in ``folder`` (made if missing), else the reason."""
    try:
        make_dirs(folder)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        file = next((p for p in (folder, *folder.parents) if os.path.lexists(p) and not p.is_dir()), folder)
        return f"{file} is a file, not a folder"
    except OSError as e:
        return e.strerror or str(e)
    return None


def is_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk is full, numpy's short write (which has no errno) included."""
    return disk.is_disk_full(error) or bool(_SHORT_WRITE.search(str(error)))


def _build_entry(tmp: Path, spec: Mapping[str, Any], build: Callable[[Path], dict[str, Any]],
                 index: Path) -> dict[str, Any]:
    """Runs ``build`` into the empty folder ``tmp`` and writes its manifest; returns the manifest."""
    started = time.time()
    extra = build(tmp)
    _share_tree(tmp, tmp.parent)
    files = {p.name: [p.stat().st_size, file_sha256(p)] for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {**extra, "spec": dict(spec), "files": files, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "build_seconds": round(time.time() - started, 1)}
    manifest[SELF_SHA256] = _self_sha256(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    share(tmp / MANIFEST, tmp)
    for path in tmp.iterdir():  # whole on disk before it gets its name
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return manifest


def open_or_build(root: Path, kind: str, spec: Mapping[str, Any],
                  build: Callable[[Path], dict[str, Any]], *, fallback: Path | None,
                  what: str, check: Callable[[dict], str | None] | None = None) -> tuple[Path, dict]:
    """The folder and manifest of the entry for ``spec``, built by ``build`` if no whole one exists.

    Args:
      root: the cache root (``cache_root``); entries live in ``root/kind``.
      kind: the entry kind, a folder name ('tokenizers', 'encoded').
      spec: everything that decides the entry's content (JSON-able); recorded in the manifest.
      build: writes the entry's files into the empty folder it is given and returns extra manifest
        fields (counts, warnings); the files it wrote are hashed into the manifest afterwards.
      fallback: where to build when nothing can be written under ``root`` (e.g. the workdir's
        ``data_cache``); None: raise ``CacheError`` instead.
      what: words for messages, e.g. 'the encoded train split'.
      check: what is wrong with the values of a manifest (of the right spec) that its reader relies on,
        or None; an entry it finds wrong is damaged. The manifest's own SHA-256 guards its values, but
        manifests written before it are read too.

    Raises ``DiskFullError`` (naming the cache's filesystem; the half-written entry removed) when the disk
    fills up during the build, ``CacheError`` when a file has the entry's name. ``<key>.chunks``
    (``chunks_folder``), which ``build`` may keep for the next build, is removed once the entry is whole.
    """
    key = spec_key(spec)
    folder = root / kind
    entry = folder / key
    index = root / HASHES
    manifest, damage = _read_manifest(entry, spec, what, index, check)
    if manifest is not None:
        _remove_leftovers(root, None)  # of builds that failed or were killed, of any entry
        return entry, manifest
    reason = _writable(folder)
    if reason is not None:
        if fallback is None or Path(fallback).resolve() == root.resolve():
            raise CacheError(f"cannot build {what} in {folder} ({reason}); set config.data.cache_dir (or "
                             f"${CACHE_ENV}) to a folder you can write")
        logging.warning("The data cache %s is not writable (%s); using %s for %s", folder, reason,
                        fallback, what)
        return open_or_build(Path(fallback), kind, spec, build, fallback=None, what=what, check=check)
    try:
        with _locked(folder / f"{key}.lock", what):
            manifest, damage = _read_manifest(entry, spec, what, index, check)  # built meanwhile by another?
            if manifest is not None:
                return entry, manifest
            if damage is not None:
                aside = folder / f"{key}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                entry.rename(aside)
                logging.warning("%s in %s is damaged (%s); moved it to %s and building it again", what,
                                entry, damage, aside.name)
            _remove_leftovers(root, folder / f"{key}.lock")
            tmp = folder / f"{key}.tmp-{process_tag()}"
            tmp.mkdir()
            share(tmp, folder)
            try:
                manifest = _build_entry(tmp, spec, build, index)
                tmp.rename(entry)
            except Exception:
                shutil.rmtree(tmp, ignore_errors=True)
                # Where the lock holds only within a node, another node may have made the entry meanwhile:
                # this rename then fails, or this build did (the other removed the chunks it used).
                manifest, _ = _read_manifest(entry, spec, what, index, check)
                if manifest is None:
                    raise
            if not _live_builds(folder, key):  # else the last build to end removes them
                shutil.rmtree(chunks_folder(tmp), ignore_errors=True)
    except OSError as e:
        if isinstance(e, UserError) or not is_full(e):
            raise
        where = disk.describe_filesystem(str(folder))
        raise DiskFullError(f"no space left building {what} in {folder}: {where} ran out of space; the "
                            "half-written entry was removed. Free some space there, or set "
                            f"config.data.cache_dir (or ${CACHE_ENV}) to a filesystem with room, and run "
                            "again") from None
    for name, (_, sha) in manifest["files"].items():  # an open of the new entry reads none of its files
        path = os.path.realpath(entry / name)
        _remember(index, path, _stamp(os.stat(path)), sha)
    return entry, manifest
