"""The data cache's build under a cluster's ordinary events, with real processes and real signals: a worker
killed by SIGKILL (what the out-of-memory killer does), a stop signal to the run's process group, and a
script without an ``if __name__ == "__main__"`` guard. Each build goes through worker processes in chunks of
``faulty_corpora.CHUNK_PAIRS`` rows (58 chunks of the 400-row corpus) and ends with the same batches and
warnings as reading the corpus in memory, whatever stopped it before."""

import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faulty_corpora
import pytest
from test_corpus_cache import _assert_same_batches, _config, _in_memory, _warnings, _write_corpus

from transformer_jax.data import cache_build, corpus_cache, pipeline, tokenizer

TESTS = Path(__file__).resolve().parent
CHUNKS = 58
# The processes the tests start import this checkout's package (not the one the venv has installed).
RUN_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS.parent),
                                                                     os.environ.get("PYTHONPATH"))))}


@pytest.fixture(autouse=True)
def _no_hang():
    """A build that hangs (as one did when a worker was killed) fails its test after 5 minutes."""
    def hung(signum, frame):
        raise TimeoutError("the build did not end within 5 minutes")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _chunk_files(folder: Path) -> list[Path]:
    return sorted((folder / "cache" / "encoded").glob("*.chunks/*.npz"))


def _check_equals_in_memory(folder: Path, tok: tokenizer.Tokenizer, caplog) -> None:
    """The whole entry's batches and warnings equal the in-memory path's; no chunk is left."""
    cfg = _config(folder)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cached = pipeline.make_train_iterator(cfg, tok, seed=5)
    from_cache = [m for m in _warnings(caplog) if not m.startswith("Dropped ")]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        in_memory = _in_memory(cfg, tok)
    assert from_cache == _warnings(caplog) and len(from_cache) == 4
    _assert_same_batches(cached, in_memory)
    assert not list((folder / "cache" / "encoded").glob("*.chunks"))


def _lock_is_free(folder: Path) -> bool:
    (lock,) = (folder / "cache" / "encoded").glob("*.lock")
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_killed_worker_is_named_in_one_line_and_its_chunk_encoded_again(tmp_path, monkeypatch, capfd,
                                                                          caplog):
    _write_corpus(tmp_path)
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    faulty_corpora.faulty(monkeypatch.setattr, kill_row=70, kill_once=str(tmp_path / "killed"))
    pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    assert (tmp_path / "killed").exists()
    said = re.findall(r"data: the worker[^\r\n]*", capfd.readouterr().err)
    corpus = f"{tmp_path}/train.en / {tmp_path}/train.de"
    assert said == [f"data: the worker process reading rows 71-77 (chunk 11 of {CHUNKS}) of {corpus} was "
                    "killed by SIGKILL (most likely the out-of-memory killer); reading it again in a new "
                    "worker"]
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_chunk_whose_worker_dies_twice_ends_the_build_in_one_line_and_the_next_start_goes_on(
        tmp_path, monkeypatch, capfd, caplog):
    _write_corpus(tmp_path)
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    faulty_corpora.faulty(monkeypatch.setattr, kill_row=70)  # whenever it is read: more than it can get
    with pytest.raises(cache_build.WorkerDiedError) as failed:
        pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    message = str(failed.value)
    assert "\n" not in message and message.startswith(
        f"the worker process reading rows 71-77 (chunk 11 of {CHUNKS}) of ")
    assert ("was killed by SIGKILL (most likely the out-of-memory killer), twice; give the run more memory"
            in message)
    assert _lock_is_free(tmp_path)  # the waiters for the entry go on
    kept = len(_chunk_files(tmp_path))
    assert 10 <= kept < CHUNKS and not list((tmp_path / "cache" / "encoded").glob("*.tmp-*"))

    capfd.readouterr()
    faulty_corpora.faulty(monkeypatch.setattr)  # the next start, with the memory it needs
    pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    assert f"{kept} of {CHUNKS} chunks were encoded before" in capfd.readouterr().err
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_killed_builder_process_ends_the_build_in_one_line(tmp_path, monkeypatch):
    _write_corpus(tmp_path)
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    faulty_corpora.faulty(monkeypatch.setattr, kill_builder=True)
    with pytest.raises(cache_build.WorkerDiedError, match=r"^the data cache's builder process was killed by "
                       r"SIGKILL \(most likely the out-of-memory killer\); the chunks it finished are kept"):
        pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    assert _lock_is_free(tmp_path)


