"""Every command in README.md and docs/*.md names flags, configs and modules that exist (none is run).

A command is a line of a ```bash block (continued with a trailing backslash; ``&&``, ``;`` and ``|``
separate commands; ``# ...`` is a comment; ``< file``, ``> file``, ``2>&1`` are redirections) that runs
``python``, ``python3`` or ``.venv/bin/python``, also inside a quoted argument
(``gcloud ... --command="... python train.py ..."``). For each:

- ``-m MODULE`` must have an importable spec (a package needs ``MODULE.__main__``); a script must exist.
- For an entry point of this repository, its absl flags are read by running the script or module in a
  fresh process (a fork of one subprocess that has imported the shared libraries) with its ``main`` not
  called (``errors.run_main`` and ``absl.app.run`` replaced): every
  ``--flag``, ``--flag value``, ``--noflag`` must be one of them. ``--config.a.b`` must be a field of the
  config the command names with ``--config=`` (or of the flag's default config). Positional arguments are
  allowed only where the entry point takes them (``run_main(..., takes_args=True)``), and must be one of
  the choices in ``POSITIONAL_CHOICES`` where that lists the entry point.
- Every argument that names a ``configs/*.py`` file (``--config=configs/x.py:arg``, ``--config configs/x.py``)
  must name a file that exists and whose ``get_config(arg)`` loads.

Nothing is hard-coded per command: a new entry point or doc command is checked as it appears.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest
from ml_collections.config_flags import config_flags as ml_config_flags

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCES = ("bash", "sh", "shell")
PYTHON = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
SEPARATORS = {"&&", "||", ";", "|"}
# A redirection word (``<``, ``>``, ``2>>``, ``&>``) takes the next word as its file; ``2>&1`` stands alone.
REDIRECT = re.compile(r"^(\d*|&)(<|>|>>)$")
REDIRECT_FD = re.compile(r"^\d*(<|>)&\d+$")
CONFIG_FILE = re.compile(r"^(configs/[\w./-]+\.py)(?::(.*))?$")
# Entry points whose positional argument is one of the keys of a module-level name of theirs.
POSITIONAL_CHOICES = {"transformer_jax.data.prepare": "COMMANDS", "transformer_jax.sweep": "COMMANDS"}
# Flags absl's parser itself understands, without a definition.
ABSL_SPECIAL = {"flagfile", "undefok"}
UNPARSABLE = "<unparsable>"  # the argv of a line shlex cannot split, then its error


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # "README.md:83"
    text: str  # the whole logical line, continuations joined
    argv: tuple[str, ...]  # what follows the interpreter: ("-m", "transformer_jax.sweep", "report", ...)


# ------------------------------------------------------------------------------------------- parsing


def bash_lines(markdown: str) -> list[tuple[int, str]]:
    """(first line number, logical line) of every ```bash block, backslash continuations joined."""
    out, fence, pending, start = [], None, "", 0
    for number, line in enumerate(markdown.split("\n"), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = ""
            continue
        if fence not in FENCES:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def strip_comment(line: str) -> str:
    """``line`` without its comment: from a ``#`` that starts a word outside quotes, as bash reads it."""
    quote, escaped, previous = None, False, " "
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            return line[:i]
        previous = char
    return line


def python_argvs(line: str) -> list[tuple[str, ...]]:
    """The arguments after the interpreter of every python command in one shell line."""
    words = shlex.split(strip_comment(line))  # ValueError on an unbalanced quote
    found, segment, skip = [], [], False
    for word in [*words, ";"]:
        if skip or REDIRECT_FD.match(word):  # a redirection's file, or a descriptor copy: not an argument
            skip = False
            continue
        if REDIRECT.match(word):
            skip = True
            continue
        if word not in SEPARATORS:
            segment.append(word)
            continue
        for i, w in enumerate(segment):
            if PYTHON.match(w):
                found.append(tuple(segment[i + 1:]))
                break
        else:  # a python command in a quoted argument, e.g. --command="cd x && python train.py"
            for w in segment:
                inner = w.split("=", 1)[1] if w.startswith("-") and "=" in w else w
                if " " in inner and any(PYTHON.match(x) for x in inner.split()):
                    found.extend(python_argvs(inner))
        segment = []
    return found


def doc_commands(markdown: str, name: str) -> list[Command]:
    commands = []
    for number, line in bash_lines(markdown):
        try:
            argvs = python_argvs(line)
        except ValueError as e:
            argvs = [(UNPARSABLE, str(e))]
        commands.extend(Command(f"{name}:{number}", line, argv) for argv in argvs)
    return commands


# ------------------------------------------------------------------------------------- entry points

_INTROSPECT = r"""
import json, os, runpy, sys, traceback
from absl import app, flags
from ml_collections.config_flags import config_flags
from transformer_jax.runtime import errors
import jax, flax.linen, optax  # noqa: F401 - imported once, before the forks (they define no absl flags)


def describe(kind, target, choices_name):
    calls = []
    errors.run_main = lambda main, *, takes_args=False, **kwargs: calls.append(bool(takes_args))
    app.run = lambda main, *args, **kwargs: calls.append(True)  # not run_main: cannot tell; allow
    app.define_help_flags()
    sys.argv = [target]
    if kind == "module":
        module = runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        module = runpy.run_path(target, run_name="__main__")
    described = {}
    for name in flags.FLAGS:
        flag = flags.FLAGS[name]
        is_config = isinstance(flag, config_flags._ConfigFlag)
        described[name] = {"boolean": bool(flag.boolean), "is_config": is_config,
                           "config": getattr(flag, "default_unparsed", None) if is_config else None}
    choices = sorted(module[choices_name]) if choices_name in module else None
    return {"kind": kind, "target": target, "flags": described,
            "takes_args": calls[-1] if calls else None, "choices": choices}


failed = False
for kind, target, choices_name in json.loads(sys.argv[1]):
    sys.stdout.flush()
    child = os.fork()
    if child == 0:  # a copy of this process per entry point: flags and modules as a new process has them
        try:
            print("DOCS_CHECK " + json.dumps(describe(kind, target, choices_name)), flush=True)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    failed |= os.waitpid(child, 0)[1] != 0
sys.exit(1 if failed else 0)
"""


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    flags: dict  # name -> {"boolean": bool, "config": default config path or None}
    takes_args: bool | None  # None: main is never started (not an entry point)
    choices: list | None  # allowed positional arguments, None: any


@functools.cache
def entry_points(targets: tuple[tuple[str, str], ...]) -> dict[tuple[str, str], EntryPoint]:
    """{(kind, target): its flags (and positional rule)} of ``python target`` (kind "script") or
    ``python -m target``: one subprocess imports the libraries they share, then forks one child per target."""
    spec = [(kind, target, POSITIONAL_CHOICES.get(target, "")) for kind, target in targets]
    done = subprocess.run([sys.executable, "-c", _INTROSPECT, json.dumps(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("DOCS_CHECK "):
            record = json.loads(line.removeprefix("DOCS_CHECK "))
            key = record.pop("kind"), record.pop("target")
            found[key] = EntryPoint(**record)
    if done.returncode != 0 or len(found) != len(targets):
        missing = sorted(target for kind, target in targets if (kind, target) not in found)
        raise RuntimeError(f"reading the flags of {missing} failed:\n{done.stderr[-3000:]}")
    return found


def entry_point(kind: str, target: str) -> EntryPoint:
    """The flags of one entry point, read with those of every entry point the docs name."""
    known = entry_points(doc_entry_points())
    if (kind, target) not in known:
        known = entry_points(((kind, target),))
    return known[kind, target]


def is_repo_module(name: str) -> bool:
    top = name.split(".")[0]
    return (REPO / top).is_dir() or (REPO / f"{top}.py").is_file()


@functools.cache
def load_config(path_and_arg: str) -> ml_collections.ConfigDict:
    """``configs/x.py[:arg]`` loaded as train.py's --config loads it (relative to the repository)."""
    path, _, arg = path_and_arg.partition(":")
    full = path if os.path.isabs(path) else str(REPO / path)
    return ml_config_flags.ConfigFileFlagParser("config").parse(full + (f":{arg}" if arg else ""))


def config_problem(value: str) -> str | None:
    """Why ``configs/x.py[:arg]`` does not load, or None."""
    path = value.partition(":")[0]
    if not (REPO / path).is_file():
        return f"config file {path} does not exist"
    try:
        load_config(value)
    except Exception as e:  # noqa: BLE001 - any failure to build the config is the finding
        return f"config {value} does not load: {type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    return None


def field_problem(config: ml_collections.ConfigDict, dotted: str, config_name: str) -> str | None:
    node = config
    for i, key in enumerate(dotted.split(".")):
        if not isinstance(node, ml_collections.ConfigDict) or key not in node:
            return (f"--config.{dotted}: {config_name} has no field "
                    f"{'.'.join(dotted.split('.')[:i + 1])}")
        node = node[key]
    return None


# --------------------------------------------------------------------------------------------- checks


def command_problems(argv: tuple[str, ...]) -> list[str]:
    """What in one python command names something that does not exist (empty: nothing)."""
    problems, entry = resolve(argv)
    if entry is None:
        return problems
    kind, target, rest = entry
    return argument_problems(entry_point(kind, target), target, rest)


def resolve(argv: tuple[str, ...]) -> tuple[list[str], tuple[str, str, list[str]] | None]:
    """(problems, None), or ([], (kind, target, its arguments)) for an entry point of this repository."""
    args = list(argv)
    if args[:1] == [UNPARSABLE]:
        return [f"cannot split the line as the shell would: {args[1]}"], None
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args.pop(0)  # interpreter options (-u, -O, ...)
    if not args or args[0] == "-c":
        return [], None  # inline code: nothing to look up
    if args[0] == "-m":
        if len(args) < 2:
            return ["-m without a module"], None
        target = args[1]
        try:
            spec = importlib.util.find_spec(target)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(target + ".__main__")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return [f"-m {target}: no such module (or package without __main__)"], None
        if not is_repo_module(target):
            return [], None  # a tool (venv, pip, pytest): its flags are not ours to check
        return [], ("module", target, args[2:])
    if not (REPO / args[0]).is_file():
        return [f"{args[0]}: no such file in the repository"], None
    return [], ("script", args[0], args[1:])


def argument_problems(entry: EntryPoint, target: str, args: list[str]) -> list[str]:
    problems, positionals, overrides = [], [], []
    config_flags = {name: spec["config"] for name, spec in entry.flags.items() if spec["is_config"]}
    chosen = dict(config_flags)  # config flag -> the config it names (the default until --config=)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            positionals.extend(args[i:])
            break
        if not arg.startswith("-") or arg == "-":
            positionals.append(arg)
            continue
        name, has_value, value = arg.lstrip("-").partition("=")
        base = name.split(".")[0]
        if base in config_flags and "." in name:
            overrides.append((base, name.split(".", 1)[1]))
            continue
        if name in entry.flags:
            if not has_value and not entry.flags[name]["boolean"]:
                if i >= len(args):
                    problems.append(f"--{name} needs a value")
                    continue
                value, i = args[i], i + 1
            if name in config_flags:
                chosen[name] = value
        elif name.startswith("no") and entry.flags.get(name[2:], {}).get("boolean"):
            pass
        elif name in ABSL_SPECIAL:
            pass
        else:
            problems.append(f"--{name}: {target} defines no such flag")
            continue
        if CONFIG_FILE.match(value or "") and (problem := config_problem(value)):
            problems.append(f"--{name}={value}: {problem}")
    for base, dotted in overrides:
        source = chosen[base]
        if source is None:
            problems.append(f"--{base}.{dotted} without --{base}=: {target}'s --{base} has no default")
            continue
        if problem := config_problem(source):
            if source == config_flags[base]:  # a named one was reported with its --config=
                problems.append(f"the default --{base}={source}: {problem}")
            continue
        config = load_config(source)
        shown = os.path.relpath(source, REPO) if os.path.isabs(source) else source
        if problem := field_problem(config, dotted, shown):
            problems.append(problem)
    if positionals:
        if entry.takes_args is False:
            problems.append(f"{target} takes no positional arguments, got {positionals}")
        elif entry.choices is not None:
            problems.extend(f"{p!r}: not one of {target}'s {entry.choices}" for p in positionals
                            if p not in entry.choices)
    return problems


def all_doc_commands() -> list[Command]:
    return [c for path in DOC_FILES for c in doc_commands(path.read_text("utf-8"), path.name)]


@functools.cache
def doc_entry_points() -> tuple[tuple[str, str], ...]:
    """(kind, target) of every entry point of this repository that a doc command runs."""
    entries = (resolve(c.argv)[1] for c in all_doc_commands())
    return tuple(sorted({(e[0], e[1]) for e in entries if e is not None}))


# ---------------------------------------------------------------------------------------------- tests


def test_every_doc_command_names_flags_configs_and_modules_that_exist():
    commands = all_doc_commands()
    assert len(commands) >= 20  # the parser found the docs' commands (51 when written; else vacuous)
    problems = [f"{c.where}: {problem}\n    {c.text}"
                for c in commands for problem in command_problems(c.argv)]
    assert not problems, "\n".join(problems)


def test_the_parser_finds_commands_as_the_shell_splits_them():
    markdown = "\n".join([
        "text `python nope.py` outside a block is prose",
        "```bash",
        "# a comment line",
        "python3 -m venv .venv && .venv/bin/python train.py --workdir w  # trailing comment --bad",
        "python train.py --config=configs/default.py \\",
        "    --config.train.num_steps=3",
        'gcloud ssh --command="cd x && \\',
        '  .venv/bin/python evaluate.py --workdir=gs://b"',
        "python -c \"print('--not-a-flag')\"",
        "python evaluate.py --workdir=a#b  # it's a comment: python nope.py",
        "python -m transformer_jax.translate --workdir=w < in.en > out.de 2>&1",
        "```",
        "```",
        "python not_bash.py",
        "```",
    ])
    commands = doc_commands(markdown, "X.md")
    assert [(c.where, c.argv) for c in commands] == [
        ("X.md:4", ("-m", "venv", ".venv")),
        ("X.md:4", ("train.py", "--workdir", "w")),
        ("X.md:5", ("train.py", "--config=configs/default.py", "--config.train.num_steps=3")),
        ("X.md:7", ("evaluate.py", "--workdir=gs://b")),
        ("X.md:9", ("-c", "print('--not-a-flag')")),
        ("X.md:10", ("evaluate.py", "--workdir=a#b")),
        ("X.md:11", ("-m", "transformer_jax.translate", "--workdir=w")),
    ]
    assert all(command_problems(c.argv) == [] for c in commands)


