"""Sources (transformer_jax/data/sources.py): text files, TFDS, config validation."""

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds
from shared_data import SHARED_DATA

from transformer_jax.data import default_data_config, get_source, sources
from transformer_jax.data.config import DataConfig
from transformer_jax.data.sources import (
    TextSource,
    TfdsSource,
    normalize_whitespace,
    read_parallel,
)


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _text_source(tmp_path: Path) -> TextSource:
    return TextSource(tmp_path, {"train": "train", "dev": "dev", "test": "test"}, "en", "de")


# ----------------------------------------------------------------------------- normalisation


def test_normalize_whitespace():
    assert normalize_whitespace(" a\u00a0b\t\tc  d \r") == "a b c d"
    assert normalize_whitespace("\u00a0\t ") == ""
    assert normalize_whitespace("x\u2009y") == "x\u2009y"  # other characters are kept


# ----------------------------------------------------------------------------- text files


def test_text_source_reads_and_normalises(tmp_path):
    _write(tmp_path / "train.en", ["A dog\u00a0runs. ", "Two\tcats.", "Hi  there"])
    _write(tmp_path / "train.de", ["Ein Hund läuft.", " Zwei Katzen.", "Hallo"])
    pairs = _text_source(tmp_path).pairs("train")
    assert pairs == [
        ("A dog runs.", "Ein Hund läuft."),
        ("Two cats.", "Zwei Katzen."),
        ("Hi there", "Hallo"),
    ]


def test_text_source_missing_file_names_path(tmp_path):
    _write(tmp_path / "train.en", ["a"])
    with pytest.raises(FileNotFoundError, match=r"train\.de: no such file; expected the train"):
        _text_source(tmp_path).pairs("train")


def test_text_source_line_count_mismatch_names_both_files_and_counts(tmp_path):
    _write(tmp_path / "dev.en", [f"s{i}" for i in range(5)])
    _write(tmp_path / "dev.de", [f"t{i}" for i in range(7)])
    with pytest.raises(ValueError) as info:
        _text_source(tmp_path).pairs("dev")
    msg = str(info.value)
    assert "dev.en has 5 lines" in msg and "dev.de has 7 lines" in msg


def test_text_source_empty_file_is_named(tmp_path):
    _write(tmp_path / "test.en", ["a", "b"])
    (tmp_path / "test.de").write_bytes(b"")
    with pytest.raises(ValueError, match=r"test\.de: file is empty"):
        _text_source(tmp_path).pairs("test")


def test_text_source_invalid_utf8_names_file_and_line(tmp_path):
    _write(tmp_path / "train.en", ["one", "two", "three", "four", "five"])
    (tmp_path / "train.de").write_bytes(b"eins\nzwei\ndrei\nvi\xffer\nf\xc3\xbcnf\n")
    with pytest.raises(ValueError, match=r"train\.de:4: invalid UTF-8"):
        _text_source(tmp_path).pairs("train")


def test_text_source_skips_and_counts_empty_lines(tmp_path, caplog):
    _write(tmp_path / "train.en", ["a", "", "c", "d", "  \u00a0", "f", "g"])
    _write(tmp_path / "train.de", ["A", "B", "", "D", "E", "F", "\t"])
    source = _text_source(tmp_path)
    with caplog.at_level(logging.WARNING):  # train.py shows warnings and hides info
        pairs = source.pairs("train")
    assert pairs == [("a", "A"), ("d", "D"), ("f", "F")]
    assert source.num_skipped == {"train": 4}
    assert source.line_numbers == {"train": [1, 4, 6]}
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "skipped 4 of 7 pairs with an empty side (lines 2, 3, 5, 7)" in caplog.text


def test_read_parallel_any_two_files(tmp_path):
    _write(tmp_path / "a.src", ["x\u00a0 1", "", "y"])
    _write(tmp_path / "b.ref", ["X 1", "Z", "Y "])
    assert read_parallel(tmp_path / "a.src", tmp_path / "b.ref") == [("x 1", "X 1"), ("y", "Y")]
    with pytest.raises(FileNotFoundError, match=r"nope\.ref: no such file"):
        read_parallel(tmp_path / "a.src", tmp_path / "nope.ref")


