"""Scores by length over many runs: each position scheme's mean and seed band per bucket, a table and a plot.

    python evaluate.py --workdir=runs/extrapolation/rotary-0 --by_length   # once per run
    python -m transformer_jax.evaluation.length_report --out=runs/extrapolation/report runs/extrapolation/*-*

Each workdir's run config (read from its newest checkpoint) names its scheme; its newest
``eval/<split>-*.json`` with a ``by_length`` entry gives its scores. Runs of one scheme are its seeds: the
report gives per bucket their mean and their range (min-max), the training's ``data.max_len`` marked, and
writes ``report.md`` (the table), ``report.json`` and ``report.png`` (the means, the bands shaded). When
the runs were trained on more than one host kind, code version or JAX version (their ``provenance.json``),
a line above the table says which.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags, logging

from transformer_jax.checkpoints import restore
from transformer_jax.checkpoints.reader import CheckpointReader
from transformer_jax.evaluation import by_length
from transformer_jax.runtime import errors, provenance
from transformer_jax.runtime.errors import UserError


def read_run(workdir: str, split: str = "test") -> dict[str, Any]:
    """{"scheme", "seed", "train_max_len", "train_seconds", "measure", "rows"} of one evaluated workdir
    (``rows``: its buckets, as ``by_length.score_by_length`` gives them)."""
    _, config, _ = CheckpointReader(restore.checkpoint_dir(workdir)).saved_info()
    results = sorted(glob.glob(os.path.join(workdir, "eval", f"{split}-*.json")), key=os.path.getmtime)
    records = [(path, _read_json(path)) for path in results]
    scored = [(path, record) for path, record in records if "by_length" in record]
    own = [(path, record) for path, record in scored if "ensemble" not in record]
    if not own:
        ensembles = f" ({len(scored)} scored an ensemble, not this run alone)" if scored else ""
        raise UserError(f"{workdir}: no eval/{split}-*.json with this run's scores by length{ensembles}; "
                        f"run python evaluate.py --workdir={workdir} --by_length first")
    final = os.path.join(workdir, "final.json")
    seconds = _read_json(final).get("train_seconds") if os.path.exists(final) else None
    scores = own[-1][1]["by_length"]
    return {"scheme": config["model"]["position_encoding"], "seed": config["seed"],
            "train_max_len": config["data"]["max_len"], "train_seconds": seconds,
            "measure": scores["measure"], "rows": scores["buckets"],
            "provenance": provenance.read(os.path.join(workdir, provenance.FILENAME))}


def _read_json(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; UserError naming the file when it does not read (cut short, not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} does not read ({errors.short_error(e)}); evaluate the run again (python "
                        "evaluate.py --by_length --overwrite) or move the file away") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} holds a JSON {type(record).__name__}, not evaluate.py's record; evaluate "
                        "the run again (python evaluate.py --by_length --overwrite) or move the file away")
    return record


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scheme: the seeds, each bucket's mean, min and max score over them (``mean``, ``min``, ``max``),
    the min and max of its output/reference length ratio (``length_ratio_min``, ``length_ratio_max``),
    None where no seed has one (an empty bucket), and the runs' minutes.

    UserError, naming two runs, unless every run was scored on the same buckets: the tables and the plot
    put every scheme's cells under one header."""
    schemes: dict[str, dict[str, Any]] = {}
    runs = sorted(runs, key=lambda r: (r["scheme"], r["seed"]))
    for run in runs:
        labels, first = [r["bucket"] for r in run["rows"]], [r["bucket"] for r in runs[0]["rows"]]
        if labels != first:
            raise UserError(f"{_run_name(run)} was scored on the length buckets {', '.join(labels)}, "
                            f"{_run_name(runs[0])} on {', '.join(first)}; evaluate every run with the same "
                            "--length_buckets (python evaluate.py --by_length --length_buckets=... "
                            "--overwrite)")
        entry = schemes.setdefault(run["scheme"], {"seeds": [], "scores": [], "ratios": [], "minutes": [],
                                                   "buckets": run["rows"]})
        entry["seeds"].append(run["seed"])
        for key, field in (("scores", "score"), ("ratios", "length_ratio")):
            entry[key].append([np.nan if r.get(field) is None else r[field] for r in run["rows"]])
        if run["train_seconds"] is not None:
            entry["minutes"].append(run["train_seconds"] / 60)
    for entry in schemes.values():
        scores = np.asarray(entry.pop("scores"), float)  # [seeds, buckets]
        ratios = np.asarray(entry.pop("ratios"), float)
        with warnings.catch_warnings():  # a bucket no seed scored (empty) is None, without a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, reduce, values in (("mean", np.nanmean, scores), ("min", np.nanmin, scores),
                                         ("max", np.nanmax, scores), ("length_ratio_min", np.nanmin, ratios),
                                         ("length_ratio_max", np.nanmax, ratios)):
                entry[name] = [None if np.isnan(x) else float(x) for x in reduce(values, axis=0)]
    return schemes


