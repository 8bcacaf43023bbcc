"""Tests for transformer_jax.checkpoints.orbax_workarounds: each workaround off shows what orbax does.

A full disk is an ``OSError(ENOSPC)`` injected into orbax's write of the ``integrity`` item
(``test_disk_full.full_disk``); the real tmpfs run in ``test_disk_full.py`` checks the whole output.
"""

import asyncio
import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import tensorstore as ts
from orbax.checkpoint._src import asyncio_utils
from test_checkpoint import ABSTRACT, new_checkpointer, save_steps
from test_disk_full import _save, full_disk  # noqa: F401 (a fixture)

from transformer_jax.checkpoints import orbax_workarounds
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import DiskFullError


def _fill_the_disk_at_step_2(ckpt, disk_switch) -> None:
    """Saves step 1, then step 2 onto a full disk, whose failure ``wait`` raises."""
    assert _save(ckpt, 1)
    ckpt.wait()
    disk_switch.on = True
    assert _save(ckpt, 2)  # fails in the background
    with pytest.raises(DiskFullError):
        ckpt.wait()


def _reports_a_full_disk(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return disk.is_disk_full(error) or disk.is_disk_full(Exception(record.getMessage()))


# --------------------------------------------------------------------------------------- 1. the log filter
@pytest.mark.parametrize("filtered", [True, False])
def test_orbax_logs_a_full_disk_from_several_threads_unless_filtered(tmp_path, full_disk, monkeypatch,  # noqa: F811
                                                                     caplog, filtered):
    if not filtered:
        monkeypatch.setattr(orbax_workarounds, "quiet_disk_full_logs", lambda: None)
        monkeypatch.setattr(logging.getLogger("absl"), "filters", [])
    with caplog.at_level(logging.INFO, logger="absl"), new_checkpointer(tmp_path) as ckpt:
        _fill_the_disk_at_step_2(ckpt, full_disk)
    from_orbax = [r for r in caplog.records if "/orbax/" in r.pathname.replace(os.sep, "/")]
    full = [r for r in from_orbax if _reports_a_full_disk(r)]
    if filtered:
        assert not full and from_orbax  # only the full-disk reports are dropped
    else:
        assert len({r.threadName for r in full}) >= 2 and all(r.levelno == logging.ERROR for r in full)
    assert not [r for r in caplog.records if r.name == "asyncio"]  # asyncio itself reports nothing


def test_the_log_filter_keeps_other_records():
    keep = orbax_workarounds.DiskFullLogFilter()
    full = OSError(errno.ENOSPC, "No space left on device")
    orbax_file = "/x/site-packages/orbax/checkpoint/_src/futures/future.py"

    def record(pathname, msg, error=None):
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord("absl", logging.ERROR, pathname, 1, msg, (), exc_info)

    assert not keep.filter(record(orbax_file, "save failed", full))
    assert not keep.filter(record(orbax_file, "[Errno 28] No space left on device: '/x/2'"))
    assert keep.filter(record(orbax_file, "save failed", PermissionError(errno.EACCES, "denied")))
    assert keep.filter(record("/x/transformer_jax/checkpoints/manager.py", "save failed", full))


def _collect_a_failed_task_never_awaited(error: OSError) -> None:
    """A write task that failed with ``error`` and that nobody awaited, collected: asyncio logs it."""
    async def write():
        raise error

    loop = asyncio.new_event_loop()
    task = loop.create_task(write())
    loop.run_until_complete(asyncio.sleep(0))  # the task runs and fails; nothing awaits it
    loop.close()
    del task  # collected: "Task exception was never retrieved", traceback included


@pytest.mark.parametrize("filtered", [True, False])
def test_asyncio_logs_a_failed_write_task_never_awaited_unless_filtered(monkeypatch, caplog, filtered):
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    if filtered:
        orbax_workarounds.quiet_disk_full_logs()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _collect_a_failed_task_never_awaited(OSError(errno.ENOSPC, "No space left on device"))
        _collect_a_failed_task_never_awaited(OSError(errno.EACCES, "Permission denied"))
    never_retrieved = [r for r in caplog.records
                       if r.name == "asyncio" and "exception was never retrieved" in r.getMessage()]
    assert [r.exc_info[1].errno for r in never_retrieved] == ([errno.EACCES] if filtered else
                                                               [errno.ENOSPC, errno.EACCES])


def test_reading_logs_no_orbax_warning(tmp_path, caplog):
    """Reading needs no orbax manager (a read-only one warns "Given directory is read only" each time)."""
    save_steps(tmp_path, [1])
    with caplog.at_level(logging.WARNING):
        reader = CheckpointReader(tmp_path)
        reader.restore(ABSTRACT)
        reader.saved_info()
    assert not caplog.records


# ---------------------------------------------------------------------------- 2. closed-loop callbacks
def _a_write_ends_after_its_loop_closed() -> None:
    """What orbax does on a failed save: one write fails, ``asyncio_utils.run_sync`` returns and closes its
    loop, and a tensorstore write still in flight ends afterwards, calling back into the closed loop."""
    promise, in_flight = ts.Promise.new()

    async def writes():
        async def pending():
            await in_flight

        async def failing():
            await asyncio.sleep(0)
            raise OSError(errno.ENOSPC, "No space left on device")

        await asyncio.gather(pending(), failing())

    with pytest.raises(OSError):
        asyncio_utils.run_sync(writes())
    promise.set_result(None)


@pytest.mark.parametrize("dropped", [True, False])
def test_a_write_ending_on_a_closed_loop_is_unraisable_unless_dropped(monkeypatch, dropped):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
    if dropped:
        orbax_workarounds.drop_closed_loop_callbacks()
        orbax_workarounds.drop_closed_loop_callbacks()  # idempotent: wrapped once
    _a_write_ends_after_its_loop_closed()
    if dropped:
        assert seen == []
    else:
        assert [(type(e), str(e)) for e in seen] == [(RuntimeError, "Event loop is closed")]
    other = KeyError("another unraisable exception")
    sys.unraisablehook(type("Unraisable", (), {"exc_value": other})())
    assert seen[-1] is other  # passed on either way


# ----------------------------------------------------------------------- 3. commit threads still writing
@pytest.fixture
def slow_state_write(full_disk, monkeypatch):  # noqa: F811
    """On the full disk, the write of the ``state`` item's sharding file (in a commit thread of its own,
    which orbax waits for after the failed ``integrity`` item's) waits for ``release``, then runs out of
    space too."""
    from orbax.checkpoint._src.serialization import jax_array_handlers

    write = jax_array_handlers._async_serialize_shardings

    class Slow:
        release = threading.Event()

    async def slow_write(shardings, infos, **kwargs):
        if full_disk.on:
            Slow.release.wait(timeout=60)  # a bound, so a changed orbax fails instead of hanging
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(infos[0].parent_dir / "_sharding"))
        return await write(shardings, infos, **kwargs)

    monkeypatch.setattr(jax_array_handlers, "_async_serialize_shardings", slow_write)
    return Slow