def _start_a_run(folder: Path, *options: str) -> subprocess.Popen:
    """``faulty_corpora.py``'s start of a run, as a process group of its own (its builder and workers)."""
    return subprocess.Popen([sys.executable, str(TESTS / "faulty_corpora.py"), str(folder), *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=RUN_ENV)


def _live_processes_in_group(group: int) -> list[int]:
    """The processes of a process group that have not ended (zombies, which have, are left out)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("signum,guard", [(signal.SIGTERM, True), (signal.SIGUSR1, False)],
                         ids=["SIGTERM_under_the_training_guard", "SIGUSR1_without_a_handler"])
def test_a_stop_signal_to_the_process_group_ends_the_build_cleanly_and_the_next_start_goes_on(
        tmp_path, caplog, signum, guard):
    _write_corpus(tmp_path)
    run = _start_a_run(tmp_path, "--delay=0.3", *(["--guard"] if guard else []))
    try:
        while len(_chunk_files(tmp_path)) < 3:
            assert run.poll() is None, run.communicate()
            time.sleep(0.1)
        os.killpg(run.pid, signum)  # the run, its builder and the workers, as Slurm and Ctrl-C signal them
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    kept = len(_chunk_files(tmp_path))
    name = signal.Signals(signum).name
    assert run.returncode == 0 and "Traceback" not in err, err
    assert (f"Stopped by {name} while building the encoded train split: {kept} of {CHUNKS} chunks are "
            "encoded, kept in ") in out and 3 <= kept < CHUNKS
    assert (f"Received {name}: will save a checkpoint" in err) == guard  # the training guard was told
    for _ in range(100):  # the builder and its workers end with it (those not yet reaped are zombies)
        if not _live_processes_in_group(run.pid):
            break
        time.sleep(0.1)
    assert _live_processes_in_group(run.pid) == []
    assert _lock_is_free(tmp_path)

    again = _start_a_run(tmp_path)  # the requeued job
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"{kept} of {CHUNKS} chunks were encoded before" in err and "Data: 398 train pairs encoded" in out
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_stop_signal_while_waiting_for_another_process_s_build_ends_the_wait_cleanly(tmp_path):
    _write_corpus(tmp_path)
    builder = _start_a_run(tmp_path, "--delay=0.3")
    try:
        while not _chunk_files(tmp_path):
            assert builder.poll() is None, builder.communicate()
            time.sleep(0.1)
        with open(tmp_path / "waiter.err", "w+") as err:
            waiter = subprocess.Popen([sys.executable, str(TESTS / "faulty_corpora.py"), str(tmp_path)],
                                      stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                      env=RUN_ENV)
            while "Waiting for another process that is building" not in (tmp_path / "waiter.err").read_text():
                assert waiter.poll() is None, (tmp_path / "waiter.err").read_text()
                time.sleep(0.1)
            os.killpg(waiter.pid, signal.SIGINT)  # Ctrl-C
            out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and "Traceback" not in (tmp_path / "waiter.err").read_text()
        assert ("Stopped by SIGINT while waiting for another process that builds the encoded train split. "
                "Run the same command again to go on.") in out
        assert builder.poll() is None  # the build goes on
    finally:
        for run in (builder, locals().get("waiter")):
            if run is not None and run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.communicate()


UNGUARDED = """\
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_corpus_cache import _config
from transformer_jax.data import corpora, pipeline

corpora.SMALL_BYTES = 0  # the corpus is built as one over the size built in this process
cfg = _config(Path({folder!r}))
tok = pipeline.load_or_train_tokenizer(cfg, {workdir!r})
print("examples:", pipeline.make_train_iterator(cfg, tok, seed=0).num_examples)
"""


def test_a_script_without_a_main_guard_builds_with_worker_processes(tmp_path):
    """Such a script worked before the data cache, which then started processes that imported it again."""
    _write_corpus(tmp_path)
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(tests=str(TESTS), folder=str(tmp_path), workdir=str(tmp_path / "w")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=RUN_ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("examples: 315") == 1 and "Data: 398 train pairs encoded" in done.stdout
    assert "worker processes" in done.stderr  # the build took the worker path


def _wait_for(condition, run: subprocess.Popen) -> None:
    """Waits until ``condition()`` holds while ``run`` goes on (a minute at most)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)


