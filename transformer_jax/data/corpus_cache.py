"""A translation corpus's train split, encoded once into token ids on disk and mapped by every run.

For the file-backed translation sources ('text' and 'tfds'), the shared tokenizer and the encoded train
split are entries of the data cache (``disk_cache``):

    tokenizers/<key>/spm.model                      the SentencePiece model (``tokenizer.shared_tokenizer``)
    encoded/<key>/src.ids, tgt.ids                  every kept pair's token ids then EOS, concatenated:
                                                    uint16 when the vocabulary fits, else int32 (raw)
    encoded/<key>/src.offsets.npy, tgt.offsets.npy  int64[num_pairs + 1]: pair i is ids[off[i]:off[i+1]]
    encoded/<key>.chunks/<start>-<stop>.npz         while the entry is built: its finished chunks
    <kind>/<key>/manifest.json                      sizes and SHA-256 of the files; counts and lines left out

``open_train_split`` maps the ids (``np.memmap``: their pages are shared by every process on the host
through the page cache) and returns a ``TokenizedSplit`` equal, id for id, to encoding the pairs in memory
with ``batching.tokenize_pairs``; so are the batches a ``TrainIterator`` draws from it.

A build streams the corpus in chunks of ``CHUNK_PAIRS`` rows through worker processes, one per core, each
reading its own rows of the files, normalising them, putting them through the text form and encoding them
into a chunk file of ``<key>.chunks/``; the entry's files are then joined from the chunks in order. The
chunks stay until the entry is whole, so a build that was stopped (a signal, the time limit) or failed (a
worker killed for memory) goes on from its finished chunks at the next start, whoever starts it. A progress
bar on stderr shows each phase with its pairs per second. The build runs in a builder process
(``cache_build``: its faults, signals and processes), so the run that builds keeps none of its memory; a
text corpus under ``corpora.SMALL_BYTES`` (Multi30k's is 4 MB) is built in the calling process, where
starting processes would cost more. Phases: 'scan' (which pairs are non-empty; only when a tokenizer is
trained on a sample of a text split), 'tokenizer sample', 'tokenizer training' and 'encoding'.

An entry's key is the SHA-256 of what decides its content: the train files' SHA-256 (text) or the TFDS
dataset's name, version and files (tfds); the languages; the text form; for the encoded split the
tokenizer's SHA-256, for the tokenizer its settings; and ``FORMAT``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data import cache_build, disk_cache
from transformer_jax.data.batching import (
    TokenizedSplit,
    concat_with_eos,
    empty_pairs_warning,
    mostly_unknown,
    unknown_pairs_warning,
)
from transformer_jax.data.corpora import TextCorpus, TfdsCorpus, open_corpus
from transformer_jax.data.sources import (
    blank_pairs_warning,
    suspicious_line_warnings,
)
from transformer_jax.data.text_form import TextForm, text_form_of
from transformer_jax.data.tokenizer import SAMPLE_SEED, Tokenizer, check_vocab_size, train_tokenizer
from transformer_jax.runtime.errors import DataError
from transformer_jax.runtime.output_file import process_is_gone

FORMAT = 1  # bump when the files or their content change; older entries are then not read
CACHED_SOURCES = ("text", "tfds")  # the others are generated or small, and tokenized in memory
CHUNK_PAIRS = 50_000  # rows a worker reads, prepares and encodes at a time


def is_cached(data_config: Any) -> bool:
    """Whether the data config's train split and tokenizer go through the data cache."""
    return data_config.source in CACHED_SOURCES


# ----------------------------------------------------------------------------- worker processes

_worker_state: dict[str, Any] = {}


def _init_worker(corpus: TextCorpus | TfdsCorpus, form: TextForm, tokenizer_proto: bytes | None) -> None:
    _worker_state.update(corpus=corpus, form=form)
    if tokenizer_proto is not None:
        _worker_state["tokenizer"] = Tokenizer(tokenizer_proto, num_threads=1, text_form=form)


def _kept_rows(src: list[str], tgt: list[str]) -> list[int]:
    """The rows a source keeps: text sources skip a pair with an empty side, TFDS drops it at encoding."""
    if not _worker_state["corpus"].skips_blank:
        return list(range(len(src)))
    return [i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]


