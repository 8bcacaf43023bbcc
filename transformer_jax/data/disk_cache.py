"""Immutable entries on disk, built once per content and named by what made them.

The data cache holds the expensive results of the data pipeline: a shared SentencePiece model per dataset
and settings (``tokenizer.shared_tokenizer``) and each train split encoded to token ids
(``corpus_cache``). Every later run, process, requeue and sweep row on the same data maps the same files.

    <root>/<kind>/<key>/            a finished entry: its files and, last, manifest.json
    <root>/<kind>/<key>.lock        flock'ed by the one process that builds the entry
    <root>/<kind>/<key>.tmp-<pid>   an entry being built; renamed onto <key> when whole

The root is ``data.cache_dir``, else ``$TRANSFORMER_JAX_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax``
(``~/.cache/transformer_jax``). ``key`` is a SHA-256 of the entry's ``spec``: every input that decides its
content (the data files' own SHA-256, the tokenizer's, the settings that change the ids, and a format
version), so a changed file or setting names another entry and a stale one is never read.

Faults:
- a build is written beside the entry and renamed into place, so a build killed at any point (kill -9)
  leaves only a ``.tmp-<pid>`` folder, which the next builder removes;
- builders take the lock, so two at once make one entry (the second waits, then reads it);
- the manifest records every file's size and SHA-256, checked on each open: a damaged entry is moved
  aside (``<key>.damaged-<time>``) and rebuilt, with one warning line;
- a root where nothing can be written gives one warning line and the entry is built under the fallback
  folder (the run's workdir) instead; an entry that is already whole is read from a read-only root.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from transformer_jax.runtime.errors import UserError

CACHE_ENV = "TRANSFORMER_JAX_CACHE"
MANIFEST = "manifest.json"
_HASH_BLOCK = 1 << 24  # bytes read at a time while hashing a file


class CacheError(UserError, OSError):
    """The data cache cannot be used (no writable folder for a missing entry); says what to set."""


def default_root() -> Path:
    """``$TRANSFORMER_JAX_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax``, else ~/.cache/transformer_jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformer_jax"


def cache_root(cache_dir: str) -> Path:
    """The root a data config asks for: ``data.cache_dir``, or ``default_root()`` when it is ''."""
    return Path(cache_dir).expanduser() if cache_dir else default_root()


_hashed: dict[tuple, str] = {}  # (path, size, mtime, inode) -> SHA-256, for this process's lifetime


def file_sha256(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file's bytes, read in blocks; a file unchanged since this
    process last hashed it (same size, modification time and inode) is not read again."""
    status = os.stat(path)
    identity = (os.path.realpath(path), status.st_size, status.st_mtime_ns, status.st_ino)
    if identity not in _hashed:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                digest.update(block)
        _hashed[identity] = digest.hexdigest()
    return _hashed[identity]


def spec_key(spec: Mapping[str, Any]) -> str:
    """The entry name of ``spec`` (JSON-able): 20 hex digits of the SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _check_files(folder: Path, manifest: dict) -> str | None:
    """None if every file of ``manifest`` in ``folder`` has its size and SHA-256, else what differs."""
    for name, (size, sha) in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if file_sha256(path) != sha:
            return f"{name} does not match its SHA-256"
    return None


def _read_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) for a whole entry; (None, why) for a damaged one; (None, None) when there is none."""
    if not folder.is_dir():
        return None, None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        problem = _check_files(folder, manifest)
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{MANIFEST} is unreadable ({e})"
    return (None, problem) if problem else (manifest, None)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive flock on ``path`` (created), waiting for any other holder; released on exit."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.warning("Waiting for another process that is building %s", path.with_suffix(""))
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _remove_leftovers(folder: Path, key: str) -> None:
    """Removes the ``<key>.tmp-*`` folders of builders that died (called under the lock, so none is live)."""
    for stale in folder.glob(f"{key}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _writable(folder: Path) -> str | None:
    """None if a file can be created in ``folder`` (made if missing), else the reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def open_or_build(root: Path, kind: str, spec: Mapping[str, Any],
                  build: Callable[[Path], dict[str, Any]], *, fallback: Path | None,
                  what: str) -> tuple[Path, dict]:
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
    """
    key = spec_key(spec)
    folder = root / kind
    entry = folder / key
    manifest, damage = _read_manifest(entry)
    if manifest is not None:
        return entry, manifest
    reason = _writable(folder)
    if reason is not None:
        if fallback is None or Path(fallback).resolve() == root.resolve():
            raise CacheError(f"cannot build {what} in {folder} ({reason}); set config.data.cache_dir (or "
                             f"${CACHE_ENV}) to a folder you can write")
        logging.warning("The data cache %s is not writable (%s); using %s for %s", folder, reason,
                        fallback, what)
        return open_or_build(Path(fallback), kind, spec, build, fallback=None, what=what)
    with _locked(folder / f"{key}.lock"):
        manifest, damage = _read_manifest(entry)  # another process may have built it meanwhile
        if manifest is not None:
            return entry, manifest
        if damage is not None:
            aside = folder / f"{key}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            entry.rename(aside)
            logging.warning("%s in %s is damaged (%s); moved it to %s and building it again", what, entry,
                            damage, aside.name)
        _remove_leftovers(folder, key)
        tmp = folder / f"{key}.tmp-{os.getpid()}"
        tmp.mkdir()
        started = time.time()
        extra = build(tmp)
        files = {p.name: [p.stat().st_size, file_sha256(p)] for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {**extra, "spec": dict(spec), "files": files,
                    "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "build_seconds": round(time.time() - started, 1)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for path in tmp.iterdir():  # whole on disk before it gets its name
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        tmp.rename(entry)
    return entry, manifest
