"""The report of a sweep workdir: ``report.md``, ``report.csv`` and ``report.png``, and the params table.

For Table 3 sweeps, each row sits beside the paper's row, and the direction of each change against the
base row (PPL and BLEU up or down) is compared with the paper's. The base row's seeds (``base``,
``base-seed1``, ...) give the noise band: a row whose value lies within the seeds' range (min to max) is
"within noise", not a direction. With one seed, the band is the base value +- the tolerances below.
Every row gets its own seeds' band (``--seeds``: mean, min and max), and a row with several seeds is
compared by its mean. Rows beyond the paper (group E+) have no paper figures: nothing of the paper
stands beside them, and their directions are not compared with the paper's.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax import run_config
from transformer_jax.evaluation import paper
from transformer_jax.model.config import param_count
from transformer_jax.runtime import provenance
from transformer_jax.runtime.output_file import OutputFile
from transformer_jax.sweep import report_plot
from transformer_jax.sweep.grid import BEYOND, Row, describe, format_value, load_config, table3_config_arg
from transformer_jax.sweep.launchers import (
    MANIFEST,
    final_train_record,
    latest_dev_eval,
    read_manifest,
    read_result,
    result_from,
    table3_row,
    unscored,
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
    manifest = read_manifest(workdir)
    if manifest is None:
        raise FileNotFoundError(f"no {MANIFEST} in {workdir}; launch a sweep there first")
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
                if unscored(result):  # a diverged run: NaN or an infinite perplexity
                    problem = f"its eval/dev-{evaluation['step']}.json holds no scores ({unscored(result)})"
                    result = None
        if problem:
            warnings.append(f"row {entry['name']}: {problem}; " + (
                "its scores are read from its metrics.jsonl and eval/ instead" if result else
                "it counts as not finished") + " (launching the sweep again evaluates it again)")
        records.append({**entry, "result": result})
    return manifest, records, warnings


def row_provenance(row_dir: str, result: dict) -> dict | None:
    """Where a finished row was trained: its result's record, else its ``provenance.json`` (a row whose
    launcher predates the record), else None."""
    recorded = result.get("provenance")
    if isinstance(recorded, dict):
        return recorded
    return provenance.read(os.path.join(row_dir, provenance.FILENAME))


def build_report(workdir: str) -> dict[str, Any]:
    """Markdown, CSV rows and the per-row comparison of a sweep workdir (nothing written).

    Returns ``rows`` (one per run, as report.csv), ``bands`` (Table 3: one per row, over its finished
    seeds), ``noise`` (the base row's band), ``manifest``, ``warnings`` and ``markdown``.
    """
    manifest, records, warnings = _load_results(workdir)
    is_table3 = manifest["grid"] == "table3"
    scale = manifest["scale"]
    bands = seed_bands(records) if is_table3 else []
    base_band = next((b for b in bands if b["row"] == "base" and b["seeds"]), None)
    base, limits = None, None
    if base_band:  # the seeds' mean, and their spread as the noise band
        base = {kind: base_band[f"dev_{kind}_mean"] for kind in ("ppl", "bleu")}
        limits = {kind: noise_band(base_band[f"dev_{kind}_values"], kind) for kind in ("ppl", "bleu")}
        for band in bands:
            if band["row"] != "base" and band["seeds"]:
                band.update(_compare(band, base, limits))
    by_row = {b["row"]: b for b in bands}
    csv_rows = []
    for r in records:
        res = r["result"] or {}
        item = {"row": r["name"], "changes": _changes_text(r["changes"]), "params": r["params"],
                "dev_ppl": res.get("dev_ppl"), "dev_bleu": res.get("dev_bleu"),
                "dev_sacrebleu": res.get("dev_sacrebleu"), "steps": res.get("step"),
                "num_steps": r["num_steps"], "wall_seconds": res.get("wall_seconds"),
                "status": "done" if res else "not finished"}
        if is_table3:
            band = by_row[table3_row(r)]
            item.update(table3_row=band["row"], group=band["group"], beyond_paper=band["beyond_paper"],
                        paper_params_millions=band["paper_params_millions"], paper_ppl=band["paper_ppl"],
                        paper_bleu=band["paper_bleu"])
            if scale != "paper":
                item["params_at_paper_scale"] = paper_scale_params(band["row"])
            item.update({k: band[k] for k in BAND_KEYS})
            if r["name"] == band["row"]:  # the row's directions, once (from its seeds' mean)
                item.update({k: v for k, v in band.items() if k.endswith(DIRECTION_SUFFIXES)})
        csv_rows.append(item)
    noise = None
    if base:
        noise = {"seeds": base_band["seeds"], **{f"base_{kind}": base[kind] for kind in base},
                 **{f"{kind}_band": limits[kind] for kind in limits}}
    protocol = next((r["result"].get("bleu_protocol") for r in records if r["result"]), None)
    mixed = provenance.differences({r["name"]: row_provenance(os.path.join(workdir, r["name"]), r["result"])
                                    for r in records if r["result"]})
    markdown = _markdown(manifest, csv_rows, noise, protocol or "tokenized", warnings, bands, mixed)
    return {"markdown": markdown, "rows": csv_rows, "bands": bands, "manifest": manifest, "noise": noise,
            "warnings": warnings, "provenance": mixed}


# A row's band in report.csv (on each of its runs) and its directions (on the run named as the row).
BAND_KEYS = ("seeds", "dev_ppl_mean", "dev_ppl_min", "dev_ppl_max", "dev_bleu_mean", "dev_bleu_min",
             "dev_bleu_max")
DIRECTION_SUFFIXES = ("_vs_base", "_verdict", "_delta")


def seed_bands(records: Sequence[dict]) -> list[dict[str, Any]]:
    """One entry per Table 3 row of the sweep, in its order: the row's finished seeds' dev PPL and BLEU
    (values, mean, min, max; None when none finished) and the paper's figures (None beyond the paper)."""
    runs: dict[str, list[dict]] = {}
    for r in records:
        runs.setdefault(table3_row(r), []).append(r)
    bands = []
    for name, members in runs.items():
        done = [m["result"] for m in members if m["result"]]
        row = paper.TABLE3_ALL_BY_NAME[name]
        figures = paper.TABLE3_BY_NAME.get(name)  # None beyond the paper
        band = {"row": name, "group": row.group, "beyond_paper": figures is None, "runs": len(members),
                "seeds": len(done), "changes": _changes_text(next(
                    (m["changes"] for m in members if m["name"] == name), members[0]["changes"])),
                "paper_params_millions": None if figures is None else figures.params_millions,
                "paper_ppl": None if figures is None else figures.ppl_dev,
                "paper_bleu": None if figures is None else figures.bleu_dev}
        for kind in ("ppl", "bleu"):
            values = [float(d[f"dev_{kind}"]) for d in done]
            band[f"dev_{kind}_values"] = values
            band[f"dev_{kind}_mean"] = float(np.mean(values)) if values else None
            band[f"dev_{kind}_min"] = min(values) if values else None
            band[f"dev_{kind}_max"] = max(values) if values else None
        bands.append(band)
    return bands


def _compare(band: dict, base: dict[str, float], limits: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """A row's directions against the base row (its seeds' mean against the base band) and the paper's."""
    out: dict[str, Any] = {}
    pb = paper.TABLE3_BY_NAME["base"]
    for kind in ("ppl", "bleu"):
        ours = band[f"dev_{kind}_mean"]
        out[f"{kind}_vs_base"] = band_direction(ours, limits[kind])
        out[f"{kind}_delta"] = _delta(ours, base[kind], kind)
        if band["beyond_paper"]:
            out[f"paper_{kind}_vs_base"] = out[f"{kind}_verdict"] = BEYOND
            out[f"paper_{kind}_delta"] = None
            continue
        theirs, theirs_base = band[f"paper_{kind}"], getattr(pb, f"{kind}_dev")
        out[f"paper_{kind}_vs_base"] = direction(theirs, theirs_base, kind)
        out[f"{kind}_verdict"] = verdict(out[f"{kind}_vs_base"], out[f"paper_{kind}_vs_base"])
        if kind == "bleu" and base["bleu"] < MIN_BASE_BLEU:
            out["bleu_verdict"] = "not compared"  # no row translates yet
        out[f"paper_{kind}_delta"] = _delta(theirs, theirs_base, kind)
    return out


def _delta(value: float, base: float, kind: str) -> float:
    """The change against the base: in % for PPL, in points for BLEU."""
    return (value - base) / base * 100 if kind == "ppl" else value - base


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in changes.items()) or "—"


def _markdown(manifest: dict, rows: list[dict], noise: dict | None, protocol: str,
              warnings: Sequence[str] = (), bands: Sequence[dict] = (), mixed: str | None = None) -> str:
    is_table3, scale = manifest["grid"] == "table3", manifest["scale"]
    done = [r for r in rows if r["status"] == "done"]
    out = [f"**Warning:** {w}\n" for w in warnings]
    if mixed:
        out.append(f"**Provenance:** {mixed}\n")
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
            changes = r["changes"] + (f" ({BEYOND})" if r["beyond_paper"] else "")
            cells = [r["row"], changes, f"{r['params']:,}", second, paper_params,
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
        beyond = [b["row"] for b in bands if b["beyond_paper"]]
        if beyond:
            out.append(f"\nRows {', '.join(beyond)} (group E+) are **{BEYOND}**: row E with position schemes "
                       "that came after it. Table 3 has no such rows, so no paper figure stands beside them "
                       "and their directions are not compared with the paper's.")
        out.append("")
        out.extend(_band_section(bands))
        out.append("")
        out.extend(_direction_section(bands, noise))
    return "\n".join(out) + "\n"


def _band_section(bands: Sequence[dict]) -> list[str]:
    """Each row over its finished seeds: mean and min-max of dev PPL and BLEU, beside the paper's."""
    out = ["### Each row over its seeds\n",
           "The band is the range (min to max) of the row's finished seeds (`--base_seeds` for the base "
           "row, `--seeds` for the others); one seed has no band.\n",
           "| row | seeds | dev PPL | PPL band | paper PPL | dev BLEU | BLEU band | paper BLEU |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in bands:
        cells = [b["row"], f"{b['seeds']} of {b['runs']}"]
        for kind, digits in (("ppl", ".2f"), ("bleu", ".1f")):
            spread = (f"{b[f'dev_{kind}_min']:.2f}-{b[f'dev_{kind}_max']:.2f}" if b["seeds"] > 1 else "—")
            theirs = BEYOND if b["beyond_paper"] else _fmt(b[f"paper_{kind}"], digits)
            cells += [_fmt(b[f"dev_{kind}_mean"]), spread, theirs]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _scale_summary(scale: str) -> str:
    """How ``scale``'s base row differs from the paper's, read from the two configs."""
    ours, theirs = (load_config(table3_config_arg("base", s))[0] for s in (scale, "paper"))
    width = theirs.model.d_model / ours.model.d_model
    depth = theirs.model.num_encoder_layers / ours.model.num_encoder_layers
    return (f"{ours.data.source} data, {ours.data.vocab_size}-token vocabulary, 1/{width:g} of the width, "
            f"1/{depth:g} of the depth, {ours.train.num_steps:,} steps of {ours.data.tokens_per_batch:,} "
            f"tokens instead of {theirs.train.num_steps:,} of {theirs.data.tokens_per_batch:,}; "
            "see configs/table3.py")


def _direction_section(bands: Sequence[dict], noise: dict | None) -> list[str]:
    if noise is None:
        return ["No finished base row: the direction of each change cannot be compared "
                "(add `--rows base`)."]
    compared = [r for r in bands if "ppl_vs_base" in r]
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
           f"noise'. A row with several seeds is compared by their mean. The paper's direction is 'flat' "
           f"within {PPL_TOLERANCE:.0%} PPL or {BLEU_TOLERANCE} BLEU of its base row.\n",
           "| row | changes | PPL vs base | paper | | BLEU vs base | paper | |",
           "|---|---|---|---|---|---|---|---|"]
    for r in compared:
        paper_ppl, paper_bleu = (BEYOND, BEYOND) if r["beyond_paper"] else (
            f"{r['paper_ppl_vs_base']} ({r['paper_ppl_delta']:+.1f}%)",
            f"{r['paper_bleu_vs_base']} ({r['paper_bleu_delta']:+.1f})")
        out.append(
            f"| {r['row']} | {r['changes']} "
            f"| {r['ppl_vs_base']} ({r['ppl_delta']:+.1f}%) | {paper_ppl} | {r['ppl_verdict']} "
            f"| {r['bleu_vs_base']} ({r['bleu_delta']:+.2f}) | {paper_bleu} | {r['bleu_verdict']} |")
    compared = [r for r in compared if not r["beyond_paper"]]  # nothing of the paper to agree with
    if not compared:
        return out
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
    """Writes ``report.md``, ``report.csv`` and ``report.png`` into the workdir; returns their paths.

    The plot is drawn first, beside them: a report that cannot be built or drawn replaces none of the
    three, and each is replaced whole, so an earlier report's plot never stays beside new tables.
    """
    report = build_report(workdir)
    paths = {ext: os.path.join(workdir, f"report.{ext}") for ext in ("md", "csv", "png")}
    fields = list(dict.fromkeys(k for row in report["rows"] for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(report["rows"])
    drawn = os.path.join(workdir, f".report.{os.getpid()}.png")
    with OutputFile(paths["md"], flag="--workdir") as md, OutputFile(paths["csv"], flag="--workdir") as table:
        try:
            report_plot.plot_report(report, drawn)
            md.write(report["markdown"])
            table.write(buffer.getvalue())
            os.replace(drawn, paths["png"])
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(drawn)
    return {**paths, "markdown": report["markdown"]}


# ---------------------------------------------------------------------------------------------------
# Parameter counts (``python -m transformer_jax.sweep params``).


def params_table(rows: Sequence[Row], info: dict) -> str:
    """Markdown: each row's exact parameter count beside the paper's x10^6 (nothing is trained)."""
    lines = ["| row | changes | params (exact) | x10^6 | paper x10^6 |", "|---|---|---:|---:|---:|"]
    for row in rows:
        count = info[row.name]["params"]
        beyond = f" ({BEYOND})" if row.beyond_paper else ""
        lines.append(f"| {row.name} | {describe(row)}{beyond} | {count:,} | {count / 1e6:.1f} "
                     f"| {_fmt(_paper_params(row), 'd')} |")
    vocab = {v["vocab_size"] for v in info.values()}
    lines.append(f"\nShared vocabulary: {', '.join(str(v) for v in sorted(vocab))}.")
    return "\n".join(lines)
