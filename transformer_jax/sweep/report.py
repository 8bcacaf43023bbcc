"""The report of a sweep workdir: ``report.md``, ``report.csv`` and ``report.png``, and the params table.

For Table 3 sweeps, each row sits beside the paper's row, and the direction of each change against the
base row (PPL and BLEU up or down) is compared with the paper's. The base row's seeds (``base``,
``base-seed1``, ...) give the noise band: a row whose value lies within the seeds' range (min to max) is
"within noise", not a direction. With one seed, the band is the base value +- the tolerances below.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax import run_config
from transformer_jax.evaluation import paper
from transformer_jax.model.config import param_count
from transformer_jax.sweep.grid import Row, describe, format_value, load_config, table3_config_arg
from transformer_jax.sweep.launchers import (
    MANIFEST,
    final_train_record,
    latest_dev_eval,
    read_result,
    result_from,
)

# Below these a change counts as "flat" in the paper's printed figures (and is the noise band of a sweep
# whose base row has one seed).
PPL_TOLERANCE = 0.01  # relative: 1% of the base row's perplexity
BLEU_TOLERANCE = 0.25  # absolute BLEU points
# How the report names a dev BLEU protocol (``config.dev_bleu_protocol``).
PROTOCOL_NAMES = {"tokenized": "tokenized BLEU (the paper's protocol)",
                  "multi30k": "Multi30k BLEU (the dataset's convention: lowercased, Moses-tokenized)",
                  "sacrebleu": "sacreBLEU (13a, cased)"}
# Below this base-row BLEU the models do not translate yet and BLEU directions are not compared.
MIN_BASE_BLEU = 1.0


def _paper_params(row: Row | dict) -> int | None:
    name = row.paper_row if isinstance(row, Row) else row.get("paper_row")
    return paper.TABLE3_BY_NAME[name].params_millions if name else None


def paper_scale_params(row_name: str) -> int:
    """The exact parameter count of a Table 3 row at paper scale (its config's 37k vocabulary)."""
    config, _ = load_config(table3_config_arg(row_name, "paper"))
    return param_count(run_config.build_run_config(config, environment=False).model)


def direction(value: float, base: float, kind: str) -> str:
    """"up", "down" or "flat" (within PPL_TOLERANCE relative / BLEU_TOLERANCE absolute)."""
    delta = (value - base) / base if kind == "ppl" else value - base
    tolerance = PPL_TOLERANCE if kind == "ppl" else BLEU_TOLERANCE
    return "flat" if abs(delta) <= tolerance else "up" if delta > 0 else "down"


def noise_band(values: Sequence[float], kind: str) -> tuple[float, float]:
    """The range a row must leave to count as a change: the base seeds' min to max.

    One seed has no spread; its band is the value +- PPL_TOLERANCE (relative) / BLEU_TOLERANCE.
    """
    if len(values) > 1:
        return min(values), max(values)
    (value,) = values
    tolerance = value * PPL_TOLERANCE if kind == "ppl" else BLEU_TOLERANCE
    return value - tolerance, value + tolerance


def band_direction(value: float, band: tuple[float, float]) -> str:
    """"up", "down", or "within noise" when ``value`` lies inside ``band`` (ends included)."""
    low, high = band
    return "within noise" if low <= value <= high else "up" if value > high else "down"


def verdict(ours: str, paper_direction: str) -> str:
    """"within noise", "agrees" or "differs" (the paper's "flat" against a change here differs)."""
    return ours if ours == "within noise" else "agrees" if ours == paper_direction else "differs"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _load_results(workdir: str) -> tuple[dict, list[dict], list[str]]:
    """(manifest, its rows with their results, warnings): a result that does not read is named in a
    warning and its row counts as not finished."""
    path = os.path.join(workdir, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {MANIFEST} in {workdir}; launch a sweep there first")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} does not read ({e}); launch the sweep again to rewrite it") from None
    records, warnings = [], []
    for entry in manifest["rows"]:
        row_dir = os.path.join(workdir, entry["name"])
        result, problem = read_result(row_dir)
        if result is None:  # run by hand (--launcher print): train.py's metrics and evaluate.py's dev score
            final = final_train_record(row_dir, entry["num_steps"])
            evaluation = latest_dev_eval(row_dir)
            if final and evaluation and evaluation["step"] >= entry["num_steps"]:
                protocol = entry.get("bleu_protocol", "tokenized")
                result = {**result_from(entry["name"], entry["changes"], evaluation, final, protocol),
                          "wall_seconds": final["train_seconds"]}  # training only: evaluation untimed
        if problem:
            warnings.append(f"row {entry['name']}: {problem}; " + (
                "its scores are read from its metrics.jsonl and eval/ instead" if result else
                "it counts as not finished") + " (launching the sweep again evaluates it again)")
        records.append({**entry, "result": result})
    return manifest, records, warnings


def build_report(workdir: str) -> dict[str, Any]:
    """Markdown, CSV rows and the per-row comparison of a sweep workdir (nothing written)."""
    manifest, records, warnings = _load_results(workdir)
    is_table3 = manifest["grid"] == "table3"
    scale = manifest["scale"]
    seeds = [r["result"] for r in records if r.get("paper_row") == "base" and r["result"]]
    base = None
    if is_table3 and seeds:  # the seeds' mean, and their spread as the noise band
        base = {kind: float(np.mean([s[f"dev_{kind}"] for s in seeds])) for kind in ("ppl", "bleu")}
        bands = {kind: noise_band([s[f"dev_{kind}"] for s in seeds], kind) for kind in ("ppl", "bleu")}
    csv_rows = []
    for r in records:
        res = r["result"] or {}
        item = {"row": r["name"], "changes": _changes_text(r["changes"]), "params": r["params"],
                "dev_ppl": res.get("dev_ppl"), "dev_bleu": res.get("dev_bleu"),
                "dev_sacrebleu": res.get("dev_sacrebleu"), "steps": res.get("step"),
                "num_steps": r["num_steps"], "wall_seconds": res.get("wall_seconds"),
                "status": "done" if res else "not finished"}
        if is_table3:
            p = paper.TABLE3_BY_NAME[r["paper_row"]]
            item.update(group=p.group, paper_params_millions=p.params_millions, paper_ppl=p.ppl_dev,
                        paper_bleu=p.bleu_dev)
            if scale != "paper":
                item["params_at_paper_scale"] = paper_scale_params(r["paper_row"])
            if base and res and r.get("paper_row") != "base":
                pb = paper.TABLE3_BY_NAME["base"]
                for kind, ours, theirs, theirs_base in (("ppl", res["dev_ppl"], p.ppl_dev, pb.ppl_dev),
                                                        ("bleu", res["dev_bleu"], p.bleu_dev, pb.bleu_dev)):
                    item[f"{kind}_vs_base"] = band_direction(ours, bands[kind])
                    item[f"paper_{kind}_vs_base"] = direction(theirs, theirs_base, kind)
                    item[f"{kind}_verdict"] = verdict(item[f"{kind}_vs_base"], item[f"paper_{kind}_vs_base"])
                    if kind == "bleu" and base["bleu"] < MIN_BASE_BLEU:
                        item["bleu_verdict"] = "not compared"  # no row translates yet
                    item[f"{kind}_delta"] = _delta(ours, base[kind], kind)
                    item[f"paper_{kind}_delta"] = _delta(theirs, theirs_base, kind)
        csv_rows.append(item)
    noise = None
    if base:
        noise = {"seeds": len(seeds), **{f"base_{kind}": base[kind] for kind in base},
                 **{f"{kind}_band": bands[kind] for kind in bands}}
    protocol = next((r["result"].get("bleu_protocol") for r in records if r["result"]), None)
    markdown = _markdown(manifest, csv_rows, noise, protocol or "tokenized", warnings)
    return {"markdown": markdown, "rows": csv_rows, "manifest": manifest, "noise": noise,
            "warnings": warnings}


def _delta(value: float, base: float, kind: str) -> float:
    """The change against the base: in % for PPL, in points for BLEU."""
    return (value - base) / base * 100 if kind == "ppl" else value - base


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in changes.items()) or "—"


