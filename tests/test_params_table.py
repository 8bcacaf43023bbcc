"""Tests for transformer_jax.params_table: Table 3 parameter counts against the paper and by hand."""

import pytest

from transformer_jax import params_table
from transformer_jax.evaluation import paper
from transformer_jax.model.config import param_count

# The paper gives neither its exact vocabulary nor unrounded counts. Its base row implies a ~40.8k shared
# vocabulary and its big row ~35.9k (see params_table.implied_vocab_size), so every printed count must lie
# between our count at 35k and at 42k shared tokens, widened by the paper's rounding to millions (0.5M).
VOCAB_RANGE = (35_000, 42_000)
ROUNDING = 0.5e6


PRINTED = [r for r in paper.TABLE3 if r.params_millions is not None]


@pytest.mark.parametrize("row", PRINTED, ids=lambda r: r.name)
def test_counts_match_the_papers_rounded_millions(row):
    low, high = (param_count(params_table.row_model_config(row, v)) for v in VOCAB_RANGE)
    assert low - ROUNDING <= row.params_millions * 1e6 <= high + ROUNDING, (low, high)


def _by_hand(d, d_ff, h, d_k, d_v, n, vocab):
    attention = d * h * d_k * 2 + d * h * d_v * 2  # W^Q, W^K [d, h, d_k]; W^V [d, h, d_v]; W^O [h, d_v, d]
    ffn = d * d_ff + d_ff + d_ff * d + d  # two dense layers with biases
    encoder_layer = attention + ffn + 2 * 2 * d  # two LayerNorms (scale and bias)
    decoder_layer = 2 * attention + ffn + 3 * 2 * d
    return n * (encoder_layer + decoder_layer) + vocab * d  # one embedding shared three ways


@pytest.mark.parametrize("name, expected", [
    ("base", 63_045_632),  # 6 x (3,150,336 + 4,199,936) + 37,000 x 512
    ("B-dk16", 55_967_744),  # 6 x (2,757,120 + 3,413,504) + 18,944,000: d_k=16 shrinks W^Q and W^K
    ("C-layers2", 33_644_544),  # 2 x 7,350,272 + 18,944,000
    ("big", 214_171_648),  # 6 x (12,592,128 + 16,788,480) + 37,000 x 1024
])
def test_counts_by_hand(name, expected):
    fields = {"base": (512, 2048, 8, 64, 64, 6), "B-dk16": (512, 2048, 8, 16, 64, 6),
              "C-layers2": (512, 2048, 8, 64, 64, 2), "big": (1024, 4096, 16, 64, 64, 6)}[name]
    assert _by_hand(*fields, vocab=37_000) == expected
    row = paper.TABLE3_BY_NAME[name]
    assert param_count(params_table.row_model_config(row, 37_000)) == expected


def test_table_has_every_row_and_its_numbers():
    table = params_table.parameter_table(37_000)
    cells = {}
    for line in table.splitlines():
        parts = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and parts[0] in paper.TABLE3_BY_NAME:
            cells[parts[0]] = parts
    assert list(cells) == [r.name for r in paper.TABLE3]
    assert cells["base"][2:] == ["63,045,632", "63.0", "65"]
    assert cells["big"][2:] == ["214,171,648", "214.2", "213"]
    assert cells["A-heads1"][4] == "-"  # the paper leaves the cell blank


def test_implied_vocabulary_of_the_base_row():
    # 65M - 6 x 7,350,272 (layers) = 20,898,368 = 512 x 40,817.1
    assert params_table.implied_vocab_size(paper.TABLE3_BY_NAME["base"]) == pytest.approx(40_817.1, abs=0.1)


def test_the_rows_beyond_the_paper_count_the_relative_tables():
    """E+ rows follow row E, marked beyond the paper; relative positions add a^K and a^V, (2k+1) x 64 each,
    in each of the 12 self-attention layers: 12 x 33 x 128 = 50,688; the other schemes add nothing."""
    table = params_table.parameter_table(37_000)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| E")]
    assert [r[0] for r in rows] == ["E-learned-pos", *(r.name for r in paper.TABLE3_BEYOND)]
    cells = {r[0]: r for r in rows}
    assert cells["E+-relative-pos"][1:] == ["position_encoding=relative", "63,096,320", "63.1",
                                            "beyond the paper"]
    for name in ("E+-rotary-pos", "E+-alibi-pos", "E+-no-pos"):
        assert cells[name][2:] == ["63,045,632", "63.0", "beyond the paper"]  # the base row's count
    assert "(50,688 at the base row, k=16)" in table
    assert 63_096_320 - 63_045_632 == 12 * 33 * 128
