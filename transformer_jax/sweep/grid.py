"""The rows of a sweep: Table 3 rows or a generic cartesian grid, each a config loaded and validated.

A config is loaded exactly as ``train.py`` loads ``--config=path[:argument] --config.key=value``:
through ml_collections' ``config_flags`` (which parses each override as the type of its field), locked.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig, param_count
from transformer_jax.run_config import validate_config
from transformer_jax.runtime import errors

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE3_CONFIG = "configs/table3.py"
TABLE3_GROUPS = tuple(dict.fromkeys(row.group for row in paper.TABLE3))  # base, A, ..., E, big


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
# Configs: loading (as train.py does) and validating.


def resolve_config_path(path: str) -> str:
    """An existing config file: ``path`` as given, or relative to the repository root."""
    for candidate in (path, os.path.join(REPO_ROOT, path)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"config file {path!r} not found (relative paths are tried from the current "
                            f"directory and from {REPO_ROOT})")


def load_config(config_arg: str, overrides: Sequence[str] = ()) -> tuple[ml_collections.ConfigDict, dict]:
    """``path[:argument]`` plus ``--config.key=value`` overrides -> (locked config, parsed overrides).

    The parsed overrides map each key to its typed value (``{"model.num_heads": 4}``). Raises ValueError
    naming the config and the override at fault.
    """
    path, sep, argument = config_arg.partition(":")
    argv = ["sweep", f"--config={resolve_config_path(path)}{sep}{argument}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "The row's config.", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
        config = flag_values.config
        config.lock()  # a config that failed to load raises here (config_flags defers IOError)
    except (flags.Error, ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        raise ValueError(f"cannot load {config_arg}{''.join(' ' + o for o in overrides)}: "
                         f"{errors.config_flag_message(e, argv) if _is_lookup(e) else _last_line(e)}") from e
    return config, dict(flag_values["config"].override_values)


def _is_lookup(error: Exception) -> bool:
    """A misspelt field: ml_collections' KeyError / AttributeError (its "Did you mean" text)."""
    return isinstance(error, KeyError | AttributeError)


def _last_line(error: Exception) -> str:
    """config_flags wraps errors of ``get_config`` in a traceback; its last line says what went wrong."""
    lines = [line for line in str(error).strip("'\"").splitlines() if line.strip()]
    return lines[-1].removeprefix("ValueError: ") if lines else type(error).__name__


def build_config(row: Row) -> ml_collections.ConfigDict:
    """The row's full config: ``config_arg`` loaded, ``overrides`` set (typos and types fail)."""
    overrides = [f"--config.{key}={format_value(value)}" for key, value in row.overrides]
    return load_config(row.config_arg, overrides)[0]