@pytest.mark.parametrize("command, expected", [
    ("python train.py --workdri=runs/x", "--workdri: train.py defines no such flag"),
    ("python train.py --config.train.num_stepz=3", "configs/default.py has no field train.num_stepz"),
    ("python train.py --config=configs/multi30k.py --config.data.dirr=d",
     "configs/multi30k.py has no field data.dirr"),
    ("python train.py --config=configs/nope.py", "config file configs/nope.py does not exist"),
    ("python train.py --config=configs/table3.py:Z-row,cpu",
     "config configs/table3.py:Z-row,cpu does not load"),
    ("python -m transformer_jax.no_such_module --x=1", "-m transformer_jax.no_such_module: no such module"),
    ("python no_such_script.py", "no_such_script.py: no such file in the repository"),
    ("python -m transformer_jax.data.prepare wmt99 --dir=d",
     "'wmt99': not one of transformer_jax.data.prepare's"),
    ("python train.py --workdir='unclosed", "cannot split the line as the shell would: No closing quotation"),
    ("python evaluate.py runs/x", "evaluate.py takes no positional arguments, got ['runs/x']"),
    ("python -m transformer_jax.sweep --grid table3 --config configs/nope.py",
     "--config=configs/nope.py: config file configs/nope.py does not exist"),
    ("python evaluate.py --workdir", "--workdir needs a value"),
])
def test_a_bad_command_is_reported(command, expected):
    (found,) = doc_commands(f"```bash\n{command}\n```", "X.md")
    problems = command_problems(found.argv)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("command", [
    "python train.py --config=configs/multi30k.py --config.data.dir=data/x --workdir runs/x --nomultiprocess",
    "python -m transformer_jax.data.prepare ptb_sample --dir=data/ptb_sample",
    "python -m transformer_jax.sweep report --workdir runs/t3m",
    "python train.py --config=configs/table3.py:C-dmodel256,cpu --config.model.d_model=64",
    "python evaluate.py --helpfull",
])
def test_a_good_command_passes(command):
    (found,) = doc_commands(f"```bash\n{command}\n```", "X.md")
    assert command_problems(found.argv) == []
