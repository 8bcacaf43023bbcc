"""Token-budget batches, iterator state, process shards; evaluation batches (transformer_jax/data)."""

import collections
import json
import logging

import numpy as np
import pytest
from shared_data import SHARED_DATA

from transformer_jax.data import (
    default_data_config,
    get_source,
    load_or_train_tokenizer,
    make_eval_batches,
    make_train_iterator,
    tokenize_pairs,
)
from transformer_jax.data.batching import TokenizedSplit, TrainIterator, bucket_batch_sizes, gather_padded
from transformer_jax.data.eval_batches import extended_buckets
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError, DataError

# Odd sizes everywhere: 997 train pairs, 3 processes, budget 1001 tokens.
_CFG = dict(
    vocab_size=257,
    synthetic_train_size=997,
    synthetic_dev_size=101,
    synthetic_test_size=103,
    tokens_per_batch=1001,
    max_len=136,  # no synthetic pair is longer with this small vocabulary
    length_buckets=(8, 16, 24, 40, 56, 72, 96, 136),
)


def _config(**overrides):
    return default_data_config(**{**_CFG, **overrides})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(_config(), str(tmp_path_factory.mktemp("w")))


def _key(inputs_row: np.ndarray, targets_row: np.ndarray) -> tuple:
    return tuple(inputs_row[inputs_row > 0]), tuple(targets_row[targets_row > 0])


def _example_keys(data) -> collections.Counter:
    return collections.Counter(
        (
            tuple(data.src_ids[data.src_offsets[i] : data.src_offsets[i + 1]]),
            tuple(data.tgt_ids[data.tgt_offsets[i] : data.tgt_offsets[i + 1]]),
        )
        for i in range(len(data))
    )


def _epoch(iterator) -> list[dict]:
    return [next(iterator) for _ in range(iterator.batches_per_epoch)]


def _real_rows(batches) -> collections.Counter:
    keys = collections.Counter()
    for batch in batches:
        for src, tgt in zip(batch["inputs"], batch["targets"], strict=True):
            if src.any() or tgt.any():
                keys[_key(src, tgt)] += 1
    return keys


# ----------------------------------------------------------------------------- hand-computed


def test_gather_padded_hand_computed():
    ids = np.array([5, 6, EOS_ID, 7, EOS_ID], np.int32)
    offsets = np.array([0, 3, 5])
    out = gather_padded(ids, offsets, np.array([1, -1, 0]), 4)
    np.testing.assert_array_equal(out, [[7, 1, 0, 0], [0, 0, 0, 0], [5, 6, 1, 0]])
    assert out.dtype == np.int32
    with pytest.raises(ValueError, match="length 3 does not fit length 2"):
        gather_padded(ids, offsets, np.array([0]), 2)


def test_bucket_batch_sizes_hand_computed():
    # 1001 // 8 = 125 -> 123 (multiple of 3); 1001 // 24 = 41 -> 39; 1001 // 40 = 25 -> 24.
    assert bucket_batch_sizes((8, 24, 40), 1001, 3) == [123, 39, 24]
    assert bucket_batch_sizes((8, 24, 40), 1001, 1) == [125, 41, 25]
    assert bucket_batch_sizes((400,), 1001, 3) == [3]  # at least batch_multiple rows


# ----------------------------------------------------------------------------- train batches


