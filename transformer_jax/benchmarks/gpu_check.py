"""The first job on a new GPU: one command, about ten minutes, one table of numbers.

    python -m transformer_jax.benchmarks.gpu_check [--out=gpu_check] [--multi30k_dir=data/multi30k]
        [--train_minutes=2] [--quick] [--only=3,4]

Six steps, in order; each runs in its own process under a time box (a hang or a crash in one, such as
a cuDNN fault, is that step's red row, and the next step runs):

  1. devices: kind, count, memory; driver, CUDA, cuDNN; JAX and its libraries;
  2. the bfloat16 and float32 matmul peak;
  3. fused attention against dense, values and gradients in bfloat16, with padding and causal masks;
  4. the base model's preflight in bfloat16, fused and dense;
  5. the base model on Multi30k for ``--train_minutes``, then its test BLEU, greedy and beam;
  6. the projection of configs/wmt14_en_de_base.py's 100k steps, beside the paper's 12 hours on 8 P100s.

Steps 1-3 are in ``gpu_check_steps`` (with the options and rows every step shares), 4-6 in
``gpu_check_runs``; this module runs them, time-boxes them and writes the report.

Each row is "pass", "fail" (with the reason), or "not run" (with the reason: a step this device cannot
run, or one left out with ``--only``). Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``, each
step's output to ``<out>/logs/``, step 5's workdir to ``<out>/train``. Exits 1 if a step failed.

``--quick`` runs every step with tiny shapes (the tiny model, the synthetic task), on a CPU in about a
minute: what CI runs. Without it, a machine whose JAX found no accelerator fails step 1 and runs none of
the others. Nothing is read from the network; everything is written under ``--out``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from absl import flags, logging

from transformer_jax.benchmarks.gpu_check_runs import step_preflight, step_projection, step_train
from transformer_jax.benchmarks.gpu_check_steps import (
    FAIL,
    NOT_RUN,
    PASS,
    STEPS,
    TITLES,
    NotRun,
    Options,
    Row,
    StepFailed,
    step_devices,
    step_fused_attention,
    step_matmul_peak,
)
from transformer_jax.runtime import errors, output_file
from transformer_jax.runtime.errors import ConfigError

STEP_FUNCTIONS: dict[str, Callable[[Options, dict[str, Row]], tuple[str, dict]]] = {
    "devices": step_devices, "matmul_peak": step_matmul_peak, "fused_attention": step_fused_attention,
    "preflight": step_preflight, "train": step_train, "projection": step_projection}


# Running the steps ---------------------------------------------------------------------------------------


class _TimeBoxExceeded(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """In-process time box (main thread only): raises _TimeBoxExceeded when Python next runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TimeBoxExceeded()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_step(name: str, options: Options, earlier: dict[str, Row]) -> Row:
    """Runs one step in this process; every outcome is a Row (an exception is a "fail" with one line)."""
    index = STEPS.index(name) + 1
    started = time.time()
    try:
        with _alarm(options.time_box(name)):
            summary, details = STEP_FUNCTIONS[name](options, earlier)
        row = Row(index, name, PASS, summary, details=details)
    except StepFailed as e:
        row = Row(index, name, FAIL, str(e), details=e.details)
    except NotRun as e:
        row = Row(index, name, NOT_RUN, str(e))
    except _TimeBoxExceeded:
        row = Row(index, name, FAIL, f"did not finish within its {options.time_box(name):g} s time box")
    except Exception as e:  # noqa: BLE001 - the check reports every failure and goes on
        row = Row(index, name, FAIL, errors.short_error(e))
    row.seconds = time.time() - started
    return row


def _rows_to_json(rows: dict[str, Row]) -> dict:
    return {name: dataclasses.asdict(row) for name, row in rows.items()}


def _rows_from_json(data: dict) -> dict[str, Row]:
    return {name: Row(**row) for name, row in data.items()}


# SIGINT / SIGTERM during a check. A step's process runs in its own session, so that a Ctrl-C at the terminal
# reaches only the check; the check ends the step's process group and runs no further step.
_stopped_by: str | None = None  # "SIGINT" / "SIGTERM" once one arrived during run_checks
_running: subprocess.Popen | None = None  # the step's process while it runs
STOPPED = "stopped by"  # how a row the stop cut short or left out begins


