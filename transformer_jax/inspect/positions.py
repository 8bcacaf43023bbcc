"""The positions section: each position scheme's own mechanism, analysed on the model that has it.

* sinusoidal (section 3.5): PE(pos + k) is one fixed linear map M_k of PE(pos), for every pos.
  ``pe_linear_offset_error`` fits M_k (one 2x2 block per (sin, cos) column pair) from the table itself, so
  it tests the property the paper relies on, not the formula; ``pe_rotation`` builds the analytic rotation.
* learned (Table 3 row E): the model's own tables, measured by the same fit.
* rotary: its frequency spectrum (``rotary_report``): each dimension pair's rotation rate and wavelength in
  tokens, and the logit between a fixed query/key pair as the offset between them grows, computed with the
  model's own rotation (it depends on the offset only; the report checks that too).
* alibi: the head slopes and the bias at a few offsets per head (``alibi_report``), from the model's own
  ``SelfAttentionPositions``.
* relative (Shaw et al. 2018): the learned tables a^K and a^V of every layer (``relative_report``): the norm
  of each distance's row, and the cosine similarity of the rows across distances.
* none: no position information; the section does not apply (``model_positions_report`` returns None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer_jax.inspect import artifacts
from transformer_jax.model import positions as model_positions
from transformer_jax.model.positions import sinusoidal_table

# Offsets 0..ROTARY_OFFSETS-1 of the rotary logit-by-offset curve; the offsets of the ALiBi bias table.
ROTARY_OFFSETS = 256
ALIBI_OFFSETS = (1, 2, 4, 8, 16, 64, 256)
# The summary's rotary logits are shown at these offsets (those below ROTARY_OFFSETS).
SHOWN_OFFSETS = (1, 4, 16, 64, 255)


def _check_table(table: np.ndarray) -> np.ndarray:
    table = np.asarray(table, np.float64)
    if table.ndim != 2 or table.shape[1] % 2:
        raise ValueError(f"expected a [max_len, d_model] table with even d_model, got shape {table.shape}")
    return table


def pe_rotation(d_model: int, k: int) -> np.ndarray:
    """float64[d_model, d_model]: the block-diagonal M_k with PE(pos + k) = M_k PE(pos) for every pos.

    Block i acts on (sin(w_i pos), cos(w_i pos)) with w_i = 10000^(-2i/d_model) as the rotation
    [[cos(w_i k), sin(w_i k)], [-sin(w_i k), cos(w_i k)]] (the angle-addition formulas).
    """
    rates = 1.0 / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    c, s = np.cos(rates * k), np.sin(rates * k)
    m = np.zeros((d_model, d_model))
    m[0::2, 0::2] = np.diag(c)
    m[0::2, 1::2] = np.diag(s)
    m[1::2, 0::2] = np.diag(-s)
    m[1::2, 1::2] = np.diag(c)
    return m


def fit_offset_map(table: np.ndarray, k: int) -> np.ndarray:
    """float64[d/2, 2, 2]: per (sin, cos) column pair, the least-squares 2x2 map from PE(pos) to PE(pos+k).

    Args:
      table: float[max_len, d_model], even d_model. k: the offset, 1 <= k <= max_len - 2.
    """
    table = _check_table(table)
    if not 1 <= k <= table.shape[0] - 2:
        raise ValueError(f"offset k must be in [1, max_len - 2] = [1, {table.shape[0] - 2}], got {k}")
    blocks = table.reshape(table.shape[0], -1, 2).transpose(1, 0, 2)  # [d/2, L, 2]
    x, y = blocks[:, :-k], blocks[:, k:]  # [d/2, L-k, 2]
    return np.swapaxes(np.linalg.pinv(x) @ y, 1, 2)  # y = x M^T  =>  M = (pinv(x) y)^T, [d/2, 2, 2]


def pe_linear_offset_error(table: np.ndarray, k: int) -> float:
    """max over pos and dims of |PE(pos + k) - M_k PE(pos)| for the best block-diagonal M_k.

    M_k is fitted (least squares, one 2x2 block per (sin, cos) column pair) from the table itself, so the
    check tests the property the paper relies on, not the formula: with a genuine sinusoidal table the
    error is float32 rounding (~1e-7); any table where one offset is not one linear map fails.

    Args:
      table: float[max_len, d_model], even d_model, columns interleaved as (sin, cos) pairs.
      k: the offset, 1 <= k <= max_len - 2.
    """
    table = _check_table(table)
    m = fit_offset_map(table, k)  # [d/2, 2, 2]
    blocks = table.reshape(table.shape[0], -1, 2)  # [L, d/2, 2]
    predicted = np.einsum("nij,lnj->lni", m, blocks[:-k])  # [L-k, d/2, 2]
    return float(np.max(np.abs(blocks[k:] - predicted)))


def position_cosine_similarity(table: np.ndarray) -> np.ndarray:
    """float64[max_len, max_len]: cosine similarity of every pair of rows of a float[max_len, d] table."""
    t = np.asarray(table, np.float64)
    t = t / np.linalg.norm(t, axis=1, keepdims=True)
    return t @ t.T


def positions_report(max_len: int, d_model: int, offsets: Sequence[int] | None = None) -> dict[str, Any]:
    """The linear-offset check for every offset (default 1..max_len-2), against the fitted and analytic M_k.

    Returns:
      {"table": float32[max_len, d_model], "rows": [{"k", "fit_error", "analytic_error",
      "fit_vs_analytic"}], "cosine": float64[max_len, max_len]}.
    """
    table = sinusoidal_table(max_len, d_model)
    offsets = list(range(1, max_len - 1)) if offsets is None else list(offsets)
    rows = []
    for k in offsets:
        analytic = pe_rotation(d_model, k)
        fitted = fit_offset_map(table, k)
        analytic_blocks = np.stack([analytic[2 * i:2 * i + 2, 2 * i:2 * i + 2] for i in range(d_model // 2)])
        rows.append({"k": k, "fit_error": pe_linear_offset_error(table, k),
                     "analytic_error": float(np.max(np.abs(
                         table[k:].astype(np.float64) - table[:-k].astype(np.float64) @ analytic.T))),
                     "fit_vs_analytic": float(np.max(np.abs(fitted - analytic_blocks)))})
    return {"table": table, "rows": rows, "cosine": position_cosine_similarity(table)}


def learned_positions_report(tables: dict[str, np.ndarray], offsets: Sequence[int] | None = None
                             ) -> dict[str, Any]:
    """The fitted linear-offset check on a model's learned position tables (no formula to compare with).

    Args:
      tables: {"encoder": float[max_len, d_model], "decoder": ...}, even d_model.

    Returns:
      {"kind": "learned", "table": the encoder's table, "rows": [{"k", "fit_error" (encoder),
      "decoder_fit_error"}], "cosine": of the encoder's table}.
    """
    encoder = np.asarray(tables["encoder"])
    offsets = list(range(1, encoder.shape[0] - 1)) if offsets is None else list(offsets)
    rows = [{"k": k, "fit_error": pe_linear_offset_error(encoder, k),
             **{f"{side}_fit_error": pe_linear_offset_error(np.asarray(table), k)
                for side, table in tables.items() if side != "encoder"}} for k in offsets]
    return {"kind": "learned", "table": encoder, "rows": rows, "cosine": position_cosine_similarity(encoder)}


def rotary_report(d_k: int, num_offsets: int = ROTARY_OFFSETS, *, shift: int = 37, seed: int = 0
                  ) -> dict[str, Any]:
    """The rotary spectrum of queries and keys of size ``d_k`` (``model.positions.rotate``, the halves
    layout: dimension i is paired with i + d_k/2).

    Returns:
      {"kind": "rotary", "d_k", "pairs": [{"pair", "dims", "rate" (radians per token), "wavelength"
      (tokens for one turn)}], "rows": [{"offset", "logit_ones", "logit_random"}] for offsets
      0..num_offsets-1, "shift", "shift_error"}. ``logit_ones`` is q.k with q = k = ones / sqrt(d_k) (the
      long-term decay of Su et al., section 3.4.3: the mean of cos(offset * rate) over the pairs),
      ``logit_random`` the same for one random unit vector q = k; both are 1 at offset 0. The query sits
      at position 0 and the key at the offset; ``shift_error`` is the largest change of either curve when
      both move ``shift`` positions on (zero up to rounding: the logit depends on the offset alone).
    """
    if d_k % 2:
        raise ValueError(f"rotary positions need an even d_k, got {d_k}")
    rates = np.asarray(model_positions.rotary_angles(jnp.ones((1,), jnp.int32), d_k), np.float64)[0]
    pairs = [{"pair": i, "dims": f"{i},{i + d_k // 2}", "rate": float(rate),
              "wavelength": float(2 * np.pi / rate)} for i, rate in enumerate(rates)]
    random = np.random.default_rng(seed).standard_normal(d_k)
    vectors = np.stack([np.ones(d_k) / np.sqrt(d_k), random / np.linalg.norm(random)])  # [2, d_k]

    def logits(start: int) -> np.ndarray:  # [2, offsets]: query at ``start``, keys at start + offset
        x = jnp.asarray(vectors[:, None, None, :], jnp.float32)  # [2, 1, 1, d_k]
        query = model_positions.rotate(x, jnp.asarray([start], jnp.int32))[:, 0, 0]  # [2, d_k]
        keys = model_positions.rotate(jnp.broadcast_to(x, (2, num_offsets, 1, d_k)),
                                      start + jnp.arange(num_offsets, dtype=jnp.int32))[:, :, 0]
        return np.einsum("vd,vod->vo", np.asarray(query, np.float64), np.asarray(keys, np.float64))

    at_zero, shifted = logits(0), logits(shift)
    rows = [{"offset": o, "logit_ones": float(at_zero[0, o]), "logit_random": float(at_zero[1, o])}
            for o in range(num_offsets)]
    return {"kind": "rotary", "d_k": d_k, "pairs": pairs, "rows": rows, "shift": shift,
            "shift_error": float(np.max(np.abs(at_zero - shifted)))}


def alibi_report(cfg: Any, offsets: Sequence[int] = ALIBI_OFFSETS) -> dict[str, Any]:
    """ALiBi's head slopes m_h and the bias -m_h |offset| at ``offsets``, from the model's own
    ``SelfAttentionPositions.logit_bias`` (a query at position 0, keys at the offsets).

    Returns:
      {"kind": "alibi", "num_heads", "offsets", "rows": [{"head", "slope", "reach" (1 / m_h: the offset
      whose bias is -1), "bias_<offset>" for each offset}]}.
    """
    offsets = [int(o) for o in offsets]
    query = jnp.zeros((1, 1, cfg.num_heads, cfg.d_k), jnp.float32)
    bias = model_positions.SelfAttentionPositions(cfg).apply(
        {}, query, jnp.zeros((1,), jnp.int32), jnp.asarray(offsets, jnp.int32),
        method=model_positions.SelfAttentionPositions.logit_bias)
    bias = np.asarray(bias, np.float64)[0, :, 0]  # [H, offsets]
    slopes = model_positions.alibi_slopes(cfg.num_heads)
    rows = [{"head": h, "slope": float(slopes[h]), "reach": float(1 / slopes[h]),
             **{f"bias_{o}": float(bias[h, i]) for i, o in enumerate(offsets)}} for h in range(cfg.num_heads)]
    return {"kind": "alibi", "num_heads": cfg.num_heads, "offsets": offsets, "rows": rows}


def relative_report(cfg: Any, params: Any) -> dict[str, Any]:
    """The learned relative tables of every self-attention (``<stack>/layer_i/self_attention/positions``):
    a^K [2k+1, d_k] and a^V [2k+1, d_v], row d + k for the distance d = j - i, k = max_relative_position.
    The decoder's causal self-attention reads only d <= 0: its rows for d > 0 keep their initial values.

    Returns:
      {"kind": "relative", "k", "rows": [{"stack", "layer", "distance", "key_norm", "value_norm"}],
      "layers": [{"stack", "layer", "key_cosine", "value_cosine" (float64[2k+1, 2k+1], the rows' cosine
      similarity across distances), "key_norm_0", "key_norm_clip", "value_norm_0", "value_norm_clip" (the
      row norms at distance 0 and at -k, the clipped far past, which the causal decoder reads too),
      "key_neighbour_cosine", "value_neighbour_cosine" (the mean over d of the cosine of distances d and
      d+1), "key_ends_cosine" (of -k and +k)}]}.
    """
    k = cfg.max_relative_position
    rows, layers = [], []
    for stack, count in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(count):
            tables = params[stack][f"layer_{i}"]["self_attention"]["positions"]
            key = np.asarray(tables["relative_key"], np.float64)  # [2k+1, d_k]
            value = np.asarray(tables["relative_value"], np.float64)  # [2k+1, d_v]
            key_norm, value_norm = np.linalg.norm(key, axis=1), np.linalg.norm(value, axis=1)
            rows += [{"stack": stack, "layer": i, "distance": d, "key_norm": float(key_norm[d + k]),
                      "value_norm": float(value_norm[d + k])} for d in range(-k, k + 1)]
            key_cos, value_cos = position_cosine_similarity(key), position_cosine_similarity(value)
            layers.append({"stack": stack, "layer": i, "key_cosine": key_cos, "value_cosine": value_cos,
                           "key_norm_0": float(key_norm[k]), "key_norm_clip": float(key_norm[0]),
                           "value_norm_0": float(value_norm[k]), "value_norm_clip": float(value_norm[0]),
                           "key_neighbour_cosine": float(np.mean(np.diag(key_cos, 1))),
                           "value_neighbour_cosine": float(np.mean(np.diag(value_cos, 1))),
                           "key_ends_cosine": float(key_cos[0, -1])})
    return {"kind": "relative", "k": k, "rows": rows, "layers": layers}


def model_positions_report(cfg: Any, params: Any, offsets: Sequence[int] | None = None
                           ) -> dict[str, Any] | None:
    """The positions report of the scheme the model ``cfg`` has: its sinusoidal table
    (``positions_report``), its learned tables, read from ``params`` (``learned_positions_report``), the
    rotary spectrum (``rotary_report``), the ALiBi slopes (``alibi_report``) or its relative tables
    (``relative_report``); None without positions (``none``: the section does not apply). ``offsets``:
    the sinusoid's and learned tables' offsets k."""
    scheme = cfg.position_encoding
    if scheme == "sinusoidal":
        return {"kind": "sinusoidal", **positions_report(cfg.max_len, cfg.d_model, offsets)}
    if scheme == "learned":
        tables = {side: params[side]["positions"]["position_embedding"] for side in ("encoder", "decoder")}
        return learned_positions_report(tables, offsets)
    if scheme == "rotary":
        return rotary_report(cfg.d_k)
    if scheme == "alibi":
        return alibi_report(cfg)
    if scheme == "relative":
        return relative_report(cfg, params)
    if scheme == "none":
        return None
    raise ValueError(f"the positions section does not know position_encoding={scheme!r}")


def plot_positions(report: dict[str, Any], path: str) -> str:
    """The figure of a ``model_positions_report``: for the sinusoid and learned tables, the table, the
    cosine similarity of positions and the offset errors; for the other schemes ``plot_rotary``,
    ``plot_alibi`` or ``plot_relative``."""
    other = {"rotary": plot_rotary, "alibi": plot_alibi, "relative": plot_relative}.get(report.get("kind"))
    if other is not None:
        return other(report, path)
    table, rows = report["table"], report["rows"]
    learned = report.get("kind") == "learned"
    fig = artifacts.figure(16, 4.6)
    ax = fig.add_subplot(1, 3, 1)
    image = ax.imshow(table, cmap="RdBu", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"{'learned encoder table' if learned else 'sinusoidal encoding'} "
                 f"[{table.shape[0]} x {table.shape[1]}]", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 2)
    image = ax.imshow(report["cosine"], cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("position")
    ax.set_ylabel("position")
    ax.set_title("cosine similarity of positions", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 3)
    ks = [r["k"] for r in rows]
    series = ([("fit_error", "encoder, fitted M_k"), ("decoder_fit_error", "decoder, fitted M_k")] if learned
              else [("fit_error", "fitted block-diagonal M_k"), ("analytic_error", "analytic rotation M_k")])
    for key, label in series:
        if rows and key in rows[0]:
            ax.semilogy(ks, [max(r[key], 1e-12) for r in rows], ".", label=label)
    ax.set_xlabel("offset k")
    ax.set_ylabel("max_pos |PE(pos+k) - M_k PE(pos)|")
    ax.set_title("is PE(pos+k) a linear function of PE(pos)?" if learned
                 else "PE(pos+k) is a linear function of PE(pos)", fontsize=10)
    ax.set_ylim(1e-9, max([1.0, *(r[key] for r in rows for key, _ in series if key in r)]))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return artifacts.save(fig, path)


def plot_rotary(report: dict[str, Any], path: str) -> str:
    """Each pair's wavelength (left); the logit of a fixed query/key pair against their offset (right)."""
    fig = artifacts.figure(12, 4.2)
    ax = fig.add_subplot(1, 2, 1)
    pairs = report["pairs"]
    ax.semilogy([p["pair"] for p in pairs], [p["wavelength"] for p in pairs], "o-", ms=3)
    ax.axhline(len(report["rows"]), color="gray", ls=":", label=f"{len(report['rows'])} tokens (right)")
    ax.set_xlabel(f"dimension pair i (dims i, i + {report['d_k'] // 2})")
    ax.set_ylabel("wavelength (tokens per turn)")
    ax.set_title(f"rotary spectrum, d_k={report['d_k']}: rate 10000^(-2i/d_k)", fontsize=10)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    offsets = [r["offset"] for r in report["rows"]]
    ax.plot(offsets, [r["logit_ones"] for r in report["rows"]], label="q = k = ones / sqrt(d_k)")
    ax.plot(offsets, [r["logit_random"] for r in report["rows"]], lw=0.8, label="q = k, a random unit vector")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("offset between query and key (tokens)")
    ax.set_ylabel("q . k after rotation")
    ax.set_title("the logit of a fixed pair against its offset", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return artifacts.save(fig, path)


def plot_alibi(report: dict[str, Any], path: str) -> str:
    """Each head's bias against the offset (left); the slopes (right)."""
    fig = artifacts.figure(12, 4.2)
    ax = fig.add_subplot(1, 2, 1)
    offsets = report["offsets"]
    for r in report["rows"]:
        ax.plot(offsets, [r[f"bias_{o}"] for o in offsets], "o-", ms=3, label=f"head {r['head']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("|i - j| (tokens)")
    ax.set_ylabel("logit bias -m_h |i - j|")
    ax.set_title("ALiBi bias by offset (encoder both ways, decoder the past)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax = fig.add_subplot(1, 2, 2)
    ax.bar([r["head"] for r in report["rows"]], [r["slope"] for r in report["rows"]])
    ax.set_yscale("log", base=2)
    ax.set_xlabel("head h")
    ax.set_ylabel("slope m_h")
    ax.set_title(f"slopes of {report['num_heads']} heads", fontsize=10)
    fig.tight_layout()
    return artifacts.save(fig, path)


def plot_relative(report: dict[str, Any], path: str) -> str:
    """The norms of a^K and a^V rows by distance, per layer; the cosine of the first layer's a^K rows."""
    fig = artifacts.figure(16, 4.6)
    for column, name in ((1, "key"), (2, "value")):
        ax = fig.add_subplot(1, 3, column)
        for layer in report["layers"]:
            rows = [r for r in report["rows"] if (r["stack"], r["layer"]) == (layer["stack"], layer["layer"])]
            ax.plot([r["distance"] for r in rows], [r[f"{name}_norm"] for r in rows], "o-", ms=3,
                    label=f"{layer['stack']} L{layer['layer']}")
        ax.set_xlabel("distance j - i (clipped)")
        ax.set_ylabel(f"|a^{name[0].upper()}| row norm")
        ax.set_title(f"relative {name} table by distance (k={report['k']})", fontsize=10)
        ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 3)
    first = report["layers"][0]
    k = report["k"]
    image = ax.imshow(first["key_cosine"], cmap="viridis", vmin=-1, vmax=1, interpolation="nearest",
                      extent=(-k - 0.5, k + 0.5, k + 0.5, -k - 0.5))
    ax.set_xlabel("distance")
    ax.set_ylabel("distance")
    ax.set_title(f"cosine of a^K rows, {first['stack']} L{first['layer']}", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    return artifacts.save(fig, path)