def _scan_rows(span: tuple[int, int]) -> np.ndarray:
    """int64 indices of the kept rows in ``span`` = [start, stop)."""
    src, tgt, _ = _worker_state["corpus"].read(*span)
    return np.asarray(_kept_rows(src, tgt), np.int64) + span[0]


def _sample_rows(task: tuple[int, int, np.ndarray | None]) -> list[str]:
    """The text-form sentences (source, target, source, ...) of rows ``task[2]`` (None: every kept row)
    of [start, stop)."""
    start, stop, rows = task
    src, tgt, _ = _worker_state["corpus"].read(start, stop)
    rows = _kept_rows(src, tgt) if rows is None else rows - start
    form = _worker_state["form"]
    sources = form.prepare([src[r] for r in rows], "source")
    targets = form.prepare([tgt[r] for r in rows], "target")
    return [text for pair in zip(sources, targets, strict=True) for text in pair]


def _encode_rows(task: tuple[int, int, Path]) -> int:
    """Encodes the kept pairs of rows [start, stop) (``tokenize_pairs``'s rules) into the chunk file
    ``task[2]`` (``write_chunk``), with what was left out; returns the number of rows."""
    start, stop, path = task
    tokenizer = _worker_state["tokenizer"]
    src, tgt, suspicious = _worker_state["corpus"].read(start, stop)
    rows = _kept_rows(src, tgt)
    src_ids = tokenizer.encode_text([src[i] for i in rows], side="source")
    tgt_ids = tokenizer.encode_text([tgt[i] for i in rows], side="target")
    keep = [k for k, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)) if s and t]
    dtype = ids_dtype(tokenizer.vocab_size)
    src_flat, src_offsets = concat_with_eos([src_ids[k] for k in keep])
    tgt_flat, tgt_offsets = concat_with_eos([tgt_ids[k] for k in keep])
    blank = sorted(set(range(len(src))) - set(rows))
    found = {"blank": [start + i + 1 for i in blank], "empty": len(rows) - len(keep),
             "unknown": [start + rows[k] + 1 for k in keep
                         if mostly_unknown(src_ids[k]) or mostly_unknown(tgt_ids[k])],
             "suspicious": suspicious}
    write_chunk(path, found, src=src_flat.astype(dtype), src_lengths=np.diff(src_offsets),
                tgt=tgt_flat.astype(dtype), tgt_lengths=np.diff(tgt_offsets))
    return len(src)


def write_chunk(path: Path, found: dict[str, Any], **arrays: np.ndarray) -> None:
    """One encoded chunk as ``path`` (.npz): its ids, lengths and ``found`` (JSON); whole or absent (a
    write that fails, such as on a full disk, removes its partial file)."""
    partial = path.with_name(f"{path.name}.tmp-{disk_cache.process_tag()}")
    try:
        with open(partial, "wb") as f:
            np.savez(f, found=np.frombuffer(json.dumps(found).encode(), np.uint8), **arrays)
        disk_cache.share(partial, path.parent)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


# A chunk file being written: ``<start>-<stop>.npz.tmp-<host>-<pid>`` (``write_chunk``).
_PARTIAL_CHUNK = re.compile(r"\d+-\d+\.npz\.tmp-(?P<host>[A-Za-z0-9.-]+)-(?P<pid>\d+)")


def remove_dead_partials(chunks_dir: Path) -> None:
    """Removes the partial chunk files in ``chunks_dir`` of this host's processes that are gone: a worker
    killed mid-write (the pool kills its workers when a task fails, as on a full disk) cannot remove its own.
    Another host's, and a live process's, are left alone."""
    host = socket.gethostname()
    for path in chunks_dir.glob("*.npz.tmp-*"):
        match = _PARTIAL_CHUNK.fullmatch(path.name)
        if match and match["host"] == host and process_is_gone(int(match["pid"])):
            path.unlink(missing_ok=True)