def test_text_source_unknown_split(tmp_path):
    with pytest.raises(ValueError, match=r"split must be one of .* got 'valid'"):
        _text_source(tmp_path).pairs("valid")


# ----------------------------------------------------------------------------- config


def test_config_validation_names_field_expected_and_actual():
    with pytest.raises(ValueError, match=r"data_config\.source must be one of .* got 'wmt'"):
        get_source(default_data_config(source="wmt"))
    with pytest.raises(ValueError, match=r"must cover max_len=100: the largest bucket is 64"):
        get_source(default_data_config(max_len=100))
    with pytest.raises(ValueError, match=r"strictly increasing, got \(8, 32, 16\)"):
        get_source(default_data_config(length_buckets=(8, 32, 16), max_len=16))
    with pytest.raises(ValueError, match=r"vocab_type must be one of .* got 'wordpiece'"):
        get_source(default_data_config(vocab_type="wordpiece"))
    with pytest.raises(ValueError, match=r"tokens_per_batch must be a positive int, got 0"):
        get_source(default_data_config(tokens_per_batch=0))
    with pytest.raises(ValueError, match=r"dir must be a non-empty str, got ''"):
        get_source(default_data_config(source="text", dir=""))
    with pytest.raises(ValueError, match=r"config\.data has unknown fields \['vocab_sise'\]"):
        DataConfig.from_mapping({"vocab_sise": 300})
    assert DataConfig.from_mapping({"length_buckets": [8, 16], "max_len": 16}).length_buckets == (8, 16)


# ----------------------------------------------------------------------------- synthetic lengths


def _synthetic(**overrides):
    sizes = dict(synthetic_train_size=300, synthetic_dev_size=50, synthetic_test_size=70)
    return get_source(default_data_config(**{**sizes, **overrides}))


def _words(text: str) -> int:
    return len(text.replace(",", " ").split())


def test_synthetic_default_lengths_give_the_same_pairs_as_before():
    """The pairs of the default settings, hashed before the sentence length became a setting."""
    import hashlib
    import json

    source = _synthetic(synthetic_min_words=3, synthetic_max_words=40, synthetic_test_min_words=0)
    pairs = [source.pairs(split) for split in ("test", "dev", "train")]
    assert hashlib.sha256(json.dumps(pairs).encode()).hexdigest() == (
        "68a2b9585121d38a1f9162e85c3cb0eb867ccce7dc7ee0a85351bf864aabfb57")
    assert pairs == [_synthetic().pairs(split) for split in ("test", "dev", "train")]


def test_synthetic_sentence_length_is_a_setting():
    source = _synthetic(synthetic_min_words=5, synthetic_max_words=9)
    for split in ("test", "dev", "train"):
        assert {_words(s) for s, _ in source.pairs(split)} <= set(range(5, 10))
    assert {_words(s) for s, _ in source.pairs("train")} == set(range(5, 10))


def test_a_long_test_split_is_disjoint_from_dev_and_train():
    source = _synthetic(synthetic_test_min_words=30)
    splits = {split: source.pairs(split) for split in ("test", "dev", "train")}
    assert [len(splits[s]) for s in ("test", "dev", "train")] == [70, 50, 300]
    assert min(_words(s) for s, _ in splits["test"]) >= 30
    assert min(_words(s) for s, _ in splits["train"]) < 10  # the other splits keep every length
    sources = [s for pairs in splits.values() for s, _ in pairs]
    assert len(set(sources)) == len(sources)
    default = _synthetic()  # the same stream: dev and train are what the default layout's are, less test
    stream = [p for split in ("test", "dev", "train") for p in default.pairs(split)]
    assert splits["dev"] == [p for p in stream if p not in splits["test"]][:50]


