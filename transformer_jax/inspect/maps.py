"""The attention maps of one sentence: greedy-decode it, run the teacher-forced forward on that output, plot.

Writes ``maps/{kind}_layer{l}_head{h}.png`` (pieces on the axes), ``maps/attention_maps.npz`` (the numbers
behind every plot) and ``maps/manifest.json`` (which array and head each PNG shows).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.checkpoints.restore import Restored
from transformer_jax.evaluation import paper
from transformer_jax.inspect import artifacts, forward
from transformer_jax.model.special_ids import BOS_ID

_AXIS_LABELS = {"encoder_self": ("query (source piece)", "key (source piece)"),
                "decoder_self": ("query (piece it predicts)", "key (decoder input piece)"),
                "cross": ("query (piece it predicts)", "key (source piece)")}


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


def sentence_maps(restored: Restored, sentence: str, *,
                  max_extra_len: int = paper.MAX_EXTRA_LEN) -> SentenceMaps:
    """Greedy-decodes ``sentence``, then runs the teacher-forced forward on that output for the maps."""
    tok = restored.tokenizer
    inputs = forward.encode_sentence(tok, sentence, restored.model_config.max_len)
    output = forward.greedy_output(restored.params, restored.model_config, inputs,
                                   max_extra_len=max_extra_len)
    records = forward.attention_records(restored.params, restored.model_config, inputs, output)
    out_ids = output[0].tolist()
    return SentenceMaps(
        source=sentence, output=tok.decode_batch(output[:1])[0],
        source_pieces=forward.pieces(tok, inputs[0]),
        output_pieces=forward.pieces(tok, out_ids),
        decoder_input_pieces=forward.pieces(tok, [BOS_ID, *out_ids[:-1]]),
        maps={kind: np.stack([r.weights[0] for r in recs]) for kind, recs in records.items()})


def plot_attention_map(weights: np.ndarray, query_pieces: Sequence[str], key_pieces: Sequence[str],
                       title: str, path: str, *, query_label: str, key_label: str) -> str:
    """Heatmap of float[q_len, kv_len] weights with the pieces on the axes; returns ``path``."""
    q_len, kv_len = weights.shape
    fig = artifacts.figure(max(4.0, 0.26 * kv_len + 2.2), max(3.5, 0.26 * q_len + 1.6))
    ax = fig.add_subplot()
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(kv_len), list(key_pieces), rotation=90, fontsize=8)
    ax.set_yticks(range(q_len), list(query_pieces), fontsize=8)
    ax.set_xlabel(key_label)
    ax.set_ylabel(query_label)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    return artifacts.save(fig, path)


def write_sentence_maps(sm: SentenceMaps, out_dir: str) -> list[dict[str, Any]]:
    """Writes one PNG per (kind, layer, head), ``attention_maps.npz`` and ``manifest.json`` into ``out_dir``.

    Returns:
      The manifest: one entry per image with its relative path, kind, layer, head and npz key.
    """
    os.makedirs(out_dir, exist_ok=True)
    manifest = []
    for kind in forward.KINDS:
        queries, keys = sm.axis_pieces(kind)
        query_label, key_label = _AXIS_LABELS[kind]
        for layer, heads in enumerate(sm.maps[kind]):
            for head, weights in enumerate(heads):
                name = f"{kind}_layer{layer}_head{head}.png"
                plot_attention_map(weights, queries, keys,
                                   f"{forward.KIND_TITLES[kind]}, layer {layer}, head {head}",
                                   os.path.join(out_dir, name), query_label=query_label, key_label=key_label)
                manifest.append({"image": name, "kind": kind, "layer": layer, "head": head, "npz_key": kind})
    np.savez(os.path.join(out_dir, "attention_maps.npz"),
             source_pieces=np.asarray(sm.source_pieces), output_pieces=np.asarray(sm.output_pieces),
             decoder_input_pieces=np.asarray(sm.decoder_input_pieces),
             **{kind: sm.maps[kind] for kind in forward.KINDS})
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump({"source": sm.source, "output": sm.output, "npz": "attention_maps.npz",
                   "npz_layout": "{kind}: float32[layers, heads, q_len, kv_len]", "images": manifest},
                  f, indent=1)
    return manifest