def _run_name(run: dict[str, Any]) -> str:
    return f"the run of {run['scheme']} with seed {run['seed']}"


def markdown_table(schemes: dict[str, dict[str, Any]]) -> str:
    """One row per scheme: mean (min-max) per bucket ("—" for an empty one, as by_length), the buckets
    beyond training marked in the header."""
    buckets = next(iter(schemes.values()))["buckets"]
    header = [b["bucket"] + (" (beyond)" if b["training"] == "beyond" else "") for b in buckets]
    lines = ["| scheme | seeds | " + " | ".join(header) + " | minutes per run |",
             "|---|---:|" + "---:|" * len(header) + "---:|",
             "| sentences | | " + " | ".join(str(b["sentences"]) for b in buckets) + " | |"]
    for scheme, entry in schemes.items():
        bands = zip(entry["mean"], entry["min"], entry["max"], strict=True)
        cells = ["—" if m is None else f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in bands]
        minutes = f"{np.mean(entry['minutes']):.1f}" if entry["minutes"] else "-"
        lines.append(f"| {scheme} | {len(entry['seeds'])} | " + " | ".join(cells) + f" | {minutes} |")
    return "\n".join(lines)


def length_ratio_table(schemes: dict[str, dict[str, Any]]) -> str:
    """One row per scheme: the range over its seeds of the outputs' words over the references' words, per
    bucket (one value where the seeds agree to two decimals; "—" where none has a ratio, as by_length)."""
    buckets = next(iter(schemes.values()))["buckets"]
    header = [b["bucket"] + (" (beyond)" if b["training"] == "beyond" else "") for b in buckets]
    lines = ["| scheme | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for scheme, entry in schemes.items():
        cells = []
        for low, high in zip(entry["length_ratio_min"], entry["length_ratio_max"], strict=True):
            if low is None:
                cells.append("—")
            else:
                cells.append(f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}")
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def define_flags() -> None:
    """The command's flags (defined only when it runs, so that importing the module defines none)."""
    flags.DEFINE_string("out", None, "folder for report.md, report.json and report.png", required=True)
    flags.DEFINE_string("split", "test", "the evaluated split")
    flags.DEFINE_string("title", "", "the plot's title")


def main(argv: Sequence[str]) -> None:
    FLAGS = flags.FLAGS
    logging.set_verbosity(logging.WARNING)  # orbax logs every config it reads
    workdirs = argv[1:]
    if not workdirs:
        raise app.UsageError("pass the evaluated workdirs")
    try:
        runs = {w: read_run(w, FLAGS.split) for w in workdirs}
        schemes = summarize(list(runs.values()))
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    print(write_report(runs, schemes, FLAGS.out, title=FLAGS.title))


def write_report(runs: dict[str, dict[str, Any]], schemes: dict[str, dict[str, Any]], out: str, *,
                 title: str = "") -> str:
    """Writes ``report.md``, ``report.json`` and ``report.png`` of ``runs`` (workdir -> ``read_run``) and
    their ``summarize``; returns the Markdown. A line above the tables names the runs' hosts, code versions
    or JAX versions when they differ (``provenance.differences``)."""
    first = next(iter(runs.values()))
    os.makedirs(out, exist_ok=True)
    table = markdown_table(schemes)
    mixed = provenance.differences({w: run["provenance"] for w, run in runs.items()})
    if mixed:
        table = f"**Provenance:** {mixed}\n\n{table}"
    if any(low is not None for e in schemes.values() for low in e["length_ratio_min"]):
        table += ("\n\nThe outputs' words over the references' words (the seeds' range):\n\n"
                  + length_ratio_table(schemes))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"train_max_len": first["train_max_len"], "schemes": schemes, "provenance": mixed}, f,
                  indent=1)
    series = {s: [{**b, "score": m} for b, m in zip(e["buckets"], e["mean"], strict=True)]
              for s, e in schemes.items()}
    bands = {s: (e["min"], e["max"]) for s, e in schemes.items() if len(e["seeds"]) > 1}
    by_length.plot_by_length(series, os.path.join(out, "report.png"), first["measure"],
                             train_max_len=first["train_max_len"], bands=bands, title=title)
    return table


if __name__ == "__main__":
    define_flags()
    app.run(main)