def read_chunk(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and ``found`` of a chunk file, or None if it cannot be read whole."""
    try:
        with np.load(path) as chunk:
            arrays = {name: chunk[name] for name in ("src", "src_lengths", "tgt", "tgt_lengths")}
            return arrays, json.loads(chunk["found"].tobytes())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None


def ids_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache of int32), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def spans(num_rows: int, size: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) row ranges of ``size`` (``CHUNK_PAIRS``) rows covering ``num_rows``."""
    size = size or CHUNK_PAIRS
    return [(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def _labels(corpus: TextCorpus | TfdsCorpus, chunks: list[tuple[int, int]]) -> list[str]:
    return [f"rows {start + 1:,}-{stop:,} (chunk {i + 1} of {len(chunks)}) of {corpus.describe()}"
            for i, (start, stop) in enumerate(chunks)]


def progress(corpus: TextCorpus | TfdsCorpus, total: int | None, phase: str, unit: str = " pairs",
             initial: int = 0):
    """A tqdm bar on stderr for one build phase: its count and rate (none for a corpus built in this
    process, which takes seconds)."""
    import tqdm

    return tqdm.tqdm(total=total, desc=f"data: {phase}", unit=unit, unit_scale=True, file=sys.stderr,
                     mininterval=1.0, dynamic_ncols=True, disable=not corpus.processes, initial=initial)


def announce(corpus: TextCorpus | TfdsCorpus, message: str) -> None:
    """``message`` on stderr before a phase of a build in worker processes (minutes); logged otherwise."""
    if corpus.processes:
        print(message, file=sys.stderr, flush=True)
    else:
        logging.info("%s", message)


class _InProcessPool:
    """``WorkerPool.run`` in this process, for a corpus too small to be worth starting processes."""

    def __init__(self, *initargs: Any):
        _init_worker(*initargs)

    def run(self, function: Callable[[Any], Any], tasks: list, labels: list[str]) -> Any:
        return enumerate(map(function, tasks))

    def __enter__(self) -> _InProcessPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _worker_state.clear()


def worker_pool(corpus: TextCorpus | TfdsCorpus, form: TextForm, tokenizer_proto: bytes | None,
                hint: str = ""):
    """``corpus.processes`` spawned workers holding the corpus and tokenizer (``cache_build.WorkerPool``;
    ``hint``: what to do when one dies twice); with 0, this process."""
    if not corpus.processes:
        return _InProcessPool(corpus, form, tokenizer_proto)
    return cache_build.WorkerPool(corpus.processes, _init_worker, (corpus, form, tokenizer_proto), hint=hint)


def with_elapsed_time(corpus: TextCorpus | TfdsCorpus, phase: str, function: Callable[[], Any]) -> Any:
    """``function()`` while a bar on stderr shows ``phase`` and the seconds it has taken (a call into C++
    that reports nothing, such as training SentencePiece)."""
    done = threading.Event()
    with progress(corpus, None, phase, unit=" s") as bar:
        def tick() -> None:
            while not done.wait(1.0):
                bar.update(1)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            return function()
        finally:
            done.set()
            ticker.join()


# ----------------------------------------------------------------------------- building


def sample_sentences(corpus: TextCorpus | TfdsCorpus, form: TextForm, cap: int, seed: int,
                     chunk_pairs: int | None = None) -> list[str]:
    """The tokenizer's training sentences (source, target of each pair, in order) of the kept pairs, or of
    ``cap`` of them drawn with ``seed`` when there are more; the same as reading the pairs in memory."""
    chunks = spans(corpus.num_rows, chunk_pairs)
    labels = _labels(corpus, chunks)
    with worker_pool(corpus, form, None, hint="give the run more memory") as pool:
        tasks: list[tuple[int, int, np.ndarray | None]]
        if corpus.num_rows <= cap:  # every kept pair: no need to count them first
            tasks = [(start, stop, None) for start, stop in chunks]
        else:
            kept = []
            with progress(corpus, corpus.num_rows, "scan") as bar:
                scanned = cache_build.in_order(pool.run(_scan_rows, chunks, labels))
                for (start, stop), rows in zip(chunks, scanned, strict=True):
                    kept.append(rows)
                    bar.update(stop - start)
            kept = np.concatenate(kept)
            if len(kept) > cap:
                kept = kept[np.sort(np.random.default_rng(seed).choice(len(kept), size=cap, replace=False))]
            tasks = [(start, stop, kept[(kept >= start) & (kept < stop)]) for start, stop in chunks]
        sentences: list[str] = []
        with progress(corpus, min(corpus.num_rows, cap), "tokenizer sample") as bar:
            for part in cache_build.in_order(pool.run(_sample_rows, tasks, labels)):
                sentences += part
                bar.update(len(part) // 2)
    return sentences


def build_encoded(folder: Path, chunks_dir: Path, corpus: TextCorpus | TfdsCorpus, form: TextForm,
                  tokenizer_proto: bytes, chunk_pairs: int | None = None) -> dict[str, Any]:
    """Encodes the corpus into ``folder``'s files, each chunk of ``chunk_pairs`` rows first into a file of
    ``chunks_dir`` (those an earlier build finished are taken as they are); returns the manifest's counts
    and warnings."""
    corpus = corpus.indexed()  # the files checked before anything is said
    chunks = spans(corpus.num_rows, chunk_pairs)
    paths = [chunks_dir / f"{start:012d}-{stop:012d}.npz" for start, stop in chunks]
    disk_cache.make_dirs(chunks_dir)
    remove_dead_partials(chunks_dir)  # of an earlier build that was killed
    for path in chunks_dir.glob("*.npz"):  # another chunk size's
        if path not in paths:
            path.unlink()
    todo = [i for i, path in enumerate(paths) if read_chunk(path) is None]
    labels = _labels(corpus, chunks)
    workers = f"{corpus.processes} worker processes" if corpus.processes else "this process"
    before = len(chunks) - len(todo)
    kept = f"; {before} of {len(chunks)} chunks were encoded before" if before else ""
    announce(corpus, f"Encoding the train split of {corpus.describe()} into the data cache ({workers}{kept})")
    hint = (f"give the run more memory and start it again: it goes on from the chunks finished, kept in "
            f"{chunks_dir}")
    try:
        with (worker_pool(corpus, form, tokenizer_proto, hint) as pool,
              progress(corpus, corpus.num_rows, "encoding",
                       initial=corpus.num_rows - sum(chunks[i][1] - chunks[i][0] for i in todo)) as bar):
            tasks = [(*chunks[i], paths[i]) for i in todo]
            for _, rows in pool.run(_encode_rows, tasks, [labels[i] for i in todo]):
                bar.update(rows)
    except cache_build.BuildStopped as e:
        done = sum(path.is_file() for path in paths)
        e.detail = f"{done} of {len(chunks)} chunks are encoded, kept in {chunks_dir} for the next start"
        raise
    finally:  # the pool's workers have ended
        remove_dead_partials(chunks_dir)
    return _join_chunks(folder, paths, corpus, dtype=ids_dtype(Tokenizer(tokenizer_proto).vocab_size))


def _join_chunks(folder: Path, paths: list[Path], corpus: TextCorpus | TfdsCorpus,
                 dtype: np.dtype) -> dict[str, Any]:
    """The entry's files in ``folder`` from the chunk files ``paths``, in order; the manifest's counts."""
    lengths: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
    found: dict[str, Any] = {"blank": [], "empty": 0, "unknown": [], "suspicious": {}}
    with open(folder / "src.ids", "wb") as src_file, open(folder / "tgt.ids", "wb") as tgt_file:
        for path in paths:
            arrays, part = read_chunk(path)
            arrays["src"].astype(dtype, copy=False).tofile(src_file)
            arrays["tgt"].astype(dtype, copy=False).tofile(tgt_file)
            lengths["src"].append(arrays["src_lengths"])
            lengths["tgt"].append(arrays["tgt_lengths"])
            found["blank"] += part["blank"]
            found["unknown"] += part["unknown"]
            found["empty"] += part["empty"]
            for kind, numbers in part["suspicious"].items():
                found["suspicious"].setdefault(kind, []).extend(numbers)
    for side, parts in lengths.items():
        offsets = np.zeros(sum(map(len, parts)) + 1, np.int64)
        np.cumsum(np.concatenate(parts), out=offsets[1:])
        np.save(folder / f"{side}.offsets.npy", offsets)
    if len(offsets) == 1:
        raise DataError(f"{corpus.describe()}: no pair has both sides non-empty")
    return {"dtype": dtype.name, "num_pairs": len(offsets) - 1, "num_rows": corpus.num_rows,
            "num_empty": found["empty"], "left_out": found}


def _warnings(corpus: TextCorpus | TfdsCorpus, rows: int, *, blank: list[int], empty: int,
              unknown: list[int], suspicious: dict[str, list[int]]) -> list[str]:
    """The warnings that reading and encoding the ``rows`` pairs in memory gives (``sources``,
    ``tokenize_pairs``), naming this corpus's files (an entry may have been built from a copy)."""
    found = []
    if isinstance(corpus, TextCorpus):
        for side, path in (("src", corpus.src_path), ("tgt", corpus.tgt_path)):
            found += suspicious_line_warnings(
                path, {kind: suspicious.get(f"{kind}_{side}", []) for kind in ("nul", "long")}, rows)
    if blank:
        found.append(blank_pairs_warning(corpus.describe(), blank, rows))
    if empty:
        found.append(empty_pairs_warning(empty, rows - len(blank)))
    if unknown:
        found.append(unknown_pairs_warning(unknown, rows - len(blank),
                                           f"{corpus.describe()} lines {', '.join(map(str, unknown[:5]))}"))
    return found


def _open_or_build(data_config: Any, corpus: TextCorpus | TfdsCorpus, kind: str, spec: dict[str, Any],
                   function: Callable[..., dict[str, Any]], *args: Any, fallback: str | os.PathLike | None,
                   what: str, check: Callable[[dict], str | None] | None = None,
                   ) -> tuple[Path, dict[str, Any], bool]:
    """``disk_cache.open_or_build`` of the entry ``spec`` with the corpus's ``format`` and ``data``
    fingerprint, built by ``function(folder, chunks_dir, *args)`` in a builder process (``cache_build``) or,
    for a small corpus, here; (entry, manifest, built). A build during which a file of the corpus was
    written to (its size, times or inode differ from when it was hashed) is a ``DataError``: what it read
    may not be the content its key names, so nothing it made is kept."""
    before = disk_cache.file_stamps(corpus.files())  # taken first: a write from here on shows
    spec = {"format": FORMAT, "data": corpus.fingerprint(), **spec}
    built = []

    def build(folder: Path) -> dict[str, Any]:
        built.append(folder)
        chunks_dir = disk_cache.chunks_folder(folder)  # removed by disk_cache once the entry is whole
        try:
            if corpus.processes:
                return cache_build.run_builder(function, folder, chunks_dir, *args, folder=chunks_dir)
            return function(folder, chunks_dir, *args)
        finally:
            after = disk_cache.file_stamps(corpus.files())
            if changed := [path for path, stamp in after.items() if before.get(path) != stamp]:
                shutil.rmtree(chunks_dir, ignore_errors=True)
                if not isinstance(sys.exc_info()[1], cache_build.BuildStopped):
                    raise DataError(f"{changed[0]} was written to while {what} was built from it, so what "
                                    "the build read may not be the content its key names; nothing it made "
                                    "is kept. Run the same command again once nothing writes to the file")

    with cache_build.stopping(what, enabled=bool(corpus.processes)):
        entry, manifest = disk_cache.open_or_build(
            disk_cache.cache_root(data_config.cache_dir), kind, spec, build,
            fallback=Path(fallback) / "data_cache" if fallback else None, what=what, check=check)
    return entry, manifest, bool(built)


def _encoded_problem(manifest: dict[str, Any], vocab_size: int) -> str | None:
    """What is wrong with the values ``load`` and the warnings read from an encoded entry's manifest, else
    None (a manifest written before it had its own SHA-256 has only this check)."""
    dtype, said = ids_dtype(vocab_size).name, manifest.get("dtype")
    if said != dtype:
        return f"{disk_cache.MANIFEST} says the ids are {said!r}; this tokenizer's are {dtype}"
    counts = [manifest.get(field) for field in ("num_pairs", "num_rows", "num_empty")]
    left_out = manifest.get("left_out")
    if not all(type(count) is int and count >= 0 for count in counts) or not (
            isinstance(left_out, dict) and set(left_out) == {"blank", "empty", "unknown", "suspicious"}):
        return f"{disk_cache.MANIFEST} has malformed counts or lines left out"
    return None


def open_train_split(data_config: Any, tokenizer: Any, *, fallback: str | os.PathLike | None = None,
                     ) -> TokenizedSplit:
    """The train split of ``data_config`` encoded with ``tokenizer``, from the data
    cache, built there first if missing. ``fallback``: the folder (the workdir) under whose ``data_cache``
    to build when the cache root cannot be written."""
    started = time.time()
    corpus = open_corpus(data_config)
    spec = {"src_lang": data_config.src_lang, "tgt_lang": data_config.tgt_lang,
            "text_form": data_config.text_form, "tokenizer_sha256": tokenizer.sha256}
    entry, manifest, built = _open_or_build(
        data_config, corpus, "encoded", spec, build_encoded, corpus, text_form_of(data_config),
        tokenizer.model_proto, CHUNK_PAIRS, fallback=fallback, what="the encoded train split",
        check=lambda manifest: _encoded_problem(manifest, tokenizer.vocab_size))
    for warning in _warnings(corpus, manifest["num_rows"], **manifest["left_out"]):  # train.py shows them
        logging.warning("%s", warning)
    split = load(entry, manifest)
    how = "encoded into" if built else "mapped from"
    print(f"Data: {len(split):,} train pairs {how} {entry} in {time.time() - started:.1f} s", flush=True)
    return split


def load(entry: Path, manifest: dict[str, Any]) -> TokenizedSplit:
    """The ``TokenizedSplit`` of a whole entry: the ids mapped read-only, the offsets in memory."""
    sides = []
    for side in ("src", "tgt"):
        sides += [np.memmap(entry / f"{side}.ids", dtype=manifest["dtype"], mode="r"),
                  np.load(entry / f"{side}.offsets.npy")]
    return TokenizedSplit(*sides, num_empty=manifest["num_empty"])



# ----------------------------------------------------------------------------- the shared tokenizer


def build_tokenizer(folder: Path, chunks_dir: Path, corpus: TextCorpus | TfdsCorpus, data_config: Any,
                    seed: int, chunk_pairs: int | None = None) -> dict[str, Any]:
    """Trains ``data_config``'s SentencePiece model on (a sample of) the corpus into ``folder/spm.model``."""
    corpus = corpus.indexed()  # the files checked before anything is said
    announce(corpus, f"Training the {data_config.vocab_type} tokenizer (vocab_size={data_config.vocab_size}) "
             f"of {corpus.describe()} into the data cache")
    sentences = sample_sentences(corpus, text_form_of(data_config), data_config.tokenizer_train_examples,
                                 seed, chunk_pairs)
    check_vocab_size(data_config, sentences)
    proto = with_elapsed_time(corpus, f"tokenizer training on {len(sentences):,} sentences", lambda: (
        train_tokenizer(sentences, vocab_size=data_config.vocab_size,
                                      vocab_type=data_config.vocab_type,
                                      character_coverage=data_config.character_coverage)))
    (folder / "spm.model").write_bytes(proto)
    return {"sentences": len(sentences)}


def shared_tokenizer(data_config: Any, *, fallback: str | os.PathLike | None = None) -> bytes:
    """The serialized SentencePiece model for ``data_config``'s data and vocabulary settings, from the data
    cache (trained there first if missing): every run and sweep row on the same data and settings gets
    the same vocabulary (the sample drawn with ``tokenizer.SAMPLE_SEED``). ``fallback`` as in
    ``open_train_split``."""
    seed = SAMPLE_SEED
    corpus = open_corpus(data_config)
    spec = {"src_lang": data_config.src_lang, "tgt_lang": data_config.tgt_lang,
            "text_form": data_config.text_form, "vocab_size": data_config.vocab_size,
            "vocab_type": data_config.vocab_type,
            "tokenizer_train_examples": data_config.tokenizer_train_examples,
            "character_coverage": data_config.character_coverage, "sample_seed": seed}
    entry, _, _ = _open_or_build(data_config, corpus, "tokenizers", spec, build_tokenizer, corpus,
                                 data_config, seed, CHUNK_PAIRS, fallback=fallback,
                                 what="the shared tokenizer")
    return (entry / "spm.model").read_bytes()
