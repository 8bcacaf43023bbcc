"""The report of a sweep workdir: ``report.md``, ``report.csv`` and ``report.png``, and the params table.

For Table 3 sweeps, each row sits beside the paper's row, and the direction of each change against the
base row (PPL and BLEU up, down or flat) is compared with the paper's.
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

from transformer_jax import paper
from transformer_jax.model import ModelConfig, param_count
from transformer_jax.sweep.grid import Row, describe, format_value, load_config, table3_config_arg
from transformer_jax.sweep.launchers import MANIFEST, RESULT, final_train_record, latest_dev_eval, result_from

# Below these a change counts as "flat" (both for this run and for the paper's printed figures).
PPL_TOLERANCE = 0.01  # relative: 1% of the base row's perplexity
BLEU_TOLERANCE = 0.25  # absolute BLEU points
# Below this base-row BLEU the models do not translate yet and BLEU directions are not compared.
MIN_BASE_BLEU = 1.0


def _paper_params(row: Row | dict) -> int | None:
    name = row.paper_row if isinstance(row, Row) else row.get("paper_row")
    return paper.TABLE3_BY_NAME[name].params_millions if name else None


def paper_scale_params(row_name: str) -> int:
    """The exact parameter count of a Table 3 row at paper scale (its config's 37k vocabulary)."""
    config, _ = load_config(table3_config_arg(row_name, "paper"))
    return param_count(ModelConfig(vocab_size=config.data.vocab_size, **config.model))


def direction(value: float, base: float, kind: str) -> str:
    """"up", "down" or "flat" (within PPL_TOLERANCE relative / BLEU_TOLERANCE absolute)."""
    delta = (value - base) / base if kind == "ppl" else value - base
    tolerance = PPL_TOLERANCE if kind == "ppl" else BLEU_TOLERANCE
    return "flat" if abs(delta) <= tolerance else "up" if delta > 0 else "down"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _load_results(workdir: str) -> tuple[dict, list[dict]]:
    path = os.path.join(workdir, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {MANIFEST} in {workdir}; launch a sweep there first")
    with open(path) as f:
        manifest = json.load(f)
    records = []
    for entry in manifest["rows"]:
        row_dir = os.path.join(workdir, entry["name"])
        result = None
        if os.path.exists(os.path.join(row_dir, RESULT)):
            with open(os.path.join(row_dir, RESULT)) as f:
                result = json.load(f)
        else:  # run by hand (--launcher print): train.py's metrics and evaluate.py's dev score
            final = final_train_record(row_dir, entry["num_steps"])
            evaluation = latest_dev_eval(row_dir)
            if final and evaluation and evaluation["step"] >= entry["num_steps"]:
                result = {**result_from(entry["name"], entry["changes"], evaluation, final),
                          "wall_seconds": final["train_seconds"]}  # training only: evaluation untimed
        records.append({**entry, "result": result})
    return manifest, records


def build_report(workdir: str) -> dict[str, Any]:
    """Markdown, CSV rows and the per-row comparison of a sweep workdir (nothing written)."""
    manifest, records = _load_results(workdir)
    is_table3 = manifest["grid"] == "table3"
    scale = manifest["scale"]
    base = next((r["result"] for r in records if r["name"] == "base" and r["result"]), None)
    csv_rows = []
    for r in records:
        res = r["result"] or {}
        item = {"row": r["name"], "changes": _changes_text(r["changes"]), "params": r["params"],
                "dev_ppl": res.get("dev_ppl"), "dev_bleu": res.get("dev_bleu"),
                "dev_sacrebleu": res.get("dev_sacrebleu"), "steps": res.get("step"),
                "num_steps": r["num_steps"], "wall_seconds": res.get("wall_seconds"),
                "status": "done" if res else "not finished"}
        if is_table3:
            p = paper.TABLE3_BY_NAME[r["name"]]
            item.update(paper_params_millions=p.params_millions, paper_ppl=p.ppl_dev, paper_bleu=p.bleu_dev)
            if scale != "paper":
                item["params_at_paper_scale"] = paper_scale_params(r["name"])
            if base and res and r["name"] != "base":
                pb = paper.TABLE3_BY_NAME["base"]
                for kind, ours, theirs, ours_base, theirs_base in (
                        ("ppl", res["dev_ppl"], p.ppl_dev, base["dev_ppl"], pb.ppl_dev),
                        ("bleu", res["dev_bleu"], p.bleu_dev, base["dev_bleu"], pb.bleu_dev)):
                    item[f"{kind}_vs_base"] = direction(ours, ours_base, kind)
                    item[f"paper_{kind}_vs_base"] = direction(theirs, theirs_base, kind)
                    item[f"{kind}_agrees"] = item[f"{kind}_vs_base"] == item[f"paper_{kind}_vs_base"]
                    if kind == "bleu" and ours_base < MIN_BASE_BLEU:
                        item["bleu_agrees"] = None  # nothing to compare: no row translates yet
                    item[f"{kind}_delta"] = ((ours - ours_base) / ours_base * 100 if kind == "ppl"
                                             else ours - ours_base)
                    item[f"paper_{kind}_delta"] = ((theirs - theirs_base) / theirs_base * 100
                                                   if kind == "ppl" else theirs - theirs_base)
        csv_rows.append(item)
    markdown = _markdown(manifest, csv_rows, base is not None)
    return {"markdown": markdown, "rows": csv_rows, "manifest": manifest}


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in changes.items()) or "—"


def _markdown(manifest: dict, rows: list[dict], has_base: bool) -> str:
    is_table3, scale = manifest["grid"] == "table3", manifest["scale"]
    done = [r for r in rows if r["status"] == "done"]
    out = []
    if is_table3:
        out.append(f"## Table 3 sweep, {scale} scale ({len(done)} of {len(rows)} rows finished)\n")
        out.append("Dev PPL is per subword on the run's dev split; dev BLEU is tokenized BLEU (the "
                   "paper's protocol). Paper columns: Table 3, newstest2013, beam 4, 37k BPE.\n")
        if scale != "paper":
            out.append(f"**{scale} scale: absolute values are not comparable with the paper's** "
                       f"({_scale_summary(scale)}). Compare the direction of each change against the base "
                       "row (below). 'params' counts this scale's model; 'at paper scale' is the same row "
                       "built at paper scale (37k vocabulary), beside the paper's x10^6.\n")
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
        out.extend(_direction_section(rows, has_base))
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


def _direction_section(rows: list[dict], has_base: bool) -> list[str]:
    if not has_base:
        return ["No finished base row: the direction of each change cannot be compared "
                "(add `--rows base`)."]
    compared = [r for r in rows if "ppl_vs_base" in r]
    if not compared:
        return ["Only the base row has finished; nothing to compare with it yet."]
    out = ["### Direction of each change against the base row\n",
           f"'flat' = within {PPL_TOLERANCE:.0%} of the base PPL or {BLEU_TOLERANCE} BLEU "
           "(the same rule for the paper's printed figures and for this run). One seed per row: "
           "small changes at reduced scale are within run-to-run noise.\n",
           "| row | changes | PPL vs base | paper | | BLEU vs base | paper | |",
           "|---|---|---|---|---|---|---|---|"]
    verdict = {True: "agrees", False: "differs", None: "not compared"}
    for r in compared:
        out.append(
            f"| {r['row']} | {r['changes']} "
            f"| {r['ppl_vs_base']} ({r['ppl_delta']:+.1f}%) | {r['paper_ppl_vs_base']} "
            f"({r['paper_ppl_delta']:+.1f}%) | {verdict[r['ppl_agrees']]} "
            f"| {r['bleu_vs_base']} ({r['bleu_delta']:+.2f}) | {r['paper_bleu_vs_base']} "
            f"({r['paper_bleu_delta']:+.1f}) | {verdict[r['bleu_agrees']]} |")
    ppl_ok = sum(r["ppl_agrees"] for r in compared)
    bleu_compared = [r for r in compared if r["bleu_agrees"] is not None]
    summary = f"\nPPL direction agrees with the paper on {ppl_ok} of {len(compared)} rows; "
    if bleu_compared:
        summary += (f"BLEU direction on {sum(r['bleu_agrees'] for r in bleu_compared)} of "
                    f"{len(bleu_compared)}.")
    else:
        base_bleu = next(r["dev_bleu"] for r in rows if r["row"] == "base")
        summary += (f"BLEU directions are not compared: the base row's dev BLEU is {base_bleu:.2f} "
                    f"(< {MIN_BASE_BLEU}): the models do not translate yet at this budget, so BLEU "
                    "differences between rows are noise.")
    out.append(summary)
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


def _plot(report: dict, path: str) -> None:
    """Table 3 with a base row: change vs base, this run beside the paper. Otherwise absolute values."""
    # Imported here: matplotlib is heavy and only the report's plot needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["status"] == "done"]
    relative = [r for r in rows if "ppl_delta" in r]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.7 * max(len(rows), 1) + 4), 4.5))
    if relative:
        x = np.arange(len(relative))
        for ax, kind, label in ((axes[0], "ppl", "dev PPL change vs base (%)"),
                                (axes[1], "bleu", "dev BLEU change vs base (points)")):
            ax.bar(x - 0.2, [r[f"{kind}_delta"] for r in relative], 0.4, label="this sweep")
            ax.bar(x + 0.2, [r[f"paper_{kind}_delta"] for r in relative], 0.4, label="paper")
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_xticks(x, [r["row"] for r in relative], rotation=60, ha="right", fontsize=8)
            ax.set_title(label)
            ax.legend()
        fig.suptitle(f"Table 3, {report['manifest']['scale']} scale: the direction of each change")
    else:
        x = np.arange(len(rows))
        for ax, key, label in ((axes[0], "dev_ppl", "dev PPL"), (axes[1], "dev_bleu", "dev BLEU")):
            ax.bar(x, [r[key] for r in rows])
            ax.set_xticks(x, [r["row"] for r in rows], rotation=60, ha="right", fontsize=7)
            ax.set_title(label)
    fig.tight_layout()
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
