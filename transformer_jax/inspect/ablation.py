"""An intervention: every head ablated in turn (its rows of W^O zeroed) and the change in dev loss.

An attention weight is a mixing coefficient, not an explanation; the ablation measures how much the
output depends on a head, beside the descriptive statistics of ``heads``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer_jax.checkpoints.restore import Restored
from transformer_jax.evaluation.scoring import perplexity
from transformer_jax.inspect import artifacts, forward

WEIGHTS_ARE_NOT_EXPLANATIONS = (
    "An attention weight is a mixing coefficient, not an explanation: it says how much of a value vector "
    "a head mixes in, not whether the output depends on it. The ablation (each head's rows of W^O zeroed "
    "in turn) measures that dependence directly, and it need not agree with how sharp or how "
    "interpretable a head's maps look.")
BASELINE = ("baseline", -1, -1)  # the key of the unablated numbers in ``ablate_heads``'s result


def ablated_params(params: Any, kind: str, layer: int, head: int) -> Any:
    """A copy of ``params`` with head ``head``'s rows of W^O (out kernel [h, d_v, d_model]) zeroed.

    The head's output is multiplied by exactly zero, so the rest of the model sees it removed. Only the
    path to that kernel is copied; every other leaf is shared with ``params`` (which is not mutated).
    """
    stack, module = forward.MODULES[kind]
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
      ``BASELINE`` the unablated numbers.
    """
    cfg = restored.model_config
    base = perplexity(restored.params, cfg, batches)
    out = {BASELINE: {"nll": base["nll"], "delta_nll": 0.0, "accuracy": base["accuracy"],
                      "delta_accuracy": 0.0}}
    for kind in forward.KINDS:
        for layer in range(forward.num_layers(cfg, kind)):
            for head in range(cfg.num_heads):
                m = perplexity(ablated_params(restored.params, kind, layer, head), cfg, batches)
                out[(kind, layer, head)] = {"nll": m["nll"], "delta_nll": m["nll"] - base["nll"],
                                            "accuracy": m["accuracy"],
                                            "delta_accuracy": m["accuracy"] - base["accuracy"]}
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (no ties correction; NaNs dropped pairwise; NaN under 3 pairs)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 3:
        return float("nan")
    rx, ry = (np.argsort(np.argsort(np.asarray(v))).astype(float) for v in zip(*pairs, strict=True))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def plot_ablation(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Bars of the dev-NLL change per ablated head, and that change against the head's mean max weight.

    Args:
      rows: ``heads.head_stats_rows`` with the ablation (each has "delta_nll" and "max_weight").
    """
    fig = artifacts.figure(max(8.0, 0.28 * len(rows) + 5), 4.4)
    ax = fig.add_subplot(1, 2, 1)
    colors = {"encoder_self": "tab:blue", "decoder_self": "tab:orange", "cross": "tab:green"}
    short = {"encoder_self": "enc", "decoder_self": "dec", "cross": "x"}
    ax.bar(range(len(rows)), [r["delta_nll"] for r in rows], color=[colors[r["kind"]] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{short[r['kind']]} L{r['layer']}H{r['head']}" for r in rows],
                  rotation=90, fontsize=7)
    ax.set_ylabel("dev NLL with the head ablated - baseline (nats/token)")
    ax.set_title("ablating one head at a time (its W^O rows zeroed)", fontsize=10)
    for kind, color in colors.items():
        ax.bar([0], [0], color=color, label=forward.KIND_TITLES[kind])
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    for kind, color in colors.items():
        sel = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["max_weight"] for r in sel], [r["delta_nll"] for r in sel], color=color,
                   label=forward.KIND_TITLES[kind], s=18)
    ax.set_xlabel("head's mean max attention weight (dev)")
    ax.set_ylabel("dev NLL change when ablated")
    ax.set_title("is a sharp head an important head?", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return artifacts.save(fig, path)
