"""Tests for run_config.py: a whole run config is checked up front, and config.model builds the model."""

import json
import os

import pytest

from configs import default as default_config
from transformer_jax import run_config
from transformer_jax.checkpoints import integrity
from transformer_jax.runtime.errors import ConfigError, MissingFileError, UserError
from transformer_jax.training import loop


def test_model_config_from_takes_every_field_of_config_model():
    config = default_config.get_config()
    config.model.attention_block_size = 48
    config.model.d_k = 11
    config.model.norm_style = "pre"
    model_config = run_config.model_config_from(config.model, vocab_size=37)
    assert (model_config.vocab_size, model_config.attention_block_size, model_config.d_k,
            model_config.norm_style) == (37, 48, 11, "pre")
    assert model_config.d_v == config.model.d_model // config.model.num_heads  # unset: derived


def test_default_config_is_valid_and_each_part_holds_its_fields():
    config = default_config.get_config()
    run = run_config.build_run_config(config)
    assert run.model.d_model == config.model.d_model and run.model.vocab_size == config.data.vocab_size
    assert run.data.length_buckets == tuple(config.data.length_buckets)
    assert run.train.warmup_steps == config.train.warmup_steps
    assert run.eval.final_beam_size == config.final_beam_size
    assert run.checkpoint.checkpoint_keep == config.checkpoint_keep
    assert run.loop.log_every_steps == config.log_every_steps
    assert run.sharding.mesh_shape == tuple(config.sharding.mesh_shape)


def test_saved_json_reads_back_into_the_same_run_config():
    run = run_config.build_run_config(default_config.get_config())
    again = run_config.run_config_from_saved(json.loads(json.dumps(dict(run.saved))))
    assert again == run  # every part, field by field (the JSON form is not compared)


def test_a_config_saved_before_cooldown_existed_has_none():
    saved = json.loads(json.dumps(dict(run_config.build_run_config(default_config.get_config()).saved)))
    del saved["train"]["cooldown_steps"]
    assert run_config.run_config_from_saved(saved).train.cooldown_steps == 0


def test_a_config_saved_with_the_old_decode_mode_fields_still_restores():
    """Model configs once held decode_cache_len and decode_beams (now the decode cache's shapes): a
    checkpoint that saved them reads back, and a resume does not count them as a model difference."""
    saved = json.loads(json.dumps(dict(run_config.build_run_config(default_config.get_config()).saved)))
    old = json.loads(json.dumps(saved))
    old["model"].update(decode_cache_len=200, decode_beams=4)
    assert run_config.run_config_from_saved(old) == run_config.run_config_from_saved(saved)
    assert integrity.model_differences(old, saved) == []


@pytest.mark.parametrize("section, field", [("train", "num_stepz"), ("data", "vocab_sise"),
                                            ("model", "rotary_dim")])
def test_a_saved_config_is_read_leniently(section, field):
    """A field the code no longer has is ignored, and a value a check added since would refuse (here a
    label smoothing of 1.5) does not lock the checkpoint out; a user's config file is still refused."""
    run = run_config.build_run_config(default_config.get_config())
    saved = json.loads(json.dumps(dict(run.saved)))
    saved[section][field] = 1
    saved["train"]["label_smoothing"] = 1.5
    again = run_config.run_config_from_saved(saved)
    assert again.model == run.model and again.data == run.data
    assert again.train.label_smoothing == 1.5
    with pytest.raises(ConfigError):
        run_config.build_run_config(saved, environment=False)


@pytest.mark.parametrize("field, value, named", [
    ("model.d_model", 130, r"d_model=130.*num_heads=4"),  # not divisible by 4 heads
    ("train.label_smoothing", 1.5, r"label_smoothing.*1\.5"),
    ("train.num_steps", 0, r"num_steps.*0"),
    ("log_every_steps", 0, r"log_every_steps.*0"),
    ("eval_every_steps", -1, r"eval_every_steps.*-1"),
    ("sharding.logical_axis_rules", (("batch", "dataa"),), "dataa"),
    # Issue 12 section 5: accepted before, failed late or never.
    ("train.learning_rate_scale", -1.0,
     r"config\.train\.learning_rate_scale=-1\.0: expected a finite number > 0"),
    ("train.learning_rate_scale", 0.0, r"config\.train\.learning_rate_scale=0\.0"),
    ("train.adam_b2", 1.0, r"config\.train\.adam_b2=1\.0: expected .*\[0, 1\)"),
    ("train.adam_eps", 0.0, r"config\.train\.adam_eps=0\.0"),
    ("train.max_grad_norm", -1.0, r"config\.train\.max_grad_norm=-1\.0"),
    ("train.cooldown_steps", 5000, r"config\.train\.cooldown_steps=5000: expected at most train\.num_steps"),
    ("train.loss_chunk_tokens", -1, r"config\.train\.loss_chunk_tokens=-1: expected an integer >= 0"),
    ("eval_bleu_examples", -3, r"config\.eval_bleu_examples=-3: expected an integer >= 0"),
    ("checkpoint_keep", 0, r"config\.checkpoint_keep=0: expected an integer >= 1"),
    ("checkpoint_every_minutes", -1.0, r"config\.checkpoint_every_minutes=-1\.0"),
    ("final_beam_size", 0, r"config\.final_beam_size=0: expected an integer >= 1"),
    ("final_alpha", -0.5, r"config\.final_alpha=-0\.5"),
    ("final_max_extra_len", -1, r"config\.final_max_extra_len=-1"),
    ("seed", -7, r"config\.seed=-7"),
    ("profile_num_steps", 0, r"config\.profile_num_steps=0"),
    ("dev_bleu_protocol", "bleu", r"config\.dev_bleu_protocol='bleu': expected one of 'sacrebleu'"),
    ("sharding.mesh_shape", (0, 1), r"config\.sharding\.mesh_shape=\(0, 1\)"),
    ("sharding.mesh_shape", (-1, -1), r"config\.sharding\.mesh_shape=\(-1, -1\)"),
    ("sharding.mesh_shape", (-1, 1, 1), r"config\.sharding\.mesh_shape=\(-1, 1, 1\)"),
    ("model.dropout_rate", 1.0, r"config\.model: dropout_rate"),
])
def test_bad_fields_are_named_before_anything_compiles(field, value, named):
    config = default_config.get_config()
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ConfigError, match=named) as info:
        run_config.build_run_config(config)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)
    assert "\n" not in str(info.value)  # one line on the terminal


