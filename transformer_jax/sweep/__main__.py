"""Command line of the sweeps: ``python -m transformer_jax.sweep [launch|report|params] --flags``.

    python -m transformer_jax.sweep --grid table3 [--rows A,E] --scale multi30k --workdir runs/t3m
    python -m transformer_jax.sweep --grid table3 --rows E,E+ --seeds 3 --scale cpu --workdir runs/t3e
    python -m transformer_jax.sweep --grid 'model.num_heads=1,4,8 model.dropout_rate=0.0,0.1' \\
        --config configs/default.py --workdir runs/heads --launcher print
    python -m transformer_jax.sweep report --workdir runs/table3
    python -m transformer_jax.sweep params [--scale paper|cpu|multi30k] [--rows C]

Dev decoding: beam 4, alpha 0.6 as in Table 3, except at ``--scale cpu`` where it is greedy (beam 1) to
save time; ``--beam_size`` overrides both. See ``transformer_jax/sweep/__init__.py`` and docs/sweeps.md.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from transformer_jax import slurm
from transformer_jax.evaluation import paper
from transformer_jax.runtime import errors, output_file
from transformer_jax.sweep import grid, launchers, report

COMMANDS = ("launch", "report", "params")
DEFAULT_BASE_SEEDS = 3


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.sweep``."""
    flags.DEFINE_string("grid", "table3", "'table3' (the paper's Table 3 rows), or space-separated "
                        "key=v1,v2 items over --config, e.g. "
                        "'model.num_heads=1,4,8 model.dropout_rate=0.0,0.1' "
                        "(their cartesian product; values are parsed as the field's type).",
                        flag_values=flag_values)
    flags.DEFINE_string("rows", None, "Table 3 only: comma-separated groups (base, A-E, E+, big) and row "
                        "names, e.g. A,E or C-dmodel256. E+ is beyond the paper: row E with the position "
                        "schemes rotary, alibi, relative and none. Default: every row of the paper's "
                        "Table 3. The base row is added when missing.", flag_values=flag_values)
    flags.DEFINE_string("scale", None, "Table 3 only: the scale of configs/table3.py the rows run at: "
                        "paper (default: WMT14 EN-DE as in the paper), multi30k (Multi30k EN-DE on 2 CPU "
                        "cores, ~6 min a row) or cpu (a synthetic task, ~2 min a row).",
                        flag_values=flag_values)
    flags.DEFINE_integer("base_seeds", None, "Table 3 only: the base row runs with seeds 0 .. n-1 (rows "
                         "base, base-seed1, ...); a row's change counts as a direction only outside their "
                         f"spread. Default: {DEFAULT_BASE_SEEDS}, or 1 with --override=seed=N (every row, "
                         "the base row included, runs with that one seed).", flag_values=flag_values)
    flags.DEFINE_integer("seeds", 1, "Table 3 only: every row but base runs with seeds 0 .. n-1 (rows "
                         "<row>, <row>-seed1, ...); the report gives each row its seeds' band.",
                         flag_values=flag_values)
    flags.DEFINE_multi_string("override", [], "Table 3 only: key=value set on every row, as train.py's "
                              "--config.key=value, e.g. --override=data.dir=data/multi30k (repeatable). A "
                              "field the rows set (Table 3's columns: N, d_model, ..., positions, steps) is "
                              "refused.", flag_values=flag_values)
    flags.DEFINE_string("config", "configs/default.py", "Base config of a generic grid, path[:argument] "
                        "as train.py's --config (e.g. configs/table3.py:base,cpu).", flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "Sweep directory, one sub-directory per row (default: runs/table3 "
                        "or runs/sweep). 'report' reads and writes here.", flag_values=flag_values)
    flags.DEFINE_enum("launcher", "local", ["local", "print", "slurm"],
                      "local: run the rows here, one after another (finished rows are skipped, partial ones "
                      "resume); print: print each row's train and evaluate commands; slurm: write "
                      "<workdir>/sweep.sbatch, one array task per row.", flag_values=flag_values)
    flags.DEFINE_integer("beam_size", None, "Beam of the dev decoding (default: 1 at --scale cpu, else the "
                         f"paper's {paper.BEAM_SIZE}).", flag_values=flag_values)
    flags.DEFINE_integer("row_index", None, "Run only this row (0-based, in sweep order); the SLURM array "
                         "task id.", flag_values=flag_values)
    flags.DEFINE_string("python", None, "Interpreter in the commands (default: this one for the local "
                        "launcher, 'python' for print and slurm).", flag_values=flag_values)
    flags.DEFINE_multi_string("slurm_option", [], "Extra #SBATCH line of the slurm launcher, e.g. "
                              "--slurm_option=--gres=gpu:1 or --slurm_option=--time=4:00:00 "
                              "(repeatable).", flag_values=flag_values)
    flags.DEFINE_integer("slurm_signal_seconds", slurm.DEFAULT_SIGNAL_SECONDS,
                         "slurm launcher: seconds before a task's time limit its row saves a checkpoint "
                         "and the task requeues itself.", flag_values=flag_values)
    flags.DEFINE_bool("submit", False, "slurm launcher: also submit the array with sbatch and print its "
                      "job id.", flag_values=flag_values)


