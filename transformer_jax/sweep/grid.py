"""The rows of a sweep: Table 3 rows or a generic cartesian grid, each a config loaded and validated.

A config is loaded exactly as ``train.py`` loads ``--config=path[:argument] --config.key=value``
(``run_config.load_config``: each override parsed as the type of its field, the config locked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Sequence
from typing import Any

from transformer_jax import run_config
from transformer_jax.evaluation import paper
from transformer_jax.model.config import param_count

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE3_CONFIG = "configs/table3.py"
TABLE3_GROUPS = tuple(dict.fromkeys(row.group for row in paper.TABLE3_ALL))  # base, A, ..., E, E+, big
# A row's name is its folder's name. Filesystems take 255 bytes a name; beyond this many, or with a "/",
# a generic grid's row is named by the items that vary and a hash of the whole name.
MAX_ROW_NAME_BYTES = 200
BEYOND = "beyond the paper"  # what stands in the paper's columns of a row of group E+


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
    paper_row: str | None = None  # the paper's Table 3 row this one reproduces
    table3_row: str | None = None  # the row of configs/table3.py it runs: the paper's, or one beyond it (E+)

    @property
    def beyond_paper(self) -> bool:
        """A Table 3 sweep's row that the paper does not have (group E+): no figures to compare with."""
        return self.table3_row is not None and self.paper_row is None


# ---------------------------------------------------------------------------------------------------
# Configs: loading (as train.py does) and validating.


def resolve_config_path(path: str) -> str:
    """An existing config file: ``path`` as given, or relative to the repository root."""
    for candidate in (path, os.path.join(REPO_ROOT, path)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"config file {path!r} not found (relative paths are tried from the current "
                            f"directory and from {REPO_ROOT})")


def load_config(config_arg: str, overrides: Sequence[str] = ()) -> tuple[Any, dict]:
    """``path[:argument]`` (relative to here or the repository root) plus overrides, as train.py loads
    them: ``run_config.load_config`` on the resolved path."""
    path, sep, argument = config_arg.partition(":")
    return run_config.load_config(f"{resolve_config_path(path)}{sep}{argument}", overrides)


def build_config(row: Row) -> Any:
    """The row's full config: ``config_arg`` loaded, ``overrides`` set (typos and types fail)."""
    overrides = [f"--config.{key}={format_value(value)}" for key, value in row.overrides]
    return load_config(row.config_arg, overrides)[0]


