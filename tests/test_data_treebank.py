"""Parsing sources (transformer_jax/data/treebank.py) and their data_config fields."""


import pytest
from shared_data import SHARED_DATA

from transformer_jax.data import default_data_config, get_source, load_or_train_tokenizer, make_train_iterator
from transformer_jax.data.treebank import TreebankSource, is_parsing
from transformer_jax.data.trees import delinearize, parse_trees

PTB_SAMPLE = SHARED_DATA / "ptb_sample"
SAMPLE_SPLIT = dict(ptb_train_files="0001-0159", ptb_dev_files="0160-0179", ptb_test_files="0180-0199")


def _ptb_config(directory, **overrides):
    return default_data_config(**{"source": "ptb", "dir": str(directory), **SAMPLE_SPLIT, **overrides})


def test_is_parsing():
    assert is_parsing(default_data_config(source="ptb", dir="x"))
    assert is_parsing(default_data_config(source="synthetic_trees"))
    assert not is_parsing(default_data_config())
    assert not is_parsing(default_data_config(source="text", dir="x"))


def test_synthetic_trees_source_pairs_align_with_trees():
    cfg = default_data_config(
        source="synthetic_trees", synthetic_train_size=31, synthetic_dev_size=5, synthetic_test_size=7
    )
    source = get_source(cfg)
    assert isinstance(source, TreebankSource)
    assert [len(source.pairs(s)) for s in ("train", "dev", "test")] == [31, 5, 7]
    for (words, target), tree in zip(source.pairs("test"), source.trees("test"), strict=True):
        assert words.split() == tree.words()
        assert "XX" in target.split() and delinearize(target.split(), tree.words()).words() == tree.words()
    cfg = cfg.replace(keep_pos_tags=True)
    _, target = get_source(cfg).pairs("test")[0]
    assert "XX" not in target.split()


def test_ptb_source_reads_ranges_from_a_folder(tmp_path):
    for number, word in ((1, "a"), (2, "b"), (3, "c")):
        (tmp_path / f"wsj_{number:04d}.mrg").write_text(
            f"( (S (NP-SBJ (NN {word})) (VP (VBD ran) (NP (-NONE- *T*-1))) (. .)) )\n"
        )
    ranges = dict(ptb_train_files="0001", ptb_dev_files="0002", ptb_test_files="0003")
    source = get_source(_ptb_config(tmp_path, **ranges))
    assert source.pairs("dev") == [("b ran .", "(S (NP XX )NP (VP XX )VP XX )S")]
    assert source.trees("test") == parse_trees("(S (NP (NN c)) (VP (VBD ran)) (. .))")
    with pytest.raises(ValueError, match="split must be one of"):
        source.trees("validation")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dir=""), "data_config.dir must name the folder of .mrg files"),
        (dict(ptb_dev_files="0150-0165"),
         r"ptb_train_files='0001-0159' and ptb_dev_files='0150-0165' share files 0150-0159"),
        (dict(ptb_test_files="1-2"), r"data_config.ptb_test_files: file range '1-2': expected sections"),
    ],
)  # fmt: skip
def test_ptb_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_source(_ptb_config("somewhere", **overrides))


def test_ptb_missing_folder_says_what_to_put_where(tmp_path):
    source = get_source(_ptb_config(tmp_path / "wsj"))
    with pytest.raises(FileNotFoundError, match=r"wsj: no such folder; expected LDC's"):
        source.pairs("train")


def test_ptb_sample_splits():
    if not PTB_SAMPLE.is_dir():
        pytest.skip(f"{PTB_SAMPLE} is absent")
    source = get_source(_ptb_config(PTB_SAMPLE))
    assert [len(source.trees(s)) for s in ("train", "dev", "test")] == [3396, 273, 245]
    words, target = source.pairs("train")[0]
    assert words.startswith("Pierre Vinken , 61 years old ,")
    assert target.startswith("(S (NP (NP XX XX )NP XX (ADJP (NP XX XX )NP XX )ADJP XX )NP (VP XX")


def test_ptb_sample_words_as_leaves_keep_their_source_pieces(tmp_path):
    """With tree_leaves='words', every train target is its bracket ids and exactly the source's pieces."""
    if not PTB_SAMPLE.is_dir():
        pytest.skip(f"{PTB_SAMPLE} is absent")
    cfg = _ptb_config(PTB_SAMPLE, tree_leaves="words", vocab_size=4000)
    tokenizer = load_or_train_tokenizer(cfg, str(tmp_path))
    assert len(tokenizer.bracket_ids) == 52  # 26 labels, opening and closing
    pairs = get_source(cfg).pairs("train")
    sources = tokenizer.encode_batch([w for w, _ in pairs])
    targets = tokenizer.encode_batch([t for _, t in pairs])
    bracket_of = {token: i for i, token in tokenizer.bracket_ids.items()}
    for (_, target), src, tgt in zip(pairs, sources, targets, strict=True):
        assert [i for i in tgt if i not in tokenizer.bracket_ids] == src
        assert [i for i in tgt if i in tokenizer.bracket_ids] == [
            bracket_of[t] for t in target.split() if t[0] in "()"]


def test_synthetic_trees_go_through_the_tokenizer_and_batches(tmp_path):
    cfg = default_data_config(
        source="synthetic_trees", synthetic_train_size=301, synthetic_dev_size=7, synthetic_test_size=11,
        vocab_size=97, max_len=96, tokens_per_batch=960, length_buckets=(32, 64, 96),
    )  # fmt: skip
    tokenizer = load_or_train_tokenizer(cfg, str(tmp_path))
    # A decoded target splits back into the bracket tokens: outputs can be repaired and scored.
    for _, target in get_source(cfg).pairs("test"):
        assert tokenizer.decode(tokenizer.encode(target)).split() == target.split()
    batch = next(make_train_iterator(cfg, tokenizer, seed=0))
    assert batch["inputs"].shape[1] in (32, 64, 96)