@pytest.mark.parametrize("by_source", [False, True])
def test_sources_are_padded_to_the_groups_source_bucket(by_source):
    """Hand-computed, buckets (4, 8, 12), 24 tokens a batch (rows 6, 3, 2). Pairs (source, target)
    lengths, EOS included: (2, 3) -> bucket 4; (3, 7), (2, 8) -> bucket 8; (9, 4), (5, 11) -> 12.
    By default a bucket's sources are padded to the bucket of its longest source: 4, 4, 12. With
    by_source, (5, 11) is grouped apart from (9, 4) and padded to 8."""
    lengths = [(2, 3), (3, 7), (2, 8), (9, 4), (5, 11)]

    def side(k):  # ids 2.. then EOS, per pair
        seqs = [list(range(2, 1 + n[k])) + [EOS_ID] for n in lengths]
        return (np.array(sum(seqs, []), np.int32),
                np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64))

    data = TokenizedSplit(*side(0), *side(1))
    it = TrainIterator(data, length_buckets=(4, 8, 12), tokens_per_batch=24, seed=0, by_source=by_source)
    expected = [(2, 12, 12), (3, 4, 8), (6, 4, 4)] + ([(2, 8, 12)] if by_source else [])
    assert it.shapes == sorted(expected)
    assert it.batches_per_epoch == len(expected)
    seen = collections.Counter()
    for batch in _epoch(it):
        assert (*batch["inputs"].shape, batch["targets"].shape[1]) in it.shapes
        for src, tgt in zip(batch["inputs"], batch["targets"], strict=True):
            if tgt.any():
                seen[(int((src > 0).sum()), int((tgt > 0).sum()), len(src))] += 1
    padded_to = {(9, 4): 12, (5, 11): 8 if by_source else 12}
    assert seen == collections.Counter((s, t, padded_to.get((s, t), 4)) for s, t in lengths)


def test_bucket_by_source_pads_each_source_to_its_own_bucket(tok):
    cfg = _config(bucket_by_source=True)
    it = make_train_iterator(cfg, tok, seed=3)
    buckets = list(it.bucket_lengths)
    batches = _epoch(it)
    for batch in batches:
        length = batch["inputs"].shape[1]
        smaller = buckets[buckets.index(length) - 1] if length != buckets[0] else 0
        used = (batch["inputs"] > 0).sum(1)
        assert ((used > smaller) | (used == 0)).all() and (used <= length).all()
    assert _real_rows(batches) == _example_keys(tokenize_pairs(get_source(cfg).pairs("train"), tok))
    with pytest.raises(ConfigError, match="bucket_by_source must be a bool"):
        make_train_iterator(_config(bucket_by_source="yes"), tok, seed=3)


