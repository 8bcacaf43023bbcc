"""Scoring by source length (evaluation/by_length.py) and the lengths a model takes: only a learned position
table bounds them (``ModelConfig.position_limit``); dev and test keep every pair whatever ``data.max_len``."""

import dataclasses
import types

import numpy as np
import pytest

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.restore import restore_workdir
from transformer_jax.evaluation import bleu, by_length, translation, workdir_scoring
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError, DataError
from transformer_jax.training import loop


def _exact(hypotheses, references):
    """A corpus score computable by hand: the percentage of exact matches."""
    return 100.0 * sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(hypotheses)


# ----------------------------------------------------------------------------- buckets


def test_edges_are_inclusive_upper_bounds_and_the_last_bucket_is_open():
    assert by_length.buckets((10, 20, 40)) == [(1, 10), (11, 20), (21, 40), (41, None)]
    assert [by_length.bucket_label(*b) for b in by_length.buckets((10, 20))] == ["1-10", "11-20", "21+"]
    assert by_length.check_edges(["10", " 20", "30"]) == (10, 20, 30)
    for bad in (["20", "10"], ["0", "5"], ["10", "10"], ["ten"], []):
        with pytest.raises(ConfigError, match=r"^--length_buckets=.*: expected strictly increasing positive"):
            by_length.check_edges(bad)


def test_each_bucket_is_scored_as_a_corpus_of_its_own_sentences():
    lengths = [3, 10, 11, 25, 40, 41, 7]
    hypotheses = ["a", "b", "c", "d", "x", "f", "y"]
    references = ["a", "b", "c", "d", "e", "f", "g"]
    rows = by_length.score_by_length(lengths, hypotheses, references, (10, 20, 30, 40, 50, 60), _exact,
                                     train_max_len=30)
    # 1-10: a b (y wrong) -> 2 of 3; 11-20: c; 21-30: d; 31-40: x wrong; 41-50: f; 51-60 and 61+ empty.
    assert [(r["bucket"], r["sentences"], r["score"], r["training"]) for r in rows] == [
        ("1-10", 3, pytest.approx(200 / 3), "within"), ("11-20", 1, 100.0, "within"),
        ("21-30", 1, 100.0, "within"), ("31-40", 1, 0.0, "beyond"), ("41-50", 1, 100.0, "beyond"),
        ("51-60", 0, None, "beyond"), ("61+", 0, None, "beyond")]
    assert by_length.score_by_length(lengths, hypotheses, references, (20,), _exact,
                                     train_max_len=15)[0]["training"] == "partly"
    with pytest.raises(ValueError, match="one of each per sentence"):
        by_length.score_by_length(lengths[:-1], hypotheses, references, (10,), _exact)


def test_each_bucket_gives_its_outputs_words_over_its_references_words():
    """Whitespace words, summed over the bucket: a model that stops early shows a ratio below 1."""
    hypotheses = ["a b", "a b c d", "", "x y z"]
    references = ["a b c", "a b c d", "p q", "x y"]
    rows = by_length.score_by_length([3, 12, 14, 30], hypotheses, references, (10, 20, 30, 40), _exact)
    assert [r["length_ratio"] for r in rows] == [pytest.approx(2 / 3), pytest.approx(4 / 6), 1.5, None, None]
    trees = [types.SimpleNamespace(label="S")] * 4  # parsing's gold trees: no words to count
    assert {r["length_ratio"] for r in by_length.score_by_length([3, 12, 14, 30], hypotheses, trees, (10,),
                                                                 lambda h, r: 0.0)} == {None}


