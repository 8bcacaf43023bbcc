"""A wheelhouse for an offline node: this project and the wheels the node lacks, for its Python and platform.

Run on a machine with internet; carry the folder to the node; install there without an index:

    # on the node, once:  python -m pip list --format=freeze > node-freeze.txt   (carry it out)
    python -m transformer_jax.wheelhouse --python-version=3.12 --have=node-freeze.txt --out=wheelhouse
    # on the node:        python -m pip install --no-index --find-links=wheelhouse transformer_jax

How the set is chosen (``plan``): pip resolves the project for the node's Python and platform
(``pip install --dry-run --report``, wheels only), with every package the node already has pinned to the
node's version, so the rest is chosen to work with what is there (the site's JAX, flax, optax...). The
packages the node has are then left out; the others are downloaded (``pip download --no-deps``), with the
project's own wheel built from this checkout. A dependency that PyPI ships as source only and that is pure
Python (``PURE_SDISTS``) is built into a wheel here, which serves any platform.

A node version that PyPI does not have (a site build) cannot pin the resolution: it is left unpinned and
said so, and the package is still left out, since the node has it. The folder's size is printed at the end.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl import flags

from transformer_jax.runtime import errors, output_file
from transformer_jax.runtime.errors import ConfigError, UserError

# Dependencies (direct or not) that PyPI ships only as a source archive, all pure Python: built here.
PURE_SDISTS = ("promise",)
PROJECT = "transformer-jax"  # canonical
DEFAULT_GLIBC = "2.28"  # RHEL/Rocky 8, the oldest common cluster OS; `ldd --version` on the node says
ARCHES = ("x86_64", "aarch64")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FREEZE_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(===?|@)\s*(\S.*?)\s*$")
_NOT_FOUND = re.compile(r"No matching distribution found for ([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503's normalized name: ``Tensorflow_Datasets`` and ``tensorflow-datasets`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class NodePackage:
    """One line of the node's ``pip list --format=freeze``."""

    name: str  # canonical
    version: str | None  # None for a direct reference (``name @ file:///...``)

    def constraint(self) -> str | None:
        """A pip constraint for the node's version (its public part: a site's ``+cuda`` label dropped)."""
        return None if self.version is None else f"{self.name}=={self.version.split('+')[0]}"


def parse_freeze(text: str, source: str = "the freeze list") -> dict[str, NodePackage]:
    """{canonical name: NodePackage} from ``pip list --format=freeze`` (or ``pip freeze``) output.

    Blank lines, comments, ``-e`` and other option lines are skipped; any other line that is not
    ``name==version``, ``name===version`` or ``name @ url`` is a DataError naming the line.
    """
    packages = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        match = _FREEZE_LINE.match(line)
        if not match:
            raise errors.DataError(f"{source}, line {number}: expected name==version (pip list "
                                   f"--format=freeze), got {raw.strip()!r}")
        name, operator, version = match.groups()
        packages[canonical(name)] = NodePackage(canonical(name), None if operator == "@" else version)
    return packages


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the wheelhouse carries, from pip's resolution (``resolved``: {canonical name: version})."""

    download: dict[str, str]  # name -> version: the node lacks these
    skipped: dict[str, str]  # name -> the node's version: the node has these
    unpinned: tuple[str, ...]  # the node's packages whose version could not pin the resolution


def plan(resolved: dict[str, str], have: dict[str, NodePackage], unpinned=()) -> Plan:
    """Splits pip's resolution into what to download and what the node has (by canonical name)."""
    download, skipped = {}, {}
    for name, version in sorted(resolved.items()):
        if name in have:
            skipped[name] = have[name].version or "direct reference"
        else:
            download[name] = version
    return Plan(download, skipped, tuple(sorted(unpinned)))


def platform_tags(glibc: str, arch: str) -> list[str]:
    """pip ``--platform`` values for a node of glibc ``glibc`` ("2.28") on ``arch``: every manylinux tag it
    runs, newest first (pip does not widen a ``manylinux_2_28`` tag to the older ones by itself)."""
    match = re.fullmatch(r"2\.(\d+)", glibc)
    if not match or int(match.group(1)) < 17:
        raise ConfigError(f"--glibc={glibc}: expected the node's glibc as 2.N with N >= 17 (`ldd --version` "
                          "on the node prints it), e.g. 2.28")
    if arch not in ARCHES:
        raise ConfigError(f"--arch={arch}: expected one of {', '.join(ARCHES)} (`uname -m` on the node)")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(int(match.group(1)), 16, -1)]
    return tags + [f"manylinux2014_{arch}"]


