"""A text corpus whose reads fail as a host does: a worker killed (SIGKILL, as the out-of-memory killer does)
or slow; and the start-up of a run on it, for tests that send real signals to real processes.

``FaultyCorpus`` is pickled into the data cache's worker processes, which import it from this module; so is
anything a test asks a build to use. ``python tests/faulty_corpora.py FOLDER [--delay=S] [--guard]`` does
what a run does at start (the tokenizer, then the train split encoded by worker processes in chunks of
``CHUNK_PAIRS`` rows) on ``test_corpus_cache``'s corpus in FOLDER.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time

from transformer_jax.data import corpora, corpus_cache

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

    def indexed(self):
        indexed = super().indexed()
        if self.kill_builder and sys.argv[0] == "-c":  # the builder, a fresh interpreter (cache_build)
            os.kill(os.getpid(), signal.SIGKILL)
        return indexed

    def read(self, start: int, stop: int):
        in_worker = multiprocessing.parent_process() is not None
        if in_worker and start == self.kill_row and not (self.kill_once and os.path.exists(self.kill_once)):
            if self.kill_once:
                open(self.kill_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay)
        return super().read(start, stop)


def faulty(monkeypatch_setattr=setattr, **faults):
    """Makes the data cache read every corpus as a ``FaultyCorpus`` with ``faults``, in worker processes."""
    monkeypatch_setattr(corpora, "SMALL_BYTES", 0)
    monkeypatch_setattr(corpus_cache, "CHUNK_PAIRS", CHUNK_PAIRS)

    def open_corpus(data_config):
        corpus = corpora.open_corpus(data_config)
        fields = {f.name: getattr(corpus, f.name) for f in dataclasses.fields(corpus)}
        return FaultyCorpus(**fields, **faults)

    monkeypatch_setattr(corpus_cache, "open_corpus", open_corpus)


def start_a_run(folder: str, delay: float, guard: bool) -> None:
    """The tokenizer (in this process), then the train split by worker processes that take ``delay`` s a
    chunk; with ``guard``, inside training's ``PreemptionGuard`` as train.py's set-up is."""
    import contextlib
    from pathlib import Path

    from test_corpus_cache import _config

    from transformer_jax.data import tokenizer

    cfg = _config(Path(folder))
    tok = tokenizer.Tokenizer(corpus_cache.shared_tokenizer(cfg))
    faulty(delay=delay)
    if guard:
        from transformer_jax.training.preemption import PreemptionGuard
    with PreemptionGuard() if guard else contextlib.nullcontext():
        corpus_cache.open_train_split(cfg, tok)


if __name__ == "__main__":
    import faulty_corpora  # this module by its name, so that its corpus can be pickled into the workers

    options = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "1") for arg in sys.argv[2:])
    faulty_corpora.start_a_run(sys.argv[1], float(options.get("delay", 0)), "guard" in options)
