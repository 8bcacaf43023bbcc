"""transformer_jax/inspect/positions.py: PE(pos + k) = M_k PE(pos), checked and broken on purpose."""

import dataclasses
import os
import types

import numpy as np
import pytest

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

    rotary = types.SimpleNamespace(position_encoding="rotary", max_len=13, d_model=6)
    assert positions.model_positions_report(rotary, params={}) is None


def test_the_summary_says_what_was_analysed(tmp_path):
    learned = ModelConfig(vocab_size=9, d_model=6, num_heads=2, max_len=13, position_encoding="learned")
    tables = {side: np.random.default_rng(1).standard_normal((13, 6)) for side in ("encoder", "decoder")}
    section, files = run_all.positions_section(learned, _params_with_tables(tables), str(tmp_path))
    lines = "\n".join(run_all.positions_lines(section, learned))
    assert "learned" in lines and "sinusoid" not in lines.replace("a sinusoidal table", ""), lines
    assert f"{section['max_fit_error']:.2e}" in lines and os.path.exists(files["positions_png"])
    rotary = types.SimpleNamespace(position_encoding="rotary", max_len=13, d_model=6)
    section, files = run_all.positions_section(rotary, {}, str(tmp_path / "r"))
    assert files == {} and "does not apply" in "\n".join(run_all.positions_lines(section, rotary))
