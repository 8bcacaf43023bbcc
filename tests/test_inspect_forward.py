"""transformer_jax/inspect/forward.py: masks, sentence encoding, pieces."""

import types

import numpy as np
import pytest

from transformer_jax.inspect import forward
from transformer_jax.model.special_ids import EOS_ID


def test_attention_masks_by_hand():
    inputs = np.array([[5, 6, 0], [7, 0, 0]])  # [B=2, S=3]
    targets = np.array([[8, 9, 1, 0, 0], [4, 1, 0, 0, 0]])  # [B=2, T=5]
    enc = forward.attention_mask("encoder_self", inputs, targets)
    assert enc.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(enc[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(enc[1, 0], [[1, 0, 0], [0, 0, 0], [0, 0, 0]])
    cross = forward.attention_mask("cross", inputs, targets)
    assert cross.shape == (2, 1, 5, 3)
    np.testing.assert_array_equal(cross[1, 0], [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    dec = forward.attention_mask("decoder_self", inputs, targets)
    assert dec.shape == (2, 1, 5, 5)
    np.testing.assert_array_equal(dec[0, 0], [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                              [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="kind must be one of"):
        forward.attention_mask("self", inputs, targets)


def test_encode_sentence_appends_eos_and_rejects_an_empty_sentence():
    class Pieces:  # a stand-in tokenizer: one id per word
        def encode_text(self, texts, *, side):
            assert side == "source"
            return [[10 + len(w) for w in text.split(" ")] for text in texts]

    np.testing.assert_array_equal(forward.encode_sentence(Pieces(), "  ab\tcde  "), [[12, 13, EOS_ID]])
    with pytest.raises(ValueError, match="--sentence is empty"):
        forward.encode_sentence(Pieces(), " \t ")


def test_pieces_name_the_special_ids():
    class Tok:
        def id_to_piece(self, i):
            return f"p{i}"

    assert forward.pieces(Tok(), [0, 1, 3, 7]) == ["<pad>", "</s>", "<s>", "p7"]
    cfg = types.SimpleNamespace(num_encoder_layers=5, num_decoder_layers=3)
    assert [forward.num_layers(cfg, kind) for kind in forward.KINDS] == [5, 3, 3]
