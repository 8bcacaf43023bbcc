"""Looking inside a trained Transformer, and the paper's explanations tested as experiments.

    python -m transformer_jax.inspect --workdir DIR --sentence "The old dog saw a red car." [--out OUT]

What it writes into the output folder (``index.html`` links everything; ``summary.md`` is printed):

1. Attention maps (``maps/``). The sentence is greedy-decoded first; the teacher-forced forward on that
   output then gives, for every layer and head, the encoder self-attention, the decoder masked
   self-attention and the encoder-decoder attention as PNG heatmaps with SentencePiece pieces on the
   axes. ``maps/attention_maps.npz`` holds the numbers behind every plot and ``maps/manifest.json``
   says which array and head each PNG shows.
2. Head statistics over N dev sentences (padding excluded): mean entropy, mean max weight and the share
   of mass on the previous / same / next position (``head_stats.{csv,md,png}``).
3. The paper's explanations as experiments:
   * scaling (section 3.2.1): attention entropy with and without 1/sqrt(d_k), on random unit-variance
     q and k as d_k grows, and on the trained model's own queries and keys (``scaling.*``);
   * positions (section 3.5): the sinusoidal table, the check that PE(pos+k) = M_k PE(pos) for one fixed
     block-diagonal rotation M_k per offset k, and the cosine similarity of positions (``positions.*``);
   * Table 1 measured: XLA's FLOP count and the wall time of one self-attention layer against the
     sequence length n, beside n^2 d and n d^2, dense and blockwise (``complexity.*``);
   * an intervention: every head ablated in turn (its rows of W^O zeroed) and the change in dev loss,
     because an attention weight is a mixing coefficient, not an explanation (``ablation.*``).
4. On the synthetic task only: how much of each cross-attention head's mass lands on the source word the
   grammar aligns with the target word being produced, also for words that the target language
   reorders (adjectives after nouns, verb-final subordinate clauses) (``alignment.*``).

Conventions. Attention kinds are ``encoder_self``, ``decoder_self`` and ``cross``. Weights are
``float[batch, heads, q_len, kv_len]`` (as the model sows them). Decoder position t reads the decoder
input token (BOS, y_1, ..., y_{t}) and predicts y_{t+1}; plots label decoder queries with the token they
predict and decoder self-attention keys with the input token at that position. Masks are boolean,
True = may attend, as everywhere in this package.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend change).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import html
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import evaluation
from transformer_jax.evaluation import Restored
from transformer_jax.model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ModelConfig,
    MultiHeadAttention,
    Transformer,
    sinusoidal_table,
)

KINDS = ("encoder_self", "decoder_self", "cross")
KIND_TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder masked self-attention",
               "cross": "encoder-decoder attention"}
_MODULES = {"encoder_self": ("encoder", "self_attention"), "decoder_self": ("decoder", "self_attention"),
            "cross": ("decoder", "cross_attention")}
DEFAULT_D_KS = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)
WEIGHTS_ARE_NOT_EXPLANATIONS = (
    "An attention weight is a mixing coefficient, not an explanation: it says how much of a value vector "
    "a head mixes in, not whether the output depends on it. The ablation (each head's rows of W^O zeroed "
    "in turn) measures that dependence directly, and it need not agree with how sharp or how "
    "interpretable a head's maps look.")


# --------------------------------------------------------------------------------------------------
# Restoring a workdir and running the model with its intermediates.


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """The workdir's model, with a deterministic dense-attention config (the dense path sows weights)."""
    restored = evaluation.restore_workdir(workdir, step)
    return dataclasses.replace(restored, model_config=restored.model_config.replace(
        deterministic=True, decode=False, attention_impl="dense", attention_witness=False))


@dataclasses.dataclass(frozen=True)
class AttentionRecord:
    """What one attention sub-layer sowed (as NumPy arrays).

    Attributes:
      weights: float32[batch, heads, q_len, kv_len]; queries: float32[batch, q_len, heads, d_k];
      keys: float32[batch, kv_len, heads, d_k].
    """

    weights: np.ndarray
    queries: np.ndarray
    keys: np.ndarray


@functools.lru_cache(maxsize=8)
def _forward_fn(model_config: ModelConfig):
    model = Transformer(model_config.replace(deterministic=True, decode=False, attention_impl="dense"))

    def forward(params, inputs, targets):
        logits, state = model.apply({"params": params}, inputs, targets, mutable=["intermediates"])
        return logits, state["intermediates"]

    return jax.jit(forward)


def attention_records(params: Any, model_config: ModelConfig, inputs: np.ndarray,
                      targets: np.ndarray) -> dict[str, list[AttentionRecord]]:
    """Teacher-forced forward that collects every attention's sown weights, queries and keys.

    Args:
      inputs: int[batch, src_len] source ids; targets: int[batch, tgt_len] (the decoder reads
        ``shift_right(targets)``).

    Returns:
      {kind: one AttentionRecord per layer}, as NumPy arrays.
    """
    _, inter = _forward_fn(model_config)(params, jnp.asarray(inputs, jnp.int32),
                                         jnp.asarray(targets, jnp.int32))
    num_layers = {"encoder": model_config.num_encoder_layers, "decoder": model_config.num_decoder_layers}
    out = {}
    for kind, (stack, module) in _MODULES.items():
        records = []
        for i in range(num_layers[stack]):
            sown = inter[stack][f"layer_{i}"][module]
            records.append(AttentionRecord(*(np.asarray(sown[name][0], np.float32)
                                             for name in ("attention_weights", "queries", "keys"))))
        out[kind] = records
    return out


