"""Launchers: run a sweep's rows here one after another, print their commands, or write a SLURM array.

  local   runs the rows in order, each as ``train.py`` then ``evaluate.py --split=dev`` subprocesses (a
          crash or a jit cache in one row cannot touch the next; logs go to ``<row>/train.log`` and
          ``<row>/evaluate.log``). A row with a readable ``<row>/result.json`` is finished and skipped
          (one that does not read is evaluated again); a partial one resumes from its checkpoints
          (train.py does that by itself).
  print   prints the train + evaluate command of every row, for your own cluster tooling.
  slurm   writes ``<workdir>/sweep.sbatch``, an array job with one task per row (each task runs the sweep
          with ``--launcher=local --row_index=$SLURM_ARRAY_TASK_ID``, so it skips and resumes too).

Every launcher writes ``<workdir>/sweep.json`` (the rows, their changes and parameter counts), which the
report reads; sweeps into one workdir accumulate rows (``--rows A`` then ``--rows D,E``).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import math
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence

from transformer_jax import slurm
from transformer_jax.evaluation import paper
from transformer_jax.evaluation.scoring import BLEU_KEYS
from transformer_jax.runtime import provenance
from transformer_jax.runtime.errors import DataError, short_error
from transformer_jax.sweep.grid import REPO_ROOT, Row, describe, format_value

MANIFEST = "sweep.json"
RESULT = "result.json"
ATTEMPTS = "attempts.jsonl"


def train_command(row: Row, row_dir: str, python: str) -> list[str]:
    return [python, "train.py", f"--config={row.config_arg}",
            *(f"--config.{k}={format_value(v)}" for k, v in row.overrides), f"--workdir={row_dir}"]


def evaluate_command(row_dir: str, python: str, beam_size: int) -> list[str]:
    # --overwrite: a rerun of the sweep scores a row's dev split again (evaluate.py refuses otherwise).
    # --average_last=1: a row is scored by its last checkpoint (Table 3), whatever its config averages,
    # and latest_dev_eval reads dev-<step>.json.
    return [python, "evaluate.py", f"--workdir={row_dir}", "--split=dev", f"--beam_size={beam_size}",
            "--average_last=1", "--overwrite"]


_stopped_by: str | None = None  # "SIGTERM" / "SIGINT" once one reached the launcher: no further row starts
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_launcher() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (even by kill -9), so that the row saves a
    checkpoint and stops instead of running on as an orphan that holds the workdir's lock. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen):
    """SIGTERM / SIGINT to the launcher go to ``child`` (train.py saves and exits) and stop the sweep."""

    def forward(signum, frame):
        del frame
        global _stopped_by
        _stopped_by = signal.Signals(signum).name
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_command(command: list[str], log_path: str) -> int:
    """Runs ``command`` from the repository root, stdout and stderr to ``log_path``; returns its status.

    Rows share a persistent XLA compilation cache (``<workdir>/jax_cache`` unless
    JAX_COMPILATION_CACHE_DIR is set), so identical programs (e.g. the decoder of rows that differ only
    in dropout or label smoothing, or a resumed row) compile once. A SIGTERM / SIGINT to the launcher is
    passed on to the command, which saves and stops; the command also stops if the launcher is killed.
    """
    row_dir = os.path.dirname(os.path.abspath(log_path))
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(row_dir), "jax_cache"))
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(command)}\n")
        log.flush()
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=_die_with_launcher)
        with _forwarding_signals(child):
            return child.wait()


def _read_text(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


RESULT_KEYS = ("step", "dev_ppl", "dev_bleu")  # what the report and the launcher read of a result


def read_result(row_dir: str) -> tuple[dict | None, str | None]:
    """``(result, None)`` for a row's readable ``result.json``; ``(None, problem)`` when the file exists but
    does not read as a result (the problem names it); ``(None, None)`` when there is none."""
    path = os.path.join(row_dir, RESULT)
    if not os.path.exists(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"{path} does not read ({' '.join(str(e).split())})"
    missing = [k for k in RESULT_KEYS if k not in result] if isinstance(result, dict) else list(RESULT_KEYS)
    if missing:
        return None, f"{path} is not a result (it lacks {', '.join(missing)})"
    if unscored(result):
        return None, f"{path} holds no scores ({unscored(result)})"
    return result, None


def unscored(result: dict) -> str:
    """What ``result`` holds in place of scores, ``"dev_ppl=nan: expected finite numbers ..."``, or "" when
    each of ``RESULT_KEYS`` is a finite number (a run that diverged has a NaN or infinite perplexity)."""
    bad = [f"{k}={result[k]!r}" for k in RESULT_KEYS if isinstance(result[k], bool)
           or not isinstance(result[k], int | float) or not math.isfinite(result[k])]
    return f"{', '.join(bad)}: expected finite numbers; a run that diverged has none" if bad else ""


def final_train_record(row_dir: str, num_steps: int) -> dict | None:
    """The last ``metrics.jsonl`` record of a finished training run (it carries ``train_seconds``)."""
    for record in reversed(read_jsonl(os.path.join(row_dir, "metrics.jsonl"))):
        if "train_seconds" in record and record.get("step", 0) >= num_steps:
            return record
    return None


def latest_dev_eval(row_dir: str) -> dict | None:
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


def _append_attempt(row_dir: str, record: dict) -> None:
    with open(os.path.join(row_dir, ATTEMPTS), "a") as f:
        f.write(json.dumps(record) + "\n")


def run_phase(row_dir: str, phase: str, command: list[str]) -> int:
    """Runs one phase ("train" or "evaluate") of a row, its output to ``<row>/<phase>.log``.

    The attempt is logged in ``attempts.jsonl`` twice: when it starts and when it ends, so that an attempt
    killed together with the launcher still counts (see ``attempt_seconds``). Returns the exit status.
    """
    started = time.time()
    _append_attempt(row_dir, {"phase": phase, "started": started})
    code = run_command(command, os.path.join(row_dir, f"{phase}.log"))
    _append_attempt(row_dir, {"phase": phase, "started": started, "seconds": time.time() - started,
                              "returncode": code})
    return code


def attempt_seconds(row_dir: str) -> tuple[float, int]:
    """(wall seconds of every attempt of the row, train and evaluate; the number of train attempts).

    An attempt that started but never logged its end (the launcher was killed with it) counts until the
    last write to its log, or until the next attempt started, whichever came first.
    """
    records = read_jsonl(os.path.join(row_dir, ATTEMPTS))
    ended = {(r["phase"], r["started"]) for r in records if "seconds" in r}
    seconds = sum(r["seconds"] for r in records if "seconds" in r)
    starts = sorted({r["started"] for r in records})
    for r in records:
        if "seconds" not in r and (r["phase"], r["started"]) not in ended:
            log = os.path.join(row_dir, f"{r['phase']}.log")
            end = os.path.getmtime(log) if os.path.exists(log) else r["started"]
            end = min([end, *(t for t in starts if t > r["started"])])
            seconds += max(0.0, end - r["started"])
    return seconds, sum(r["phase"] == "train" and "seconds" not in r for r in records)


def run_row(row: Row, row_dir: str, *, num_steps: int, bleu_protocol: str, beam_size: int,
            python: str) -> dict | None:
    """Trains (or resumes) and evaluates one row; writes and returns ``result.json``, or None if it failed."""
    os.makedirs(row_dir, exist_ok=True)
    if final_train_record(row_dir, num_steps) is None:
        code = run_phase(row_dir, "train", train_command(row, row_dir, python))
        if code != 0:
            print(f"  training failed (exit {code}); see {os.path.join(row_dir, 'train.log')}")
            return None
    final = final_train_record(row_dir, num_steps)
    if final is None:
        print(f"  training stopped before step {num_steps} (preempted?); run the sweep again to resume")
        return None
    code = run_phase(row_dir, "evaluate", evaluate_command(row_dir, python, beam_size))
    evaluation = latest_dev_eval(row_dir)
    if code != 0 or evaluation is None or evaluation["step"] < num_steps:
        print(f"  evaluation failed (exit {code}); see {os.path.join(row_dir, 'evaluate.log')}")
        return None
    wall_seconds, attempts = attempt_seconds(row_dir)
    result = {**result_from(row.name, dict(row.changes), evaluation, final, bleu_protocol),
              "wall_seconds": wall_seconds, "attempts": attempts}
    path = os.path.join(row_dir, RESULT)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:  # whole or not at all: the file marks the row finished
        json.dump(result, f, indent=1)
    os.replace(tmp, path)
    return result


def result_from(name: str, changes: dict, evaluation: dict, final: dict, bleu_protocol: str) -> dict:
    """A row's result: evaluate.py's dev scores (``dev_bleu`` under ``bleu_protocol``) and train time, with
    where the row was trained (``provenance``: its ``provenance.json``) and evaluated."""
    missing = provenance.unknown("the row's evaluate.py recorded none")
    return {"row": name, "changes": changes, "step": evaluation["step"], "dev_ppl": evaluation["ppl"],
            "dev_bleu": evaluation[BLEU_KEYS[bleu_protocol]], "bleu_protocol": bleu_protocol,
            "dev_sacrebleu": evaluation["sacrebleu"],
            "beam_size": evaluation["beam_size"], "num_sentences": evaluation["num_sentences"],
            "train_seconds": final["train_seconds"],
            "provenance": evaluation.get("run_provenance", missing),
            "evaluation_provenance": evaluation.get("provenance", missing)}


def launch_local(rows: Sequence[Row], info: dict, workdir: str, *, beam_size: int, python: str) -> int:
    """Runs the rows in order, skipping finished ones; returns the number of rows that failed."""
    failed = []
    sweep_started = time.time()
    for i, row in enumerate(rows, 1):
        if _stopped_by:
            print(f"Stopped by {_stopped_by}: rows from {row.name} on did not run; run the "
                  "same command again to resume", flush=True)
            failed.extend(r.name for r in rows[i - 1:])
            break
        row_dir = os.path.join(workdir, row.name)
        prefix = f"[{i}/{len(rows)}] {row.name}"
        done, problem = read_result(row_dir)
        if done is not None:
            print(f"{prefix}: done already ({os.path.join(row_dir, RESULT)}), skipped")
            continue
        if problem:
            print(f"{prefix}: {problem}; the row counts as not finished and is evaluated again", flush=True)
        print(f"{prefix}: {describe(row)}; {info[row.name]['params']:,} parameters; log in "
              f"{os.path.join(row_dir, 'train.log')}", flush=True)
        started = time.time()
        result = run_row(row, row_dir, num_steps=info[row.name]["num_steps"],
                         bleu_protocol=info[row.name]["bleu_protocol"], beam_size=beam_size, python=python)
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
        paper_params = paper.TABLE3_BY_NAME[row.paper_row].params_millions if row.paper_row else None
        print(f"# {row.name}: {describe(row)}; {info[row.name]['params']:,} parameters"
              + (f" (paper x10^6: {paper_params or '—'})" if row.paper_row else "")
              + (" (beyond the paper)" if row.beyond_paper else ""))
        print(f"{shlex.join(train_command(row, row_dir, python))} && "
              f"{shlex.join(evaluate_command(row_dir, python, beam_size))}")


def launch_slurm(rows: Sequence[Row], workdir: str, argv_for_task: list[str], *,
                 slurm_options: Sequence[str], signal_seconds: int = slurm.DEFAULT_SIGNAL_SECONDS,
                 indices: Sequence[int] | None = None) -> str:
    """Writes ``<workdir>/sweep.sbatch``, one array task per row (of ``indices``: default every row).

    Task i runs row i of every row of the sweep (``rows``, which ``argv_for_task`` rebuilds) with the local
    launcher (a finished row is skipped, a partial one resumes); near the time limit the row saves and the
    task requeues itself until the row's ``result.json`` exists. Returns the script's path.
    """
    indices = list(range(len(rows))) if indices is None else list(indices)
    path = os.path.join(workdir, "sweep.sbatch")
    array = f"0-{len(rows) - 1}" if indices == list(range(len(rows))) else ",".join(map(str, indices))
    slurm.check_sbatch_path(workdir)
    header = [f"--job-name={slurm.sbatch_value('sweep-' + os.path.basename(os.path.normpath(workdir)))}",
              f"--array={array}", slurm.output_option(workdir, "slurm-%A_%a.out"), "--ntasks=1",
              *slurm_options]
    names = " ".join(shlex.quote(row.name) for row in rows)
    text = slurm.batch_script(
        header=header,
        command=shlex.join(argv_for_task) + ' --row_index="$SLURM_ARRAY_TASK_ID"',
        done=f'[ -f {shlex.quote(workdir)}/"${{rows[$SLURM_ARRAY_TASK_ID]}}"/{RESULT} ]',
        signal_seconds=signal_seconds,
        comments=["Task i trains and evaluates row i (skipped if finished, resumed if partial):",
                  *(f"  {i}: {rows[i].name}" for i in indices)],
        setup=f"rows=({names})")
    return slurm.write_script(path, text)


# ---------------------------------------------------------------------------------------------------
# The manifest: what a workdir's sweep is.


def table3_row(entry: dict) -> str | None:
    """The configs/table3.py row a manifest entry runs (manifests written before E+ name only the paper's)."""
    return entry.get("table3_row") or entry.get("paper_row")


def read_manifest(workdir: str) -> dict | None:
    """``<workdir>/sweep.json``, or None where there is none; DataError naming the file when it does not
    read as a sweep's manifest (cut short, edited by hand)."""
    path = os.path.join(workdir, MANIFEST)
    if not os.path.exists(path):
        return None
    fix = ("move it away and launch the sweep again to write it anew (finished rows keep their result.json "
           "and are not run again)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} does not read ({short_error(e)}); {fix}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise DataError(f"{path} is not a sweep's manifest: {problem}; {fix}")
    return manifest


def _manifest_problem(manifest) -> str | None:
    """What keeps ``manifest`` from being one ``write_manifest`` wrote, or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    missing = [key for key in ("grid", "scale", "config", "rows") if key not in manifest]
    if missing or not isinstance(manifest["rows"], list):
        return f"it lacks {', '.join(missing)}" if missing else "its rows are not a list"
    for i, entry in enumerate(manifest["rows"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            return f"its row {i} has no name"
        kinds = {"changes": dict, "params": int, "num_steps": int}
        wrong = [key for key, kind in kinds.items() if not isinstance(entry.get(key), kind)]
        if wrong:
            return f"row {entry['name']} has no {', '.join(wrong)}"
        if manifest["grid"] == "table3" and table3_row(entry) not in paper.TABLE3_ALL_BY_NAME:
            return f"row {entry['name']} names no Table 3 row"
    return None


def write_manifest(workdir: str, *, grid: str, scale: str | None, config_arg: str | None,
                   rows: Sequence[Row], info: dict) -> dict:
    """Writes (or extends) ``<workdir>/sweep.json``; refuses a workdir that holds a different sweep, or a
    manifest that does not read (``read_manifest``)."""
    path = os.path.join(workdir, MANIFEST)
    manifest = {"grid": grid, "scale": scale, "config": config_arg, "rows": []}
    old = read_manifest(workdir)
    if old is not None:
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
                "paper_row": row.paper_row, "table3_row": row.table3_row, "beyond_paper": row.beyond_paper,
                **info[row.name]})
    if grid == "table3":  # Table 3 order (E+ after E); a row's extra seeds right after it
        order = {r.name: i for i, r in enumerate(paper.TABLE3_ALL)}
        manifest["rows"].sort(key=lambda r: (order[table3_row(r)], r["name"] != table3_row(r), r["name"]))
    os.makedirs(workdir, exist_ok=True)
    text = json.dumps(manifest, indent=1)
    if _read_text(path) != text:  # SLURM array tasks all write the same manifest
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return manifest
