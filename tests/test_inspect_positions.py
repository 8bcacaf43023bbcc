"""transformer_jax/inspect/positions.py: PE(pos + k) = M_k PE(pos), checked and broken on purpose."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
from tiny import random_params

from transformer_jax.inspect import positions, run_all
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.positions import sinusoidal_table


def test_pe_linear_offset_check_passes_on_the_real_table_and_fails_when_corrupted():
    table = sinusoidal_table(97, 26)
    for k in (1, 2, 5, 31, 95):
        assert positions.pe_linear_offset_error(table, k) < 1e-6, k
        analytic = positions.pe_rotation(26, k)  # the paper's rotation, built from the formula
        np.testing.assert_allclose(table[:-k].astype(np.float64) @ analytic.T, table[k:], atol=1e-6)
    spike = table.copy()
    spike[40, 7] += 1e-3  # one entry off
    assert positions.pe_linear_offset_error(spike, 3) > 1e-4
    shuffled = table.copy()
    shuffled[:, [2, 5]] = shuffled[:, [5, 2]]  # a sin column moved into another frequency's pair
    assert positions.pe_linear_offset_error(shuffled, 1) > 1e-2
    noisy_positions = table + 1e-3 * np.random.default_rng(0).standard_normal(table.shape)
    assert positions.pe_linear_offset_error(noisy_positions, 10) > 1e-3
    with pytest.raises(ValueError, match="even d_model"):
        positions.pe_linear_offset_error(table[:, :25], 1)
    with pytest.raises(ValueError, match="offset k must be in"):
        positions.pe_linear_offset_error(table, 96)


def test_positions_report_rows_and_cosine():
    report = positions.positions_report(13, 6, offsets=(1, 4, 11))
    assert [r["k"] for r in report["rows"]] == [1, 4, 11]
    assert all(r["fit_error"] < 1e-6 and r["analytic_error"] < 1e-6 for r in report["rows"])
    cos = report["cosine"]
    assert cos.shape == (13, 13)
    np.testing.assert_allclose(np.diag(cos), 1.0, atol=1e-12)
    np.testing.assert_allclose(cos, cos.T, atol=1e-12)
    t = report["table"].astype(np.float64)
    np.testing.assert_allclose(cos[2, 7], t[2] @ t[7] / np.linalg.norm(t[2]) / np.linalg.norm(t[7]),
                               rtol=1e-12)


def _params_with_tables(tables: dict) -> dict:
    return {side: {"positions": {"position_embedding": table}} for side, table in tables.items()}


def test_the_section_analyses_the_positions_the_model_has():
    """A learned model's report is of its own tables (the sinusoid's ~1e-7 would describe a table it does
    not have); a position scheme the section does not know is reported as not applying."""
    sinusoid = ModelConfig(vocab_size=9, d_model=6, num_heads=2, max_len=13)
    report = positions.model_positions_report(sinusoid, params={})
    assert report["kind"] == "sinusoidal" and max(r["fit_error"] for r in report["rows"]) < 1e-6
    np.testing.assert_array_equal(report["table"], sinusoidal_table(13, 6))

    learned = dataclasses.replace(sinusoid, position_encoding="learned")
    rng = np.random.default_rng(0)
    tables = {"encoder": rng.standard_normal((13, 6)), "decoder": rng.standard_normal((13, 6))}
    report = positions.model_positions_report(learned, _params_with_tables(tables))
    assert report["kind"] == "learned"
    np.testing.assert_array_equal(report["table"], tables["encoder"])
    assert [r["k"] for r in report["rows"]] == list(range(1, 12))
    assert all("analytic_error" not in r for r in report["rows"])  # no formula to compare with
    assert report["rows"][0]["fit_error"] == positions.pe_linear_offset_error(tables["encoder"], 1) > 0.1
    assert report["rows"][3]["decoder_fit_error"] == positions.pe_linear_offset_error(tables["decoder"], 4)
    t = tables["encoder"]
    cosine = t[2] @ t[7] / np.linalg.norm(t[2]) / np.linalg.norm(t[7])
    np.testing.assert_allclose(report["cosine"][2, 7], cosine, rtol=1e-12)

    assert positions.model_positions_report(dataclasses.replace(sinusoid, position_encoding="none"),
                                            params={}) is None


def test_the_summary_says_what_was_analysed(tmp_path):
    learned = ModelConfig(vocab_size=9, d_model=6, num_heads=2, max_len=13, position_encoding="learned")
    tables = {side: np.random.default_rng(1).standard_normal((13, 6)) for side in ("encoder", "decoder")}
    section, files = run_all.positions_section(learned, _params_with_tables(tables), str(tmp_path))
    lines = "\n".join(run_all.positions_lines(section, learned))
    assert "learned" in lines and "sinusoid" not in lines.replace("a sinusoidal table", ""), lines
    assert f"{section['max_fit_error']:.2e}" in lines and os.path.exists(files["positions_png"])
    none = dataclasses.replace(learned, position_encoding="none")
    section, files = run_all.positions_section(none, {}, str(tmp_path / "r"))
    (line,) = run_all.positions_lines(section, none)[3:]
    assert files == {} and "no position information; the section does not apply" in line


def _tiny(scheme: str, **fields) -> tuple[ModelConfig, dict]:
    """A tiny model of ``scheme`` (distinct layer counts) and its random parameters."""
    fields = {"d_model": 12, "num_heads": 3, **fields}
    cfg = ModelConfig(vocab_size=9, d_ff=7, num_encoder_layers=2, num_decoder_layers=1, max_len=13,
                      position_encoding=scheme, max_relative_position=3, **fields)
    return cfg, random_params(cfg, seed=2)


def _section(cfg, params, out_dir) -> tuple[dict, dict, str]:
    """run_all.positions_section and its summary lines; the results must be JSON as run_all writes it."""
    section, files = run_all.positions_section(cfg, params, str(out_dir))
    assert all(os.path.exists(path) for path in files.values()) and "positions_png" in files
    json.dumps(section, default=float)
    return section, files, "\n".join(run_all.positions_lines(section, cfg))


def test_rotary_spectrum_and_the_logit_of_a_fixed_pair_by_offset(tmp_path):
    """Rates 10000^(-2i/d_k), wavelengths 2 pi / rate; q = k = ones gives the mean of cos(offset * rate)
    (by hand), and the logit depends on the offset alone."""
    report = positions.rotary_report(10, num_offsets=40)
    rates = 10000.0 ** (-np.arange(0, 10, 2) / 10)
    np.testing.assert_allclose([p["rate"] for p in report["pairs"]], rates, rtol=1e-6)
    np.testing.assert_allclose([p["wavelength"] for p in report["pairs"]], 2 * np.pi / rates, rtol=1e-6)
    assert report["pairs"][1]["dims"] == "1,6"  # the halves layout
    offsets = np.arange(40)
    expected = np.cos(offsets[:, None] * rates[None, :]).mean(axis=1)
    np.testing.assert_allclose([r["logit_ones"] for r in report["rows"]], expected, atol=2e-6)
    assert report["rows"][0]["logit_random"] == pytest.approx(1.0, abs=1e-6)
    assert report["shift_error"] < 1e-4
    with pytest.raises(ValueError, match="even d_k"):
        positions.rotary_report(7)

    cfg, params = _tiny("rotary")
    section, files, lines = _section(cfg, params, tmp_path)
    assert section["position_encoding"] == "rotary" and section["d_k"] == 4
    assert section["min_wavelength"] == pytest.approx(2 * math.pi, rel=1e-6)
    assert section["max_wavelength"] == pytest.approx(2 * math.pi * 100, rel=1e-5)  # 10000^(2/4)
    assert "2 dimension pairs (i, i + 2)" in lines and "1 of the 2 pairs turn less than once" in lines
    assert f"1: {section['logits'][1]['ones']:.3f}" in lines and "does not apply" not in lines
    assert os.path.basename(files["positions_csv"]) == "positions_rotary_offsets.csv"


@pytest.mark.parametrize("num_heads, slopes", [(4, [2**-2, 2**-4, 2**-6, 2**-8]),
                                               (3, [2**-4, 2**-8, 2**-2])])
def test_alibi_slopes_and_the_bias_per_head(tmp_path, num_heads, slopes):
    """2^(-8h/H) for a power of two; otherwise the nearest smaller power's, then every other of twice it.
    The bias at each offset comes from the model's own SelfAttentionPositions: -m_h * offset."""
    cfg, params = _tiny("alibi", num_heads=num_heads, d_model=4 * num_heads)
    report = positions.alibi_report(cfg, offsets=(1, 5, 64))
    np.testing.assert_allclose([r["slope"] for r in report["rows"]], slopes, rtol=1e-12)
    for r, m in zip(report["rows"], slopes, strict=True):
        np.testing.assert_allclose([r["bias_1"], r["bias_5"], r["bias_64"]], [-m, -5 * m, -64 * m], rtol=1e-6)
        assert r["reach"] == pytest.approx(1 / m)
    section, files, lines = _section(cfg, params, tmp_path)
    assert [h["slope"] for h in section["heads"]] == pytest.approx(slopes)
    assert f"h0 m={slopes[0]:.4g} ({-slopes[0]:.3g} at 1, {-16 * slopes[0]:.3g} at 16" in lines
    assert "nothing in encoder-decoder attention" in lines
    assert os.path.basename(files["positions_csv"]) == "positions_alibi.csv"