def _end_group(child: subprocess.Popen) -> None:
    """SIGKILL to ``child``'s process group (the step and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


@contextlib.contextmanager
def _stopping():
    """Within the block, SIGINT and SIGTERM set ``_stopped_by`` and end the running step's process group
    (main thread only; elsewhere the block changes nothing)."""
    global _stopped_by
    _stopped_by = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        del frame
        global _stopped_by
        _stopped_by = _stopped_by or signal.Signals(signum).name
        if _running is not None:
            _end_group(_running)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _log_path(options: Options, name: str) -> str:
    return os.path.join(options.out, "logs", f"{STEPS.index(name) + 1}-{name}.log")


def run_isolated(name: str, options: Options, earlier: dict[str, Row]) -> Row:
    """Runs one step in a child process, killed at its time box or when SIGINT / SIGTERM stops the check
    (``_stopping``); its output goes to ``<out>/logs/``."""
    global _running
    index, box = STEPS.index(name) + 1, options.time_box(name)
    os.makedirs(os.path.join(options.out, "logs"), exist_ok=True)
    earlier_path = os.path.join(options.out, "logs", f"earlier-{index}.json")
    result_path = os.path.join(options.out, "logs", f"{index}-{name}.json")
    with open(earlier_path, "w") as f:
        json.dump(_rows_to_json(earlier), f, default=str)
    with contextlib.suppress(FileNotFoundError):
        os.remove(result_path)
    command = [sys.executable, "-m", "transformer_jax.benchmarks.gpu_check", f"--step={name}",
               f"--out={options.out}", f"--multi30k_dir={options.multi30k_dir}",
               f"--train_minutes={options.train_minutes}", f"--quick={options.quick}",
               f"--configs_dir={options.configs_dir}", f"--earlier={earlier_path}", f"--result={result_path}"]
    started = time.time()
    with open(_log_path(options, name), "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 stdin=subprocess.DEVNULL)
        _running = child
        try:
            if _stopped_by:  # the signal came while the process started
                _end_group(child)
            code = child.wait(timeout=box)
        except subprocess.TimeoutExpired:
            _end_group(child)
            child.wait()
            return Row(index, name, FAIL, f"did not finish within its {box:g} s time box (killed); its "
                       f"output: {_log_path(options, name)}", seconds=time.time() - started)
        finally:
            _running = None
    seconds = time.time() - started
    if _stopped_by:
        return Row(index, name, FAIL, f"{STOPPED} {_stopped_by} before it finished (its process was ended)",
                   seconds=seconds)
    if os.path.exists(result_path):
        with open(result_path) as f:
            row = Row(**json.load(f))
        row.seconds = seconds
        return row
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return Row(index, name, FAIL, f"the step's process ended with {how} and no result: "
               f"{_last_line(_log_path(options, name))} (all of it: {_log_path(options, name)})",
               seconds=seconds)


def _last_line(path: str) -> str:
    """What a crashed step's output says: its first line that names an error (a fatal LLVM, CUDA or
    Python error prints one before the stack dumps), else its last line."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        named = [line for line in lines if re.search(r"\b(ERROR|Error|error|Check failed|Aborted)\b", line)]
        return (named or lines or ["(no output)"])[0 if named else -1][:300]
    return "(no output)"


def run_checks(options: Options, *, only: tuple[str, ...] = STEPS, isolate: bool = True,
               say: Callable[[str], None] = print) -> list[Row]:
    """Runs the steps in order (each in its own process unless ``isolate`` is False); writes the JSON and
    the Markdown; returns the rows. A step not in ``only`` is a "not run" row that says so. ConfigError
    before any step when ``options.out`` cannot be made or written.

    SIGINT or SIGTERM ends the running step's process (a "fail" row that says so); the steps after it are
    "not run", the reports are written, and ``_stopped_by`` names the signal."""
    output_file.check_folder(options.out, flag="--out")
    rows: dict[str, Row] = {}
    with _stopping():
        for index, name in enumerate(STEPS, 1):
            if _stopped_by:
                rows[name] = Row(index, name, NOT_RUN, f"{STOPPED} {_stopped_by} before it started")
            elif name not in only:
                rows[name] = Row(index, name, NOT_RUN, "left out by --only")
            else:
                say(f"[{index}/{len(STEPS)}] {TITLES[name]} (time box {options.time_box(name):g} s) ...")
                rows[name] = (run_isolated if isolate else run_step)(name, options, rows)
            row = rows[name]
            if not _stopped_by:  # a stop is said once, by the caller
                say(f"[{index}/{len(STEPS)}] {row.title}: {row.status.upper()} ({row.seconds:.1f} s) "
                    f"{row.summary}")
        write_reports(list(rows.values()), options)
    return list(rows.values())


# The report ----------------------------------------------------------------------------------------------