def test_bucket_bleu_is_corpus_bleu_of_the_bucket():
    """sacreBLEU per bucket: the bucket of perfect outputs scores 100, the other its own corpus BLEU."""
    references = ["the cat sat on the mat today", "a dog ran in the park", "it rained all day long here"]
    hypotheses = [references[0], "a dog ran in a park", references[2]]

    def sacrebleu(h, r):
        return bleu.sacrebleu_score(h, r).score

    rows = by_length.score_by_length([5, 30, 9], hypotheses, references, (10,), sacrebleu)
    assert rows[0]["score"] == pytest.approx(100.0)
    assert rows[1]["score"] == pytest.approx(bleu.sacrebleu_score(hypotheses[1:2], references[1:2]).score)
    assert rows[1]["score"] < 100


def test_source_lengths_count_tokens_with_eos_in_split_order():
    inputs = np.array([[5, 6, EOS_ID, PAD_ID], [7, EOS_ID, PAD_ID, PAD_ID], [PAD_ID] * 4], np.int32)
    batches = [types.SimpleNamespace(inputs=inputs, num_real=2, indices=np.array([2, 0])),
               types.SimpleNamespace(inputs=np.array([[4, 4, 4, EOS_ID]], np.int32), num_real=1,
                                     indices=np.array([1]))]
    assert by_length.source_lengths(batches) == [2, 4, 3]


def test_the_table_marks_the_training_length_and_the_plot_is_a_png(tmp_path):
    rows = by_length.score_by_length([4, 14, 24], ["a", "b", "c"], ["a", "b", "x"], (10, 20), _exact,
                                     train_max_len=16)
    table = by_length.length_table(rows, "BLEU", train_max_len=16).splitlines()
    assert table[0].split() == ["source", "tokens", "sentences", "BLEU", "out/ref", "training"]
    assert table[2].split() == ["1-10", "1", "100.00", "1.00", "within"]
    assert table[3].split() == ["11-20", "1", "100.00", "1.00", "partly"]
    assert table[4].split() == ["21+", "1", "0.00", "1.00", "beyond"]
    assert table[-2].startswith("training pairs had at most data.max_len=16 tokens a side")
    assert table[-1] == "out/ref: the outputs' words over the references' words (below 1: outputs stop short)"
    out = by_length.plot_by_length({"run": rows}, str(tmp_path / "plot" / "by_length.png"), "BLEU",
                                   train_max_len=16, bands={"run": ([0, 90, None], [100, 100, None])})
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "plot").iterdir()] == ["by_length.png"]  # no partial file left


# ----------------------------------------------------------------------------- the lengths a model takes


@pytest.fixture(scope="module")
def restored(trained_run):
    return restore_workdir(trained_run[0])


def test_a_learned_table_refuses_a_longer_input_in_one_line(restored):
    cfg = restored.model_config.replace(position_encoding="learned", max_len=12)
    long_text = " ".join(["The dog sleeps."] * 6)
    n = len(restored.tokenizer.encode_text([long_text], side="source")[0]) + 1
    settings = translation.Settings(beam_size=1, max_extra_len=4)
    with pytest.raises(DataError, match=rf"^line 2: {n} tokens \(EOS included\), more than the 8 this model "
                       r"can decode \(its learned position table has model.max_len=12 positions, less the "
                       r"output allowance max_extra_len=4\)") as info:
        translation.translate_texts(None, cfg, restored.tokenizer, ["Hi.", long_text], settings)
    assert "\n" not in str(info.value)
    assert translation.source_limit(cfg, 4) == 8
    assert translation.source_limit(restored.model_config, 4) is None  # sinusoidal: any length


@pytest.mark.parametrize("scheme, positions", [("rotary", None), ("relative", None), ("learned", 12),
                                               ("sinusoidal", 1024), ("none", 1024), ("alibi", 1024)])