def _commit_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, orbax_workarounds.COMMIT_THREAD)]


def test_a_failed_save_is_raised_only_once_its_other_writes_ended(tmp_path, full_disk, slow_state_write,  # noqa: F811
                                                                    monkeypatch):
    join = orbax_workarounds.join_commit_threads

    def release_then_join(**kwargs):
        slow_state_write.release.set()  # the slow write ends only while the Checkpointer waits for it
        join(**kwargs)

    monkeypatch.setattr(orbax_workarounds, "join_commit_threads", release_then_join)
    with new_checkpointer(tmp_path) as ckpt:
        _fill_the_disk_at_step_2(ckpt, full_disk)  # DiskFullError, not the slow write's own failure
    assert not _commit_threads()
    assert sorted(os.listdir(tmp_path)) == ["1"]  # the partial directory went after the last write


def test_without_the_join_a_write_outlives_the_error(tmp_path, full_disk, slow_state_write,  # noqa: F811
                                                      monkeypatch):
    monkeypatch.setattr(orbax_workarounds, "join_commit_threads", lambda **kwargs: None)
    ckpt = new_checkpointer(tmp_path)
    _fill_the_disk_at_step_2(ckpt, full_disk)
    stray = _commit_threads()
    assert stray  # still writing after the error that ends the program, its partial directory removed
    slow_state_write.release.set()
    for thread in stray:
        threading.Thread.join(thread)
    ckpt.close()


def test_an_orbax_without_the_private_commit_thread_class_still_imports_and_saves(tmp_path):
    """A later orbax-checkpoint may move its private ``_SignalingThread``: the package still imports, the
    workaround waits for no thread, and a checkpoint is still saved."""
    code = (
        "import types, orbax.checkpoint._src.futures as package\n"
        "real, package.future = package.future, types.ModuleType('future')  # as if orbax moved it\n"
        "from transformer_jax.checkpoints import manager, orbax_workarounds as w\n"
        "package.future = real\n"
        "assert w.COMMIT_THREAD is None; w.join_commit_threads()\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "from test_checkpoint import save_steps\n"
        "from transformer_jax.checkpoints.reader import CheckpointReader\n"
        f"folder = {str(tmp_path / 'ckpt')!r}\n"
        "save_steps(folder, [1]); print(CheckpointReader(folder).all_steps())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[1]")