def test_synthetic_lengths_are_checked_and_an_exhausted_grammar_stops(monkeypatch):
    for fields, message in (
            (dict(synthetic_min_words=1), r"synthetic_min_words must be >= 2 .* got 1"),
            (dict(synthetic_min_words=9, synthetic_max_words=8), r"synthetic_max_words=8 must be >= "),
            (dict(synthetic_test_min_words=41), r"synthetic_test_min_words=41 must be 0 .* \[3, 40\]"),
            (dict(synthetic_max_words=40.5), r"synthetic_max_words must be an int, got 40\.5")):
        with pytest.raises(ValueError, match=message):
            _synthetic(**fields)
    from transformer_jax.data import synthetic
    from transformer_jax.runtime.errors import DataError

    monkeypatch.setattr(synthetic, "MAX_FAILED_DRAWS", 2000)  # the grammar's 2-word sentences run out
    with pytest.raises(DataError, match=r"unique sentences of 2 to 2 words in .* fewer than the 420 needed"):
        _synthetic(synthetic_min_words=2, synthetic_max_words=2, synthetic_seed=11).pairs("train")
    monkeypatch.setattr(synthetic, "MAX_DRAWS", 3000)  # 70 sentences of 40 words take ~5000 draws
    with pytest.raises(DataError, match=r"synthetic_test_min_words=40: only \d+ of the 70 test sentences"):
        _synthetic(synthetic_test_min_words=40, synthetic_seed=12).pairs("test")


# ----------------------------------------------------------------------------- real data


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "multi30k" / "train.de").exists():
        pytest.skip(f"real data not found under {SHARED_DATA}")
    return SHARED_DATA


def test_real_multi30k_loads_as_is(shared_data):
    cfg = default_data_config(source="text", dir=str(shared_data / "multi30k"))
    source = get_source(cfg)
    sizes = {split: len(source.pairs(split)) for split in ("train", "dev", "test")}
    assert sizes == {"train": 29000, "dev": 1014, "test": 1000}
    raw = (shared_data / "multi30k" / "train.de").read_text("utf-8").split("\n")
    assert "\t" in raw[7365]  # line 7366 holds the TAB
    _, tab_line = source.pairs("train")[7365]
    assert tab_line == " ".join(raw[7365].split()) and "\t" not in tab_line
    for src, tgt in source.pairs("train"):
        assert "\u00a0" not in tgt and tgt == tgt.strip() and "  " not in tgt and src


def test_real_newstest_loads_as_text_source(shared_data):
    cfg = default_data_config(
        source="text",
        dir=str(shared_data / "wmt14"),
        train_prefix="newstest2013",
        dev_prefix="newstest2013",
        test_prefix="newstest2014",
    )
    source = get_source(cfg)
    assert len(source.pairs("dev")) == 3000 and len(source.pairs("test")) == 3003
    assert source.pairs("test")[0] == (
        "Gutach: Increased safety for pedestrians",
        "Gutach: Noch mehr Sicherheit für Fußgänger",
    )
    wmt = shared_data / "wmt14"
    assert read_parallel(wmt / "newstest2014.en", wmt / "newstest2014.de") == source.pairs("test")


# ----------------------------------------------------------------------------- TFDS

_TINY = {
    "train": [(f"hello\u00a0number {i}", f"hallo  nummer {i}") for i in range(11)],
    "validation": [("good day", "guten Tag"), ("", "leer"), ("bye\tnow", "tschüss")],
    "test": [(f"test {i}", f"Test {i}") for i in range(5)],
}