def test_ctranslate2_takes_the_lengths_its_export_holds(restored, scheme, positions):
    """Not model.max_len for every scheme: any length under rotary and relative positions, max(max_len,
    1024) for the exported tables and ALiBi's buckets. A source within them is neither refused nor cut by
    --truncate; one past them is refused naming what holds the positions."""
    cfg = restored.model_config.replace(position_encoding=scheme, max_len=12)
    settings = translation.Settings(beam_size=1, max_extra_len=4)
    assert translation.source_limit(cfg, 4, "ctranslate2") == (None if positions is None else positions - 4)
    decoded = []

    def decode_fn(ids, settings, progress):  # the engine: records what it is given
        decoded.extend(ids)
        return [np.asarray([EOS_ID], np.int32) for _ in ids]

    text = " ".join(["The dog sleeps."] * 4)  # longer than model.max_len, shorter than 1020
    n = len(restored.tokenizer.encode_text([text], side="source")[0]) + 1
    assert 12 < n < 1020
    for truncate in (False, True) if scheme != "learned" else ():
        translation.translate_texts(None, cfg, restored.tokenizer, [text], settings, truncate=truncate,
                                    decode_fn=decode_fn)
        assert len(decoded.pop()) == n
    if positions is None:
        return
    long_text = " ".join(["The dog sleeps."] * (positions // 3))
    n = len(restored.tokenizer.encode_text([long_text], side="source")[0]) + 1
    holds = {"learned": "learned position table has", "alibi": "ALiBi encoder buckets are exact for",
             "sinusoidal": "sinusoid table has", "none": "zero position table has"}[scheme]
    holder = (f"{holds} model.max_len=12 positions" if scheme == "learned" else
              f"{holds} 1024 positions, the larger of model.max_len=12 and 1024")
    with pytest.raises(DataError) as refused:
        translation.translate_texts(None, cfg, restored.tokenizer, [long_text], settings, decode_fn=decode_fn)
    assert str(refused.value).startswith(f"line 1: {n} tokens (EOS included), more than the {positions - 4} "
                                         "this model can decode (the CTranslate2 export's ")
    assert f"{holder}, less the output allowance max_extra_len=4)" in str(refused.value)


def test_evaluate_bounds_ctranslate2_by_what_its_export_holds(restored):
    """evaluate.py's check of --max_extra_len against the largest length bucket, before anything is
    claimed: under rotary positions nothing bounds it; the exported sinusoid holds 1024 positions, not
    model.max_len."""
    data = restored.run.data
    largest = max(data.length_buckets)
    rotary = restored.model_config.replace(position_encoding="rotary", max_len=12)
    sinusoid = restored.model_config.replace(max_len=12)
    assert workdir_scoring._decodable_length(rotary, data, 500, "ctranslate2") is None
    assert workdir_scoring._decodable_length(sinusoid, data, 500, "ctranslate2") == 1024 - 500
    with pytest.raises(ConfigError) as refused:
        workdir_scoring._decodable_length(sinusoid, data, 1000, "ctranslate2")
    assert str(refused.value) == (
        "--max_extra_len=1000: the CTranslate2 export's sinusoid table has 1024 positions, the larger of "
        f"model.max_len=12 and 1024, which leaves room for at most {1024 - largest} output positions beyond "
        f"the largest length bucket {largest}; pass --max_extra_len={1024 - largest} or less")


def test_dev_and_test_keep_every_length_whatever_the_training_length(restored):
    """data.max_len drops train pairs only; with positions that have no table, a model.max_len below the
    longest dev or test pair refuses nothing either, and a learned table refuses in one line."""
    run = restored.run
    short = dataclasses.replace(run, data=run.data.replace(max_len=8, length_buckets=(8, 64)),
                                model=run.model.replace(max_len=9))
    pairs = {split: data_lib.get_source(short.data).pairs(split) for split in ("dev", "test")}
    lengths = [len(ids) + 1 for ids in restored.tokenizer.encode_text([s for s, _ in pairs["test"]],
                                                                      side="source")]
    assert max(lengths) > 9  # longer than both data.max_len and model.max_len
    dev, dev_decode, final = loop._eval_batches(short, restored.tokenizer)
    assert sum(b.num_real for b in dev) == len(pairs["dev"])
    assert sum(b.num_real for b in final) == len(pairs["test"])
    assert sum(b.num_real for b in dev_decode) == min(run.eval.eval_bleu_examples, len(pairs["dev"]))
    assert sorted(by_length.source_lengths(final)) == sorted(lengths)
    learned = dataclasses.replace(short, model=short.model.replace(position_encoding="learned"))
    with pytest.raises(DataError, match=r"more than the model's max_len=9"):
        loop._eval_batches(learned, restored.tokenizer)


def test_a_parsing_run_is_scored_by_bracket_f1_per_bucket():
    """The parsing task's scorer: the gold linearizations score F1 100, right-branching trees less."""
    from transformer_jax.data.config import default_data_config
    from transformer_jax.evaluation import evalb, tasks

    data = default_data_config(source="synthetic_trees", synthetic_train_size=5, synthetic_dev_size=7,
                               synthetic_test_size=3)
    batches = [types.SimpleNamespace(indices=np.array([4, 0, 2])), types.SimpleNamespace(indices=np.array(
        [6, 1, 5, 3]))]
    measure, gold, scorer = tasks.task_for(data).length_scorer(data, None, "dev", batches)
    source = data_lib.get_source(data)
    assert measure == "F1" and [str(t) for t in gold] == [str(t) for t in source.trees("dev")]
    outputs = [target for _, target in source.pairs("dev")]  # the gold linearizations, as decoded
    rows = by_length.score_by_length([3, 30, 3, 30, 3, 30, 3], outputs, gold, (10,), scorer)
    assert [(r["sentences"], r["score"]) for r in rows] == [(4, 100.0), (3, 100.0)]
    wrong = outputs[1:] + outputs[:1]  # each sentence given another's tree: repaired, then scored lower
    assert scorer(wrong, gold) < scorer(outputs, gold) == 100.0
    assert evalb.right_branching_baseline(gold)["f1"] < 100


@pytest.mark.parametrize("scheme", ["sinusoidal", "rotary", "alibi", "relative", "none"])
def test_a_scheme_without_a_table_decodes_past_model_max_len(scheme):
    """Sources of up to 19 tokens and outputs of up to 19 + 5 through a model whose max_len is 8: the same
    tokens as with a max_len that holds them all (the schemes read no table of max_len rows)."""
    from tiny import random_params

    from transformer_jax.model.config import ModelConfig

    def config(max_len):
        return ModelConfig(vocab_size=23, d_model=12, d_ff=14, num_heads=3, d_k=4, d_v=4,
                           num_encoder_layers=1, num_decoder_layers=2, dropout_rate=0.0, max_len=max_len,
                           position_encoding=scheme, max_relative_position=3)

    params = random_params(config(64), seed=7)
    rng = np.random.default_rng(3)
    ids = [np.append(rng.integers(4, 23, n), EOS_ID).astype(np.int32) for n in (18, 3)]
    settings = translation.Settings(beam_size=2, alpha=0.6, max_extra_len=5)
    short = translation.decode_ids(params, config(8), ids, settings)
    wide = translation.decode_ids(params, config(64), ids, settings)
    for a, b, source in zip(short, wide, ids, strict=True):
        assert a.shape == (len(source) + 5,)
        np.testing.assert_array_equal(a, b)


def test_a_learned_table_refuses_decoding_past_its_rows():
    from tiny import random_params

    from transformer_jax.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=23, d_model=12, d_ff=14, num_heads=3, num_encoder_layers=1,
                      num_decoder_layers=1, dropout_rate=0.0, max_len=8, position_encoding="learned")
    source = np.append(np.full(5, 7), EOS_ID).astype(np.int32)  # 6 tokens + 5 outputs > 8 rows
    with pytest.raises(ValueError, match=r"longer than the learned positions' model max_len=8 - "
                       r"max_extra_len=5"):
        translation.decode_ids(random_params(cfg, seed=1), cfg, [source], translation.Settings(1, 0.6, 5))
