"""transformer_jax/inspect/heads.py: entropy and head statistics against a plain per-row loop."""

import math

import numpy as np

from transformer_jax.inspect import forward, heads


def test_entropy_by_hand():
    w = np.array([[0.665241, 0.244728, 0.090031], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(heads.entropy(w), [0.832396, 0.0, math.log(3)], atol=1e-5)


def test_head_statistics_match_a_per_row_loop_and_catch_a_planted_previous_token_head():
    rng = np.random.default_rng(3)
    batch, num_heads, length = 3, 5, 7
    tokens = np.array([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 8, 9, 10, 11], [5, 6, 0, 0, 0, 0, 0]])
    mask = forward.attention_mask("encoder_self", tokens, tokens)  # [B, 1, L, L]
    logits = rng.normal(size=(batch, num_heads, length, length)) * 2
    weights = np.where(mask, np.exp(logits), 0.0)
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-30)
    prev_head = np.zeros((length, length))
    prev_head[np.arange(1, length), np.arange(length - 1)] = 1.0
    prev_head[0, 0] = 1.0
    weights[:, 2] = np.where(mask[:, 0], prev_head, 0.0)  # head 2: always the previous position
    stats = heads.HeadStatistics("encoder_self", num_heads)
    stats.add(weights, mask)
    means = stats.means()
    for h in range(num_heads):  # a plain loop over real rows
        ent, prev, prev_n, nxt, nxt_n, mx, uni, n = 0.0, 0.0, 0, 0.0, 0, 0.0, 0.0, 0
        for b in range(batch):
            real = int((tokens[b] != 0).sum())
            for q in range(real):
                w = weights[b, h, q, :real]
                ent += -sum(x * math.log(x) for x in w if x > 0)
                mx += max(w)
                uni += math.log(real)
                n += 1
                if q >= 1:
                    prev, prev_n = prev + w[q - 1], prev_n + 1
                if q + 1 < real:
                    nxt, nxt_n = nxt + w[q + 1], nxt_n + 1
        np.testing.assert_allclose(means["entropy"][h], ent / n, rtol=1e-9)
        np.testing.assert_allclose(means["max_weight"][h], mx / n, rtol=1e-9)
        np.testing.assert_allclose(means["uniform_entropy"][h], uni / n, rtol=1e-9)
        np.testing.assert_allclose(means["prev"][h], prev / prev_n, rtol=1e-9)
        np.testing.assert_allclose(means["next"][h], nxt / nxt_n, rtol=1e-9)
    assert means["prev"][2] == 1.0 and means["entropy"][2] == 0.0 and means["next"][2] == 0.0
    assert means["rows"][0] == 5 + 7 + 2


def test_cross_attention_has_no_positional_shares_and_rows_come_in_kind_layer_head_order():
    mask = forward.attention_mask("cross", np.array([[4, 5, 0]]), np.array([[6, 1]]))  # [1, 1, 2, 3]
    weights = np.broadcast_to(np.array([0.25, 0.75, 0.0]), (1, 3, 2, 3))  # [B, H=3, T=2, S=3]
    cross = heads.HeadStatistics("cross", 3)
    cross.add(weights, mask)
    enc = heads.HeadStatistics("encoder_self", 3)
    enc.add(np.broadcast_to(np.eye(2), (1, 3, 2, 2)), np.ones((1, 1, 2, 2), bool))
    rows = heads.head_stats_rows({("cross", 0): cross, ("encoder_self", 1): enc})
    assert [(r["kind"], r["layer"], r["head"]) for r in rows] == (
        [("encoder_self", 1, h) for h in range(3)] + [("cross", 0, h) for h in range(3)])
    assert all(math.isnan(r[k]) for r in rows[3:] for k in ("prev", "self", "next"))
    np.testing.assert_allclose(rows[3]["max_weight"], 0.75, rtol=1e-12)
    np.testing.assert_allclose(rows[3]["uniform_entropy"], math.log(2), rtol=1e-12)
    assert rows[0]["self"] == 1.0 and rows[0]["prev"] == 0.0 and rows[0]["rows"] == 2
    assert "delta_nll" not in rows[0]