class TinyTranslateForTest(tfds.core.GeneratorBasedBuilder):
    """A local en-de translation dataset with the WMT feature layout."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.Translation(languages=("de", "en"))
        )

    def _split_generators(self, dl_manager):
        return {name: self._generate_examples(name) for name in _TINY}

    def _generate_examples(self, split):
        for i, (en, de) in enumerate(_TINY[split]):
            yield i, {"en": en, "de": de}


@pytest.fixture(scope="module")
def tiny_tfds_dir(tmp_path_factory) -> str:
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    builder = tfds.builder("tiny_translate_for_test", data_dir=data_dir)
    builder.download_and_prepare(file_format="array_record")
    return data_dir


def _tiny_source(data_dir: str, src: str, tgt: str) -> TfdsSource:
    splits = {"train": "train", "dev": "validation", "test": "test"}
    return TfdsSource(
        "tiny_translate_for_test", data_dir=data_dir, src_lang=src, tgt_lang=tgt, split_names=splits
    )


def test_tfds_source_reads_array_record_in_both_directions(tiny_tfds_dir, monkeypatch):
    monkeypatch.setattr(sources, "is_online", lambda: pytest.fail("prepared: must not probe"))
    en_de = _tiny_source(tiny_tfds_dir, "en", "de")
    # TFDS shuffles examples when it prepares a dataset, hence sorted().
    assert sorted(en_de.pairs("dev")) == [("bye now", "tschüss"), ("good day", "guten Tag")]
    assert en_de.num_skipped == {"dev": 1}
    train = en_de.pairs("train")
    assert not isinstance(train, list) and len(train) == 11  # lazy
    assert sorted(train[:]) == sorted(
        (f"hello number {i}", f"hallo nummer {i}") for i in range(11)
    )
    assert train[2:5] == [train[2], train[3], train[4]]
    de_en = _tiny_source(tiny_tfds_dir, "de", "en")
    assert sorted(de_en.pairs("test")) == sorted((f"Test {i}", f"test {i}") for i in range(5))
    with pytest.raises(ValueError, match=r"no language 'fr'"):
        _tiny_source(tiny_tfds_dir, "fr", "en").pairs("dev")


def test_tfds_source_through_get_source(tiny_tfds_dir):
    cfg = default_data_config(
        source="tfds", tfds_name="tiny_translate_for_test", tfds_data_dir=tiny_tfds_dir
    )
    assert len(get_source(cfg).pairs("test")) == 5


def test_tfds_offline_fails_fast_with_instructions(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "is_online", lambda: False)
    source = TfdsSource(
        "wmt14_translate/de-en",
        data_dir=str(tmp_path),
        src_lang="en",
        tgt_lang="de",
        split_names={"train": "train", "dev": "validation", "test": "test"},
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        source.pairs("dev")
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "not prepared" in msg and "download_and_prepare(file_format='array_record')" in msg
    assert "tfds_data_dir" in msg and str(tmp_path) in msg


def test_connectivity_probe_is_bounded():
    start = time.monotonic()
    assert sources.is_online(("unreachable.invalid", 443), timeout_s=1.0) is False
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("processes", [False, True], ids=["in_process", "worker_processes"])
def test_tfds_train_split_goes_through_the_data_cache_with_the_same_batches(tiny_tfds_dir, tmp_path,
                                                                           monkeypatch, processes):
    """Read once into the cache (the workers open the prepared folder, no registered builder needed), then
    mapped; the batches equal those of the lazy TFDS view encoded in memory."""
    from transformer_jax.data import batching, corpora, pipeline

    if processes:
        monkeypatch.setattr(corpora, "SMALL_PAIRS", 0)
    cfg = default_data_config(source="tfds", tfds_name="tiny_translate_for_test", tfds_data_dir=tiny_tfds_dir,
                              vocab_size=40, max_len=16, length_buckets=(8, 16), tokens_per_batch=64,
                              cache_dir=str(tmp_path / "cache"))
    tok = pipeline.load_or_train_tokenizer(cfg, str(tmp_path / "workdir"))
    cached = pipeline.make_train_iterator(cfg, tok, seed=1)
    assert isinstance(cached._data.src_ids, np.memmap)
    (entry,) = [p for p in (tmp_path / "cache" / "encoded").iterdir() if p.is_dir()]
    reference = batching.TrainIterator(batching.tokenize_pairs(get_source(cfg).pairs("train"), tok),
                                       length_buckets=(8, 16), tokens_per_batch=64, seed=1)
    assert cached.batches_per_epoch == reference.batches_per_epoch > 1
    for _ in range(cached.batches_per_epoch + 1):
        a, b = next(cached), next(reference)
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2  # the entry and its lock