def test_final_eval_split_names_the_field_and_lists_only_the_valid_splits():
    config = default_config.get_config()
    config.final_eval_split = "nonsense"
    with pytest.raises(ConfigError) as info:
        run_config.build_run_config(config)
    message = str(info.value)
    assert message.startswith("config.final_eval_split='nonsense': expected one of 'dev', 'test', ''")
    assert "train" not in message.split(";")[0]  # the train split is never a valid choice
    for split in ("dev", "test", ""):
        config.final_eval_split = split
        run_config.build_run_config(config)


@pytest.mark.parametrize("scheme", ["sinusoidal", "rotary", "alibi", "relative", "none"])
def test_only_a_learned_position_table_bounds_the_lengths(scheme):
    """model.max_len sizes the learned table alone: it must cover the buckets and the output allowance;
    every other scheme takes any length, so a max_len below the longest bucket is no error."""
    config = default_config.get_config()
    config.model.max_len = 100  # below 64 + final_max_extra_len = 114
    config.model.position_encoding = "learned"
    with pytest.raises(ConfigError, match=r"^config\.model\.max_len=100 \(the learned position table\) must "
                       r"be >= 114: .*final_max_extra_len"):
        run_config.build_run_config(config)
    config.model.max_len = 40
    with pytest.raises(ConfigError, match=r"max_len=40 \(the learned position table\) must cover the "
                       r"longest length bucket 64"):
        run_config.build_run_config(config)
    config.model.position_encoding = scheme
    assert run_config.build_run_config(config).model.position_limit is None


def test_decode_allowance_is_needed_only_when_training_decodes():
    config = default_config.get_config()
    config.model.position_encoding = "learned"
    config.model.max_len = 64 + config.final_max_extra_len  # exactly enough
    run_config.build_run_config(config)
    config.model.max_len = 100  # 64 + 50 does not fit ...
    config.final_eval_split, config.eval_bleu_examples = "", 0  # ... but nothing is decoded
    run_config.build_run_config(config)


def _text_config(tmp_path, missing: str):
    for prefix in ("train", "val", "test"):
        for lang in ("en", "de"):
            if f"{prefix}.{lang}" != missing:
                (tmp_path / f"{prefix}.{lang}").write_text("a b\nc d\n")
    config = default_config.get_config()
    config.data.source, config.data.dir = "text", str(tmp_path)
    return config


@pytest.mark.parametrize("missing, split", [("val.de", "dev"), ("train.en", "train"),
                                            ("test.de", "test")])
def test_a_missing_text_file_is_named_up_front(tmp_path, missing, split):
    config = _text_config(tmp_path, missing)
    with pytest.raises(MissingFileError, match=rf"{missing}: no such file.*the {split} split"):
        run_config.build_run_config(config)
    run_config.build_run_config(config, environment=False)  # fields alone are fine


def test_missing_test_file_is_fine_when_the_test_split_is_not_scored(tmp_path):
    config = _text_config(tmp_path, "test.de")
    config.final_eval_split = "dev"
    run_config.build_run_config(config)


def test_training_fails_on_a_missing_dev_file_before_training_a_tokenizer(tmp_path):
    config = _text_config(tmp_path, "val.de")
    workdir = tmp_path / "workdir"
    with pytest.raises(MissingFileError, match=r"val\.de"):
        loop.train_and_evaluate(run_config.build_run_config(config), str(workdir))
    assert not os.path.exists(workdir / "tokenizer")


def test_a_field_given_twice_takes_its_last_value_a_tuple_too():
    """ml_collections joins the repeats of a tuple field; the project's parsing keeps the last, as absl does
    for every other flag."""
    config, overrides = run_config.load_config("configs/default.py", [
        "--config.data.length_buckets=(32,64)", "--config.train.num_steps=5",
        "--config.data.length_buckets=(16,64)", "--config.train.num_steps=7"])
    assert config.data.length_buckets == (16, 64) and config.train.num_steps == 7
    assert overrides == {"data.length_buckets": (16, 64), "train.num_steps": 7}