def header(rows: list[Row], options: Options) -> str:
    device = next((r.details for r in rows if r.name == "devices" and r.details), {})
    what = (f"{device.get('device_count')} x {device.get('device_kind')}, jax "
            f"{device.get('versions', {}).get('jax')}" if device else "device unknown (step 1 did not run)")
    return (f"gpu_check{' --quick' if options.quick else ''}: {what}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def table(rows: list[Row]) -> str:
    """The plain-text table: one line per step."""
    width = max(len(r.title) for r in rows)
    lines = [f" #  {'step':<{width}}  {'status':<7}  {'seconds':>7}  result"]
    for r in rows:
        lines.append(f" {r.index}  {r.title:<{width}}  {r.status:<7}  {r.seconds:7.1f}  {r.summary}")
    return "\n".join(lines)


def markdown(rows: list[Row], options: Options) -> str:
    out = [f"# {header(rows, options)}", "", "| # | step | status | seconds | result |",
           "|---|---|---|---:|---|"]
    out += [f"| {r.index} | {r.title} | {r.status} | {r.seconds:.1f} | {r.summary.replace('|', '/')} |"
            for r in rows]
    out += ["", f"Each step's output: `{os.path.join(options.out, 'logs')}/`.", ""]
    for r in rows:
        shown = {k: v for k, v in r.details.items() if k not in ("environment", "lines", "model")}
        if shown:
            out += [f"## {r.index}. {r.title}", "", "```json", json.dumps(shown, indent=1, default=str),
                    "```", ""]
    return "\n".join(out)


def write_reports(rows: list[Row], options: Options) -> tuple[str, str]:
    """``<out>/gpu_check.json`` and ``<out>/gpu_check.md``; returns their paths."""
    json_path, md_path = (os.path.join(options.out, f"gpu_check.{ext}") for ext in ("json", "md"))
    document = {"header": header(rows, options), "quick": options.quick, "all_passed": all_passed(rows),
                "steps": [dataclasses.asdict(r) for r in rows]}
    for path, text in ((json_path, json.dumps(document, indent=1, default=str)),
                       (md_path, markdown(rows, options))):
        with open(path + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(path + ".tmp", path)
    return json_path, md_path


def all_passed(rows: list[Row]) -> bool:
    return not any(r.status == FAIL for r in rows)


# The command -----------------------------------------------------------------------------------------------

def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.gpu_check`` (defined when it runs, not on
    import)."""
    flags.DEFINE_string("out", Options.out, "Folder of gpu_check.json, gpu_check.md, logs/ and train/.",
                        flag_values=flag_values)
    flags.DEFINE_bool("quick", False, "Tiny shapes: every step on a CPU (CI).", flag_values=flag_values)
    flags.DEFINE_string("multi30k_dir", Options.multi30k_dir, "Step 5's data, made beforehand by python -m "
                        "transformer_jax.data.prepare multi30k --dir=DIR (not needed with --quick).",
                        flag_values=flag_values)
    flags.DEFINE_float("train_minutes", Options.train_minutes, "Step 5's training time, from its first "
                       "logged steps (compiled by then).", flag_values=flag_values)
    flags.DEFINE_list("only", [], "Run only these steps (numbers 1-6 or names); the others are 'not run' "
                      "rows.", flag_values=flag_values)
    flags.DEFINE_string("configs_dir", "", "The project's configs/ (default: the checkout's).",
                        flag_values=flag_values)
    # Internal: the parent runs each step as `--step=NAME --earlier=FILE --result=FILE`.
    flags.DEFINE_enum("step", None, list(STEPS), "Internal: run this one step and write --result.",
                      flag_values=flag_values)
    flags.DEFINE_string("earlier", None, "Internal: the rows of the steps before --step (JSON).",
                        flag_values=flag_values)
    flags.DEFINE_string("result", None, "Internal: where --step writes its row (JSON).",
                        flag_values=flag_values)


def _parse_only(values: list[str]) -> tuple[str, ...]:
    if not values:
        return STEPS
    chosen = []
    for value in values:
        name = STEPS[int(value) - 1] if value.isdigit() and 1 <= int(value) <= len(STEPS) else value
        if name not in STEPS:
            raise ConfigError(f"--only={','.join(values)}: expected step numbers 1-{len(STEPS)} or names of "
                              f"{', '.join(STEPS)}; got {value!r}")
        chosen.append(name)
    return tuple(chosen)


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    values = flags.FLAGS
    if values.train_minutes <= 0:
        raise ConfigError(f"--train_minutes={values.train_minutes}: expected minutes > 0, e.g. 2")
    options = Options(out=values.out, quick=values.quick, multi30k_dir=values.multi30k_dir,
                      train_minutes=values.train_minutes, configs_dir=values.configs_dir)
    if values.step:  # a child: one step, its row written for the parent
        from transformer_jax.runtime import compile_cache

        compile_cache.enable(os.path.join(os.path.abspath(options.out), "xla_cache"))  # a rerun compiles less
        earlier = {}
        if values.earlier:
            with open(values.earlier) as f:
                earlier = _rows_from_json(json.load(f))
        row = run_step(values.step, options, earlier)
        with open(values.result + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(row), f, default=str)
        os.replace(values.result + ".tmp", values.result)
        return
    only = _parse_only(values.only)
    rows = run_checks(options, only=only, say=lambda line: print(line, flush=True))
    json_path, md_path = (os.path.join(options.out, f"gpu_check.{ext}") for ext in ("json", "md"))
    if _stopped_by:
        cut = next(r for r in rows if r.summary.startswith(STOPPED))
        print(f"Stopped by {_stopped_by} at step {cut.index} ({cut.title}): "
              + ("its process was ended" if cut.status == FAIL else "it did not start")
              + f"; the steps before it are in {md_path}. Run the same command again to check again.",
              flush=True)
        sys.exit(128 + signal.Signals[_stopped_by].value)
    print()
    print(header(rows, options))
    print(table(rows))
    print(f"\nwritten: {json_path}, {md_path}; each step's output in {os.path.join(options.out, 'logs')}/")
    if not all_passed(rows):
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