def attention_mask(kind: str, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The keys each real query may attend to: bool[batch, 1, q_len, kv_len] (padded queries: no key).

    The decoder's position t is real when it predicts a real token (targets[:, t] != PAD).
    """
    src_ok = np.asarray(inputs) != PAD_ID  # [B, S]
    tgt_ok = np.asarray(targets) != PAD_ID  # [B, T]
    if kind == "encoder_self":
        return src_ok[:, None, :, None] & src_ok[:, None, None, :]
    if kind == "cross":
        return tgt_ok[:, None, :, None] & src_ok[:, None, None, :]
    if kind == "decoder_self":
        length = tgt_ok.shape[1]
        causal = np.tril(np.ones((length, length), bool))  # [T, T], key j <= query i
        return tgt_ok[:, None, :, None] & causal[None, None]
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


# --------------------------------------------------------------------------------------------------
# 1. Attention maps of one sentence.


def encode_sentence(tokenizer, sentence: str) -> np.ndarray:
    """int32[1, src_len]: the pieces of ``sentence`` plus EOS, as the data pipeline feeds the encoder."""
    from transformer_jax.data import normalize_whitespace

    text = normalize_whitespace(sentence)
    if not text:
        raise ValueError("--sentence is empty")
    return np.asarray([tokenizer.encode(text) + [EOS_ID]], np.int32)


def greedy_output(params: Any, model_config: ModelConfig, inputs: np.ndarray, *,
                  max_extra_len: int = 50) -> np.ndarray:
    """int32[1, out_len]: the greedy output of one source up to and including its EOS (if any)."""
    from transformer_jax import decode

    tokens = np.asarray(decode.greedy_search(params, model_config, jnp.asarray(inputs),
                                             max_extra_len=max_extra_len))[0]
    tokens = tokens[tokens != PAD_ID]
    eos = np.flatnonzero(tokens == EOS_ID)
    if len(eos):
        tokens = tokens[: eos[0] + 1]
    if not len(tokens):
        tokens = np.asarray([EOS_ID], np.int32)
    return tokens[None].astype(np.int32)


def _piece(tokenizer, i: int) -> str:
    special = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>"}
    return special.get(int(i), None) or tokenizer.id_to_piece(int(i))


@dataclasses.dataclass(frozen=True)
class SentenceMaps:
    """The attention maps of one sentence and its greedy translation.

    Attributes:
      source, output: the source text and the detokenized greedy output.
      source_pieces: the encoder's pieces (with EOS); output_pieces: the predicted pieces (decoder
        queries); decoder_input_pieces: BOS then the output shifted right (decoder self-attention keys).
      maps: {kind: float32[layers, heads, q_len, kv_len]}.
    """

    source: str
    output: str
    source_pieces: list[str]
    output_pieces: list[str]
    decoder_input_pieces: list[str]
    maps: dict[str, np.ndarray]

    def axis_pieces(self, kind: str) -> tuple[list[str], list[str]]:
        """(query pieces, key pieces) of ``kind``."""
        return {"encoder_self": (self.source_pieces, self.source_pieces),
                "decoder_self": (self.output_pieces, self.decoder_input_pieces),
                "cross": (self.output_pieces, self.source_pieces)}[kind]


def sentence_maps(restored: Restored, sentence: str, *, max_extra_len: int = 50) -> SentenceMaps:
    """Greedy-decodes ``sentence``, then runs the teacher-forced forward on that output for the maps."""
    tok = restored.tokenizer
    inputs = encode_sentence(tok, sentence)
    output = greedy_output(restored.params, restored.model_config, inputs, max_extra_len=max_extra_len)
    records = attention_records(restored.params, restored.model_config, inputs, output)
    maps = {kind: np.stack([r.weights[0] for r in recs]) for kind, recs in records.items()}
    out_ids = output[0].tolist()
    return SentenceMaps(
        source=sentence, output=tok.decode(output[0]),
        source_pieces=[_piece(tok, i) for i in inputs[0]],
        output_pieces=[_piece(tok, i) for i in out_ids],
        decoder_input_pieces=[_piece(tok, i) for i in [BOS_ID, *out_ids[:-1]]],
        maps=maps)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def plot_attention_map(weights: np.ndarray, query_pieces: Sequence[str], key_pieces: Sequence[str],
                       title: str, path: str, *, query_label: str, key_label: str) -> str:
    """Heatmap of float[q_len, kv_len] weights with the pieces on the axes; returns ``path``."""
    q_len, kv_len = weights.shape
    fig = _figure(max(4.0, 0.26 * kv_len + 2.2), max(3.5, 0.26 * q_len + 1.6))
    ax = fig.add_subplot()
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(kv_len), list(key_pieces), rotation=90, fontsize=8)
    ax.set_yticks(range(q_len), list(query_pieces), fontsize=8)
    ax.set_xlabel(key_label)
    ax.set_ylabel(query_label)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    return _save(fig, path)


def write_sentence_maps(sm: SentenceMaps, out_dir: str) -> list[dict[str, Any]]:
    """Writes one PNG per (kind, layer, head), ``attention_maps.npz`` and ``manifest.json`` into ``out_dir``.

    Returns:
      The manifest: one entry per image with its relative path, kind, layer, head and npz key.
    """
    os.makedirs(out_dir, exist_ok=True)
    labels = {"encoder_self": ("query (source piece)", "key (source piece)"),
              "decoder_self": ("query (piece it predicts)", "key (decoder input piece)"),
              "cross": ("query (piece it predicts)", "key (source piece)")}
    manifest = []
    for kind in KINDS:
        queries, keys = sm.axis_pieces(kind)
        for layer, heads in enumerate(sm.maps[kind]):
            for head, weights in enumerate(heads):
                name = f"{kind}_layer{layer}_head{head}.png"
                plot_attention_map(weights, queries, keys, f"{KIND_TITLES[kind]}, layer {layer}, head {head}",
                                   os.path.join(out_dir, name), query_label=labels[kind][0],
                                   key_label=labels[kind][1])
                manifest.append({"image": name, "kind": kind, "layer": layer, "head": head, "npz_key": kind})
    np.savez(os.path.join(out_dir, "attention_maps.npz"),
             source_pieces=np.asarray(sm.source_pieces), output_pieces=np.asarray(sm.output_pieces),
             decoder_input_pieces=np.asarray(sm.decoder_input_pieces),
             **{kind: sm.maps[kind] for kind in KINDS})
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump({"source": sm.source, "output": sm.output, "npz": "attention_maps.npz",
                   "npz_layout": "{kind}: float32[layers, heads, q_len, kv_len]", "images": manifest},
                  f, indent=1)
    return manifest


# --------------------------------------------------------------------------------------------------
# 2. Head statistics over dev sentences.


def entropy(weights: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of float[..., kv_len] weights (0 log 0 = 0)."""
    w = np.asarray(weights, np.float64)
    return -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0), axis=-1)


_STATS = ("entropy", "uniform_entropy", "max_weight", "prev", "self", "next")


class HeadStatistics:
    """Per-head running sums over real query rows, for one attention kind and layer.

    Each statistic is the mean over the rows where it is defined: ``prev`` (mass on key position q-1)
    over rows whose previous position is an allowed key, ``self`` (key q) and ``next`` (key q+1)
    likewise. ``uniform_entropy`` is the mean log(number of allowed keys): the entropy bound per row.
    """

    def __init__(self, kind: str, num_heads: int):
        self.kind = kind
        self.sums = {name: np.zeros(num_heads) for name in _STATS}
        self.rows = {name: np.zeros(num_heads) for name in _STATS}

    def add(self, weights: np.ndarray, mask: np.ndarray) -> None:
        """weights: float[batch, heads, q_len, kv_len]; mask: bool[batch, 1, q_len, kv_len]."""
        w = np.asarray(weights, np.float64)
        allowed = np.broadcast_to(mask, w.shape)
        real = allowed.any(-1)  # [B, H, Q]
        self._add("entropy", entropy(w), real)
        self._add("uniform_entropy", np.log(np.maximum(allowed.sum(-1), 1)), real)
        self._add("max_weight", w.max(-1), real)
        if self.kind == "cross":
            return
        for name, offset in (("prev", -1), ("self", 0), ("next", 1)):
            # diagonal(offset) of [Q, K] holds w[q, q + offset] for the rows where q + offset exists.
            diag = np.diagonal(w, offset=offset, axis1=2, axis2=3)  # [B, H, Q - |offset|]
            ok = np.diagonal(allowed, offset=offset, axis1=2, axis2=3)
            self._add(name, diag, ok)

    def _add(self, name: str, values: np.ndarray, where: np.ndarray) -> None:
        self.sums[name] += np.where(where, values, 0.0).sum(axis=(0, 2))
        self.rows[name] += where.sum(axis=(0, 2))

    def means(self) -> dict[str, np.ndarray]:
        """{statistic: float64[heads]}; NaN where a statistic is undefined (e.g. 'next' in the decoder)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            out = {name: self.sums[name] / self.rows[name] for name in _STATS}
        out["rows"] = self.rows["entropy"]
        return out


def dev_batches(restored: Restored, num_sentences: int, split: str = "dev") -> list:
    """The first ``num_sentences`` of ``split`` as padded evaluation batches."""
    from transformer_jax import data as data_lib

    return data_lib.make_eval_batches(restored.config.data, restored.tokenizer, split,
                                      max_examples=num_sentences)


@dataclasses.dataclass
class DevAnalysis:
    """Head statistics and the model half of the scaling experiment, from one pass over dev batches.

    Attributes:
      stats: {(kind, layer): HeadStatistics}.
      scaling: {(kind, layer): {"scaled": sum, "unscaled": sum, "rows": n, "logit_sq": sum of squared
        unscaled q.k over allowed pairs, "pairs": n, "max_abs_diff": sown vs recomputed}}.
      num_sentences: real rows seen.
    """

    stats: dict
    scaling: dict
    num_sentences: int


def analyse_dev(restored: Restored, batches: Sequence) -> DevAnalysis:
    """Head statistics and entropy with/without 1/sqrt(d_k) of the model's own q and k, over ``batches``."""
    cfg = restored.model_config
    stats, scaling, seen = {}, {}, 0
    for b in batches:
        seen += b.num_real
        records = attention_records(restored.params, cfg, b.inputs, b.targets)
        for kind, layers in records.items():
            mask = attention_mask(kind, b.inputs, b.targets)
            for layer, rec in enumerate(layers):
                stats.setdefault((kind, layer), HeadStatistics(kind, cfg.num_heads)).add(rec.weights, mask)
                acc = scaling.setdefault((kind, layer), {"scaled": 0.0, "unscaled": 0.0, "rows": 0,
                                                         "logit_sq": 0.0, "pairs": 0, "max_abs_diff": 0.0})
                _add_scaling(acc, rec, mask)
    return DevAnalysis(stats, scaling, seen)