def check_python_version(version: str) -> str:
    """``version`` if it is "3.N" with N >= 11 (the project's requires-python), else a ConfigError."""
    match = re.fullmatch(r"3\.(\d+)", version)
    if not match or int(match.group(1)) < 11:
        raise ConfigError(f"--python-version={version}: expected the node's Python as 3.N with N >= 11 (this "
                          "project needs 3.11 or newer; `python3 --version` on the node), e.g. 3.12")
    return version


def _pip(args: list[str], what: str) -> subprocess.CompletedProcess:
    """Runs ``python -m pip ARGS``; a failure is a UserError with pip's own reason (its last lines)."""
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines()
                 if line.strip() and "is ignored: it is neither a file nor a directory" not in line]
        raise PipError(f"{what} failed: " + " | ".join(lines[-8:]), done.stderr + done.stdout)
    return done


class PipError(UserError):
    """pip failed; the message carries its last lines, ``output`` all of it."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def build_project_wheel(project: str, out: str) -> str:
    """Builds this project's wheel (pure Python) from the checkout ``project`` into ``out``; its path."""
    if not os.path.exists(os.path.join(project, "pyproject.toml")):
        raise ConfigError(f"--project={project}: no pyproject.toml there; point it at a checkout of this "
                          "project")
    before = set(glob.glob(os.path.join(out, "transformer_jax-*.whl")))
    _pip(["wheel", "--no-deps", "--quiet", "--wheel-dir", out, project], f"building the wheel of {project}")
    built = sorted(set(glob.glob(os.path.join(out, "transformer_jax-*.whl"))) - before) or sorted(before)
    return built[-1]


def resolve(requirement: str, target: list[str], have: dict[str, NodePackage], find_links: str,
            work: str, python_version: str) -> tuple[dict[str, str], list[str]]:
    """({canonical name: version} pip resolves for ``requirement`` on the node, the node's packages left
    unpinned because PyPI has not their version). ``target``: the ``--python-version``/``--platform`` args.

    ``pip install`` checks a package's Requires-Python against the Python running pip, not the node's
    (``--python-version`` serves the wheel tags only), so that check is off here and done on the report:
    a release that does not take ``python_version`` is excluded and the resolution run again.
    """
    unpinned: list[str] = []
    excluded: list[str] = []  # name!=version: releases whose Requires-Python excludes the node's Python
    for _ in range(len(have) + 20):
        constraints = os.path.join(work, "node-constraints.txt")
        with open(constraints, "w") as f:
            f.writelines(f"{c}\n" for p in have.values() if p.name not in unpinned and (c := p.constraint()))
            f.writelines(f"{c}\n" for c in excluded)
        report = os.path.join(work, "report.json")
        try:
            _pip(["install", "--dry-run", "--ignore-installed", "--ignore-requires-python", "--quiet",
                  "--report", report, "--only-binary=:all:", *target,
                  "--target", os.path.join(work, "target"), "--find-links", find_links, "-c", constraints,
                  requirement],
                 "resolving the dependencies for the node")
        except PipError as e:
            missing = [canonical(n) for n in _NOT_FOUND.findall(e.output)]
            pinned = [n for n in missing if n in have and n not in unpinned and have[n].version]
            if not pinned:
                raise
            unpinned += pinned  # a site build PyPI lacks: the node keeps its own, unpinned here
            continue
        with open(report) as f:
            installs = json.load(f)["install"]
        wrong = [f"{canonical(i['metadata']['name'])}!={i['metadata']['version']}" for i in installs
                 if not takes_python(i["metadata"].get("requires_python"), python_version)]
        if wrong:
            excluded += wrong
            continue
        return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}, unpinned
    raise UserError(f"resolving the dependencies for Python {python_version} did not settle; releases "
                    f"excluded for their Requires-Python: {', '.join(excluded)}")


def takes_python(requires_python: str | None, python_version: str) -> bool:
    """Whether a release's Requires-Python (e.g. ">=3.12") admits the node's Python ("3.12")."""
    if not requires_python:
        return True
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.specifiers import InvalidSpecifier, SpecifierSet
    try:
        return SpecifierSet(requires_python).contains(python_version, prereleases=True)
    except InvalidSpecifier:
        return True  # pip ignores a malformed one too


def folder_size(path: str) -> tuple[int, list[tuple[int, str]]]:
    """(bytes of the wheels in ``path``, [(bytes, file name)] largest first)."""
    wheels = glob.glob(os.path.join(path, "*.whl"))
    sizes = sorted(((os.path.getsize(p), os.path.basename(p)) for p in wheels), reverse=True)
    return sum(s for s, _ in sizes), sizes


