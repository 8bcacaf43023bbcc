"""The data cache of text corpora: the same tokenizer, batches and warnings as reading the corpus in memory;
one tokenizer and one encoded split per data and settings, shared by every run and Table 3 row.

The reference is the in-memory path (``TextSource.pairs`` read whole, ``tokenize_pairs``), which the
synthetic and treebank sources still take and which runs started before the cache used.
"""

import logging
import os
import shutil

import numpy as np
import pytest
from shared_data import SHARED_DATA

from transformer_jax.data import batching, corpora, corpus_cache, pipeline, tokenizer
from transformer_jax.data.config import default_data_config
from transformer_jax.data.sources import get_source
from transformer_jax.runtime.errors import ConfigError, DataError
from transformer_jax.sweep import grid

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "ran",
    "far",
    "away",
    "big",
    "red",
    "house",
    "über",
    "straße",
    "café",
    "naïve",
    "1999",
    "x-ray",
    "don't",
]
BUCKETS = (8, 16, 32)


def _write_corpus(folder, rows: int = 400, seed: int = 0) -> None:
    """Train files with what a real corpus holds: a byte-order mark, CRLF and no final newline, blank
    and whitespace-only sides, NBSP and tabs, U+2028 inside a line, a NUL, a line too long for max_len and
    one too long for SentencePiece."""
    rng = np.random.default_rng(seed)
    lines = {
        lang: [" ".join(rng.choice(WORDS, size=rng.integers(1, 12))) for _ in range(rows)]
        for lang in ("en", "de")
    }
    lines["en"][0] = "\ufeff" + lines["en"][0]
    lines["en"][3] += "\r"
    lines["de"][5] = ""
    lines["en"][7] = " \t "
    lines["de"][11] = "die\u00a0katze\tsass"
    lines["en"][13] = "line\u2028separator inside"
    lines["de"][17] = "nul\0byte"
    lines["en"][19] = " ".join(["longword"] * 40)  # over max_len=32 tokens: dropped from training
    lines["de"][23] = "\u0436" * 40_000  # too long to train the tokenizer on: its character is <unk>
    for lang, text in lines.items():
        (folder / f"train.{lang}").write_text("\n".join(text), encoding="utf-8")  # no final newline
        for split in ("val", "test"):
            (folder / f"{split}.{lang}").write_text("\n".join(text[:4]) + "\n", encoding="utf-8")


def _config(folder, **overrides):
    fields = dict(
        source="text",
        dir=str(folder),
        vocab_size=60,
        max_len=32,
        length_buckets=BUCKETS,
        tokens_per_batch=256,
        tokenizer_train_examples=300,
        cache_dir=str(folder / "cache"),
    )
    return default_data_config(**{**fields, **overrides})


def _in_memory(cfg, tok: tokenizer.Tokenizer) -> batching.TrainIterator:
    """The train iterator as reading the whole corpus into memory gives it."""
    source = get_source(cfg)
    data = batching.tokenize_pairs(
        source.pairs("train"), tok, where=pipeline.describe_pairs(source, "train")
    )
    fits = np.maximum(data.src_lengths, data.tgt_lengths) <= cfg.max_len
    return batching.TrainIterator(
        data.select(fits), length_buckets=BUCKETS, tokens_per_batch=cfg.tokens_per_batch, seed=5
    )