def attention_weights_np(queries: np.ndarray, keys: np.ndarray, mask: np.ndarray | None = None, *,
                         scale_logits: bool = True) -> np.ndarray:
    """float64[batch, heads, q_len, kv_len]: softmax(q.k [/ sqrt(d_k)]) in NumPy, masked entries exactly 0.

    An independent float64 reference of ``attention.dot_product_attention``'s weights (rows with no
    allowed key are all zero), used to recompute the model's maps with and without the scaling.

    Args:
      queries: float[batch, q_len, heads, d_k]; keys: float[batch, kv_len, heads, d_k].
      mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = may attend. None: all allowed.
    """
    q, k = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)  # [B, H, Q, K]
    if scale_logits:
        logits = logits / math.sqrt(q.shape[-1])
    allowed = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(mask, logits.shape)
    row_max = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    unnormalized = np.where(allowed, np.exp(np.where(allowed, logits - row_max, 0.0)), 0.0)
    denom = unnormalized.sum(-1, keepdims=True)
    return unnormalized / np.where(denom > 0, denom, 1.0)


def _add_scaling(acc: dict, rec: AttentionRecord, mask: np.ndarray) -> None:
    """Recomputes the weights from the sown q and k with and without 1/sqrt(d_k); adds their entropies."""
    scaled = attention_weights_np(rec.queries, rec.keys, mask)
    unscaled = attention_weights_np(rec.queries, rec.keys, mask, scale_logits=False)
    allowed = np.broadcast_to(mask, rec.weights.shape)
    real = allowed.any(-1)  # [B, H, Q]
    acc["scaled"] += float(entropy(scaled)[real].sum())
    acc["unscaled"] += float(entropy(unscaled)[real].sum())
    acc["rows"] += int(real.sum())
    logits = np.einsum("bqhd,bkhd->bhqk", rec.queries.astype(np.float64), rec.keys.astype(np.float64))
    acc["logit_sq"] += float(np.sum(np.where(allowed, logits, 0.0) ** 2))
    acc["pairs"] += int(allowed.sum())
    # Only real rows: the model gives padded encoder queries weights too (nothing reads them); we do not.
    diff = np.where(real[..., None], np.abs(scaled - rec.weights), 0.0)
    acc["max_abs_diff"] = max(acc["max_abs_diff"], float(np.max(diff)))


def head_stats_rows(analysis: DevAnalysis, ablation: dict | None = None) -> list[dict[str, Any]]:
    """One row per (kind, layer, head): the statistics, plus the ablation's change in dev NLL if given."""
    rows = []
    for kind, layer in sorted(analysis.stats, key=_kind_layer_order):
        means = analysis.stats[(kind, layer)].means()
        for head in range(len(means["entropy"])):
            row = {"kind": kind, "layer": layer, "head": head}
            row.update({name: float(means[name][head]) for name in _STATS})
            row["rows"] = int(means["rows"][head])
            if ablation is not None:
                row["delta_nll"] = ablation[(kind, layer, head)]["delta_nll"]
            rows.append(row)
    return rows


def _kind_layer_order(key: tuple[str, int]) -> tuple[int, int]:
    return KINDS.index(key[0]), key[1]


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def write_table(rows: Sequence[dict[str, Any]], stem: str, *, digits: int = 3) -> tuple[str, str]:
    """Writes ``rows`` as ``stem.csv`` and a markdown ``stem.md``; returns both paths."""
    columns = list(rows[0])
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(stem + ".md", "w") as f:
        f.write(markdown_table(rows, digits=digits) + "\n")
    return stem + ".csv", stem + ".md"


