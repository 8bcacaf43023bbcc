"""The sweep report's plot (``report.png``): dev PPL and BLEU per row, against the base seeds' noise band."""

from __future__ import annotations

import numpy as np

from transformer_jax.sweep.grid import BEYOND

# verdict -> (bar color, legend text)
VERDICT_STYLES = {"agrees": ("tab:green", "agrees with the paper"),
                  "differs": ("tab:red", "differs from the paper"),
                  "within noise": ("tab:gray", "within noise"), "not compared": ("lightgray", "not compared"),
                  BEYOND: ("tab:purple", f"{BEYOND} (E+): no paper figures")}


def plot_report(report: dict, path: str) -> None:
    """Table 3: one bar per row, its seeds' mean dev PPL and BLEU with their band (min to max) as error
    bars, the base seeds' noise band shaded, bars colored by the verdict against the paper, rows beyond
    the paper hatched. A generic grid: each row's values."""
    # Imported here: matplotlib is heavy and only the report's plot needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    is_table3 = report["manifest"]["grid"] == "table3"
    if is_table3:
        bars = [{"row": b["row"], **{f"dev_{k}": b[f"dev_{k}_mean"] for k in ("ppl", "bleu")}, **b}
                for b in report["bands"] if b["seeds"]]
    else:
        bars = [r for r in report["rows"] if r["status"] == "done"]
    noise = report["noise"]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.7 * max(len(bars), 1) + 4), 4.5))
    x = np.arange(len(bars))
    for ax, kind, label in ((axes[0], "ppl", "dev PPL"), (axes[1], "bleu", "dev BLEU")):
        colors = [VERDICT_STYLES[r[f"{kind}_verdict"]][0] if f"{kind}_verdict" in r else "tab:blue"
                  for r in bars]
        values = [r[f"dev_{kind}"] for r in bars]
        errors = None
        if is_table3:  # the band: mean - min below, max - mean above
            errors = np.array([[r[f"dev_{kind}"] - r[f"dev_{kind}_min"] for r in bars],
                               [r[f"dev_{kind}_max"] - r[f"dev_{kind}"] for r in bars]]).reshape(2, len(bars))
        drawn = ax.bar(x, values, color=colors, yerr=errors, capsize=3 if is_table3 else 0,
                       error_kw={"ecolor": "black", "elinewidth": 1})
        for patch, r in zip(drawn, bars, strict=True):
            if r.get("beyond_paper"):
                patch.set_hatch("//")
                patch.set_edgecolor("white")
        if noise:
            low, high = noise[f"{kind}_band"]
            ax.axhspan(low, high, color="tab:blue", alpha=0.2, label="noise band (base seeds)")
            tops = [r[f"dev_{kind}_max"] for r in bars] + [high]
            bottoms = [r[f"dev_{kind}_min"] for r in bars] + [low]
            margin = max(high - low, 0.02 * max(tops))
            ax.set_ylim(max(0.0, min(bottoms) - 3 * margin), max(tops) + 3 * margin)
        ax.set_xticks(x, [r["row"] for r in bars], rotation=60, ha="right", fontsize=8)
        seeds_note = " (the row's seeds: mean; error bars: min to max)" if is_table3 else ""
        ax.set_title(label + seeds_note, fontsize=9)
    if noise:
        handles = [Patch(color="tab:blue", alpha=0.2, label=f"noise band ({noise['seeds']} base seeds)"),
                   Patch(color="tab:blue", label="base seeds"),
                   *(Patch(facecolor=color, label=text, hatch="//" if text.startswith(BEYOND) else None,
                           edgecolor="white") for color, text in VERDICT_STYLES.values())]
        fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    scale = report["manifest"]["scale"]
    fig.suptitle(f"Table 3, {scale} scale: each row against the base row's noise band" if noise
                 else f"Sweep: {report['manifest']['grid']}")
    fig.tight_layout(rect=(0.0, 0.1 if noise else 0.0, 1.0, 1.0))  # room for the legend below
    fig.savefig(path, dpi=100)
    plt.close(fig)
