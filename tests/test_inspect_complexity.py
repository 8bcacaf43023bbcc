"""transformer_jax/inspect/complexity.py: the cost-model fit and the slope on planted numbers."""

import numpy as np

from transformer_jax.inspect import complexity


def test_fit_cost_model_recovers_planted_coefficients():
    rows = [{"n": n, "d_model": d, "flops_xla": 4.25 * n * n * d + 7.5 * n * d * d}
            for n, d in ((16, 18), (48, 18), (112, 18), (16, 30), (256, 30))]
    a, b, residual = complexity.fit_cost_model(rows)
    np.testing.assert_allclose([a, b], [4.25, 7.5], rtol=1e-9)
    assert residual < 1e-9
    rows[2]["flops_xla"] *= 1.1  # one point off by 10%: the residual shows it
    assert complexity.fit_cost_model(rows)[2] > 0.01


def test_loglog_slope_and_summary_line():
    n = [16, 32, 64, 128]
    np.testing.assert_allclose(complexity.loglog_slope(n, [3.0 * x**2 for x in n]), 2.0, rtol=1e-9)
    rows = [{"impl": "dense", "n": x, "d_model": 8, "flops_xla": 4.0 * x * x * 8 + 8.0 * x * 64,
             "flops_attention": 4.0 * x * x * 8, "flops_projections": 8.0 * x * 64, "seconds": 1e-6 * x**2}
            for x in n]
    line = complexity.summary_line("dense", rows)
    assert "n=16..128: FLOPs" in line and "time 2.00" in line
    assert "4.00 n^2 d + 8.00 n d^2" in line