def markdown_table(rows: Sequence[dict[str, Any]], *, digits: int = 3) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r[c], digits) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_head_stats(rows: Sequence[dict[str, Any]], path: str) -> str:
    """A grid of [layers x heads] heatmaps: one row per statistic, one column per attention kind."""
    import matplotlib

    names = ("entropy", "max_weight", "prev", "self", "next")
    num_heads = max(r["head"] for r in rows) + 1
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="lightgray")  # undefined statistics: grey
    fig = _figure(3.2 * len(KINDS), 2.4 * len(names))
    for j, kind in enumerate(KINDS):
        kind_rows = [r for r in rows if r["kind"] == kind]
        num_layers = max(r["layer"] for r in kind_rows) + 1
        for i, name in enumerate(names):
            grid = np.full((num_layers, num_heads), np.nan)
            for r in kind_rows:
                grid[r["layer"], r["head"]] = r[name]
            ax = fig.add_subplot(len(names), len(KINDS), i * len(KINDS) + j + 1)
            vmax = max(np.nanmax([r["uniform_entropy"] for r in kind_rows]), 1e-6) if name == "entropy" else 1
            ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
            for (li, hi), v in np.ndenumerate(grid):
                ax.text(hi, li, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if np.isnan(v) or v >= 0.6 * vmax else "white")
            ax.set_xticks(range(num_heads))
            ax.set_yticks(range(num_layers))
            ax.set_xlabel("head", fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            unit = " (nats)" if name == "entropy" else " (share)" if name in ("prev", "self", "next") else ""
            ax.set_title(f"{KIND_TITLES[kind]}\n{name}{unit}" if i == 0 else f"{name}{unit}", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# 3a. Scaling: entropy with and without 1/sqrt(d_k).


def scaling_random(d_ks: Sequence[int] = DEFAULT_D_KS, *, num_keys: int = 64, num_queries: int = 256,
                   seed: int = 0) -> list[dict[str, float]]:
    """Mean attention entropy on random q, k ~ N(0, I_{d_k}) with and without the 1/sqrt(d_k) factor.

    Unscaled, q.k has variance d_k, so the softmax saturates (entropy -> 0) as d_k grows; scaled, the
    logits keep unit variance and the entropy stays put. ``log(num_keys)`` is the uniform maximum.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for d_k in d_ks:
        q = rng.standard_normal((1, num_queries, 1, d_k))  # [B, Q, H, d_k]
        k = rng.standard_normal((1, num_keys, 1, d_k))  # [B, K, H, d_k]
        row = {"d_k": int(d_k)}
        for name, scale in (("scaled", True), ("unscaled", False)):
            w = attention_weights_np(q, k, scale_logits=scale)
            row[f"entropy_{name}"] = float(entropy(w).mean())
            row[f"max_weight_{name}"] = float(w.max(-1).mean())
        row["logit_std_unscaled"] = float(np.std(np.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0])))
        row["uniform_entropy"] = float(np.log(num_keys))
        rows.append(row)
    return rows


def scaling_model_rows(analysis: DevAnalysis, d_k: int) -> list[dict[str, Any]]:
    """Per (kind, layer): mean entropy of the model's maps with (as trained) and without 1/sqrt(d_k)."""
    rows = []
    for kind, layer in sorted(analysis.scaling, key=_kind_layer_order):
        acc = analysis.scaling[(kind, layer)]
        uniform = float(np.mean(analysis.stats[(kind, layer)].means()["uniform_entropy"]))
        rows.append({"kind": kind, "layer": layer, "d_k": d_k,
                     "entropy_scaled": acc["scaled"] / acc["rows"],
                     "entropy_unscaled": acc["unscaled"] / acc["rows"],
                     "uniform_entropy": uniform,
                     "logit_std_unscaled": math.sqrt(acc["logit_sq"] / acc["pairs"]),
                     "sown_vs_recomputed": acc["max_abs_diff"]})
    return rows


def plot_scaling(random_rows: Sequence[dict], model_rows: Sequence[dict], path: str) -> str:
    fig = _figure(12, 4.2)
    ax = fig.add_subplot(1, 2, 1)
    d_ks = [r["d_k"] for r in random_rows]
    ax.plot(d_ks, [r["entropy_scaled"] for r in random_rows], "o-", label="softmax(q.k / sqrt(d_k))")
    ax.plot(d_ks, [r["entropy_unscaled"] for r in random_rows], "s-", label="softmax(q.k)")
    ax.axhline(random_rows[0]["uniform_entropy"], color="gray", ls=":", label="uniform, log(#keys)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k")
    ax.set_ylabel("mean entropy (nats)")
    ax.set_title("random unit-variance q, k", fontsize=10)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    labels = [f"{r['kind'].replace('_self', '')}\nL{r['layer']}" for r in model_rows]
    x = np.arange(len(model_rows))
    ax.bar(x - 0.27, [r["uniform_entropy"] for r in model_rows], 0.27, label="uniform", color="lightgray")
    ax.bar(x, [r["entropy_scaled"] for r in model_rows], 0.27, label="with 1/sqrt(d_k) (as trained)")
    ax.bar(x + 0.27, [r["entropy_unscaled"] for r in model_rows], 0.27, label="without")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("mean entropy (nats)")
    ax.set_title(f"the trained model's own q, k (d_k={model_rows[0]['d_k']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# 3b. Positions: PE(pos + k) is a fixed linear map of PE(pos).


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
    """float64[d/2, 2, 2]: per (sin, cos) column pair, the least-squares 2x2 map from PE(pos) to PE(pos+k)."""
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


def positions_report(max_len: int, d_model: int, offsets: Sequence[int] | None = None) -> dict[str, Any]:
    """The linear-offset check for every offset, against the fitted and the analytic M_k."""
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


def position_cosine_similarity(table: np.ndarray) -> np.ndarray:
    """float64[max_len, max_len]: cosine similarity of every pair of position encodings."""
    t = np.asarray(table, np.float64)
    t = t / np.linalg.norm(t, axis=1, keepdims=True)
    return t @ t.T


def plot_positions(report: dict[str, Any], path: str) -> str:
    table, rows = report["table"], report["rows"]
    fig = _figure(16, 4.6)
    ax = fig.add_subplot(1, 3, 1)
    image = ax.imshow(table, cmap="RdBu", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal encoding [{table.shape[0]} x {table.shape[1]}]", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 2)
    image = ax.imshow(report["cosine"], cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("position")
    ax.set_ylabel("position")
    ax.set_title("cosine similarity of positions", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax = fig.add_subplot(1, 3, 3)
    ks = [r["k"] for r in rows]
    ax.semilogy(ks, [max(r["fit_error"], 1e-12) for r in rows], ".", label="fitted block-diagonal M_k")
    ax.semilogy(ks, [max(r["analytic_error"], 1e-12) for r in rows], ".", label="analytic rotation M_k")
    ax.set_xlabel("offset k")
    ax.set_ylabel("max_pos |PE(pos+k) - M_k PE(pos)|")
    ax.set_title("PE(pos+k) is a linear function of PE(pos)", fontsize=10)
    ax.set_ylim(1e-9, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# 3c. Table 1 measured: cost of one self-attention layer against the sequence length.


def _cost_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def self_attention_cost(lengths: Sequence[int], *, d_model: int, num_heads: int, impl: str = "dense",
                        block_size: int = 128, repeats: int = 3) -> list[dict[str, Any]]:
    """XLA FLOPs and median wall time of one MultiHeadAttention layer (forward, batch 1, float32).

    Analytic counts (2 FLOPs per multiply-add): the projections W^Q, W^K, W^V, W^O cost 8 n d^2, the
    scores Q K^T and the mixing (weights) V cost 4 n^2 d; Table 1 lists the latter as O(n^2 d).

    XLA's cost analysis counts a loop body once, whatever its trip count, so for the blockwise
    implementation (``fori_loop`` over key blocks inside ``lax.map`` over query blocks) the XLA number
    covers one tile, not the layer; ``flops_xla`` is reported as is and the analytic count beside it.
    """
    cfg = ModelConfig(vocab_size=1, d_model=d_model, d_ff=1, num_heads=num_heads, max_len=max(lengths),
                      attention_impl=impl, attention_block_size=block_size, deterministic=True)
    layer = MultiHeadAttention(cfg)
    x0 = jnp.zeros((1, 8, d_model))
    params = jax.jit(lambda rng: layer.init(rng, x0, x0, None))(jax.random.key(0))
    fn = jax.jit(lambda p, x: layer.apply(p, x, x, None))
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        x = jnp.asarray(rng.standard_normal((1, n, d_model)), jnp.float32)  # [B, n, d_model]
        compiled = fn.lower(params, x).compile()
        jax.block_until_ready(compiled(params, x))  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, x))
            times.append(time.perf_counter() - start)
        rows.append({"impl": impl, "n": int(n), "d_model": d_model, "flops_xla": _cost_flops(compiled),
                     "flops_attention": 4.0 * n * n * d_model, "flops_projections": 8.0 * n * d_model**2,
                     "seconds": statistics.median(times)})
    return rows


def fit_cost_model(rows: Sequence[dict[str, Any]]) -> tuple[float, float, float]:
    """Least-squares (a, b) in flops = a n^2 d + b n d^2 over ``rows``, and the max relative residual.

    Table 1's claim made numerical: for the dense layer a should be ~4 (Q K^T and weights V) and
    b ~8 (four d x d projections), 2 FLOPs per multiply-add.
    """
    n = np.asarray([r["n"] for r in rows], float)
    d = np.asarray([r["d_model"] for r in rows], float)
    y = np.asarray([r["flops_xla"] for r in rows], float)
    basis = np.stack([n * n * d, n * d * d], axis=1) / y[:, None]  # relative least squares
    (a, b), *_ = np.linalg.lstsq(basis, np.ones_like(y), rcond=None)
    residual = float(np.max(np.abs((a * n * n * d + b * n * d * d) / y - 1.0)))
    return float(a), float(b), residual


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (the empirical exponent)."""
    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def plot_complexity(rows: Sequence[dict[str, Any]], path: str) -> str:
    dense = [r for r in rows if r["impl"] == "dense"]
    fig = _figure(12, 4.4)
    ax = fig.add_subplot(1, 2, 1)
    n = np.asarray([r["n"] for r in dense], float)
    ax.loglog(n, [r["flops_xla"] for r in dense], "o-", label="XLA cost analysis, dense")
    blockwise = [r for r in rows if r["impl"] == "blockwise"]
    if blockwise:
        ax.loglog([r["n"] for r in blockwise], [r["flops_xla"] for r in blockwise], "x--",
                  label="XLA cost analysis, blockwise (loop body once)")
    ax.loglog(n, [r["flops_attention"] for r in dense], ":", label="4 n^2 d  (Q K^T, weights V)")
    ax.loglog(n, [r["flops_projections"] for r in dense], ":", label="8 n d^2  (W^Q, W^K, W^V, W^O)")
    ax.loglog(n, [r["flops_attention"] + r["flops_projections"] for r in dense], "k-", lw=0.8,
              label="sum")
    ax.axvline(2 * dense[0]["d_model"], color="gray", lw=0.6)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("FLOPs (forward, one layer)")
    ax.set_title(f"FLOPs, d_model={dense[0]['d_model']} (grey: n = 2d)", fontsize=10)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    for impl, marker in (("dense", "o-"), ("blockwise", "x--")):
        sel = [r for r in rows if r["impl"] == impl]
        if sel:
            ax.loglog([r["n"] for r in sel], [r["seconds"] for r in sel], marker, label=impl)
    last = dense[-1]
    for power, style in ((2, ":"), (1, "-.")):
        ax.loglog(n, last["seconds"] * (n / last["n"]) ** power, style, color="gray", lw=0.8,
                  label=f"~ n^{power} (through the last dense point)")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("median seconds (forward, one layer)")
    ax.set_title("wall time on this machine", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# 3d. Intervention: ablate one head at a time.


def ablated_params(params: Any, kind: str, layer: int, head: int) -> Any:
    """A copy of ``params`` with head ``head``'s rows of W^O (out kernel [h, d_v, d_model]) zeroed.

    The head's output is multiplied by exactly zero, so the rest of the model sees it removed.
    """
    stack, module = _MODULES[kind]
    out = jnp.asarray(params[stack][f"layer_{layer}"][module]["out"])  # [h, d_v, d_model]
    return _replace_leaf(params, (stack, f"layer_{layer}", module, "out"), out.at[head].set(0.0))


def _replace_leaf(tree: Any, path: Sequence[str], value: Any) -> Any:
    """A shallow copy of the nested dict ``tree`` with the leaf at ``path`` replaced (the rest shared)."""
    if not path:
        return value
    return {**tree, path[0]: _replace_leaf(tree[path[0]], path[1:], value)}


def ablate_heads(restored: Restored, batches: Sequence) -> dict[tuple[str, int, int], dict[str, float]]:
    """Dev NLL (no label smoothing) and accuracy with each head ablated in turn, and their change.

    Returns:
      {(kind, layer, head): {"nll", "delta_nll", "accuracy", "delta_accuracy"}} and under the key
      ("baseline", -1, -1) the unablated numbers.
    """
    from transformer_jax.evaluation import perplexity

    cfg = restored.model_config
    base = perplexity(restored.params, cfg, batches)
    out = {("baseline", -1, -1): {"nll": base["nll"], "delta_nll": 0.0, "accuracy": base["accuracy"],
                                  "delta_accuracy": 0.0}}
    layers = {"encoder_self": cfg.num_encoder_layers, "decoder_self": cfg.num_decoder_layers,
              "cross": cfg.num_decoder_layers}
    for kind in KINDS:
        for layer in range(layers[kind]):
            for head in range(cfg.num_heads):
                m = perplexity(ablated_params(restored.params, kind, layer, head), cfg, batches)
                out[(kind, layer, head)] = {"nll": m["nll"], "delta_nll": m["nll"] - base["nll"],
                                            "accuracy": m["accuracy"],
                                            "delta_accuracy": m["accuracy"] - base["accuracy"]}
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (no ties correction; NaNs dropped pairwise)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 3:
        return float("nan")
    rx, ry = (np.argsort(np.argsort(np.asarray(v))).astype(float) for v in zip(*pairs, strict=True))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def plot_ablation(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Bars of the dev-NLL change per ablated head, and that change against the head's mean max weight."""
    fig = _figure(max(8.0, 0.28 * len(rows) + 5), 4.4)
    ax = fig.add_subplot(1, 2, 1)
    colors = {"encoder_self": "tab:blue", "decoder_self": "tab:orange", "cross": "tab:green"}
    short = {"encoder_self": "enc", "decoder_self": "dec", "cross": "x"}
    ax.bar(range(len(rows)), [r["delta_nll"] for r in rows], color=[colors[r["kind"]] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{short[r['kind']]} L{r['layer']}H{r['head']}" for r in rows],
                  rotation=90, fontsize=7)
    ax.set_ylabel("dev NLL with the head ablated - baseline (nats/token)")
    ax.set_title("ablating one head at a time (its W^O rows zeroed)", fontsize=10)
    for kind, color in colors.items():
        ax.bar([0], [0], color=color, label=KIND_TITLES[kind])
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    for kind, color in colors.items():
        sel = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["max_weight"] for r in sel], [r["delta_nll"] for r in sel], color=color,
                   label=KIND_TITLES[kind], s=18)
    ax.set_xlabel("head's mean max attention weight (dev)")
    ax.set_ylabel("dev NLL change when ablated")
    ax.set_title("is a sharp head an important head?", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------
# 4. Synthetic task: does cross-attention follow the grammar's word alignment?


def synthetic_word_alignment(source: str, target: str, seed: int) -> list[tuple[int, int]]:
    """(target word index, source word index) pairs that the synthetic grammar makes unambiguous.

    A target word aligns to a source word when the target form is an inflection of that source word's
    lemma and exactly one source word has that lemma (so e.g. a second 'the' leaves both unaligned).
    Words are split on spaces; punctuation is stripped and case ignored.
    """
    lemma_of_target, lemma_of_source = _synthetic_lemmas(seed)
    src_words, tgt_words = _words(source), _words(target)
    src_lemmas = [lemma_of_source.get(w) for w in src_words]
    pairs = []
    for t, word in enumerate(tgt_words):
        lemma = lemma_of_target.get(word)
        matches = [s for s, lem in enumerate(src_lemmas) if lem is not None and lem == lemma]
        if lemma is not None and len(matches) == 1:
            pairs.append((t, matches[0]))
    return pairs


def _words(text: str) -> list[str]:
    return [re.sub(r"[^\w]", "", w).lower() for w in text.split()]


@functools.lru_cache(maxsize=4)
def _synthetic_lemmas(seed: int) -> tuple[dict[str, str], dict[str, str]]:
    """({target form: lemma}, {source form: lemma}) of the synthetic language of ``seed``."""
    from transformer_jax.data import synthetic as syn

    lex = syn.build_lexicon(seed)
    agreement = {s for numbers in syn.AGREEMENT.values() for genders in numbers.values()
                 for s in genders.values()}
    verb_suffixes = {s for persons in syn.VERB_SUFFIX.values() for s in persons.values()}
    tgt, src = {}, {}
    for sg, pl in syn._NOUNS:
        tgt[lex.noun_stem[sg]] = tgt[lex.noun_stem[sg] + syn.NOUN_PLURAL[lex.noun_gender[sg]]] = sg
        src[sg] = src[pl] = sg
    for adj in syn._ADJECTIVES:
        tgt.update({lex.stem[adj] + s: adj for s in agreement})
        src[adj] = adj
    for forms in syn._TRANSITIVE + syn._INTRANSITIVE + syn._SAYING:
        tgt.update({lex.stem[forms[0]] + s: forms[0] for s in verb_suffixes})
        src.update({f: forms[0] for f in forms})
    tgt.update({lex.stem["be"] + s: "be" for s in verb_suffixes})
    src.update({f: "be" for f in ("am", "is", "are", "was", "were")})
    for det, (lemma, _) in syn._DETERMINERS.items():
        tgt.update({lex.stem[lemma] + s: "det:" + lemma for s in agreement})
        src[det] = "det:" + lemma
    for word, translation in lex.word.items():
        tgt[translation] = src[word] = word
    for subj, obj, person, gender in syn._PRONOUNS:
        key = person + gender
        tgt[lex.subj[key]] = "subj:" + key
        tgt[lex.obj[key]] = "obj:" + key
        src.setdefault(subj.lower(), "subj:" + key)
        if obj != subj:  # 'you' is both; its subject reading wins, as in base_translations
            src.setdefault(obj, "obj:" + key)
    for name in syn._NAMES:
        tgt[name.lower()] = src[name.lower()] = "name:" + name
    return tgt, src


def word_of_piece(pieces: Sequence[str]) -> list[int]:
    """Word index of each SentencePiece piece (a piece starting with U+2581 opens a word; EOS: -1)."""
    out, word = [], -1
    for p in pieces:
        if p in ("</s>", "<s>", "<pad>"):
            out.append(-1)
            continue
        if p.startswith("\u2581") or word < 0:
            word += 1
        out.append(word)
    return out


def _crossing(pairs: Sequence[tuple[int, int]]) -> set[int]:
    """Target words whose alignment crosses an earlier one (reordered relative to the source)."""
    out = set()
    for i, (t, s) in enumerate(pairs):
        if any(s2 > s for _, s2 in pairs[:i]):
            out.add(t)
    return out


def alignment_analysis(restored: Restored, batches: Sequence) -> list[dict[str, Any]]:
    """Per cross-attention head: mean attention mass on the aligned source word's pieces (dev references).

    A query is the decoder position that predicts a piece of an aligned target word. ``mass_all`` averages
    over every piece of every aligned word, ``mass_first`` over the first (stem) piece of each word only,
    since later pieces are mostly agreement suffixes that may look elsewhere. ``*_reordered`` restricts to
    words whose alignment crosses an earlier word's (adjectives after their noun, verb-final subordinate
    clauses); ``chance_*`` is the mass a uniform head would put on the aligned word.
    """
    seed = restored.config.data.synthetic_seed
    tok, cfg = restored.tokenizer, restored.model_config
    groups = ("all", "reordered", "first", "first_reordered")
    mass = {g: {} for g in groups}  # group -> layer -> float64[heads] summed mass
    chance = dict.fromkeys(groups, 0.0)
    count = dict.fromkeys(groups, 0)
    for b in batches:
        records = attention_records(restored.params, cfg, b.inputs, b.targets)["cross"]
        for row in range(b.num_real):
            src_ids = b.inputs[row][b.inputs[row] != PAD_ID]
            tgt_ids = b.targets[row][b.targets[row] != PAD_ID]
            src_word = np.asarray(word_of_piece([_piece(tok, i) for i in src_ids]))
            tgt_word = np.asarray(word_of_piece([_piece(tok, i) for i in tgt_ids]))
            if (src_word.max(initial=-1) + 1 != len(_words(b.source_texts[row]))
                    or tgt_word.max(initial=-1) + 1 != len(_words(b.target_texts[row]))):
                continue  # pieces do not split into the text's words (unusual spacing): skip the pair
            pairs = synthetic_word_alignment(b.source_texts[row], b.target_texts[row], seed)
            reordered = _crossing(pairs)
            for t, s in pairs:
                pieces = np.flatnonzero(tgt_word == t)
                keys = src_word == s
                word_groups = [("all", pieces), ("first", pieces[:1])]
                if t in reordered:
                    word_groups += [("reordered", pieces), ("first_reordered", pieces[:1])]
                for group, queries in word_groups:
                    count[group] += len(queries)
                    chance[group] += len(queries) * keys.sum() / len(src_ids)
                    for layer, rec in enumerate(records):
                        w = rec.weights[row][:, queries, : len(src_ids)]  # [H, q, S]
                        on_word = w[:, :, keys].sum(axis=(1, 2))  # [H]
                        mass[group][layer] = mass[group].get(layer, 0.0) + on_word
    rows = []
    for layer in sorted(mass["all"]):
        for head in range(cfg.num_heads):
            row = {"layer": layer, "head": head}
            row.update({f"mass_{g}": float(mass[g][layer][head]) / count[g] if count[g] else float("nan")
                        for g in groups})
            row.update({f"chance_{g}": chance[g] / max(count[g], 1) for g in ("all", "first_reordered")})
            row.update({"words": count["first"], "reordered_words": count["first_reordered"]})
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# The report: everything into one folder, one HTML page, one markdown summary.


@dataclasses.dataclass(frozen=True)
class InspectOptions:
    """What :func:`run` computes. Small values make it a quick smoke run (tests)."""

    num_dev: int = 200  # dev sentences for head statistics, the scaling experiment and the ablation
    d_ks: tuple[int, ...] = DEFAULT_D_KS  # random-q/k scaling experiment
    lengths: tuple[int, ...] = DEFAULT_LENGTHS  # self-attention cost against n
    block_size: int = 128  # blockwise attention tile in the cost experiment
    repeats: int = 3  # timing repeats (median)
    max_extra_len: int = 50  # greedy decoding limit: input length + this
    ablation: bool = True
    benchmark: bool = True
    alignment: bool = True  # synthetic task only


def run(workdir: str, sentence: str, out_dir: str | None = None, *, step: int | None = None,
        options: InspectOptions = InspectOptions()) -> dict[str, Any]:
    """Restores ``workdir`` and writes every analysis into ``out_dir`` (default ``workdir/inspect``).

    Returns:
      A dict of the results (also saved as ``results.json``) with the markdown summary under "summary".
    """
    out_dir = out_dir or os.path.join(workdir, "inspect")
    os.makedirs(os.path.join(out_dir, "maps"), exist_ok=True)
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[inspect {time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr, flush=True)

    restored = restore_workdir(workdir, step)
    progress(f"restored step {restored.step} of {workdir}; attention maps")
    cfg = restored.model_config
    files: dict[str, str] = {}

    sm = sentence_maps(restored, sentence, max_extra_len=options.max_extra_len)
    manifest = write_sentence_maps(sm, os.path.join(out_dir, "maps"))

    progress(f"head statistics over {options.num_dev} dev sentences")
    batches = dev_batches(restored, options.num_dev)
    analysis = analyse_dev(restored, batches)
    if options.ablation:
        progress("ablating one head at a time")
    ablation = ablate_heads(restored, batches) if options.ablation else None
    stat_rows = head_stats_rows(analysis, ablation)
    files["head_stats_csv"], files["head_stats_md"] = write_table(
        stat_rows, os.path.join(out_dir, "head_stats"))
    files["head_stats_png"] = plot_head_stats(stat_rows, os.path.join(out_dir, "head_stats.png"))

    progress("scaling and position experiments")
    random_rows = scaling_random(options.d_ks)
    model_rows = scaling_model_rows(analysis, cfg.d_k)
    write_table(random_rows, os.path.join(out_dir, "scaling_random"), digits=4)
    files["scaling_model_csv"], _ = write_table(model_rows, os.path.join(out_dir, "scaling_model"),
                                                digits=4)
    files["scaling_random_csv"] = os.path.join(out_dir, "scaling_random.csv")
    files["scaling_png"] = plot_scaling(random_rows, model_rows, os.path.join(out_dir, "scaling.png"))

    pos = positions_report(cfg.max_len, cfg.d_model)
    learned_error = None
    if cfg.position_encoding == "learned":  # Table 3 (E): does the learned table have the property?
        learned = np.asarray(restored.params["encoder"]["positions"]["position_embedding"])
        learned_error = max(pe_linear_offset_error(learned, k) for k in (1, 2, 4, 8))
    files["positions_csv"], _ = write_table(pos["rows"], os.path.join(out_dir, "positions_offset"), digits=9)
    files["positions_png"] = plot_positions(pos, os.path.join(out_dir, "positions.png"))

    cost_rows = []
    if options.benchmark:
        progress(f"cost of one self-attention layer at n = {', '.join(map(str, options.lengths))}")
        for impl in ("dense", "blockwise"):
            cost_rows += self_attention_cost(
                options.lengths, d_model=cfg.d_model, num_heads=cfg.num_heads, impl=impl,
                block_size=options.block_size, repeats=options.repeats)
        files["complexity_csv"], _ = write_table(cost_rows, os.path.join(out_dir, "complexity"), digits=6)
        files["complexity_png"] = plot_complexity(cost_rows, os.path.join(out_dir, "complexity.png"))

    if ablation is not None:
        ablation_rows = [{"kind": k, "layer": la, "head": h, **v} for (k, la, h), v in ablation.items()]
        files["ablation_csv"], _ = write_table(ablation_rows, os.path.join(out_dir, "ablation"), digits=4)
        files["ablation_png"] = plot_ablation(stat_rows, os.path.join(out_dir, "ablation.png"))

    align_rows = []
    if options.alignment and restored.config.data.source == "synthetic":
        progress("cross-attention against the synthetic grammar's alignment")
        align_rows = alignment_analysis(restored, batches)
        if align_rows:
            files["alignment_csv"], _ = write_table(align_rows, os.path.join(out_dir, "alignment"))

    results = {
        "workdir": workdir, "out_dir": out_dir, "step": restored.step, "sentence": sentence,
        "output": sm.output,
        "num_dev_sentences": analysis.num_sentences,
        "dev_max_len": max(max(b.inputs.shape[1], b.targets.shape[1]) for b in batches),
        "head_stats": stat_rows,
        "scaling_random": random_rows, "scaling_model": model_rows,
        "positions": {"max_fit_error": max(r["fit_error"] for r in pos["rows"]),
                      "max_analytic_error": max(r["analytic_error"] for r in pos["rows"]),
                      "max_fit_vs_analytic": max(r["fit_vs_analytic"] for r in pos["rows"]),
                      "learned_encoder_table_error_k1to8": learned_error,
                      "offsets": [pos["rows"][0]["k"], pos["rows"][-1]["k"]]},
        "complexity": cost_rows, "alignment": align_rows,
        "ablation_baseline": None if ablation is None else ablation[("baseline", -1, -1)],
        "files": {k: os.path.relpath(v, out_dir) for k, v in files.items()},
    }
    results["summary"] = summarize(results, cfg)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(results["summary"] + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    write_html(os.path.join(out_dir, "index.html"), results, manifest, sm, cfg)
    return results


def _top(rows, key, n=3, where=lambda r: True):
    sel = [r for r in rows if where(r) and not math.isnan(r[key])]
    return sorted(sel, key=lambda r: -r[key])[:n]


def _head_name(r) -> str:
    return f"{r['kind']} L{r['layer']}H{r['head']}"


def summarize(results: dict[str, Any], cfg: ModelConfig) -> str:
    """A short markdown summary of ``results`` (the numbers the report leads with)."""
    stats = results["head_stats"]
    lines = [f"# Inspecting {results['workdir']} (step {results['step']})", "",
             f"- Sentence: `{results['sentence']}`", f"- Greedy output: `{results['output']}`",
             f"- Dev sentences analysed: {results['num_dev_sentences']}", "", "## Heads", ""]
    for kind, offsets in (("encoder_self", ("prev", "self", "next")), ("decoder_self", ("prev", "self"))):
        for name in offsets:
            best = _top(stats, name, 2, lambda r, k=kind: r["kind"] == k)
            lines.append(f"- {KIND_TITLES[kind]}, most '{name}'-position mass: " + ", ".join(
                f"{_head_name(r)} {r[name]:.2f}" for r in best))
    sharp = _top(stats, "max_weight", 3)
    lines.append("- Sharpest heads (mean max weight): " + ", ".join(
        f"{_head_name(r)} {r['max_weight']:.2f} (entropy {r['entropy']:.2f} of {r['uniform_entropy']:.2f})"
        for r in sharp))
    if results["alignment"]:
        best = sorted(results["alignment"], key=lambda r: -r["mass_all"])[:3]
        first = sorted(results["alignment"], key=lambda r: -r["mass_first_reordered"])[:3]
        r0 = results["alignment"][0]
        lines.append(f"- Cross-attention mass on the grammar-aligned source word, every piece of "
                     f"{r0['words']} aligned words (uniform: {r0['chance_all']:.2f}): " + ", ".join(
                         f"L{r['layer']}H{r['head']} {r['mass_all']:.2f}" for r in best))
        lines.append(f"- The same for the stem (first piece) of the {r0['reordered_words']} reordered words "
                     f"(adjective after its noun, verb-final; uniform {r0['chance_first_reordered']:.2f}): "
                     + ", ".join(f"L{r['layer']}H{r['head']} {r['mass_first_reordered']:.2f}" for r in first))
    if results["ablation_baseline"] is not None:
        base = results["ablation_baseline"]
        worst = _top(stats, "delta_nll", 3)
        least = sorted(stats, key=lambda r: abs(r["delta_nll"]))[:3]
        rho = spearman([r["max_weight"] for r in stats], [r["delta_nll"] for r in stats])
        rho_h = spearman([-r["entropy"] for r in stats], [r["delta_nll"] for r in stats])
        lines += ["", "## Ablation (weights are not causal importance)", "", WEIGHTS_ARE_NOT_EXPLANATIONS, "",
                  f"- Baseline dev NLL {base['nll']:.4f} nats/token, accuracy {base['accuracy']:.4f}.",
                  "- Largest NLL increases: " + ", ".join(f"{_head_name(r)} +{r['delta_nll']:.4f}"
                                                          for r in worst),
                  "- Smallest |change|: " + ", ".join(f"{_head_name(r)} {r['delta_nll']:+.4f}"
                                                       for r in least),
                  f"- Spearman rank correlation of a head's mean max weight with its ablation effect: "
                  f"{rho:.2f}; of its negative entropy: {rho_h:.2f}."]
    rnd = results["scaling_random"]
    lines += ["", "## Scaling by 1/sqrt(d_k)", "",
              f"- Random unit-variance q, k over {math.exp(rnd[0]['uniform_entropy']):.0f} keys: entropy "
              f"scaled {rnd[0]['entropy_scaled']:.2f} -> {rnd[-1]['entropy_scaled']:.2f}, unscaled "
              f"{rnd[0]['entropy_unscaled']:.2f} -> {rnd[-1]['entropy_unscaled']:.2f} nats as d_k goes "
              f"{rnd[0]['d_k']} -> {rnd[-1]['d_k']} (uniform {rnd[0]['uniform_entropy']:.2f})."]
    for r in results["scaling_model"]:
        lines.append(f"- Model {r['kind']} L{r['layer']} (d_k={r['d_k']}): entropy "
                     f"{r['entropy_scaled']:.2f} as trained, {r['entropy_unscaled']:.2f} without the factor "
                     "(uniform "
                     f"{r['uniform_entropy']:.2f}); std of raw q.k {r['logit_std_unscaled']:.1f}.")
    p = results["positions"]
    lines += ["", "## Positions", "",
              f"- PE(pos+k) = M_k PE(pos) for every k in {p['offsets'][0]}..{p['offsets'][1]} "
              f"(d_model={cfg.d_model}): max error {p['max_fit_error']:.2e} with the fitted block-diagonal "
              f"M_k, {p['max_analytic_error']:.2e} with the analytic rotation; fitted vs analytic blocks "
              f"differ by at most {p['max_fit_vs_analytic']:.2e} (the lowest frequencies barely rotate "
              "over max_len positions, so the data pins their blocks down only loosely)."]
    if p["learned_encoder_table_error_k1to8"] is not None:
        lines.append(f"- The model's learned encoder position table (Table 3 row E): max error "
                     f"{p['learned_encoder_table_error_k1to8']:.3g} for k = 1, 2, 4, 8.")
    if results["complexity"]:
        lines += ["", "## Table 1 measured (one self-attention layer, forward)", ""]
        lines += [_complexity_line(impl, [r for r in results["complexity"] if r["impl"] == impl])
                  for impl in ("dense", "blockwise")]
        lines.append(f"- Attention (4 n^2 d) overtakes the projections (8 n d^2) at n = 2 d = "
                     f"{2 * cfg.d_model}. XLA's cost analysis counts a loop body once, so the blockwise "
                     "FLOPs cover one tile, not the layer.")
    return "\n".join(lines)


def _complexity_line(impl: str, rows: Sequence[dict[str, Any]]) -> str:
    """One summary line: FLOPs and time at the ends of the sweep, log-log slopes where n >= 2 d."""
    first, last = rows[0], rows[-1]
    big = [r for r in rows if r["n"] >= 2 * r["d_model"]]
    big = big if len(big) >= 2 else rows[-2:]
    n = [r["n"] for r in big]
    slopes = (f"log-log slope over n={n[0]}..{n[-1]}: FLOPs "
              f"{loglog_slope(n, [r['flops_xla'] for r in big]):.2f}, time "
              f"{loglog_slope(n, [r['seconds'] for r in big]):.2f}") if len(rows) >= 2 else "one length"
    analytic = last["flops_attention"] + last["flops_projections"]
    fit = ""
    if len(rows) >= 2 and impl == "dense":  # the blockwise XLA count is one tile, nothing to fit
        a, b, residual = fit_cost_model(rows)
        fit = f" Fit: XLA FLOPs = {a:.2f} n^2 d + {b:.2f} n d^2 (max relative residual {residual:.1%})."
    return (f"- {impl}: XLA FLOPs {first['flops_xla']:.3g} at n={first['n']} -> {last['flops_xla']:.3g} "
            f"at n={last['n']} (analytic {analytic:.3g}); {slopes}; {last['seconds'] * 1e3:.2f} ms at "
            f"n={last['n']}.{fit}")


def _image_html(path: str, alt: str) -> str:
    path, alt = html.escape(path), html.escape(alt)
    return f'<p><a href="{path}"><img src="{path}" alt="{alt}"></a></p>'


def _table_html(rows: Sequence[dict[str, Any]], digits: int = 3) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[c], digits))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_html(path: str, results: dict[str, Any], manifest: Sequence[dict], sm: SentenceMaps,
               cfg: ModelConfig) -> str:
    """One self-contained page (inline CSS and JS, relative image paths, no network) linking everything."""
    files = results["files"]
    maps = {f"{m['kind']}/{m['layer']}/{m['head']}": "maps/" + m["image"] for m in manifest}
    layers = {kind: cfg.num_encoder_layers if kind == "encoder_self" else cfg.num_decoder_layers
              for kind in KINDS}
    options = "".join(f'<option value="{k}">{html.escape(KIND_TITLES[k])}</option>' for k in KINDS)
    all_links = " ".join(f'<a href="{html.escape(p)}">{html.escape(k)}</a>' for k, p in maps.items())
    sections = [
        ("Head statistics", "head_stats_png", "head_stats_csv", results["head_stats"]),
        ("Scaling by 1/sqrt(d_k)", "scaling_png", "scaling_model_csv", results["scaling_model"]),
        ("Positions", "positions_png", "positions_csv", None),
        ("Table 1 measured", "complexity_png", "complexity_csv", results["complexity"]),
        ("Head ablation", "ablation_png", "ablation_csv", None),
        ("Cross-attention vs the grammar's alignment", None, "alignment_csv", results["alignment"]),
    ]
    file_links = " &middot; ".join(f'<a href="{html.escape(p)}">{html.escape(p)}</a>' for p in files.values())
    parts = []
    for title, png, table_file, rows in sections:
        if png not in files and table_file not in files:
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if title == "Head ablation":
            parts.append(f"<p><b>{html.escape(WEIGHTS_ARE_NOT_EXPLANATIONS)}</b></p>")
        if png in files:
            parts.append(_image_html(files[png], title))
        if table_file in files:
            link = html.escape(files[table_file])
            parts.append(f'<p>Data: <a href="{link}">{link}</a></p>')
        if rows:
            parts.append(f"<details><summary>table</summary>{_table_html(rows)}</details>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>transformer_jax inspect: step {results['step']}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; max-width: 1400px; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; font-size: 12px; }} td, th {{ border: 1px solid #ccc; padding: 2px 6px; }}
select {{ margin-right: 1em; }} pre {{ background: #f6f6f6; padding: 1em; white-space: pre-wrap; }}
</style></head><body>
<h1>Inside the Transformer: {html.escape(results['workdir'])}, step {results['step']}</h1>
<p>Source: <code>{html.escape(sm.source)}</code><br>Greedy output (drives the decoder maps):
<code>{html.escape(sm.output)}</code></p>
<h2>Attention maps</h2>
<p><label>Attention <select id="kind" onchange="update()">{options}</select></label>
<label>Layer <select id="layer" onchange="update()"></select></label>
<label>Head <select id="head" onchange="update()"></select></label>
<label><input type="checkbox" id="allheads" onchange="update()"> all heads of the layer</label>
<a id="maplink" href="#">open</a> &middot; numbers:
<a href="maps/attention_maps.npz">maps/attention_maps.npz</a>,
<a href="maps/manifest.json">maps/manifest.json</a></p>
<p><img id="map" src="{html.escape(maps[f'{KINDS[0]}/0/0'])}" alt="attention map"></p>
<div id="grid"></div>
<details><summary>all maps</summary><p>{all_links}</p></details>
<script>
const MAPS = {json.dumps(maps)};
const LAYERS = {json.dumps(layers)};
const HEADS = {cfg.num_heads};
function fill(id, n, keep) {{
  const s = document.getElementById(id); const old = s.value; s.innerHTML = "";
  for (let i = 0; i < n; i++) {{
    const o = document.createElement("option"); o.value = o.text = i; s.add(o);
  }}
  if (keep && old !== "" && Number(old) < n) s.value = old;
}}
function update() {{
  const kind = document.getElementById("kind").value;
  fill("layer", LAYERS[kind], true);
  const layer = document.getElementById("layer").value, head = document.getElementById("head").value;
  const key = kind + "/" + layer + "/" + head;
  const all = document.getElementById("allheads").checked, grid = document.getElementById("grid");
  document.getElementById("map").src = MAPS[key];
  document.getElementById("map").style.display = all ? "none" : "";
  document.getElementById("maplink").href = MAPS[key];
  grid.innerHTML = "";
  for (let h = 0; all && h < HEADS; h++) {{
    const img = document.createElement("img");
    img.src = MAPS[kind + "/" + layer + "/" + h]; img.style.maxWidth = "48%"; grid.appendChild(img);
  }}
}}
fill("head", HEADS, false); fill("layer", LAYERS["{KINDS[0]}"], false); update();
</script>
{"".join(parts)}
<h2>Summary</h2>
<p><a href="summary.md">summary.md</a> &middot; <a href="results.json">results.json</a></p>
<p>All files: {file_links}</p>
<pre>{html.escape(results['summary'])}</pre>
</body></html>
"""
    with open(path, "w") as f:
        f.write(page)
    return path