def _markdown(manifest: dict, rows: list[dict], noise: dict | None, protocol: str,
              warnings: Sequence[str] = ()) -> str:
    is_table3, scale = manifest["grid"] == "table3", manifest["scale"]
    done = [r for r in rows if r["status"] == "done"]
    out = [f"**Warning:** {w}\n" for w in warnings]
    if is_table3:
        out.append(f"## Table 3 sweep, {scale} scale ({len(done)} of {len(rows)} rows finished)\n")
        out.append(f"Dev PPL is per subword on the run's dev split; dev BLEU is {PROTOCOL_NAMES[protocol]}. "
                   "Paper columns: Table 3, newstest2013, beam 4, 37k BPE.\n")
        if scale != "paper":
            out.append(f"**{scale} scale: absolute values are not comparable with the paper's** "
                       f"({_scale_summary(scale)}). The paper's PPL is per wordpiece of a 37k vocabulary "
                       "on WMT newstest2013, so only the direction of each change against the base row "
                       "compares (below). 'params' counts this scale's model; 'at paper scale' is the same "
                       "row built at paper scale (37k vocabulary), beside the paper's x10^6.\n")
            header = ["row", "changes", "params", "at paper scale (x10^6)", "paper (x10^6)",
                      "dev PPL", "paper PPL", "dev BLEU", "paper BLEU", "steps", "wall"]
        else:
            header = ["row", "changes", "params", "x10^6", "paper (x10^6)", "dev PPL", "paper PPL",
                      "dev BLEU", "paper BLEU", "steps", "wall"]
    else:
        out.append(f"## Sweep over {manifest['config']}: `{manifest['grid']}` "
                   f"({len(done)} of {len(rows)} rows finished)\n")
        header = ["row", "params", "dev PPL", "dev BLEU", "steps", "wall"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" if h in ("row", "changes") else "---:" for h in header) + "|")
    for r in rows:
        steps = f"{r['steps']:,}" if r["steps"] is not None else f"— / {r['num_steps']:,}"
        wall = _duration(r["wall_seconds"])
        if is_table3:
            paper_params = _fmt(r["paper_params_millions"], "d")
            second = (_fmt(r["params_at_paper_scale"] / 1e6, ".1f") if scale != "paper"
                      else _fmt(r["params"] / 1e6, ".1f"))
            cells = [r["row"], r["changes"], f"{r['params']:,}", second, paper_params,
                     _fmt(r["dev_ppl"]), _fmt(r["paper_ppl"]), _fmt(r["dev_bleu"]),
                     _fmt(r["paper_bleu"], ".1f"), steps, wall]
        else:
            cells = [r["row"], f"{r['params']:,}", _fmt(r["dev_ppl"]), _fmt(r["dev_bleu"]), steps, wall]
        out.append("| " + " | ".join(cells) + " |")
    walls = [r["wall_seconds"] for r in done if r["wall_seconds"] is not None]
    if walls:
        out.append(f"\nWall time, all finished rows (training and evaluation, every attempt): "
                   f"{_duration(sum(walls))}.")
    if is_table3:
        out.append("")
        out.extend(_direction_section(rows, noise))
    return "\n".join(out) + "\n"


def _scale_summary(scale: str) -> str:
    """How ``scale``'s base row differs from the paper's, read from the two configs."""
    ours, theirs = (load_config(table3_config_arg("base", s))[0] for s in (scale, "paper"))
    width = theirs.model.d_model / ours.model.d_model
    depth = theirs.model.num_encoder_layers / ours.model.num_encoder_layers
    return (f"{ours.data.source} data, {ours.data.vocab_size}-token vocabulary, 1/{width:g} of the width, "
            f"1/{depth:g} of the depth, {ours.train.num_steps:,} steps of {ours.data.tokens_per_batch:,} "
            f"tokens instead of {theirs.train.num_steps:,} of {theirs.data.tokens_per_batch:,}; "
            "see configs/table3.py")


def _direction_section(rows: list[dict], noise: dict | None) -> list[str]:
    if noise is None:
        return ["No finished base row: the direction of each change cannot be compared "
                "(add `--rows base`)."]
    compared = [r for r in rows if "ppl_vs_base" in r]
    if not compared:
        return ["Only the base row has finished; nothing to compare with it yet."]
    (ppl_low, ppl_high), (bleu_low, bleu_high) = noise["ppl_band"], noise["bleu_band"]
    if noise["seeds"] > 1:
        band = (f"the spread of the base row's {noise['seeds']} seeds: dev PPL {ppl_low:.2f} to "
                f"{ppl_high:.2f}, dev BLEU {bleu_low:.2f} to {bleu_high:.2f}; changes are against their "
                f"mean (PPL {noise['base_ppl']:.2f}, BLEU {noise['base_bleu']:.2f})")
    else:
        band = (f"one base seed, so the band is its value +- {PPL_TOLERANCE:.0%} PPL / {BLEU_TOLERANCE} BLEU "
                "(run the sweep with --base_seeds=3 for a measured band)")
    out = ["### Direction of each change against the base row\n",
           f"A row's change is a direction only outside the noise band, {band}; otherwise it is 'within "
           f"noise'. The paper's direction is 'flat' within {PPL_TOLERANCE:.0%} PPL or {BLEU_TOLERANCE} "
           "BLEU of its base row.\n",
           "| row | changes | PPL vs base | paper | | BLEU vs base | paper | |",
           "|---|---|---|---|---|---|---|---|"]
    for r in compared:
        out.append(
            f"| {r['row']} | {r['changes']} "
            f"| {r['ppl_vs_base']} ({r['ppl_delta']:+.1f}%) | {r['paper_ppl_vs_base']} "
            f"({r['paper_ppl_delta']:+.1f}%) | {r['ppl_verdict']} "
            f"| {r['bleu_vs_base']} ({r['bleu_delta']:+.2f}) | {r['paper_bleu_vs_base']} "
            f"({r['paper_bleu_delta']:+.1f}) | {r['bleu_verdict']} |")
    out += ["\nBy group (rows whose direction agrees with the paper's / differs / lies within noise):\n",
            "| group | rows | PPL: agree | differ | within noise | BLEU: agree | differ | within noise |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups = dict.fromkeys(r["group"] for r in compared)
    for group in [*groups, "all"]:
        members = [r for r in compared if group in ("all", r["group"])]
        counts = [sum(r[f"{kind}_verdict"] == v for r in members)
                  for kind in ("ppl", "bleu") for v in ("agrees", "differs", "within noise")]
        out.append(f"| {group} | {len(members)} | " + " | ".join(map(str, counts)) + " |")
    if noise["base_bleu"] < MIN_BASE_BLEU:
        out.append(f"\nBLEU directions are not compared: the base row's dev BLEU is "
                   f"{noise['base_bleu']:.2f} (< {MIN_BASE_BLEU}): the models do not translate yet at this "
                   "budget, so BLEU differences between rows are noise.")
    return out


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def write_report(workdir: str) -> dict[str, str]:
    """Writes ``report.md``, ``report.csv`` and ``report.png`` into the workdir; returns their paths."""
    report = build_report(workdir)
    paths = {ext: os.path.join(workdir, f"report.{ext}") for ext in ("md", "csv", "png")}
    with open(paths["md"], "w") as f:
        f.write(report["markdown"])
    fields = list(dict.fromkeys(k for row in report["rows"] for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(report["rows"])
    with open(paths["csv"], "w", newline="") as f:
        f.write(buffer.getvalue())
    _plot(report, paths["png"])
    return {**paths, "markdown": report["markdown"]}


# verdict -> (bar color, legend text)
VERDICT_STYLES = {"agrees": ("tab:green", "agrees with the paper"),
                  "differs": ("tab:red", "differs from the paper"),
                  "within noise": ("tab:gray", "within noise"), "not compared": ("lightgray", "not compared")}


def _plot(report: dict, path: str) -> None:
    """Table 3 with a base row: each row's dev PPL and BLEU, the base seeds' noise band shaded, bars
    colored by the verdict against the paper. Otherwise each row's absolute values."""
    # Imported here: matplotlib is heavy and only the report's plot needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [r for r in report["rows"] if r["status"] == "done"]
    noise = report["noise"]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.7 * max(len(rows), 1) + 4), 4.5))
    x = np.arange(len(rows))
    for ax, kind, label in ((axes[0], "ppl", "dev PPL"), (axes[1], "bleu", "dev BLEU")):
        colors = [VERDICT_STYLES[r[f"{kind}_verdict"]][0] if f"{kind}_verdict" in r else "tab:blue"
                  for r in rows]
        ax.bar(x, [r[f"dev_{kind}"] for r in rows], color=colors)
        if noise:
            low, high = noise[f"{kind}_band"]
            ax.axhspan(low, high, color="tab:blue", alpha=0.2, label="noise band (base seeds)")
            values = [r[f"dev_{kind}"] for r in rows]
            margin = max(high - low, 0.02 * max(values))
            ax.set_ylim(max(0.0, min(values + [low]) - 3 * margin), max(values + [high]) + 3 * margin)
        ax.set_xticks(x, [r["row"] for r in rows], rotation=60, ha="right", fontsize=8)
        ax.set_title(label)
    if noise:
        handles = [Patch(color="tab:blue", alpha=0.2, label=f"noise band ({noise['seeds']} base seeds)"),
                   Patch(color="tab:blue", label="base seeds"),
                   *(Patch(color=color, label=text) for color, text in VERDICT_STYLES.values())]
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    scale = report["manifest"]["scale"]
    fig.suptitle(f"Table 3, {scale} scale: each row against the base row's noise band" if noise
                 else f"Sweep: {report['manifest']['grid']}")
    fig.tight_layout(rect=(0.0, 0.06 if noise else 0.0, 1.0, 1.0))  # room for the legend below
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# Parameter counts (``python -m transformer_jax.sweep params``).


def params_table(rows: Sequence[Row], info: dict) -> str:
    """Markdown: each row's exact parameter count beside the paper's x10^6 (nothing is trained)."""
    lines = ["| row | changes | params (exact) | x10^6 | paper x10^6 |", "|---|---|---:|---:|---:|"]
    for row in rows:
        count = info[row.name]["params"]
        lines.append(f"| {row.name} | {describe(row)} | {count:,} | {count / 1e6:.1f} "
                     f"| {_fmt(_paper_params(row), 'd')} |")
    vocab = {v["vocab_size"] for v in info.values()}
    lines.append(f"\nShared vocabulary: {', '.join(str(v) for v in sorted(vocab))}.")
    return "\n".join(lines)
