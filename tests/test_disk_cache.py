"""The data cache's entries: built once under a lock, renamed into place whole, checked on every open.

Faults: a builder killed with SIGKILL mid-build leaves nothing a later open uses; two builders at once make
one entry; a truncated or altered file is found by its size or SHA-256 and the entry rebuilt with a
warning; a root where nothing can be written falls back to the given folder and says so.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from transformer_jax.data import disk_cache

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