def validate_rows(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Builds and validates every row's config; returns ``{row: {"params", "num_steps", "vocab_size",
    "bleu_protocol"}}`` (the protocol of the row's dev BLEU, its ``config.dev_bleu_protocol``).

    Raises ValueError naming the row, before anything trains or is written (a row name that cannot be a
    folder name included).
    """
    info = {}
    for row in rows:
        if (not row.name or row.name in (".", "..") or "/" in row.name or "\0" in row.name
                or len(row.name.encode()) > MAX_ROW_NAME_BYTES):
            raise ValueError(f"sweep row name {row.name[:60]!r}... cannot be a folder name (expected at most "
                             f"{MAX_ROW_NAME_BYTES} bytes, no '/')")
        if row.name in info:
            raise ValueError(f"two sweep rows are named {row.name!r}; give each row its own values")
        try:
            run = run_config.build_run_config(build_config(row))
        except (ValueError, TypeError) as e:
            raise ValueError(f"sweep row {row.name!r} ({describe(row)}) is invalid: {e}") from e
        info[row.name] = {"params": param_count(run.model), "num_steps": run.train.num_steps,
                          "vocab_size": run.data.vocab_size, "bleu_protocol": run.eval.dev_bleu_protocol}
    return info


# ---------------------------------------------------------------------------------------------------
# Table 3 rows.


def select_table3_rows(selection: str | None) -> list[paper.Table3Row | paper.BeyondTable3Row]:
    """``"A,E"``, ``"base,C-dmodel256"``, ``"E,E+"``...: groups (base, A-E, E+, big) and row names, in
    Table 3 order (E+ after E). No selection: every row of the paper's Table 3 (E+ only when named)."""
    if not selection:
        return list(paper.TABLE3)
    chosen = set()
    for token in (t.strip() for t in selection.split(",")):
        if token in TABLE3_GROUPS:
            chosen.update(r.name for r in paper.TABLE3_ALL if r.group == token)
        elif token in paper.TABLE3_ALL_BY_NAME:
            chosen.add(token)
        else:
            names = ", ".join(r.name for r in paper.TABLE3_ALL)
            raise ValueError(f"unknown Table 3 row or group {token!r} in --rows={selection!r}; groups: "
                             f"{', '.join(TABLE3_GROUPS)}; rows: {names}")
    return [r for r in paper.TABLE3_ALL if r.name in chosen]


def table3_config_arg(row: str, scale: str) -> str:
    return f"{TABLE3_CONFIG}:{row},{scale}"


def paper_fixed_fields() -> set[str]:
    """The dotted config fields a paper-scale row must keep to be the paper's row: Table 3's columns
    (N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls, train steps, and row E's positions) and what
    ``paper.row_fields`` fixes for every row (the training recipe, the vocabulary, the language pair)."""
    fields = {f"model.{name}" for row in paper.TABLE3_ALL for name in row.model}
    fields |= {f"train.{name}" for name in paper.BASE_TRAIN}
    return fields | set(paper.row_fields("base"))


def table3_rows(selection: str | None, scale: str, base_seeds: int = 1,
                overrides: Sequence[str] = (), seeds: int = 1) -> list[Row]:
    """The selected rows at ``scale``; a row's changes are the model and train fields it sets there.

    With ``base_seeds`` > 1 the base row (when selected) runs again with seeds 1 .. base_seeds - 1, as
    rows ``base-seed<k>`` right after it: their spread is the noise band of the report. ``seeds`` does
    the same for every other row (``<row>-seed<k>``): the report gives each row its seeds' band.
    ``overrides`` (``"data.dir=data/multi30k"``...) are set on every row, typed as config_flags types
    them. An override is refused where the run would not be the row it is named and reported as: of a
    field a selected row changes from the base row, of ``seed`` beside seed rows (``base_seeds`` counts
    only where the base row is selected), and at paper scale of
    any field the paper fixes (``paper_fixed_fields``). Elsewhere it sets every row's base, e.g. a
    smaller model for a smoke run of rows D and E.
    """
    for flag, value in (("--base_seeds", base_seeds), ("--seeds", seeds)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    base_config_arg = table3_config_arg("base", scale)
    common = tuple(_parse_override(base_config_arg, item) for item in overrides)
    base = _flat_sections(load_config(base_config_arg)[0])
    rows = []
    for table3_row in select_table3_rows(selection):
        name = table3_row.name
        config_arg = table3_config_arg(name, scale)
        values = _flat_sections(load_config(config_arg)[0])
        order = [*table3_row.model, *table3_row.train]  # as the paper's row lists them
        changed = sorted((k for k, v in values.items() if v != base[k]),
                         key=lambda k: order.index(k) if k in order else len(order))
        changes = tuple((key, values[key]) for key in changed)
        paper_row = name if name in paper.TABLE3_BY_NAME else None
        rows.append(Row(name, config_arg, common, changes, paper_row, name))
        rows.extend(Row(f"{name}-seed{seed}", config_arg, (*common, ("seed", seed)),
                        (*changes, ("seed", seed)), paper_row, name)
                    for seed in range(1, base_seeds if name == "base" else seeds))
    _check_overrides(common, rows, scale)
    return rows


def _check_overrides(overrides: Sequence[tuple[str, Any]], rows: Sequence[Row], scale: str) -> None:
    """Refuses, in one line, an override of a field that makes a row another row (the first one found)."""
    paper_fields = paper_fixed_fields() if scale == "paper" else set()
    seeded = [row.name for row in rows if row.name != row.table3_row]  # base-seed1, E-learned-pos-seed1...
    for key, value in overrides:
        item = f"--override={key}={format_value(value)}"
        if key == "seed" and seeded:
            raise ValueError(f"{item} conflicts with the seed of row {seeded[0]} (--base_seeds, --seeds); "
                             "leave them out or set them to 1 to run every row with one seed of your choice")
        as_grid = (f"sweep it as a generic grid: --grid '{key}={format_value(value)}' "
                   f"--config {table3_config_arg('base', scale)}")
        if key in paper_fields:
            raise ValueError(f"{item} changes a field the paper fixes for every Table 3 row, so the runs at "
                             "paper scale would not be the paper's rows; run --scale=multi30k or cpu, or "
                             f"{as_grid}")
        section, _, field = key.partition(".")
        changing = [row.name for row in rows
                    if section in ("model", "train") and field in dict(row.changes)]
        if changing:
            raise ValueError(f"{item} changes a field row {changing[0]} sets ({field}), so it would not be "
                             f"the row it is named and reported as; leave the rows that set {field} out "
                             f"of --rows, or {as_grid}")


def _parse_override(config_arg: str, item: str) -> tuple[str, Any]:
    """``"data.dir=runs/x"`` -> ``("data.dir", "runs/x")``, the value typed as the field of ``config_arg``."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"bad --override {item!r}: expected key=value, e.g. data.dir=data/multi30k")
    return key, _parse_value(config_arg, key, text)


def _flat_sections(config: Any) -> dict[str, Any]:
    """The fields of ``config.model`` and ``config.train``, by field name (the names Table 3 rows use)."""
    return {**config.model.to_dict(), **config.train.to_dict()}


# ---------------------------------------------------------------------------------------------------
# Generic grids.


def parse_grid(spec: str, config_arg: str) -> list[Row]:
    """``"model.num_heads=1,4,8 model.dropout_rate=0.0,0.1"`` -> the cartesian product, as rows.

    Keys are dotted config fields; each value is parsed by config_flags as the field's type in
    ``config_arg``. A row is named by its assignments, ``model.num_heads=4,model.dropout_rate=0.1``, or,
    when that is too long for a folder name or holds a "/" (:func:`row_name`), by the assignments that
    vary across the grid and a hash of the whole name.
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
    varying = {key for key, values in axes if len(values) > 1}
    rows = []
    for values in itertools.product(*(vs for _, vs in axes)):
        assignments = tuple((key, value) for (key, _), value in zip(axes, values, strict=True))
        rows.append(Row(row_name(assignments, varying), config_arg, assignments, assignments))
    return rows


def row_name(assignments: Sequence[tuple[str, Any]], varying: set[str]) -> str:
    """``k1=v1,k2=v2``; when longer than ``MAX_ROW_NAME_BYTES`` or holding a "/", the ``varying`` keys'
    assignments (cut to 120 bytes, "/" made "_") and 10 hex digits of the full name's SHA-256."""
    name = ",".join(f"{k}={format_value(v)}" for k, v in assignments)
    if len(name.encode()) <= MAX_ROW_NAME_BYTES and "/" not in name:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    short = ",".join(f"{k}={format_value(v)}" for k, v in assignments if k in varying).replace("/", "_")
    short = short.encode()[:120].decode(errors="ignore")
    return f"{short}-{digest}" if short else f"row-{digest}"


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