def test_relative_tables_norms_by_distance_and_cosine_across_distances(tmp_path):
    cfg, params = _tiny("relative")
    report = positions.relative_report(cfg, params)
    assert [(la["stack"], la["layer"]) for la in report["layers"]] == [
        ("encoder", 0), ("encoder", 1), ("decoder", 0)]
    assert len(report["rows"]) == 3 * 7 and [r["distance"] for r in report["rows"][:7]] == list(range(-3, 4))
    tables = params["encoder"]["layer_1"]["self_attention"]["positions"]
    key, value = tables["relative_key"].astype(np.float64), tables["relative_value"].astype(np.float64)
    row = next(r for r in report["rows"] if (r["stack"], r["layer"], r["distance"]) == ("encoder", 1, -2))
    assert row["key_norm"] == pytest.approx(np.linalg.norm(key[1])) and row["value_norm"] == pytest.approx(
        np.linalg.norm(value[1]))  # row d + k for distance d
    layer = report["layers"][1]
    cosine = key[0] @ key[6] / np.linalg.norm(key[0]) / np.linalg.norm(key[6])
    assert layer["key_ends_cosine"] == pytest.approx(cosine)
    neighbours = np.mean([key[i] @ key[i + 1] / np.linalg.norm(key[i]) / np.linalg.norm(key[i + 1])
                          for i in range(6)])
    assert layer["key_neighbour_cosine"] == pytest.approx(neighbours)
    np.testing.assert_allclose(np.diag(layer["value_cosine"]), 1.0, atol=1e-12)
    assert layer["key_norm_clip"] == pytest.approx(np.linalg.norm(key[0]))  # distance -k
    section, files, lines = _section(cfg, params, tmp_path)
    assert len(section["layers"]) == 3 and "key_cosine" not in section["layers"][0]
    assert "distances -3..3 (clipped; the causal decoder reads only distances <= 0" in lines
    assert "decoder L0" in lines
    assert f"|a^K| {report['layers'][0]['key_norm_0']:.3f}" in lines
    assert os.path.basename(files["positions_csv"]) == "positions_relative.csv"
