"""Sweeps: the paper's Table 3 or a cartesian grid, run here, printed, or written as a SLURM array.

    python -m transformer_jax.sweep --grid table3 [--rows A,E] --scale cpu --workdir runs/table3
    python -m transformer_jax.sweep --grid table3 --scale paper --workdir runs/t3 --launcher slurm
    python -m transformer_jax.sweep --grid 'model.num_heads=1,4,8 model.dropout_rate=0.0,0.1' \\
        --config configs/default.py --workdir runs/heads --launcher print
    python -m transformer_jax.sweep report --workdir runs/table3
    python -m transformer_jax.sweep params [--scale paper|cpu] [--rows C]

A sweep is a list of rows; each row is a config (``configs/table3.py:<row>,<scale>``, or ``--config`` plus
``--config.<key>=<value>`` overrides) trained by ``train.py`` into ``<workdir>/<row>`` and scored on the
dev split by ``evaluate.py``. Every row's config is built and validated (``train_lib.validate_config``)
before anything trains, so an unknown key, a value of the wrong type or an invalid model fails at once.

Launchers:
  local   runs the rows one after another, each as ``train.py`` then ``evaluate.py --split=dev``
          subprocesses (a crash or a jit cache in one row cannot touch the next; logs go to
          ``<row>/train.log`` and ``<row>/evaluate.log``). A row with ``<row>/result.json`` is finished and
          skipped; a partial one resumes from its checkpoints (train.py does that by itself).
  print   prints the train + evaluate command of every row, for your own cluster tooling.
  slurm   writes ``<workdir>/sweep.sbatch``, an array job with one task per row (each task runs this
          module with ``--launcher local --row_index $SLURM_ARRAY_TASK_ID``, so it skips and resumes too).

Every launcher writes ``<workdir>/sweep.json`` (the rows, their changes and parameter counts), which
``report`` reads; sweeps into one workdir accumulate rows (``--rows A`` then ``--rows D,E``).

Dev decoding: beam 4, alpha 0.6 as in Table 3, except at ``--scale cpu`` where it is greedy (beam 1) to
save time; ``--beam_size`` overrides both.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import glob
import importlib.util
import io
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from transformer_jax import paper

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE3_CONFIG = "configs/table3.py"
TABLE3_GROUPS = tuple(dict.fromkeys(row.group for row in paper.TABLE3))  # base, A, ..., E, big
MANIFEST = "sweep.json"
RESULT = "result.json"
ATTEMPTS = "attempts.jsonl"
# Below these a change counts as "flat" (both for this run and for the paper's printed figures).
PPL_TOLERANCE = 0.01  # relative: 1% of the base row's perplexity
BLEU_TOLERANCE = 0.25  # absolute BLEU points
# Below this base-row BLEU the models do not translate yet and BLEU directions are not compared.
MIN_BASE_BLEU = 1.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One run of a sweep.

    ``config_arg`` is what follows ``--config=`` (a file, ``:argument`` optional) and ``overrides`` the
    ``--config.<key>=<value>`` flags on top of it; ``changes`` are the values the report shows.
    """

    name: str
    config_arg: str
    overrides: tuple[tuple[str, Any], ...] = ()
    changes: tuple[tuple[str, Any], ...] = ()
    paper_row: str | None = None  # the Table 3 row this one reproduces


# ---------------------------------------------------------------------------------------------------
# Configs: loading, overriding, validating.


def _ensure_configs_importable() -> None:
    if REPO_ROOT not in sys.path:  # configs import each other as ``configs.<name>``
        sys.path.insert(0, REPO_ROOT)


def _table3_config_module():
    """``configs/table3.py`` as a module, from any working directory."""
    _ensure_configs_importable()
    from configs import table3

    return table3


def load_config(config_arg: str) -> ml_collections.ConfigDict:
    """Loads ``path[:argument]`` as train.py's ``--config`` does; the result is locked."""
    path, _, argument = config_arg.partition(":")
    resolved = _resolve_config_path(path)
    _ensure_configs_importable()
    spec = importlib.util.spec_from_file_location(f"_sweep_config_{abs(hash(resolved))}", resolved)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(argument) if argument else module.get_config()
    config.lock()
    return config