def validate_rows(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Builds and validates every row's config; returns ``{row: {"params", "num_steps", "vocab_size",
    "bleu_protocol"}}`` (the protocol of the row's dev BLEU, its ``config.dev_bleu_protocol``).

    Raises ValueError naming the row, before anything trains.
    """
    info = {}
    for row in rows:
        try:
            config = build_config(row)
            validate_config(config)
            model_config = ModelConfig(vocab_size=config.data.vocab_size, **config.model)
        except (ValueError, TypeError) as e:
            raise ValueError(f"sweep row {row.name!r} ({describe(row)}) is invalid: {e}") from e
        info[row.name] = {"params": param_count(model_config), "num_steps": config.train.num_steps,
                          "vocab_size": config.data.vocab_size, "bleu_protocol": config.dev_bleu_protocol}
    return info


# ---------------------------------------------------------------------------------------------------
# Table 3 rows.


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


def table3_config_arg(row: str, scale: str) -> str:
    return f"{TABLE3_CONFIG}:{row},{scale}"


def table3_rows(selection: str | None, scale: str, base_seeds: int = 1,
                overrides: Sequence[str] = ()) -> list[Row]:
    """The selected rows at ``scale``; a row's changes are the model and train fields it sets there.

    With ``base_seeds`` > 1 the base row (when selected) runs again with seeds 1 .. base_seeds - 1, as
    rows ``base-seed<k>`` right after it: their spread is the noise band of the report. ``overrides``
    (``"data.dir=data/multi30k"``...) are set on every row, typed as config_flags types them.
    """
    if base_seeds < 1:
        raise ValueError(f"--base_seeds must be at least 1, got {base_seeds}")
    base_config_arg = table3_config_arg("base", scale)
    common = tuple(_parse_override(base_config_arg, item) for item in overrides)
    base = _flat_sections(load_config(base_config_arg)[0])
    rows = []
    for paper_row in select_table3_rows(selection):
        config_arg = table3_config_arg(paper_row.name, scale)
        values = _flat_sections(load_config(config_arg)[0])
        order = [*paper_row.model, *paper_row.train]  # as the paper's row lists them
        changed = sorted((k for k, v in values.items() if v != base[k]),
                         key=lambda k: order.index(k) if k in order else len(order))
        changes = tuple((key, values[key]) for key in changed)
        rows.append(Row(paper_row.name, config_arg, common, changes, paper_row.name))
        if paper_row.name == "base":
            rows.extend(Row(f"base-seed{seed}", base_config_arg, (*common, ("seed", seed)), (("seed", seed),),
                            "base") for seed in range(1, base_seeds))
    return rows


def _parse_override(config_arg: str, item: str) -> tuple[str, Any]:
    """``"data.dir=runs/x"`` -> ``("data.dir", "runs/x")``, the value typed as the field of ``config_arg``."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"bad --override {item!r}: expected key=value, e.g. data.dir=data/multi30k")
    return key, _parse_value(config_arg, key, text)


def _flat_sections(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The fields of ``config.model`` and ``config.train``, by field name (the names Table 3 rows use)."""
    return {**config.model.to_dict(), **config.train.to_dict()}


# ---------------------------------------------------------------------------------------------------
# Generic grids.


def parse_grid(spec: str, config_arg: str) -> list[Row]:
    """``"model.num_heads=1,4,8 model.dropout_rate=0.0,0.1"`` -> the cartesian product, as rows.

    Keys are dotted config fields; each value is parsed by config_flags as the field's type in
    ``config_arg``. A row is named by its assignments, ``model.num_heads=4,model.dropout_rate=0.1``.
    """
    axes: list[tuple[str, list[Any]]] = []
    for item in spec.split():
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"bad grid item {item!r} in --grid={spec!r}: expected key=value1,value2,...")
        if key in (k for k, _ in axes):
            raise ValueError(f"grid key {key!r} appears twice in --grid={spec!r}")
        texts = split_values(values)
        if any(not t for t in texts):
            raise ValueError(f"empty value in grid item {item!r}")
        axes.append((key, [_parse_value(config_arg, key, text) for text in texts]))
    if not axes:
        raise ValueError("--grid is empty: give 'table3' or key=value1,value2 items separated by spaces")
    config_arg = command_config_arg(config_arg)
    rows = []
    for values in itertools.product(*(vs for _, vs in axes)):
        assignments = tuple((key, value) for (key, _), value in zip(axes, values, strict=True))
        name = ",".join(f"{k}={format_value(v)}" for k, v in assignments)
        rows.append(Row(name, config_arg, assignments, assignments))
    return rows


def _parse_value(config_arg: str, key: str, text: str) -> Any:
    """``text`` as config_flags parses ``--config.<key>=<text>`` on ``config_arg``."""
    try:
        return load_config(config_arg, [f"--config.{key}={text}"])[1][key]
    except ValueError as e:
        raise ValueError(f"bad grid value {key}={text!r}: {e}") from None


def split_values(values: str) -> list[str]:
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


def command_config_arg(config_arg: str) -> str:
    """The config argument as commands spell it: the path relative to the repository root when inside."""
    path, sep, argument = config_arg.partition(":")
    resolved = resolve_config_path(path)
    relative = os.path.relpath(resolved, REPO_ROOT)
    return (resolved if relative.startswith("..") else relative) + sep + argument


def format_value(value: Any) -> str:
    """A value as a command-line flag spells it: ``true``, ``(16,64)``, ``0.1``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def describe(row: Row) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in row.changes) or "no changes"