def _ended(run: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """``run``'s output once it ends; its process group killed if it does not."""
    try:
        return run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()


def test_a_kill_after_the_encoding_before_the_entry_is_whole_keeps_every_chunk(tmp_path, caplog):
    _write_corpus(tmp_path)
    run = _start_a_run(tmp_path, "--stall_after_encoding")
    try:
        _wait_for((tmp_path / "encoded").exists, run)  # encoded and joined; not yet hashed nor renamed
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
    assert len(_chunk_files(tmp_path)) == CHUNKS
    again = _start_a_run(tmp_path)
    out, err = _ended(again)
    assert again.returncode == 0, err
    assert f"{CHUNKS} of {CHUNKS} chunks were encoded before" in err and "Data: 398 train pairs" in out
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_two_nodes_whose_locks_do_not_see_each_other_build_one_entry_from_shared_chunks(tmp_path, caplog):
    """Where a lock holds within a node only (NFS with local_lock=flock, Lustre's localflock), two nodes
    build at once: neither removes the other's build nor the chunks it still reads."""
    _write_corpus(tmp_path)
    first = _start_a_run(tmp_path, "--delay=0.3", "--node=node1")
    try:
        _wait_for(lambda: len(_chunk_files(tmp_path)) >= 3, first)
        second = _start_a_run(tmp_path, "--delay=0.3", "--node=node2")
        runs = [(first, *_ended(first)), (second, *_ended(second))]
    finally:
        for run in (first, locals().get("second")):
            if run is not None and run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    for run, out, err in runs:
        assert run.returncode == 0 and "Traceback" not in err, err
        assert "Data: 398 train pairs encoded into" in out
    assert not list((tmp_path / "cache" / "encoded").glob("*.tmp-*"))
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_train_file_written_to_during_the_build_keeps_nothing_it_made(tmp_path, caplog):
    """Written to and put back as it was while the chunks are encoded: the key names the content hashed
    before, which the build may not have read."""
    _write_corpus(tmp_path)
    train = tmp_path / "train.en"
    run = _start_a_run(tmp_path, "--delay=0.3")
    try:
        _wait_for(lambda: len(_chunk_files(tmp_path)) >= 3, run)
        original = train.read_bytes()
        train.write_bytes(b"XX " + original.replace(b"\n", b"\nXX "))
        time.sleep(1.0)  # chunks are encoded from it meanwhile
        train.write_bytes(original)
        out, err = _ended(run)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {train} was written to while the encoded train split was built from it"), err
    encoded = tmp_path / "cache" / "encoded"
    assert not [p for p in encoded.iterdir() if p.is_dir()]  # no entry, no chunks, no build folder
    again = _start_a_run(tmp_path)
    assert _ended(again)[0].count("Data: 398 train pairs encoded") == 1
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_worker_killed_as_it_starts_is_replaced_and_the_build_ends(tmp_path, monkeypatch, capfd, caplog):
    """Killed while it reads its start-up data, which for a large corpus is more than a pipe holds: the
    build once waited for it for ever, holding the lock."""
    _write_corpus(tmp_path)
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    faulty_corpora.faulty(monkeypatch.setattr, kill_at_start=str(tmp_path / "killed"),
                          ballast=b"\0" * (4 << 20))
    pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    assert (tmp_path / "killed").exists()
    said = re.findall(r"data: a worker[^\r\n]*", capfd.readouterr().err)
    assert said == ["data: a worker process was killed by SIGKILL (most likely the out-of-memory killer) "
                    "before it took a task; starting another"]
    _check_equals_in_memory(tmp_path, tok, caplog)


def test_a_full_disk_in_a_worker_is_one_line_naming_the_caches_filesystem(tmp_path, monkeypatch, capfd):
    from transformer_jax.runtime import disk
    from transformer_jax.runtime.errors import DiskFullError

    _write_corpus(tmp_path)
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(tmp_path)))
    faulty_corpora.faulty(monkeypatch.setattr, full_row=70)
    with pytest.raises(DiskFullError) as info:
        pipeline.make_train_iterator(_config(tmp_path), tok, seed=5)
    message = str(info.value)
    assert message.startswith("no space left building the encoded train split in ") and "\n" not in message
    assert f"filesystem mounted at {disk.mount_point(str(tmp_path))} " in message
    assert "Traceback" not in capfd.readouterr().err


