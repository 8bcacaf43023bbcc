"""The text a model trains on: raw, or lowercased and Moses-tokenized (transformer_jax/data/text_form.py)."""

import pytest
from shared_data import SHARED_DATA

from transformer_jax.data import default_data_config, load_or_train_tokenizer, make_eval_batches
from transformer_jax.data.text_form import RAW, TextForm, text_form_of
from transformer_jax.evaluation import bleu
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError

MOSES_LC = TextForm("moses_lc", "en", "de")


def test_moses_lc_lowercases_normalizes_and_tokenizes_per_language():
    # English splits the clitic ("'s") and moves the full stop inside the closing quote; German does not.
    assert MOSES_LC.prepare(['A man\'s hat, "red".', "Two dogs (brown)."], "source") == [
        'a man \'s hat , " red . "', "two dogs ( brown ) ."]
    assert MOSES_LC.prepare(["Ein Mann sagt „Ja“.", "Zwei Hunde, 3,5 km."], "target") == [
        'ein mann sagt " ja " .', "zwei hunde , 3,5 km ."]


def test_moses_lc_finish_detokenizes_the_target_language():
    assert MOSES_LC.finish(['ein mann sagt " ja " .', "zwei hunde , 3,5 km ."]) == [
        'ein mann sagt "ja".', "zwei hunde, 3,5 km."]


def test_raw_changes_nothing_and_unknown_names_and_sides_fail():
    texts = ["A man's hat.", "  Ein  Mann "]
    assert RAW.prepare(texts, "source") == texts and RAW.finish(texts) == texts
    with pytest.raises(ValueError, match="text_form must be one of"):
        TextForm("lowercase", "en", "de")
    with pytest.raises(ValueError, match="side must be one of"):
        MOSES_LC.prepare(texts, "src")


def test_config_validates_text_form_before_reading_data(tmp_path):
    with pytest.raises(ConfigError, match="text_form must be one of"):
        load_or_train_tokenizer(default_data_config(text_form="lc"), str(tmp_path))
    with pytest.raises(ConfigError, match="is for translation text"):
        load_or_train_tokenizer(default_data_config(source="synthetic_trees", text_form="moses_lc"),
                                str(tmp_path))
    assert text_form_of(default_data_config()) is RAW
    assert text_form_of(default_data_config(source="text", text_form="moses_lc", src_lang="de",
                                            tgt_lang="en")) == TextForm("moses_lc", "de", "en")


_TRAIN = {
    "en": ["A dog runs.", "The Dog's ball.", "Two men (smiling) talk.", "A woman, a man."] * 8,
    "de": ["Ein Hund rennt.", "Der Ball des Hundes.", "Zwei Männer (lächelnd) reden.",
           "Eine Frau, ein Mann."] * 8,
}


@pytest.fixture(scope="module")
def moses_lc_run(tmp_path_factory):
    """A tiny text dataset and the tokenizer a 'moses_lc' run trains on it."""
    folder = tmp_path_factory.mktemp("text")
    for split in ("train", "val", "test"):
        for lang, lines in _TRAIN.items():
            (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = default_data_config(source="text", dir=str(folder), text_form="moses_lc", vocab_size=60,
                              length_buckets=(8, 16, 32, 64))
    return cfg, load_or_train_tokenizer(cfg, str(tmp_path_factory.mktemp("workdir")))


def test_tokenizer_trains_and_encodes_the_prepared_text(moses_lc_run):
    cfg, tok = moses_lc_run
    assert tok.text_form == TextForm("moses_lc", "en", "de")
    pieces = {tok.id_to_piece(i) for i in range(tok.vocab_size)}
    assert not any(c.isupper() for piece in pieces for c in piece)  # the vocabulary never saw a capital
    assert tok.encode_text(["The Dog's ball."], side="source") == [tok.encode("the dog 's ball .")]
    assert tok.encode_text(["The Dog's ball."], side="target") == [tok.encode("the dog ' s ball .")]


def test_decode_batch_detokenizes_and_references_stay_raw(moses_lc_run):
    cfg, tok = moses_lc_run
    ids = tok.encode("ein hund rennt .")
    assert tok.decode(ids) == "ein hund rennt ."  # the model's text
    assert tok.decode_batch([[*ids, EOS_ID, PAD_ID]]) == ["ein hund rennt."]  # the user's
    batches = make_eval_batches(cfg, tok, "dev")
    texts = {t for b in batches for t in b.target_texts}
    assert texts == set(_TRAIN["de"])  # scored against the files' own (cased) text
    row = batches[0].targets[0]
    assert tok.decode(row) in {" ".join(MOSES_LC.prepare([t], "target")) for t in _TRAIN["de"]}


@pytest.mark.parametrize("lang", ["en", "de"])
def test_real_multi30k_val_survives_prepare_and_finish_under_multi30k_bleu(lang):
    path = SHARED_DATA / "multi30k" / f"val.{lang}"
    if not path.exists():
        pytest.skip(f"real data not found under {SHARED_DATA}")
    references = path.read_text(encoding="utf-8").splitlines()
    form = TextForm("moses_lc", "xx", lang)  # the target side is `lang`
    back = form.finish(form.prepare(references, "target"))
    changed = [r for r, b in zip(references, back, strict=True)
               if bleu.multi30k_tokenize(r, lang) != bleu.multi30k_tokenize(b, lang)]
    assert len(references) == 1014 and changed == []