def _resolve_config_path(path: str) -> str:
    for candidate in (path, os.path.join(REPO_ROOT, path)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ValueError(f"config file {path!r} not found (relative paths are tried from the current "
                     f"directory and from {REPO_ROOT})")


def _command_config_path(path: str) -> str:
    """The config path as commands spell it: relative to the repository root when inside it."""
    resolved = _resolve_config_path(path)
    relative = os.path.relpath(resolved, REPO_ROOT)
    return resolved if relative.startswith("..") else relative


def _get_field(config: ml_collections.ConfigDict, key: str) -> Any:
    node = config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(parts[:i]) or "the config"
            known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}; "
                             f"its fields: {', '.join(known)}")
        node = node[part]
    if isinstance(node, ml_collections.ConfigDict):
        raise ValueError(f"config key {key!r} is a section, not a field; its fields: "
                         f"{', '.join(sorted(node.keys()))}")
    return node


def _set_field(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *sections, field = key.split(".")
    node = config
    for section in sections:
        node = node[section]
    setattr(node, field, value)


def parse_value(key: str, text: str, current: Any) -> Any:
    """Parses ``text`` as the type of the field's current value; ValueError says what was expected."""
    def fail(expected):
        return ValueError(f"bad value {key}={text!r}: expected {expected} "
                          f"(the type of {key}, currently {current!r})")

    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise fail("a bool (true/false)")
        return text.lower() in ("true", "1")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise fail("an int") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise fail("a float") from None
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise fail(f"a Python literal of type {type(current).__name__}") from None
    if current is not None and not isinstance(value, type(current)):
        raise fail(type(current).__name__)
    return value


def build_config(row: Row) -> ml_collections.ConfigDict:
    """The row's full config: ``config_arg`` loaded, ``overrides`` set (typos and types fail)."""
    config = load_config(row.config_arg)
    for key, value in row.overrides:
        _get_field(config, key)
        _set_field(config, key, value)
    return config


def validate_rows(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Builds and validates every row's config; returns ``{row: {"params": ..., "num_steps": ...}}``.

    Raises ValueError naming the row, before anything trains.
    """
    from transformer_jax import model, train_lib

    info = {}
    for row in rows:
        try:
            config = build_config(row)
            train_lib.validate_config(config)
            model_config = train_lib.model_config_from(config, config.data.vocab_size)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"sweep row {row.name!r} ({_describe(row)}) is invalid: {e}") from e
        info[row.name] = {"params": model.param_count(model_config), "num_steps": config.train.num_steps,
                          "vocab_size": config.data.vocab_size}
    return info


# ---------------------------------------------------------------------------------------------------
# Rows: Table 3 and generic grids.


def select_table3_rows(selection: str | None) -> list[paper.Table3Row]:
    """``"A,E"``, ``"base,C-dmodel256"``...: groups (base, A-E, big) and row names, in Table 3 order."""
    if not selection:
        return list(paper.TABLE3)
    chosen = set()
    for token in (t.strip() for t in selection.split(",")):
        if token in TABLE3_GROUPS:
            chosen.update(r.name for r in paper.TABLE3 if r.group == token)
        elif token in paper.TABLE3_BY_NAME:
            chosen.add(token)
        else:
            raise ValueError(f"unknown Table 3 row or group {token!r} in --rows={selection!r}; groups: "
                             f"{', '.join(TABLE3_GROUPS)}; rows: {', '.join(r.name for r in paper.TABLE3)}")
    return [r for r in paper.TABLE3 if r.name in chosen]


def table3_rows(selection: str | None, scale: str) -> list[Row]:
    table3 = _table3_config_module()
    if scale not in table3.SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid scales: {', '.join(table3.SCALES)}")
    rows = []
    for paper_row in select_table3_rows(selection):
        hparams = table3.row_hparams(paper_row.name, scale)
        changes = tuple((k, hparams[k]) for k in paper_row.changes)
        rows.append(Row(paper_row.name, f"{TABLE3_CONFIG}:{paper_row.name},{scale}", (), changes,
                        paper_row.name))
    return rows


def parse_grid(spec: str, config_arg: str) -> list[Row]:
    """``"model.num_heads=1,4,8 model.dropout_rate=0.0,0.1"`` -> the cartesian product, as rows.

    Keys are dotted config fields; values are parsed as the field's type in ``config_arg``. A row is named
    by its assignments, ``model.num_heads=4,model.dropout_rate=0.1``.
    """
    base = load_config(config_arg)
    axes = []
    for item in spec.split():
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"bad grid item {item!r} in --grid={spec!r}: expected key=value1,value2,...")
        if key in (k for k, _ in axes):
            raise ValueError(f"grid key {key!r} appears twice in --grid={spec!r}")
        current = _get_field(base, key)
        texts = _split_values(values)
        if any(not t for t in texts):
            raise ValueError(f"empty value in grid item {item!r}")
        axes.append((key, [parse_value(key, t, current) for t in texts]))
    if not axes:
        raise ValueError("--grid is empty: give 'table3' or key=value1,value2 items separated by spaces")
    config_arg = _command_config_arg(config_arg)
    rows = []
    for values in itertools.product(*(vs for _, vs in axes)):
        assignments = tuple((key, value) for (key, _), value in zip(axes, values, strict=True))
        name = ",".join(f"{k}={_format_value(v)}" for k, v in assignments)
        rows.append(Row(name, config_arg, assignments, assignments))
    return rows


def _split_values(values: str) -> list[str]:
    """Splits on commas outside brackets, so tuple values survive: ``(16,32),(32,64)``."""
    parts, depth, current = [], 0, ""
    for char in values:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _command_config_arg(config_arg: str) -> str:
    path, sep, argument = config_arg.partition(":")
    return _command_config_path(path) + sep + argument


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def _describe(row: Row) -> str:
    return ", ".join(f"{k}={_format_value(v)}" for k, v in row.changes) or "no changes"


# ---------------------------------------------------------------------------------------------------
# Commands and the three launchers.


def train_command(row: Row, row_dir: str, python: str) -> list[str]:
    return [python, "train.py", f"--config={row.config_arg}",
            *(f"--config.{k}={_format_value(v)}" for k, v in row.overrides), f"--workdir={row_dir}"]


def evaluate_command(row_dir: str, python: str, beam_size: int) -> list[str]:
    return [python, "evaluate.py", f"--workdir={row_dir}", "--split=dev", f"--beam_size={beam_size}"]


def _run_command(command: list[str], log_path: str) -> int:
    """Runs ``command`` from the repository root, stdout and stderr to ``log_path``; returns its status.

    Rows share a persistent XLA compilation cache (``<workdir>/jax_cache`` unless
    JAX_COMPILATION_CACHE_DIR is set), so identical programs (e.g. the decoder of rows that differ only
    in dropout or label smoothing, or a resumed row) compile once.
    """
    row_dir = os.path.dirname(os.path.abspath(log_path))
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(row_dir), "jax_cache"))
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(command)}\n")
        log.flush()
        return subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode


def _read_text(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _final_train_record(row_dir: str, num_steps: int) -> dict | None:
    """The last ``metrics.jsonl`` record of a finished training run (it carries ``train_seconds``)."""
    for record in reversed(_read_jsonl(os.path.join(row_dir, "metrics.jsonl"))):
        if "train_seconds" in record and record.get("step", 0) >= num_steps:
            return record
    return None


def _latest_dev_eval(row_dir: str) -> dict | None:
    """The dev-split evaluation of the highest step (``<row>/eval/dev-<step>.json``)."""
    found = []
    for path in glob.glob(os.path.join(row_dir, "eval", "dev-*.json")):
        stem = os.path.basename(path)[len("dev-"):-len(".json")]
        if stem.isdigit():
            found.append((int(stem), path))
    if not found:
        return None
    with open(max(found)[1]) as f:
        return json.load(f)


def _log_attempt(row_dir: str, phase: str, seconds: float, returncode: int) -> None:
    with open(os.path.join(row_dir, ATTEMPTS), "a") as f:
        f.write(json.dumps({"phase": phase, "seconds": seconds, "returncode": returncode,
                            "time": time.time()}) + "\n")


def run_row(row: Row, row_dir: str, *, num_steps: int, beam_size: int, python: str) -> dict | None:
    """Trains (or resumes) and evaluates one row; writes and returns ``result.json``, or None if it failed."""
    os.makedirs(row_dir, exist_ok=True)
    if _final_train_record(row_dir, num_steps) is None:
        started = time.time()
        code = _run_command(train_command(row, row_dir, python), os.path.join(row_dir, "train.log"))
        _log_attempt(row_dir, "train", time.time() - started, code)
        if code != 0:
            print(f"  training failed (exit {code}); see {os.path.join(row_dir, 'train.log')}")
            return None
    final = _final_train_record(row_dir, num_steps)
    if final is None:
        print(f"  training stopped before step {num_steps} (preempted?); run the sweep again to resume")
        return None
    started = time.time()
    code = _run_command(evaluate_command(row_dir, python, beam_size),
                        os.path.join(row_dir, "evaluate.log"))
    _log_attempt(row_dir, "evaluate", time.time() - started, code)
    evaluation = _latest_dev_eval(row_dir)
    if code != 0 or evaluation is None or evaluation["step"] < num_steps:
        print(f"  evaluation failed (exit {code}); see {os.path.join(row_dir, 'evaluate.log')}")
        return None
    attempts = _read_jsonl(os.path.join(row_dir, ATTEMPTS))
    result = {
        **_result_from(row.name, dict(row.changes), evaluation, final),
        "wall_seconds": sum(a["seconds"] for a in attempts),  # every attempt: train and evaluate
        "attempts": len([a for a in attempts if a["phase"] == "train"]),
    }
    with open(os.path.join(row_dir, RESULT), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _result_from(name: str, changes: dict, evaluation: dict, final: dict) -> dict:
    return {"row": name, "changes": changes, "step": evaluation["step"], "dev_ppl": evaluation["ppl"],
            "dev_bleu": evaluation["tokenized_bleu"], "dev_sacrebleu": evaluation["sacrebleu"],
            "beam_size": evaluation["beam_size"], "num_sentences": evaluation["num_sentences"],
            "train_seconds": final["train_seconds"]}


def launch_local(rows: Sequence[Row], info: dict, workdir: str, *, beam_size: int, python: str) -> int:
    """Runs the rows in order, skipping finished ones; returns the number of rows that failed."""
    failed = []
    sweep_started = time.time()
    for i, row in enumerate(rows, 1):
        row_dir = os.path.join(workdir, row.name)
        prefix = f"[{i}/{len(rows)}] {row.name}"
        if os.path.exists(os.path.join(row_dir, RESULT)):
            print(f"{prefix}: done already ({os.path.join(row_dir, RESULT)}), skipped")
            continue
        print(f"{prefix}: {_describe(row)}; {info[row.name]['params']:,} parameters; log in "
              f"{os.path.join(row_dir, 'train.log')}", flush=True)
        started = time.time()
        result = run_row(row, row_dir, num_steps=info[row.name]["num_steps"], beam_size=beam_size,
                         python=python)
        if result is None:
            failed.append(row.name)
            continue
        print(f"{prefix}: dev PPL {result['dev_ppl']:.2f}, dev BLEU {result['dev_bleu']:.2f} "
              f"({time.time() - started:.0f} s)", flush=True)
    print(f"Sweep: {len(rows) - len(failed)} of {len(rows)} rows done in {time.time() - sweep_started:.0f} s"
          + (f"; failed: {', '.join(failed)} (run again to retry)" if failed else ""))
    print(f"Report: python -m transformer_jax.sweep report --workdir {workdir}")
    return len(failed)


def launch_print(rows: Sequence[Row], info: dict, workdir: str, *, beam_size: int, python: str) -> None:
    print(f"# {len(rows)} rows; run from {REPO_ROOT}. Collect results with: "
          f"{python} -m transformer_jax.sweep report --workdir {workdir}")
    for row in rows:
        row_dir = os.path.join(workdir, row.name)
        paper_params = _paper_params(row)
        print(f"# {row.name}: {_describe(row)}; {info[row.name]['params']:,} parameters"
              + (f" (paper x10^6: {_fmt(paper_params, 'd')})" if row.paper_row else ""))
        print(f"{shlex.join(train_command(row, row_dir, python))} && "
              f"{shlex.join(evaluate_command(row_dir, python, beam_size))}")


def launch_slurm(rows: Sequence[Row], workdir: str, argv_for_task: list[str], *,
                 slurm_options: Sequence[str]) -> str:
    """Writes ``<workdir>/sweep.sbatch`` (one array task per row); returns its path."""
    path = os.path.join(workdir, "sweep.sbatch")
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=sweep-{os.path.basename(os.path.normpath(workdir))}",
             f"#SBATCH --array=0-{len(rows) - 1}",
             f"#SBATCH --output={os.path.join(workdir, 'slurm-%A_%a.out')}",
             *(f"#SBATCH {option}" for option in slurm_options),
             "# Task i trains and evaluates row i (skipped if finished, resumed if partial):",
             *(f"#   {i}: {row.name}" for i, row in enumerate(rows)),
             "set -euo pipefail",
             f"cd {shlex.quote(REPO_ROOT)}",
             shlex.join(argv_for_task) + ' --row_index="$SLURM_ARRAY_TASK_ID"', ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


# ---------------------------------------------------------------------------------------------------
# The manifest: what a workdir's sweep is.


def write_manifest(workdir: str, *, grid: str, scale: str | None, config_arg: str | None,
                   rows: Sequence[Row], info: dict) -> dict:
    """Writes (or extends) ``<workdir>/sweep.json``; refuses a workdir that holds a different sweep."""
    path = os.path.join(workdir, MANIFEST)
    manifest = {"grid": grid, "scale": scale, "config": config_arg, "rows": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if (old["grid"], old["scale"], old["config"]) != (grid, scale, config_arg):
            raise ValueError(
                f"{workdir} holds another sweep (grid={old['grid']!r}, scale={old['scale']!r}, "
                f"config={old['config']!r}); use another --workdir")
        manifest["rows"] = old["rows"]
    known = {r["name"] for r in manifest["rows"]}
    for row in rows:
        if row.name not in known:
            manifest["rows"].append({
                "name": row.name, "config_arg": row.config_arg, "changes": dict(row.changes),
                "paper_row": row.paper_row, **info[row.name]})
    if grid == "table3":
        order = {r.name: i for i, r in enumerate(paper.TABLE3)}
        manifest["rows"].sort(key=lambda r: order[r["name"]])
    os.makedirs(workdir, exist_ok=True)
    text = json.dumps(manifest, indent=1)
    if _read_text(path) != text:  # SLURM array tasks all write the same manifest
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return manifest


# ---------------------------------------------------------------------------------------------------
# The report.


def _paper_params(row: Row | dict) -> int | None:
    name = row.paper_row if isinstance(row, Row) else row.get("paper_row")
    return paper.TABLE3_BY_NAME[name].params_millions if name else None


def paper_scale_params(row_name: str) -> int:
    """The exact parameter count of a Table 3 row at paper scale (37k vocabulary)."""
    from transformer_jax import model, train_lib

    config = load_config(f"{TABLE3_CONFIG}:{row_name},paper")
    return model.param_count(train_lib.model_config_from(config, config.data.vocab_size))


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
            final = _final_train_record(row_dir, entry["num_steps"])
            evaluation = _latest_dev_eval(row_dir)
            if final and evaluation and evaluation["step"] >= entry["num_steps"]:
                result = {**_result_from(entry["name"], entry["changes"], evaluation, final),
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
    return ", ".join(f"{k}={_format_value(v)}" for k, v in changes.items()) or "—"


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
                       f"({_cpu_scale_summary()}). Compare the direction of each change against the base "
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


def _cpu_scale_summary() -> str:
    table3 = _table3_config_module()
    base = table3.get_config("base,cpu")
    return (f"synthetic task, {base.data.vocab_size}-token vocabulary, 1/{table3.CPU_WIDTH_DIVISOR} of the "
            f"width, 1/{table3.CPU_LAYER_DIVISOR} of the depth, {base.train.num_steps} steps of "
            f"{base.data.tokens_per_batch} tokens instead of 100k of 25k; see configs/table3.py")


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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
# Parameter counts.


def params_table(rows: Sequence[Row], info: dict) -> str:
    """Markdown: each row's exact parameter count beside the paper's x10^6 (nothing is trained)."""
    lines = ["| row | changes | params (exact) | x10^6 | paper x10^6 |", "|---|---|---:|---:|---:|"]
    for row in rows:
        count = info[row.name]["params"]
        lines.append(f"| {row.name} | {_describe(row)} | {count:,} | {count / 1e6:.1f} "
                     f"| {_fmt(_paper_params(row), 'd')} |")
    vocab = {v["vocab_size"] for v in info.values()}
    lines.append(f"\nShared vocabulary: {', '.join(str(v) for v in sorted(vocab))}. Every row's ModelConfig "
                 "was built and its config validated (train_lib.validate_config).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Command line.


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_jax.sweep", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="launch", choices=("launch", "report", "params"),
                        help="launch (default) a sweep, report on one, or print parameter counts")
    parser.add_argument("--grid", default="table3",
                        help="'table3', or space-separated key=v1,v2 items (cartesian product)")
    parser.add_argument("--rows", default=None,
                        help="table3 only: groups (base, A-E, big) and row names, e.g. A,E or C-dmodel256")
    parser.add_argument("--scale", default=None, choices=("paper", "cpu"),
                        help="table3 only: paper (default) or cpu (see configs/table3.py)")
    parser.add_argument("--config", default="configs/default.py",
                        help="base config of a generic grid (path[:argument])")
    parser.add_argument("--workdir", default=None,
                        help="one sub-directory per row (default: runs/table3 or runs/sweep)")
    parser.add_argument("--launcher", default="local", choices=("local", "print", "slurm"))
    parser.add_argument("--beam_size", type=int, default=None,
                        help="dev decoding beam (default: 1 at --scale cpu, else 4, the paper's)")
    parser.add_argument("--row_index", type=int, default=None,
                        help="run only this row (0-based, in sweep order); the SLURM array task id")
    parser.add_argument("--python", default=None,
                        help="interpreter in commands (default: this one for local, 'python' otherwise)")
    parser.add_argument("--slurm_option", action="append", default=[],
                        help="extra #SBATCH line, e.g. --slurm_option=--gres=gpu:1 (repeatable)")
    return parser


def _rows_from_args(args) -> list[Row]:
    if args.grid == "table3":
        return table3_rows(args.rows, args.scale or "paper")
    if args.rows or args.scale:
        raise ValueError("--rows and --scale apply to --grid table3; a generic grid runs every "
                         "combination (use --row_index for one)")
    return parse_grid(args.grid, args.config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _main(args, parser)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args, parser) -> int:
    if args.command == "report":
        if not args.workdir:
            parser.error("report needs --workdir")
        paths = write_report(args.workdir)
        print(paths["markdown"])
        print(f"Wrote {paths['md']}, {paths['csv']} and {paths['png']}")
        return 0
    rows = _rows_from_args(args)
    info = validate_rows(rows)  # every row builds a valid config before anything runs
    if args.command == "params":
        print(params_table(rows, info))
        return 0
    args.workdir = args.workdir or ("runs/table3" if args.grid == "table3" else "runs/sweep")
    if args.grid == "table3" and args.rows and not any(r.name == "base" for r in rows):
        rows = table3_rows("base," + args.rows, args.scale or "paper")
        info = validate_rows(rows)
        print("Adding the base row: the report compares every row with it.")
    workdir = os.path.abspath(args.workdir)
    scale = (args.scale or "paper") if args.grid == "table3" else None
    config_arg = None if args.grid == "table3" else _command_config_arg(args.config)
    write_manifest(workdir, grid=args.grid, scale=scale, config_arg=config_arg, rows=rows, info=info)
    beam_size = args.beam_size or (1 if scale == "cpu" else paper.BEAM_SIZE)
    if args.row_index is not None:
        if not 0 <= args.row_index < len(rows):
            raise ValueError(f"--row_index={args.row_index} is out of range: the sweep has {len(rows)} rows")
        rows = [rows[args.row_index]]
    if args.launcher == "local":
        failed = launch_local(rows, info, workdir, beam_size=beam_size, python=args.python or sys.executable)
        return 1 if failed else 0
    python = args.python or "python"
    if args.launcher == "print":
        launch_print(rows, info, workdir, beam_size=beam_size, python=python)
        return 0
    task = [python, "-m", "transformer_jax.sweep", f"--grid={args.grid}", f"--workdir={workdir}",
            "--launcher=local", f"--beam_size={beam_size}", f"--python={python}"]
    if args.grid == "table3":  # explicit names, so that array index i is row i
        task += [f"--scale={scale}", f"--rows={','.join(r.name for r in rows)}"]
    else:
        task += [f"--config={config_arg}"]
    path = launch_slurm(rows, workdir, task, slurm_options=args.slurm_option)
    print(f"Wrote {path} ({len(rows)} array tasks). Submit it with:\n  sbatch {path}\n"
          f"then, when the tasks finish: python -m transformer_jax.sweep report --workdir {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
