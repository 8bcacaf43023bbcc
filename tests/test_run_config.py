"""Tests for run_config.py: a whole run config is checked up front, and config.model builds the model."""

import pytest

from configs import default as default_config
from transformer_jax import run_config


def test_model_config_from_takes_every_field_of_config_model():
    config = default_config.get_config()
    config.model.attention_block_size = 48
    config.model.d_k = 11
    config.model.norm_style = "pre"
    model_config = run_config.model_config_from(config, vocab_size=37)
    assert (model_config.vocab_size, model_config.attention_block_size, model_config.d_k,
            model_config.norm_style) == (37, 48, 11, "pre")
    assert model_config.d_v == config.model.d_model // config.model.num_heads  # unset: derived


def test_default_config_is_valid():
    run_config.validate_config(default_config.get_config())


@pytest.mark.parametrize("field, value, named", [
    ("model.d_model", 130, r"d_model=130.*num_heads=4"),  # not divisible by 4 heads
    ("model.max_len", 40, r"max_len=40.*64"),  # shorter than the longest length bucket
    ("train.label_smoothing", 1.5, r"label_smoothing.*1\.5"),
    ("train.num_steps", 0, r"num_steps.*0"),
    ("log_every_steps", 0, r"log_every_steps.*0"),
    ("eval_every_steps", -1, r"eval_every_steps.*-1"),
    ("sharding.logical_axis_rules", (("batch", "dataa"),), "dataa"),
])
def test_bad_fields_are_named_before_anything_compiles(field, value, named):
    config = default_config.get_config()
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ValueError, match=named):
        run_config.validate_config(config)