def main(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> int:
    """Runs the command in ``argv[1:]`` (launch, report or params) with parsed ``flag_values``.

    Returns the exit status: 0 done, 1 some rows failed (run again to resume) or bad input (one
    ``error:`` line and the hint every entry point prints).
    """
    if len(argv) > 2 or (len(argv) == 2 and argv[1] not in COMMANDS):
        raise app.UsageError(f"expected one command of {COMMANDS} (default: launch), got {argv[1:]}")
    command = argv[1] if len(argv) == 2 else "launch"
    try:
        return _run(command, flag_values)
    except (ValueError, FileNotFoundError, errors.UserError) as e:
        if errors.show_tracebacks():
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        print(f"(set {errors.TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def _base_seeds(f: flags.FlagValues) -> int:
    """``--base_seeds``, or its default: one seed where an ``--override`` sets ``seed`` for every row."""
    if f.base_seeds is not None:
        return f.base_seeds
    seed_set = any(item.partition("=")[0].strip() == "seed" for item in f.override)
    return 1 if seed_set else DEFAULT_BASE_SEEDS


def _rows(f: flags.FlagValues, rows: str | None) -> list[grid.Row]:
    if f.grid == "table3":
        return grid.table3_rows(rows, f.scale or "paper", _base_seeds(f), f.override, f.seeds)
    if f.rows or f.scale or f.override or f.seeds != 1 or f.base_seeds is not None:
        raise ValueError("--rows, --scale, --seeds, --base_seeds and --override apply to --grid table3; a "
                         "generic grid runs every combination of its items over --config (use --row_index "
                         "for one)")
    return grid.parse_grid(f.grid, f.config)


def _run(command: str, f: flags.FlagValues) -> int:
    if command == "report":
        if not f.workdir:
            raise ValueError("report needs --workdir, the directory of a launched sweep")
        paths = report.write_report(f.workdir)
        print(paths["markdown"])
        print(f"Wrote {paths['md']}, {paths['csv']} and {paths['png']}")
        return 0
    rows = _rows(f, f.rows)
    if command != "params" and f.grid == "table3" and f.rows and not any(r.name == "base" for r in rows):
        rows = _rows(f, "base," + f.rows)
        print("Adding the base row: the report compares every row with it.")
    info = grid.validate_rows(rows)  # every row builds a valid config before anything runs
    if command == "params":
        print(report.params_table(rows, info))
        return 0
    workdir = os.path.abspath(f.workdir or ("runs/table3" if f.grid == "table3" else "runs/sweep"))
    output_file.check_folder(workdir, flag="--workdir")  # before anything is written or run
    scale = (f.scale or "paper") if f.grid == "table3" else None
    config_arg = None if f.grid == "table3" else grid.command_config_arg(f.config)
    if f.launcher == "slurm":
        slurm.check_sbatch_path(workdir)  # before anything is written
    launchers.write_manifest(workdir, grid=f.grid, scale=scale, config_arg=config_arg, rows=rows, info=info)
    beam_size = f.beam_size or (1 if scale == "cpu" else paper.BEAM_SIZE)
    indices = list(range(len(rows)))  # the rows to run, by their index in the sweep
    if f.row_index is not None:
        if not 0 <= f.row_index < len(rows):
            raise ValueError(f"--row_index={f.row_index} is out of range: the sweep has {len(rows)} rows "
                             f"(0 to {len(rows) - 1})")
        indices = [f.row_index]
    if f.launcher == "local":
        rows = [rows[i] for i in indices]
        failed = launchers.launch_local(rows, info, workdir, beam_size=beam_size,
                                        python=f.python or sys.executable)
        return 1 if failed else 0
    python = f.python or "python"
    if f.launcher == "print":
        launchers.launch_print([rows[i] for i in indices], info, workdir, beam_size=beam_size, python=python)
        return 0
    task = [python, "-m", "transformer_jax.sweep", f"--grid={f.grid}", f"--workdir={workdir}",
            "--launcher=local", f"--beam_size={beam_size}", f"--python={python}"]
    if f.grid == "table3":  # explicit names and seeds, so that array index i is row i
        task += [f"--scale={scale}", f"--rows={','.join(r.name for r in rows if r.name == r.table3_row)}",
                 f"--base_seeds={_base_seeds(f)}", f"--seeds={f.seeds}",
                 *(f"--override={item}" for item in f.override)]
    else:
        task += [f"--config={config_arg}"]
    # Every row goes into the script, so that task i runs row i of the sweep the task rebuilds; the array
    # holds the tasks to run.
    path = launchers.launch_slurm(rows, workdir, task, slurm_options=f.slurm_option,
                                  signal_seconds=f.slurm_signal_seconds, indices=indices)
    if f.submit:
        print(f"Submitted {path} ({len(indices)} array tasks): job {slurm.submit(path)}")
    else:
        print(f"Wrote {path} ({len(indices)} array tasks). Submit it with:\n  sbatch {path}")
    print(f"When the tasks finish: python -m transformer_jax.sweep report --workdir {workdir} (submitting "
          "again runs only the rows not finished)")
    return 0


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, takes_args=True)  # launch, report or params