def test_a_real_full_tmpfs_in_a_builder_process_build_is_one_line_and_leaves_no_partial_file(
        tmp_path, monkeypatch, capfd):
    from test_disk_cache import small_tmpfs

    from transformer_jax.runtime.errors import DiskFullError

    with small_tmpfs(tmp_path, "96k") as point:
        _write_corpus(tmp_path)
        cfg = _config(tmp_path, cache_dir=str(point))
        tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(cfg))
        faulty_corpora.faulty(monkeypatch.setattr)
        with pytest.raises(DiskFullError) as info:
            pipeline.make_train_iterator(cfg, tok, seed=5)
        assert f"the tmpfs filesystem mounted at {point} (" in str(info.value)
        assert "Traceback" not in capfd.readouterr().err
        left = [p.name for p in point.rglob("*") if ".tmp" in p.name]
        assert left == [] and 0 < len(list(point.glob("encoded/*.chunks/*.npz"))) < CHUNKS


def test_a_second_user_goes_on_from_the_chunks_of_the_first_users_failed_build(monkeypatch, caplog):
    """In a group's cache (setgid, group-writable): the chunks folder, its chunks and the builder's files
    are the group's, so another member goes on from them and removes them once the entry is whole (in its
    own process: the second user here may not start the interpreter a builder process needs)."""
    from test_disk_cache import NOBODY, _shared_folder

    folder = _shared_folder(0o2775, group=NOBODY)
    old_umask = os.umask(0o022)
    try:
        _write_corpus(folder)
        tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(_config(folder)))
        faulty_corpora.faulty(monkeypatch.setattr, kill_row=70)  # killed twice: the build ends, chunks kept
        with pytest.raises(cache_build.WorkerDiedError):
            pipeline.make_train_iterator(_config(folder), tok, seed=5)
        kept = len(_chunk_files(folder))
        assert kept >= 10
        for path in (folder / "cache").rglob("*"):
            assert path.stat().st_mode & 0o060 == 0o060, (path, oct(path.stat().st_mode))
        run = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
             str(TESTS / "faulty_corpora.py"), str(folder), "--in_process"],
            capture_output=True, text=True, timeout=300, cwd="/", env=RUN_ENV)
        assert run.returncode == 0 and "Data: 398 train pairs encoded" in run.stdout, run.stderr[-3000:]
        _check_equals_in_memory(folder, tok, caplog)  # and no chunks are left
    finally:
        os.umask(old_umask)
        shutil.rmtree(folder)