def build(*, python_version: str, out: str, have: dict[str, NodePackage], glibc: str = DEFAULT_GLIBC,
          arch: str = "x86_64", extras: tuple[str, ...] = (), project: str = _ROOT, say=print) -> Plan:
    """Builds the wheelhouse in ``out`` (created; wheels already there are kept) and returns its plan.
    ConfigError, before anything is built, when ``out`` cannot be made or written."""
    check_python_version(python_version)
    have = {name: package for name, package in have.items() if name != PROJECT}  # always carried
    target = [f"--python-version={python_version}"] + [f"--platform={t}" for t in platform_tags(glibc, arch)]
    output_file.check_folder(out, flag="--out")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as work:
        local = os.path.join(work, "local")  # wheels built here: the project's and PURE_SDISTS
        os.makedirs(local)
        say(f"building the project's wheel from {project}")
        wheel = build_project_wheel(project, local)
        for name in PURE_SDISTS:
            if name not in have:
                _pip(["wheel", "--no-deps", "--quiet", "--wheel-dir", local, name],
                     f"building a wheel of {name} (PyPI ships its source only)")
        requirement = wheel if not extras else f"transformer_jax[{','.join(extras)}] @ file://{wheel}"
        say(f"resolving for Python {python_version} on manylinux (glibc {glibc}, {arch}), "
            f"{len(have)} packages on the node pinned")
        resolved, unpinned = resolve(requirement, target, have, local, work, python_version)
        result = plan(resolved, have, unpinned)
        for name in result.unpinned:
            say(f"  {name}: the node's {have[name].version} is not on the index; the node keeps its own "
                "(the resolution did not pin it)")
        pins = [f"{n}=={v}" for n, v in result.download.items() if n != PROJECT]
        if pins:
            say(f"downloading {len(pins)} wheels the node lacks")
            _pip(["download", "--no-deps", "--quiet", "--only-binary=:all:", *target, "--find-links", local,
                  "--dest", out, *pins], "downloading the wheels")
        if PROJECT in result.download:
            shutil.copy(wheel, out)
    total, sizes = folder_size(out)
    say(f"left out, the node has them: {', '.join(result.skipped) or 'none'}")
    say(f"{out}: {len(sizes)} wheels, {total / 1e6:,.1f} MB; the largest: "
        + ", ".join(f"{name} {size / 1e6:,.1f} MB" for size, name in sizes[:5]))
    say(f"on the node: python -m pip install --no-index --find-links={out} "
        + (f"'transformer_jax[{','.join(extras)}]'" if extras else "transformer_jax"))
    return result


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.wheelhouse`` (defined when it runs, not on import)."""
    flags.DEFINE_string("python-version", None, "The node's Python as 3.N (`python3 --version` there), "
                        "e.g. 3.12.", flag_values=flag_values)
    flags.DEFINE_string("out", None, "Folder to fill with wheels (created; wheels already there stay).",
                        flag_values=flag_values)
    flags.DEFINE_string("have", None, "The node's `python -m pip list --format=freeze` output: those "
                        "packages are left out and pin the resolution. Default: the node has nothing.",
                        flag_values=flag_values)
    flags.DEFINE_string("glibc", DEFAULT_GLIBC, "The node's glibc version (`ldd --version` there).",
                        flag_values=flag_values)
    flags.DEFINE_enum("arch", "x86_64", list(ARCHES), "The node's CPU (`uname -m` there).",
                      flag_values=flag_values)
    flags.DEFINE_list("extras", [], "The project's extras to carry too, e.g. cuda12 for a node without a "
                      "CUDA JAX (~3 GB).", flag_values=flag_values)
    flags.DEFINE_string("project", _ROOT, "The checkout of this project whose wheel is carried.",
                        flag_values=flag_values)


def main(argv: list[str]) -> None:
    values = flags.FLAGS
    for name in ("python-version", "out"):
        if not values[name].value:
            raise ConfigError(f"--{name} is required, e.g. python -m transformer_jax.wheelhouse "
                              "--python-version=3.12 --out=wheelhouse [--have=node-freeze.txt]")
    have, have_path = {}, values["have"].value
    if have_path:
        if not os.path.isfile(have_path):
            raise errors.MissingFileError(f"--have={have_path}: no such file; make it on the node with "
                                          "python -m pip list --format=freeze > node-freeze.txt")
        with open(have_path) as f:
            have = parse_freeze(f.read(), have_path)
    build(python_version=values["python-version"].value, out=values.out, have=have, glibc=values.glibc,
          arch=values.arch, extras=tuple(values.extras), project=values.project,
          say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
