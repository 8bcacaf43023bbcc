"""SentencePiece tokenizer (transformer_jax/data/tokenizer.py)."""

import re
from pathlib import Path

import numpy as np
import pytest
from shared_data import SHARED_DATA

import transformer_jax.data.tokenizer as tokenizer_lib
from transformer_jax.data import (
    default_data_config,
    get_source,
    load_or_train_tokenizer,
)
from transformer_jax.model.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.runtime.errors import ConfigError


def _synthetic_config(**overrides):
    sizes = dict(synthetic_train_size=1001, synthetic_dev_size=51, synthetic_test_size=53)
    return default_data_config(**{"vocab_size": 257, **sizes, **overrides})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workdir")


@pytest.fixture(scope="module")
def tok(workdir):
    return load_or_train_tokenizer(_synthetic_config(), str(workdir))


def test_fixed_special_ids(tok):
    assert (PAD_ID, EOS_ID, UNK_ID, BOS_ID) == (0, 1, 2, 3)
    pieces = [tok.id_to_piece(i) for i in range(4)]
    assert pieces == ["<pad>", "</s>", "<unk>", "<s>"]
    assert tok.vocab_size == 257


def test_round_trip_and_no_special_ids_in_encodings(tok):
    pairs = get_source(_synthetic_config()).pairs("dev")
    texts = [t for pair in pairs for t in pair]
    encoded = tok.encode_batch(texts)
    assert encoded == [tok.encode(t) for t in texts]
    for text, ids in zip(texts, encoded, strict=True):
        assert tok.decode(ids) == text
        assert not {PAD_ID, EOS_ID, UNK_ID, BOS_ID} & set(ids)


def test_decode_stops_at_eos_and_ignores_pad_and_bos(tok):
    a, b = "The dog sleeps.", "Our cats laughed!"
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    assert tok.decode([BOS_ID, *ids_a, EOS_ID, *ids_b, EOS_ID]) == a
    assert tok.decode([PAD_ID, *ids_a[:2], PAD_ID, *ids_a[2:]]) == a
    width = 3 + max(len(ids_a), len(ids_b))
    batch = np.zeros((3, width), np.int32)  # [B=3, L]
    batch[0, : len(ids_a) + 1] = [*ids_a, EOS_ID]
    batch[1, 0] = BOS_ID
    batch[1, 1 : len(ids_b) + 1] = ids_b
    assert tok.decode_batch(batch) == [a, b, ""]


def test_cached_in_workdir_and_reused(tok, workdir, monkeypatch):
    path = workdir / "tokenizer" / "spm.model"
    assert path.is_file()
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    again = load_or_train_tokenizer(_synthetic_config(), str(workdir))
    assert again.encode("The red dog sleeps.") == tok.encode("The red dog sleeps.")
    with pytest.raises(ValueError, match=r"has vocab_size=257 but data_config\.vocab_size=263"):
        load_or_train_tokenizer(_synthetic_config(vocab_size=263), str(workdir))


def test_unigram_and_temporary_workdir():
    tok = load_or_train_tokenizer(_synthetic_config(vocab_type="unigram"), None)
    assert tok.vocab_size == 257 and Path(tok.model_path).is_file()
    assert tok.decode(tok.encode("My dog saw the cats.")) == "My dog saw the cats."


def test_vocab_too_large_is_caught_before_training_then_by_sentencepiece(tmp_path):
    for name, text in (("train.en", "a cat sat on a mat\n"), ("train.de", "eine Katze\n")):
        (tmp_path / name).write_text(text * 3, encoding="utf-8")
    cfg = default_data_config(source="text", dir=str(tmp_path), vocab_size=5001)
    with pytest.raises(ConfigError, match=r"vocab_size=5001 is too large.* at most (\d+) pieces") as info:
        load_or_train_tokenizer(cfg, str(tmp_path / "w"))  # before training: a bound from the words
    assert not (tmp_path / "w" / "tokenizer").exists()
    bound = int(re.search(r"at most (\d+) pieces", str(info.value)).group(1))
    words = {"a", "cat", "sat", "on", "mat", "eine", "Katze"}
    chars = {c for w in words for c in w} | {"\u2581"}
    assert bound == 4 + len(chars) + sum(len(w) for w in words)  # specials + characters + BPE merges
    cfg = cfg.replace(vocab_size=bound + 1)
    with pytest.raises(ConfigError, match=rf"vocab_size={bound + 1} is too large"):
        load_or_train_tokenizer(cfg, str(tmp_path / "w"))
    # Here every merge is possible: the bound is SentencePiece's exact limit.
    cfg = cfg.replace(vocab_size=bound)
    assert load_or_train_tokenizer(cfg, str(tmp_path / "w")).vocab_size == bound

    # Unigram's bound (every substring) is loose: within it, SentencePiece names the real limit.
    cfg = default_data_config(source="text", dir=str(tmp_path), vocab_size=5001, vocab_type="unigram")
    with pytest.raises(ConfigError, match=r"at most (\d+) pieces") as info:
        load_or_train_tokenizer(cfg, str(tmp_path / "u"))
    cfg = cfg.replace(vocab_size=int(re.search(r"at most (\d+) pieces", str(info.value)).group(1)))
    with pytest.raises(ConfigError, match=rf"vocab_size={cfg.vocab_size} is too large") as info:
        load_or_train_tokenizer(cfg, str(tmp_path / "u"))
    suggested = int(re.search(r"vocab_size <= (\d+)", str(info.value)).group(1))
    assert 8 < suggested < cfg.vocab_size
    cfg = cfg.replace(vocab_size=suggested)
    assert load_or_train_tokenizer(cfg, str(tmp_path / "u")).vocab_size == suggested


def test_real_multi30k_round_trip(tmp_path):
    if not (SHARED_DATA / "multi30k" / "train.de").exists():
        pytest.skip(f"real data not found under {SHARED_DATA}")
    cfg = default_data_config(
        source="text", dir=str(SHARED_DATA / "multi30k"), vocab_size=301,
        tokenizer_train_examples=3001,
    )  # fmt: skip
    tok = load_or_train_tokenizer(cfg, str(tmp_path))
    pairs = get_source(cfg).pairs("train")
    tab_line = pairs[7365][1]
    assert tok.decode(tok.encode(tab_line)) == tab_line
    ids = tok.encode_batch([t for _, t in pairs[:500]])
    # Characters outside the 3001 sampled training pairs are UNK; everything else round-trips.
    ok = [tok.decode(i) == t for i, (_, t) in zip(ids, pairs[:500], strict=True) if UNK_ID not in i]
    assert len(ok) > 450 and all(ok)
