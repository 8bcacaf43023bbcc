"""Where a compiled computation's time goes: the XLA ops of a profiler trace, summed by kind.

    python -m transformer_jax.benchmarks.profile --presets=tiny --searches=greedy,beam  # traces decoding
    python -m transformer_jax.benchmarks.profile --trace_dir=runs/x/profile  # any trace (train.py's too)

The trace's XPlane files are read with ``jax.profiler.ProfileData`` (no TensorFlow, no TensorBoard).
Every event that names an HLO op (``hlo_op``) is one executed op: on XLA:CPU, one per op ("thunk") on
the thread that ran it, and an op inside a ``while`` loop is nested in the loop's event. Ops are grouped
by kind, the name without its ``.N`` suffix (``fusion.12`` -> ``fusion``), with their calls and their
exclusive time (the event's duration less that of the events nested in it). A ``while`` loop's
exclusive time is the part of its body's run that no op covers: on XLA:CPU, launching the body's ops
one after another (and the profiler's own markers).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import tempfile
import time

import jax
from absl import flags

from transformer_jax.benchmarks import decoding, presets
from transformer_jax.evaluation import paper
from transformer_jax.runtime import errors
from transformer_jax.runtime.errors import MissingFileError

_OP_SUFFIX = re.compile(r"\.\d+$")


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed HLO op: its name and its interval on the thread (``line``) that ran it."""

    name: str
    line: str
    start_ns: float
    end_ns: float


def read_op_events(trace_dir: str, plane_prefix: str = "") -> list[OpEvent]:
    """Every event naming an HLO op in the ``*.xplane.pb`` files under ``trace_dir``, in the planes
    whose name starts with ``plane_prefix`` (e.g. ``/device:`` to leave out a host's launch events on
    an accelerator; this module was only measured on XLA:CPU, where the ops run in ``/host:CPU``)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise MissingFileError(f"no *.xplane.pb under {trace_dir}; record one with jax.profiler.trace "
                               "or train.py's --config.profile_start_step")
    events = []
    for path in paths:
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            if not plane.name.startswith(plane_prefix):
                continue
            for line in plane.lines:
                for event in line.events:
                    if any(key == "hlo_op" for key, _ in event.stats):
                        events.append(OpEvent(event.name, f"{path}:{plane.name}:{line.name}",
                                              event.start_ns, event.start_ns + event.duration_ns))
    return events


def summarize(events: list[OpEvent]) -> list[dict]:
    """Per op kind: calls, exclusive milliseconds and share of all ops' time, the largest first."""
    calls: collections.Counter = collections.Counter()
    exclusive_ns: collections.Counter = collections.Counter()
    by_line = collections.defaultdict(list)
    for event in events:
        by_line[event.line].append(event)
    for line_events in by_line.values():
        line_events.sort(key=lambda e: (e.start_ns, -e.end_ns))  # a parent before the ops nested in it
        open_events: list[OpEvent] = []
        for event in line_events:
            while open_events and open_events[-1].end_ns <= event.start_ns:
                open_events.pop()
            kind = _OP_SUFFIX.sub("", event.name)
            calls[kind] += 1
            exclusive_ns[kind] += event.end_ns - event.start_ns
            if open_events:  # nested: its time is not its parent's own
                exclusive_ns[_OP_SUFFIX.sub("", open_events[-1].name)] -= event.end_ns - event.start_ns
            open_events.append(event)
    total = sum(exclusive_ns.values()) or 1.0
    return [dict(op=kind, calls=calls[kind], exclusive_ms=round(ns / 1e6, 6), share=round(ns / total, 4))
            for kind, ns in exclusive_ns.most_common()]


def markdown(rows: list[dict], *, per: int = 1, per_name: str = "call") -> str:
    """The summary as a table; ``per`` divides calls and time (e.g. by decoding steps)."""
    lines = [f"| op | calls per {per_name} | us per {per_name} | share |", "|---|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['calls'] / per:.1f} | {r['exclusive_ms'] * 1e3 / per:.1f} | "
              f"{100 * r['share']:.1f}% |" for r in rows]
    return "\n".join(lines)


