"""Every config file loads through config_flags as train.py does; config.model is ModelConfig's fields."""

import glob
import os

import pytest
from absl import flags
from ml_collections import config_flags

from transformer_jax.model.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                      if not p.endswith("__init__.py"))
# A value for every settable ModelConfig field that differs from every config's own and is valid on a
# d_model=256, num_heads=8 model (set alongside, below).
NEW_VALUES = {
    "d_model": 256, "d_ff": 96, "num_heads": 8, "d_k": 16, "d_v": 24, "num_encoder_layers": 7,
    "num_decoder_layers": 5, "dropout_rate": 0.25, "attention_dropout_rate": 0.05, "max_len": 300,
    "position_encoding": "learned", "norm_style": "pre", "attention_impl": "blockwise",
    "attention_init": "matrix", "attention_block_size": 48, "dtype": "bfloat16", "max_relative_position": 7,
    "ffn_activation": "swish",
    "attention_witness": True,  # last: the test below sets it apart
}


def load(config_arg: str, *overrides: str):
    """A config as train.py loads it: config_flags, locked, with command-line overrides."""
    argv = ["train.py", f"--config={config_arg}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True,
                                    sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def test_new_values_cover_every_settable_field():
    assert set(NEW_VALUES) == set(ModelConfig.settable_defaults())


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_model_holds_exactly_the_model_config_fields(path):
    config = load(path)
    assert set(config.model.keys()) == set(ModelConfig.settable_defaults())
    model_config = ModelConfig(vocab_size=config.data.vocab_size, **config.model)
    head_size = config.model.d_model // config.model.num_heads
    for name, value in config.model.items():  # every value reaches the model; None head sizes resolve
        expected = head_size if value is None and name in ("d_k", "d_v") else value
        assert getattr(model_config, name) == expected, name


def test_every_model_config_field_can_be_set_from_the_command_line():
    path = os.path.join(ROOT, "configs", "default.py")
    overrides = [f"--config.model.{name}={value}" for name, value in NEW_VALUES.items()]
    # Blockwise attention forms no weights, so the witness and attention dropout are checked separately.
    config = load(path, *overrides[:-1])
    config.model.attention_witness = False
    config.model.attention_dropout_rate = 0.0
    built = ModelConfig(vocab_size=11, **config.model)
    for name, value in NEW_VALUES.items():
        if name not in ("attention_witness", "attention_dropout_rate"):
            assert getattr(built, name) == value, name
    assert load(path, "--config.model.attention_witness=True").model.attention_witness is True


def test_a_misspelt_model_field_fails():
    with pytest.raises(Exception, match="d_modle"):
        load(os.path.join(ROOT, "configs", "default.py"), "--config.model.d_modle=3")


def test_paper_base_model_is_model_config_defaults():
    config = load(os.path.join(ROOT, "configs", "wmt14_en_de_base.py"))
    base = ModelConfig(vocab_size=37000, **config.model)
    assert (base.d_model, base.d_ff, base.num_heads, base.d_k, base.d_v) == (512, 2048, 8, 64, 64)
    assert (base.num_encoder_layers, base.num_decoder_layers, base.dropout_rate) == (6, 6, 0.1)
