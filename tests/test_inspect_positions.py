"""transformer_jax/inspect/positions.py: PE(pos + k) = M_k PE(pos), checked and broken on purpose."""

import numpy as np
import pytest

from transformer_jax.inspect import positions
from transformer_jax.model.transformer import sinusoidal_table


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