def profile_decode(name: str, preset: presets.DecodePreset, kind: str, *, beam_size: int, repeats: int,
                   trace_dir: str, plane_prefix: str = "") -> dict:
    """Traces ``repeats`` compiled runs of one decoding preset (``kind`` of ``decoding.SEARCHES``) into
    ``trace_dir``; returns its op summary, and its wall and op time per decoding step."""
    cfg, params, inputs = decoding.model_and_inputs(preset, preset.new_tokens)
    search = decoding.make_search(kind, params, cfg, beam_size=beam_size, new_tokens=preset.new_tokens,
                                  use_cache=True)
    decoding.time_search(search, inputs, preset.new_tokens, repeats=1)  # compiled and warm
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()  # the runs alone: starting and stopping the profiler take seconds
        for _ in range(repeats):
            jax.block_until_ready(search(inputs, preset.new_tokens))
        wall_ms = (time.perf_counter() - start) * 1e3
    rows = summarize(read_op_events(trace_dir, plane_prefix))
    steps = repeats * preset.new_tokens
    measured = f"decode_{'greedy' if kind == 'greedy' else f'beam{beam_size}'}_profile"
    return dict(preset=name, measured=measured, batch=preset.batch, new_tokens=preset.new_tokens,
                runs=repeats, traced_wall_ms_per_step=round(wall_ms / steps, 3),
                op_ms_per_step=round(sum(r["exclusive_ms"] for r in rows) / steps, 3),
                ops_per_step=round(sum(r["calls"] for r in rows) / steps, 1), ops=rows)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.profile``."""
    flags.DEFINE_list("presets", ["tiny"], f"Decoding presets to trace, of {list(presets.DECODE_PRESETS)}.",
                      flag_values=flag_values)
    flags.DEFINE_list("searches", list(decoding.SEARCHES),
                      f"Searches to trace, of {list(decoding.SEARCHES)}.", flag_values=flag_values)
    flags.DEFINE_integer("beam_size", paper.BEAM_SIZE, "Hypotheses kept per example in beam search.",
                         flag_values=flag_values)
    flags.DEFINE_integer("repeats", 3, "Compiled decoding runs traced per setting.", flag_values=flag_values)
    flags.DEFINE_integer("top", 12, "Op kinds printed per table (the JSON line has them all).",
                         flag_values=flag_values)
    flags.DEFINE_string("trace_dir", None, "Summarize this existing trace (e.g. <workdir>/profile from "
                        "train.py) instead of tracing decoding.", flag_values=flag_values)
    flags.DEFINE_string("plane", "", "Only the trace planes whose name starts with this, e.g. /device: "
                        "on an accelerator (default: all).", flag_values=flag_values)


def main(argv: list[str]) -> None:
    values = flags.FLAGS
    if values.trace_dir:
        rows = summarize(read_op_events(values.trace_dir, values.plane))
        print(json.dumps(dict(trace_dir=values.trace_dir, ops=rows)))
        print(markdown(rows[:values.top], per=1, per_name="trace"))
        return
    names = presets.check_names(values.presets, presets.DECODE_PRESETS, "--presets")
    searches = presets.check_names(values.searches, dict.fromkeys(decoding.SEARCHES), "--searches")
    for name in names:
        for kind in searches:
            with tempfile.TemporaryDirectory() as trace_dir:
                record = profile_decode(name, presets.DECODE_PRESETS[name], kind, beam_size=values.beam_size,
                                        repeats=values.repeats, trace_dir=trace_dir,
                                        plane_prefix=values.plane)
            print(json.dumps(record), flush=True)
            print(f"\n{name} {record['measured']}: {record['traced_wall_ms_per_step']} ms per step traced, "
                  f"{record['op_ms_per_step']} ms in {record['ops_per_step']} ops\n")
            print(markdown(record["ops"][:values.top], per=record["runs"] * record["new_tokens"],
                           per_name="step"), flush=True)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, keep_freed_memory=False)  # decoding: see runtime/host_memory.py
