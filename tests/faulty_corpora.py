"""A text corpus whose reads fail as a host does: a worker killed (SIGKILL, as the out-of-memory killer does)
as it reads a chunk or as it starts, slow, or on a full disk; and the start-up of a run on it, for tests
that send real signals to real processes.

``FaultyCorpus`` is pickled into the data cache's worker processes, which import it from this module; so is
anything a test asks a build to use. ``python tests/faulty_corpora.py FOLDER [--delay=S] [--guard]
[--node=NAME] [--stall_after_encoding] [--in_process]`` does what a run does at start (the tokenizer, then
the train split encoded by worker processes in chunks of ``CHUNK_PAIRS`` rows) on ``test_corpus_cache``'s
corpus in FOLDER, with one ``error:`` line for a user error as the entry points give. ``--node``: as a
process on another node of a filesystem whose locks hold within a node only (its host is NAME and no lock
holds it back);
``--stall_after_encoding``: the encoding done, it writes ``FOLDER/encoded`` and waits (to be killed);
``--in_process``: the chunks encoded in this process, as a small corpus's are.
"""

from __future__ import annotations

import dataclasses
import errno
import multiprocessing
import os
import signal
import sys
import time

from transformer_jax.data import corpora, corpus_cache, disk_cache

CHUNK_PAIRS = 7  # 58 chunks of the 400-row corpus


@dataclasses.dataclass(frozen=True)
class FaultyCorpus(corpora.TextCorpus):
    """A ``TextCorpus`` whose worker processes die or dawdle: a worker reading the chunk that starts at row
    ``kill_row`` kills itself with SIGKILL (once, if ``kill_once`` names a file it then creates; else every
    time), every read takes ``delay`` more seconds, and with ``kill_builder`` the builder process is killed
    before it starts encoding."""

    kill_row: int = -1
    kill_once: str = ""
    delay: float = 0.0
    kill_builder: bool = False  # the builder process kills itself once it has found the lines
    kill_at_start: str = ""  # a worker kills itself as it reads its start-up data (once: creates this file)
    ballast: bytes = b""  # start-up data as large as a big corpus's line offsets (72 MB at WMT's size)
    full_row: int = -1  # a worker reading the chunk that starts here finds the disk full

    def __reduce__(self):
        """Unpickled as a worker starts: ``kill_at_start`` comes before the fields, so that a worker that
        kills itself has read only the start of its start-up data."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _unpickle, (_DieAtStart(self.kill_at_start), fields)

    def indexed(self):
        indexed = super().indexed()
        if self.kill_builder and sys.argv[0] == "-c":  # the builder, a fresh interpreter (cache_build)
            os.kill(os.getpid(), signal.SIGKILL)
        return indexed

    def read(self, start: int, stop: int):
        in_worker = multiprocessing.parent_process() is not None
        if in_worker and start == self.full_row:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{start}.npz")
        if in_worker and start == self.kill_row and not (self.kill_once and os.path.exists(self.kill_once)):
            if self.kill_once:
                open(self.kill_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay)
        return super().read(start, stop)


class _DieAtStart:
    def __init__(self, once: str):
        self.once = once

    def __reduce__(self):
        return _die_at_start, (self.once,)


def _die_at_start(once: str) -> None:
    """Kills this process with SIGKILL if it is a spawned worker (once: creates ``once``)."""
    spawned = multiprocessing.current_process().name != "MainProcess"  # set before it unpickles anything
    if once and spawned and not os.path.exists(once):
        open(once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def _unpickle(_, fields):
    return FaultyCorpus(**fields)


def faulty(monkeypatch_setattr=setattr, **faults):
    """Makes the data cache read every corpus as a ``FaultyCorpus`` with ``faults``, in worker processes."""
    monkeypatch_setattr(corpora, "SMALL_BYTES", 0)
    monkeypatch_setattr(corpus_cache, "CHUNK_PAIRS", CHUNK_PAIRS)

    def open_corpus(data_config):
        corpus = corpora.open_corpus(data_config)
        fields = {f.name: getattr(corpus, f.name) for f in dataclasses.fields(corpus)}
        return FaultyCorpus(**fields, **faults)

    monkeypatch_setattr(corpus_cache, "open_corpus", open_corpus)


def on_a_node(name: str) -> None:
    """This process as one on node ``name`` of a filesystem whose locks hold within a node only: its host
    is ``name``, and the data cache's locks never hold it back (another node's are not seen)."""
    import fcntl
    import socket

    socket.gethostname = lambda: name
    fcntl.flock = lambda fd, operation: None


def stall_after_encoding(folder: str) -> None:
    """The next entry's build, once its files are written (before they are hashed and renamed into
    place), writes ``folder/encoded`` and waits for a signal."""
    share_tree = disk_cache._share_tree

    def stall(tmp, parent):
        open(os.path.join(folder, "encoded"), "w").close()
        time.sleep(600)
        share_tree(tmp, parent)

    disk_cache._share_tree = stall


def start_a_run(folder: str, delay: float, guard: bool, node: str = "", stall: bool = False,
                in_process: bool = False) -> None:
    """The tokenizer (in this process), then the train split by worker processes (or, ``in_process``,
    this one) that take ``delay`` s a chunk; with ``guard``, inside training's ``PreemptionGuard`` as
    train.py's set-up is; ``node`` and ``stall``: ``on_a_node``, ``stall_after_encoding``."""
    import contextlib
    from pathlib import Path

    from test_corpus_cache import _config

    from transformer_jax.data import tokenizer

    if node:
        on_a_node(node)
    cfg = _config(Path(folder))
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(cfg))
    faulty(delay=delay)
    if in_process:
        corpora.SMALL_BYTES = 1 << 30
    if stall:
        stall_after_encoding(folder)
    if guard:
        from transformer_jax.training.preemption import PreemptionGuard
    with PreemptionGuard() if guard else contextlib.nullcontext():
        corpus_cache.open_train_split(cfg, tok)


if __name__ == "__main__":
    import faulty_corpora  # this module by its name, so that its corpus can be pickled into the workers

    from transformer_jax.runtime.errors import short_errors

    options = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "1") for arg in sys.argv[2:])
    short_errors(lambda argv: faulty_corpora.start_a_run(
        sys.argv[1], float(options.get("delay", 0)), "guard" in options, options.get("node", ""),
        "stall_after_encoding" in options, "in_process" in options))([])