def test_epoch_respects_budget_shapes_and_covers_every_example_once(tok):
    cfg = _config()
    it = make_train_iterator(cfg, tok, seed=3)
    data = tokenize_pairs(get_source(cfg).pairs("train"), tok)
    assert it.num_examples == 997 and it.num_dropped == 0
    batches = _epoch(it)
    shapes = set()
    for batch in batches:
        inputs, targets = batch["inputs"], batch["targets"]
        assert inputs.dtype == np.int32 and targets.dtype == np.int32
        assert inputs.shape[0] == targets.shape[0] and inputs.shape[1] <= targets.shape[1]
        assert targets.shape[0] * targets.shape[1] <= cfg.tokens_per_batch
        # Every batch, the last of a bucket too (padded with empty rows), fills its budget: the rows a
        # bucket of this target length holds, at least one.
        assert targets.shape[0] == max(1, cfg.tokens_per_batch // targets.shape[1])
        assert targets.shape[1] in cfg.length_buckets and inputs.shape[1] in cfg.length_buckets
        shapes.add((*inputs.shape, targets.shape[1]))
    assert len(shapes) > 3
    assert _real_rows(batches) == _example_keys(data)


def test_rows_are_ids_then_eos_then_pad(tok):
    it = make_train_iterator(_config(), tok, seed=5)
    for batch in _epoch(it):
        for side in ("inputs", "targets"):
            for row in batch[side]:
                if not row.any():
                    continue
                (eos,) = np.flatnonzero(row == EOS_ID)  # exactly one EOS
                assert (row[:eos] > EOS_ID).all() and (row[eos + 1 :] == PAD_ID).all()


def test_smallest_fitting_bucket_and_few_filler_rows(tok):
    it = make_train_iterator(_config(), tok, seed=7)
    buckets = list(it.bucket_lengths)
    filler = collections.Counter()
    for batch in _epoch(it):
        length = batch["targets"].shape[1]
        used = np.maximum((batch["inputs"] > 0).sum(1), (batch["targets"] > 0).sum(1))
        real = used > 0
        smaller = buckets[buckets.index(length) - 1] if length != buckets[0] else 0
        assert (used[real] > smaller).all() and (used[real] <= length).all()
        filler[length] += int((~real).sum())
    for length, rows in filler.items():  # only each bucket's last batch is padded
        assert rows < it.batch_sizes[buckets.index(length)]


def test_shuffle_is_seeded_and_changes_each_epoch(tok):
    a, b, c = (make_train_iterator(_config(), tok, seed=s) for s in (11, 11, 13))
    first_a, first_b, first_c = _epoch(a), _epoch(b), _epoch(c)
    for x, y in zip(first_a, first_b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert any(x["inputs"].shape != y["inputs"].shape or (x["inputs"] != y["inputs"]).any()
               for x, y in zip(first_a, first_c, strict=True))  # fmt: skip
    second_a = _epoch(a)
    assert _real_rows(second_a) == _real_rows(first_a)
    assert any(x["inputs"].shape != y["inputs"].shape or (x["inputs"] != y["inputs"]).any()
               for x, y in zip(first_a, second_a, strict=True))  # fmt: skip


@pytest.mark.parametrize("skip", [7, "epoch_end"])
def test_state_restore_continues_identical_sequence(tok, skip):
    it = make_train_iterator(_config(), tok, seed=17)
    steps = it.batches_per_epoch - 2 if skip == "epoch_end" else skip
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as stored in a checkpoint
    expected = [next(it) for _ in range(5)]  # crosses into epoch 1 for "epoch_end"
    fresh = make_train_iterator(_config(), tok, seed=17)
    fresh.set_state(state)
    for want, got in zip(expected, [next(fresh) for _ in range(5)], strict=True):
        np.testing.assert_array_equal(want["inputs"], got["inputs"])
        np.testing.assert_array_equal(want["targets"], got["targets"])
    with pytest.raises(ValueError, match=r"iterator state has seed=17 but .* seed=19"):
        make_train_iterator(_config(), tok, seed=19).set_state(state)


def test_process_shards_are_disjoint_complete_and_in_lockstep(tok):
    cfg = _config()
    whole = make_train_iterator(cfg, tok, seed=23, batch_multiple=3)
    shards = [
        make_train_iterator(cfg, tok, seed=23, process_index=p, process_count=3, batch_multiple=3)
        for p in range(3)
    ]
    assert all(s.batches_per_epoch == whole.batches_per_epoch for s in shards)
    seen = [collections.Counter() for _ in shards]
    for _ in range(whole.batches_per_epoch):
        global_batch = next(whole)
        local = [next(s) for s in shards]
        assert len({b["inputs"].shape for b in local}) == 1  # same bucket on every process
        assert local[0]["inputs"].shape[0] * 3 == global_batch["inputs"].shape[0]
        for side in ("inputs", "targets"):
            np.testing.assert_array_equal(
                np.concatenate([b[side] for b in local]), global_batch[side]
            )
        for counter, batch in zip(seen, local, strict=True):
            counter.update(_real_rows([batch]))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert seen[0] + seen[1] + seen[2] == _example_keys(
        tokenize_pairs(get_source(cfg).pairs("train"), tok)
    )
    with pytest.raises(ValueError, match=r"batch_multiple=2 must be a positive multiple of"):
        make_train_iterator(cfg, tok, seed=0, process_index=0, process_count=3, batch_multiple=2)


def test_long_train_pairs_are_dropped_and_counted(tok, caplog):
    cfg = _config(max_len=24, length_buckets=(8, 16, 24, 40))
    data = tokenize_pairs(get_source(cfg).pairs("train"), tok)
    too_long = int((np.maximum(data.src_lengths, data.tgt_lengths) > 24).sum())
    assert too_long > 0
    with caplog.at_level("INFO"):
        it = make_train_iterator(cfg, tok, seed=0)
    assert it.num_dropped == too_long and it.num_examples == 997 - too_long
    assert f"Dropped {too_long} of 997" in caplog.text
    assert it.bucket_lengths == [8, 16, 24]
    assert sum(_real_rows(_epoch(it)).values()) == 997 - too_long


# ----------------------------------------------------------------------------- eval batches


def test_eval_batches_keep_every_example_once_in_a_fixed_order(tok):
    cfg = _config()
    batches = make_eval_batches(cfg, tok, "dev", batch_multiple=3)
    again = make_eval_batches(cfg, tok, "dev", batch_multiple=3)
    pairs = get_source(cfg).pairs("dev")
    indices = np.concatenate([b.indices for b in batches])
    assert sorted(indices.tolist()) == list(range(101))
    for b, b2 in zip(batches, again, strict=True):
        np.testing.assert_array_equal(b.inputs, b2.inputs)
    for b in batches:
        assert b.inputs.shape[0] % 3 == 0 and b.inputs.shape == b.targets.shape
        assert b.inputs.shape[0] * b.inputs.shape[1] <= cfg.tokens_per_batch
        assert not b.inputs[b.num_real :].any() and not b.targets[b.num_real :].any()
        assert b.source_texts == [pairs[i][0] for i in b.indices]
        assert tok.decode_batch(b.inputs[: b.num_real]) == b.source_texts
        assert tok.decode_batch(b.targets[: b.num_real]) == b.target_texts
    assert all(b.num_real == b.inputs.shape[0] for b in batches[:-1])  # only the last batch has PAD rows
    lengths = [int(np.max(np.sum((b.inputs != 0) | (b.targets != 0), axis=1))) for b in batches]
    assert all(length <= b.inputs.shape[1] for length, b in zip(lengths, batches, strict=True))
    assert sum(b.num_real for b in make_eval_batches(cfg, tok, "test", max_examples=17)) == 17
    given = make_eval_batches(cfg, tok, "files", pairs=pairs[:7])
    assert sorted(t for b in given for t in b.target_texts) == sorted(t for _, t in pairs[:7])


def test_eval_length_limits_name_the_first_example_over_each(tok):
    cfg = _config()
    short, long_text = "a b", " ".join(["the house is small"] * 12)
    pairs = [(short, short), (short, long_text), (long_text, short), (long_text, long_text)]
    src, ref = (len(tok.encode_text([t], side=side)[0]) + 1 for t, side in ((long_text, "source"),
                                                                           (long_text, "target")))
    names = [f"f.en:{i}" for i in range(1, 5)]

    def batches(**limits):
        return make_eval_batches(cfg, tok, "files", pairs=pairs, locations=names, **limits)

    assert sum(b.num_real for b in batches(max_length=max(src, ref), max_source_length=src)) == 4
    with pytest.raises(DataError, match=rf"^f\.en:3: the source has {src} tokens \(EOS included\), more "
                       rf"than the {src - 1} this model can decode \(2 such lines\); .*final_max_extra_len"):
        batches(max_source_length=src - 1)
    with pytest.raises(DataError, match=rf"^f\.en:2: the reference has {ref} tokens .* more than the model's "
                       rf"max_len={ref - 1} \(3 such lines\); .*raise config\.model\.max_len"):
        batches(max_length=ref - 1, max_source_length=src)
    with pytest.raises(DataError, match=r"^files example 3: the source"):  # no locations: the number
        make_eval_batches(cfg, tok, "files", pairs=pairs, max_source_length=src - 1)


def test_eval_never_truncates_examples_longer_than_the_buckets(tok):
    cfg = _config(max_len=16, length_buckets=(8, 16))
    batches = make_eval_batches(cfg, tok, "test")
    longest = max(int(np.max(np.sum((b.inputs != 0) | (b.targets != 0), axis=1))) for b in batches)
    assert longest > 16
    assert {b.inputs.shape[1] for b in batches} <= set(extended_buckets((8, 16), longest))
    assert max(b.inputs.shape[1] for b in batches) == longest
    assert sum(b.num_real for b in batches) == 103
    for b in batches:
        assert tok.decode_batch(b.targets[: b.num_real]) == b.target_texts
    buckets = extended_buckets((8, 16), longest)
    for b in batches:  # a bucket's own rows (not those moved up from shorter buckets) by source length
        shorter = max([0] + [length for length in buckets if length < b.inputs.shape[1]])
        rows = slice(0, b.num_real)
        own = np.sum((b.inputs[rows] != 0) | (b.targets[rows] != 0), axis=1) > shorter
        assert (np.diff(np.sum(b.inputs[rows] != 0, axis=1)[own]) >= 0).all()


def test_extended_buckets_grow_by_a_quarter_in_multiples_of_8_up_to_the_longest():
    assert extended_buckets((16, 24, 32, 48, 64), 153) == [16, 24, 32, 48, 64, 80, 104, 136, 153]
    assert extended_buckets((8, 16), 16) == [8, 16]
    assert extended_buckets((8, 16), 17) == [8, 16, 17]
    assert extended_buckets((8, 16), 30) == [8, 16, 24, 30]


# ----------------------------------------------------------------------------- real data


def test_real_multi30k_through_the_whole_pipeline(tmp_path):
    if not (SHARED_DATA / "multi30k" / "train.de").exists():
        pytest.skip(f"real data not found under {SHARED_DATA}")
    cfg = default_data_config(
        source="text", dir=str(SHARED_DATA / "multi30k"), vocab_size=301, max_len=128,
        tokens_per_batch=8191, length_buckets=(8, 16, 24, 32, 48, 64, 96, 128),
        tokenizer_train_examples=5003,
    )  # fmt: skip
    tok = load_or_train_tokenizer(cfg, str(tmp_path))
    it = make_train_iterator(cfg, tok, seed=0)
    assert it.num_examples + it.num_dropped == 29000
    rows = sum(
        int((b["inputs"].any(1) | b["targets"].any(1)).sum()) for b in _epoch(it)
    )
    assert rows == it.num_examples
    dev = make_eval_batches(cfg, tok, "dev")
    assert sum(b.num_real for b in dev) == 1014


def test_nul_bytes_long_lines_and_unknown_text_are_warned_about_naming_file_and_line(tmp_path, caplog):
    en = [f"the cat sat on mat number {i}" for i in range(40)]
    de = [f"die katze sass auf matte nummer {i}" for i in range(40)]
    en[6] = "the ca\0t sat"  # a NUL inside a word: an <unk> piece in it
    de[9] = "\u0436" * 100_000  # too long for SentencePiece to train on, so its character is unknown
    for split, lines in (("train", (en, de)), ("val", (en[:3], de[:3])), ("test", (en[:3], de[:3]))):
        for lang, side in zip(("en", "de"), lines, strict=True):
            (tmp_path / f"{split}.{lang}").write_text("".join(s + "\n" for s in side), encoding="utf-8")
    cfg = default_data_config(source="text", dir=str(tmp_path), vocab_size=60, max_len=128,
                              length_buckets=(16, 128), tokens_per_batch=512)
    tokenizer = load_or_train_tokenizer(cfg, str(tmp_path / "w"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        iterator = make_train_iterator(cfg, tokenizer, seed=0)
    messages = [r.getMessage() for r in caplog.records]
    text = " ".join(messages)
    assert f"{tmp_path / 'train.en'}: 1 of 40 lines hold a NUL byte (lines 7)" in text
    assert f"{tmp_path / 'train.de'}: 1 of 40 lines are longer than 65536 bytes (lines 10)" in text
    unknown = [m for m in messages if "mostly <unk>" in m]
    assert len(unknown) == 1 and unknown[0].startswith("1 of 40 pairs are mostly <unk> pieces on a side ")
    assert f"{tmp_path / 'train.en'} / {tmp_path / 'train.de'} lines 10)" in unknown[0]
    assert iterator.num_examples + iterator.num_dropped == 40  # warned about, not silently dropped


def test_clean_text_gives_no_such_warnings(tmp_path, caplog, tok):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tokenize_pairs(get_source(_config()).pairs("train"), tok)
    assert not [r for r in caplog.records if "<unk>" in r.getMessage() or "NUL" in r.getMessage()]


def test_a_max_len_that_leaves_no_train_pair_is_one_line_naming_it():
    """data.max_len=6 with a learned table of 6 rows: the model builds, and every train pair is longer."""
    empty = TokenizedSplit(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32),
                           np.zeros(1, np.int64), num_empty=2)
    with pytest.raises(ConfigError, match=r"^no train pair is left: 398 are longer than data.max_len "
                       r"\(either side, EOS included\) and 2 have an empty side; raise data.max_len$"):
        TrainIterator(empty, length_buckets=(8,), tokens_per_batch=64, seed=0, num_dropped=398)
