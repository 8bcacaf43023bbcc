"""``evaluate.py``'s arguments, checked before anything is restored or decoded, and where its outputs go.

``check_arguments`` runs first: every flag's range, the workdir and the input files exist, and the output
folder (``<workdir>/eval`` or ``--output_dir``) is writable, so a read-only workdir fails in a second,
not after the whole set is decoded. Once the checkpoint step is known, ``output_stem`` names the
outputs after what was scored (``test-<step>``, ``dev-<step>``, or the source file's name, e.g.
``newstest2014.en-<step>``; ``-avg<N>`` when N checkpoints are averaged, ``-ens<M>-<key>`` for an
ensemble) and ``claimed_outputs`` holds them for this run: a second run that would write them is refused
at once, and an existing result is not replaced unless ``overwrite`` is set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from transformer_jax.evaluation import by_length as by_length_lib
from transformer_jax.runtime import output_file
from transformer_jax.runtime.errors import ConfigError, MissingFileError, UserError

SPLITS = ("dev", "test")


def default_output_dir(workdir: str) -> str:
    """Where evaluate.py writes by default: ``<workdir>/eval``."""
    return os.path.join(workdir, "eval")


def check_at_least(flag: str, value, minimum, what: str = "", *, integer: bool = True) -> None:
    """ConfigError naming ``--flag`` when ``value`` (None: not given) is not a number >= ``minimum``."""
    if value is None:
        return
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"--{flag}={value!r}: expected {kind} >= {minimum} ({what})")


def check_writable(output_dir: str) -> None:
    """Creates ``output_dir`` if needed and writes a probe file there; UserError naming it if it can't.

    The probe (``.write-test-<pid>``) is removed in a ``finally``, so that an interrupt (Ctrl-C) right
    after it was made leaves none."""
    probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(output_dir, exist_ok=True)
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write the results to {output_dir} ({e.strerror or e}); pass "
                        "--output_dir=DIR to write them elsewhere") from None


def check_arguments(workdir: str, *, step: int | None, average_last: int, split: str,
                    source_file: str | None, reference_file: str | None, beam_size: int | None,
                    alpha: float | None, max_extra_len: int | None, output_dir: str,
                    ensemble: Sequence[str] = (), by_length: bool = False,
                    length_buckets: Sequence[int] | None = None) -> None:
    """Every argument of ``workdir_scoring.evaluate_workdir``, before anything is restored.

    Raises:
      ConfigError: a flag out of range, --source_file without --reference_file (or the reverse), or
        --length_buckets without --by_length or not increasing.
      MissingFileError: the workdir, its checkpoints folder or an input file does not exist.
      UserError: ``output_dir`` cannot be written.
    """
    check_at_least("step", step, 0, "a saved checkpoint step; leave it out for the latest")
    check_at_least("average_last", average_last, 0, "0 or 1: no averaging; N: the last N checkpoints")
    check_at_least("beam_size", beam_size, 1, "1 is greedy search")
    check_at_least("alpha", alpha, 0, "the GNMT length penalty; 0 turns it off", integer=False)
    check_at_least("max_extra_len", max_extra_len, 0, "outputs may be input length + this long")
    if length_buckets is not None:
        if not by_length:
            raise ConfigError("--length_buckets sets the buckets of --by_length; pass --by_length too")
        by_length_lib.check_edges(length_buckets)
    if split not in SPLITS:
        raise ConfigError(f"--split={split!r}: expected one of {', '.join(SPLITS)}")
    if bool(source_file) != bool(reference_file):
        given, missing = (("--source_file", "--reference_file") if source_file
                          else ("--reference_file", "--source_file"))
        raise ConfigError(f"{given} needs {missing} too (the line-aligned other side)")
    for flag, folder in (("workdir", workdir), *(("ensemble", d) for d in ensemble)):
        if not os.path.isdir(folder):
            raise MissingFileError(f"--{flag}={folder}: no such directory; pass the --workdir of a "
                                   "train.py run")
        if not os.path.isdir(os.path.join(folder, "checkpoints")):
            raise MissingFileError(f"--{flag}={folder} holds no checkpoints/ folder; is it a train.py "
                                   "workdir, and has it saved a checkpoint yet?")
    if any(os.path.realpath(d) == os.path.realpath(workdir) for d in ensemble) or \
            len({os.path.realpath(d) for d in ensemble}) < len(ensemble):
        raise ConfigError(f"--ensemble={','.join(ensemble)}: name each model once, and not --workdir="
                          f"{workdir} (it is the first)")
    for flag, path in (("source_file", source_file), ("reference_file", reference_file)):
        if path and not os.path.isfile(path):
            raise MissingFileError(f"--{flag}={path}: no such file")
    check_writable(output_dir)


def output_stem(output_dir: str, *, split: str, step: int, source_file: str | None,
                average_last: int, engine: str = "jax", ensemble: Sequence[tuple[str, Any]] = ()) -> str:
    """``<output_dir>/<name>-<step>[-avg<N>][-ens<M>-<key>][-<engine>]``: name is the split, or the source
    file's base name; ``ensemble`` is (workdir, steps) of each of the M > 1 models decoded together, the
    first included, and key a hash of them (the first's, then the others' in any order), so that another
    ensemble with the same first model is named apart; the engine is named unless it is the JAX
    reference."""
    name = os.path.basename(source_file) if source_file else split
    suffix = f"-avg{average_last}" if average_last > 1 else ""
    if len(ensemble) > 1:
        first, *others = ([os.path.realpath(d), json.loads(json.dumps(s))] for d, s in ensemble)
        members = json.dumps([first, *sorted(others)]).encode()
        suffix += f"-ens{len(ensemble)}-{hashlib.sha256(members).hexdigest()[:8]}"
    if engine != "jax":
        suffix += f"-{engine}"
    return os.path.join(output_dir, f"{name}-{step}{suffix}")


@contextlib.contextmanager
def claimed_outputs(stem: str, *, overwrite: bool) -> Iterator[tuple[str, str]]:
    """``with claimed_outputs(stem, overwrite=...) as (txt, json): ...``: the outputs ``stem.txt`` and
    ``stem.json``, held by this process until the block ends.

    The claim is a file ``.<name>.claim`` beside them, locked (``output_file.claim``), so of two runs
    that would write the same outputs one gets them and the other a UserError at once, before decoding
    (a claim left by a killed run is taken over by exactly one run). Once claimed, an existing result is
    a UserError unless ``overwrite``.
    """
    folder, name = os.path.split(stem)
    claim = os.path.join(folder, f".{name}.claim")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(output_file.claim(claim))
        except output_file.ClaimHeldError as e:
            raise UserError(
                f"another evaluate.py (pid {e.holder.get('pid', '?')} on {e.holder.get('host', '?')}) is "
                f"writing {stem}.txt and .json now; wait for it to end (then --overwrite replaces its "
                "result), or pass --output_dir=DIR") from None
        paths = (stem + ".txt", stem + ".json")
        existing = [p for p in paths if os.path.exists(p)]
        if existing and not overwrite:
            raise UserError(f"{existing[-1]} exists: this checkpoint was scored on these inputs before; "
                            "pass --overwrite to replace it, or --output_dir=DIR to keep both")
        yield paths