def _assert_same_batches(a: batching.TrainIterator, b: batching.TrainIterator) -> None:
    assert (a.num_examples, a.batches_per_epoch) == (b.num_examples, b.batches_per_epoch)
    for _ in range(a.batches_per_epoch * 3 // 2):  # into the second epoch
        x, y = next(a), next(b)
        for key in ("inputs", "targets"):
            assert x[key].dtype == y[key].dtype == np.int32
            np.testing.assert_array_equal(x[key], y[key])


def _warnings(caplog) -> list[str]:
    return sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize(
    "processes,text_form,chunk_pairs",
    [(False, "raw", 3), (True, "raw", 7), (False, "moses_lc", None)],
    ids=["in_process_134_chunks", "worker_processes_58_chunks", "moses_lc_one_chunk"],
)
def test_tokenizer_batches_and_warnings_equal_reading_the_corpus_in_memory(
    tmp_path, caplog, monkeypatch, processes, text_form, chunk_pairs
):
    """300 of 400 rows train the tokenizer, so the build scans for non-empty pairs and samples them. In
    chunks of 3 or 7 rows, the lines the warnings name (6, 8, 18, 24) lie in different chunks."""
    if processes:  # the path of a corpus over SMALL_BYTES: a builder process with worker processes
        monkeypatch.setattr(corpora, "SMALL_BYTES", 0)
    if chunk_pairs:  # a real corpus is many chunks of CHUNK_PAIRS rows
        monkeypatch.setattr(corpus_cache, "CHUNK_PAIRS", chunk_pairs)
    _write_corpus(tmp_path)
    cfg = _config(tmp_path, text_form=text_form)
    tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / "workdir"))
    reference = tokenizer.Tokenizer(
        tokenizer.train_tokenizer(
            list(tokenizer.training_sentences(cfg)), vocab_size=cfg.vocab_size, vocab_type=cfg.vocab_type
        )
    )
    assert tok.sha256 == reference.sha256  # the vocabulary a run trained before the cache existed

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cached = pipeline.make_train_iterator(cfg, tok, seed=5)
    from_cache = _warnings(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        in_memory = _in_memory(cfg, tok)
    dropped = [m for m in from_cache if m.startswith("Dropped ")]
    assert len(dropped) == 1 and " train pairs longer than max_len=32" in dropped[0]
    in_memory_warnings = _warnings(caplog)  # the NUL, the long line, the blank pairs, the <unk> pair
    assert sorted(set(from_cache) - set(dropped)) == in_memory_warnings and len(in_memory_warnings) == 4
    assert isinstance(cached._data.src_ids, np.memmap) and cached._data.src_ids.dtype == np.uint16
    _assert_same_batches(cached, in_memory)


def _large_vocabulary() -> tokenizer.Tokenizer:
    """70,060 pieces: a trained model and the 70,000 words zq00000 ... zq69999 as pieces of their own."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(tokenizer.train_tokenizer([" ".join(WORDS)] * 50, vocab_size=60, vocab_type="bpe"))
    for i in range(70_000):
        model.pieces.add(piece=f"zq{i:05d}", score=0.0, type=model.SentencePiece.USER_DEFINED)
    return tokenizer.Tokenizer(model.SerializeToString())


def test_a_vocabulary_over_65536_pieces_keeps_every_id_in_int32(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_cache, "CHUNK_PAIRS", 23)
    tok = _large_vocabulary()
    rng = np.random.default_rng(3)
    for lang in ("en", "de"):  # the words of the largest ids: 65,536 and over wrap in uint16
        lines = [" ".join([*rng.choice(WORDS, size=3), f"zq{rng.integers(65_400, 70_000):05d}"])
                 for _ in range(100)]
        for split in ("train", "val", "test"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = _config(tmp_path)
    cached = pipeline.make_train_iterator(cfg, tok, seed=5)
    ids = cached._data.tgt_ids
    assert tok.vocab_size == 70_060 and ids.dtype == np.int32 and ids.max() > 1 << 16
    _assert_same_batches(cached, _in_memory(cfg, tok))


MULTI30K = SHARED_DATA / "multi30k"


@pytest.mark.skipif(not (MULTI30K / "train.en").exists(), reason=f"Multi30k is not in {MULTI30K}")
def test_multi30k_batches_equal_reading_it_in_memory(tmp_path):
    cfg = _config(MULTI30K, vocab_size=2000, tokens_per_batch=2048, tokenizer_train_examples=1_000_000,
                  cache_dir=str(tmp_path / "cache"))
    tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / "workdir"))
    _assert_same_batches(pipeline.make_train_iterator(cfg, tok, seed=5), _in_memory(cfg, tok))


def _entries(cache, kind: str) -> list[str]:
    return sorted(p.name for p in (cache / kind).iterdir() if p.is_dir())


def test_later_runs_map_the_entries_and_a_changed_file_or_setting_builds_new_ones(tmp_path, monkeypatch):
    builds = []
    for name in ("build_tokenizer", "build_encoded"):
        original = getattr(corpus_cache, name)
        monkeypatch.setattr(corpus_cache, name, lambda *a, _f=original, _n=name: builds.append(_n) or _f(*a))
    _write_corpus(tmp_path)
    cache = tmp_path / "cache"

    def start(cfg, workdir):  # what a run does at start-up
        tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / workdir))
        return tok, pipeline.make_train_iterator(cfg, tok, seed=0)

    tok, _ = start(_config(tmp_path), "run1")
    assert builds == ["build_tokenizer", "build_encoded"]
    start(_config(tmp_path), "run2")  # a new workdir on the same data
    start(_config(tmp_path, max_len=24, length_buckets=(8, 16, 24)), "run3")  # no effect on the ids
    assert len(builds) == 2
    entry = cache / "tokenizers" / _entries(cache, "tokenizers")[0]
    for run in ("run1", "run2", "run3"):  # each workdir keeps its copy, for evaluate.py, translate, export
        assert (tmp_path / run / "tokenizer" / "spm.model").read_bytes() == (entry / "spm.model").read_bytes()

    start(_config(tmp_path, vocab_size=70), "run4")  # another vocabulary: another tokenizer and split
    assert builds[2:] == ["build_tokenizer", "build_encoded"]
    with open(tmp_path / "train.de", "a") as f:  # the data changes under a run that resumes
        f.write("\n")
    tok_again, _ = start(_config(tmp_path), "run1")
    assert tok_again.sha256 == tok.sha256 and builds[4:] == ["build_encoded"]  # its own tokenizer, new ids
    assert len(_entries(cache, "tokenizers")) == 2 and len(_entries(cache, "encoded")) == 3


def test_table3_rows_on_the_same_data_share_one_tokenizer_and_one_encoded_split(tmp_path):
    _write_corpus(tmp_path, rows=200)
    rows = grid.table3_rows(
        "A,B,D,E",
        "multi30k",
        base_seeds=2,
        overrides=[f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=60"],
    )
    assert len(rows) > 10
    models = set()
    for row in rows:
        run = grid.run_config.build_run_config(grid.build_config(row))
        models.add(run.model)
        tok = pipeline.load_or_train_tokenizer(run.data, str(tmp_path / row.name))
        pipeline.make_train_iterator(run.data, tok, seed=run.seed)
    assert len(models) >= 10  # the rows differ in the model, not in the data
    assert len(_entries(tmp_path / "cache", "tokenizers")) == 1
    assert len(_entries(tmp_path / "cache", "encoded")) == 1
    vocabularies = {(tmp_path / row.name / "tokenizer" / "spm.model").read_bytes() for row in rows}
    assert len(vocabularies) == 1  # every row is scored on one vocabulary, as in the paper


def test_a_damaged_encoded_file_is_rebuilt_and_gives_the_same_batches(tmp_path, caplog):
    _write_corpus(tmp_path)
    cfg = _config(tmp_path)
    tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / "workdir"))
    pipeline.make_train_iterator(cfg, tok, seed=5)
    caplog.clear()
    entry = tmp_path / "cache" / "encoded" / _entries(tmp_path / "cache", "encoded")[0]
    ids = (entry / "tgt.ids").read_bytes()
    (entry / "tgt.ids").write_bytes(ids[: len(ids) // 2])  # a copy cut short
    with caplog.at_level(logging.WARNING):
        rebuilt = pipeline.make_train_iterator(cfg, tok, seed=5)
    assert any("is damaged (tgt.ids has" in m for m in _warnings(caplog))
    _assert_same_batches(rebuilt, _in_memory(cfg, tok))


def test_a_copy_of_the_corpus_elsewhere_maps_the_same_entry_and_names_its_own_files(tmp_path, caplog):
    _write_corpus(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in tmp_path.glob("*.*"):
        shutil.copy(path, copy)
    tok = pipeline.load_or_train_tokenizer(_config(tmp_path), str(tmp_path / "workdir"))
    pipeline.make_train_iterator(_config(tmp_path), tok, seed=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pipeline.make_train_iterator(_config(copy, cache_dir=str(tmp_path / "cache")), tok, seed=0)
    assert len(_entries(tmp_path / "cache", "encoded")) == 1  # keyed by content, not by path
    warned = _warnings(caplog)
    assert len(warned) == 5 and all(str(copy / "train.") in m for m in warned[:4]), warned


def test_a_train_file_written_to_while_the_tokenizer_is_trained_keeps_nothing(tmp_path, monkeypatch):
    _write_corpus(tmp_path)
    train = tmp_path / "train.en"
    original = corpus_cache.train_tokenizer

    def train_while_written(*args, **kwargs):
        train.write_text(train.read_text() + "\nadded")  # another process edits the file meanwhile
        return original(*args, **kwargs)

    monkeypatch.setattr(corpus_cache, "train_tokenizer", train_while_written)
    with pytest.raises(DataError, match=f"^{train} was written to while the shared tokenizer was built from"):
        corpus_cache.shared_tokenizer(_config(tmp_path))
    assert not [p for p in (tmp_path / "cache" / "tokenizers").iterdir() if p.is_dir()]


def test_a_failed_tokenizer_build_in_a_builder_process_leaves_no_chunks_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "SMALL_BYTES", 0)
    _write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="too large for this training corpus"):
        corpus_cache.shared_tokenizer(_config(tmp_path, vocab_size=100_000))
    assert not list((tmp_path / "cache" / "tokenizers").glob("*.chunks"))


@pytest.mark.parametrize("dtype", ["int8", "uint36"])
def test_a_damaged_dtype_in_a_manifest_without_its_own_sha256_is_found_and_rebuilt(tmp_path, caplog, dtype):
    """A manifest written before it had its own SHA-256: int8 would read every id wrongly, uint36 fail."""
    from test_disk_cache import _manifest_with

    from transformer_jax.data import disk_cache

    _write_corpus(tmp_path)
    cfg = _config(tmp_path)
    tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / "workdir"))
    pipeline.make_train_iterator(cfg, tok, seed=5)
    entry = tmp_path / "cache" / "encoded" / _entries(tmp_path / "cache", "encoded")[0]
    _manifest_with(entry, lambda m: m.pop(disk_cache.SELF_SHA256) and m.update(dtype=dtype))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rebuilt = pipeline.make_train_iterator(cfg, tok, seed=5)
    assert any(f"is damaged (manifest.json says the ids are '{dtype}'; this tokenizer's are uint16" in m
               for m in _warnings(caplog))
    _assert_same_batches(rebuilt, _in_memory(cfg, tok))


def test_partial_chunk_files_of_this_hosts_ended_processes_are_removed_and_no_others(tmp_path):
    """A worker killed mid-write leaves ``<chunk>.npz.tmp-<host>-<pid>``; the build removes those of its
    host's ended processes, and keeps a live process's and another host's (a node sharing the folder)."""
    import socket
    import subprocess
    import sys

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    host = socket.gethostname()
    names = {"dead": f"000000000000-000000000010.npz.tmp-{host}-{int(ended.stdout)}",
             "live": f"000000000010-000000000020.npz.tmp-{host}-{os.getpid()}",
             "other host": f"000000000020-000000000030.npz.tmp-other-node-{int(ended.stdout)}",
             "whole": "000000000030-000000000040.npz"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    corpus_cache.remove_dead_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "other host", "whole"))
