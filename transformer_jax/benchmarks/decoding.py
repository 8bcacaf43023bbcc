"""Decoding throughput: greedy and beam search, with the key/value cache and (optionally) without.

    python -m transformer_jax.benchmarks.decoding [--presets=tiny,base] [--new_tokens=32,128] [--uncached]
    python -m transformer_jax.benchmarks.decoding --file=test.en --workdir=DIR [--num_sentences=1000]

A randomly initialized preset model decodes ``batch`` random sources of ``src_len`` tokens. EOS is
banned (``min_len``) and the output buffer is ``new_tokens`` long, so every sequence gets exactly
``new_tokens`` tokens. Each setting is first compiled and run on one-token sources with
``max_extra_len=0`` (traced, so the timed calls reuse that executable and the warm-up stops after one
step), then timed ``--repeats`` times. One JSON line per setting: median and best seconds and generated
tokens/s = batch x new_tokens / median (for beam search, the best beam's tokens).

Throughput mode (``--file=PATH --workdir=DIR [--num_sentences=N] [--beam_size=K]``): the first N lines
of a real file through the translate command's path (``translation.translate_texts``: token-budget
batches sorted by length) with a trained workdir. The first pass compiles; ``--repeats`` more are
timed. One JSON line: sentences/s and target tokens/s (SentencePiece tokens of the outputs) of the
first pass (what a one-off command sees, compilation included) and of the median timed pass.

MFU (cached runs only): XLA counts a while-loop body once, so the FLOPs are the analytic count of
``flops.decode_flops`` (every step attends to the whole cache buffer), over the best matmul peak.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np
from absl import flags

from transformer_jax.benchmarks import presets
from transformer_jax.evaluation import decode, paper, translation
from transformer_jax.model import flops
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import init_params
from transformer_jax.runtime import errors, timing
from transformer_jax.runtime.errors import ConfigError, MissingFileError

SEARCHES = ("greedy", "beam")


def make_search(kind: str, params, cfg: ModelConfig, *, beam_size: int, new_tokens: int, use_cache: bool):
    """``fn(inputs int32[batch, src_len], max_extra_len) -> int32[batch, new_tokens]`` output tokens."""
    if kind == "greedy":
        return lambda src, max_extra_len: decode.greedy_search(
            params, cfg, src, max_len=new_tokens, max_extra_len=max_extra_len, min_len=new_tokens,
            use_cache=use_cache)
    return lambda src, max_extra_len: decode.beam_search(
        params, cfg, src, beam_size=beam_size, alpha=paper.LENGTH_PENALTY_ALPHA, max_len=new_tokens,
        max_extra_len=max_extra_len, min_len=new_tokens, use_cache=use_cache)[0]


def time_search(search, inputs: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, list[float]]:
    """(compile seconds, seconds of each of ``repeats`` runs) of ``search(inputs, new_tokens)``.

    The untimed first call has the same shapes but sources of one token and ``max_extra_len=0``: it
    compiles the executable the timed calls use, and its loop stops after one step.
    """
    one_token = np.where(np.arange(inputs.shape[1]) == 0, inputs, PAD_ID).astype(np.int32)  # [B, S]
    start = time.perf_counter()
    jax.block_until_ready(search(one_token, 0))
    compile_seconds = time.perf_counter() - start
    return compile_seconds, timing.time_calls(lambda: search(inputs, new_tokens), repeats)


def model_and_inputs(preset: presets.DecodePreset, new_tokens: int):
    """(ModelConfig, random parameters, int32[batch, src_len] random sources) of a decoding preset."""
    cfg = presets.model_config(preset.model, deterministic=True)
    longest = max(preset.src_len, new_tokens)
    if longest > cfg.max_len:  # the position table must cover the sources and the outputs
        cfg = cfg.replace(max_len=longest)
    params = init_params(cfg, rng=jax.random.key(0))
    # Sources no longer than the output, so the output buffer is every example's length limit.
    inputs = np.random.default_rng(0).integers(
        PAD_ID + 4, cfg.vocab_size, size=(preset.batch, preset.src_len)).astype(np.int32)
    return cfg, params, inputs


def bench_decode(name: str, preset: presets.DecodePreset, peak: timing.Peak | None, *, kind: str,
                 new_tokens: list[int], beam_size: int = paper.BEAM_SIZE, use_cache: bool = True,
                 repeats: int) -> list[dict]:
    """Times one search of one preset at each output length; returns one record per length."""
    cfg, params, inputs = model_and_inputs(preset, max(new_tokens))
    beams = beam_size if kind == "beam" else 1
    records = []
    for n in new_tokens:
        search = make_search(kind, params, cfg, beam_size=beam_size, new_tokens=n, use_cache=use_cache)
        compile_s, times = time_search(search, inputs, n, repeats)
        seconds = statistics.median(times)
        record = dict(preset=name, measured=f"decode_{'greedy' if beams == 1 else f'beam{beams}'}_"
                                           f"{'cached' if use_cache else 'uncached'}",
                      batch=preset.batch, src_len=preset.src_len, new_tokens=n, beam_size=beams,
                      median_s=round(seconds, 5), best_s=round(min(times), 5),
                      generated_tokens_per_s=round(preset.batch * n / seconds, 1),
                      compile_s=round(compile_s, 2))
        if use_cache and peak is not None:
            flop = flops.decode_flops(cfg, preset.batch, preset.src_len, n, beam_size=beams, cache_len=n)
            record.update(timing.mfu_fields(flop, seconds, peak))
        record.update(jax=jax.__version__, backend=jax.default_backend())
        records.append(record)
    return records


def run(names: list[str], peak: timing.Peak | None, *, searches=SEARCHES, new_tokens: list[int] | None = None,
        beam_size: int = paper.BEAM_SIZE, uncached: bool = False, repeats: int,
        uncached_repeats: int = 1) -> list[dict]:
    """Benchmarks the named presets (each at its own ``new_tokens`` unless given); prints the records."""
    records = []
    for name in names:
        preset = presets.DECODE_PRESETS[name]
        for kind in searches:
            for use_cache in (True, False) if uncached else (True,):
                for record in bench_decode(name, preset, peak, kind=kind,
                                           new_tokens=new_tokens or [preset.new_tokens],
                                           beam_size=beam_size, use_cache=use_cache,
                                           repeats=repeats if use_cache else uncached_repeats):
                    print(json.dumps(record), flush=True)
                    records.append(record)
    return records


def bench_throughput(path: str, workdir: str, *, num_sentences: int | None, beam_size: int | None,
                     average_last: int = 0, tokens_per_batch: int | None = None,
                     repeats: int) -> dict:
    """Translates the first ``num_sentences`` lines of ``path`` with ``workdir``; one record.

    ``beam_size`` None takes the run config's (with its alpha and max_extra_len).
    """
    from transformer_jax.checkpoints.restore import averaged_params, restore_workdir

    lines = translation.read_lines(path)[:num_sentences]
    restored = restore_workdir(workdir)
    final = restored.run.eval
    params = averaged_params(restored, average_last) if average_last > 1 else restored.params
    if tokens_per_batch is None:
        tokens_per_batch = translation.default_tokens_per_batch(restored.model_config)
    settings = translation.Settings(
        beam_size=final.final_beam_size if beam_size is None else beam_size,
        alpha=final.final_alpha, max_extra_len=final.final_max_extra_len)
    run_once = lambda: translation.translate_texts(  # noqa: E731
        params, restored.model_config, restored.tokenizer, lines, settings, truncate=True,
        tokens_per_batch=tokens_per_batch)
    start = time.perf_counter()
    outputs = run_once()
    first_s = time.perf_counter() - start
    times = timing.time_calls(run_once, repeats) if repeats else [first_s]
    seconds = statistics.median(times)
    target_tokens = sum(len(ids) for ids in restored.tokenizer.encode_text(outputs, side="target"))
    record = dict(measured="translate_throughput", file=os.path.basename(path), num_sentences=len(lines),
                  beam_size=settings.beam_size, alpha=settings.alpha, tokens_per_batch=tokens_per_batch,
                  params=sum(x.size for x in jax.tree.leaves(params)), first_s=_sig(first_s),
                  first_sentences_per_s=round(len(lines) / first_s, 2),
                  median_s=_sig(seconds), best_s=_sig(min(times)),
                  sentences_per_s=round(len(lines) / seconds, 2),
                  target_tokens_per_s=round(target_tokens / seconds, 1), target_tokens=target_tokens,
                  jax=jax.__version__, backend=jax.default_backend())
    print(json.dumps(record), flush=True)
    return record


def _sig(seconds: float) -> float:
    """Seconds to 4 significant digits: rates recomputed from them agree to 0.05%."""
    return float(f"{seconds:.4g}")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.decoding``."""
    flags.DEFINE_list("presets", ["tiny"],
                      f"Comma-separated decoding presets, of {list(presets.DECODE_PRESETS)} (model, batch, "
                      "source length and output length; see transformer_jax/benchmarks/presets.py).",
                      flag_values=flag_values)
    flags.DEFINE_list("new_tokens", None,
                      "Comma-separated output lengths to time, e.g. 32,128. Default: the preset's (32).",
                      flag_values=flag_values)
    flags.DEFINE_list("searches", list(SEARCHES), f"Which searches to run, of {list(SEARCHES)}.",
                      flag_values=flag_values)
    flags.DEFINE_integer("beam_size", paper.BEAM_SIZE, "Hypotheses kept per example in beam search.",
                         flag_values=flag_values)
    flags.DEFINE_integer("repeats", 5, "Timed runs per cached setting; the median is reported.",
                         flag_values=flag_values)
    flags.DEFINE_bool("uncached", False, "Also time the cache-off reference path, which reruns the full "
                      "decoder every step (slow: minutes at 128 tokens).", flag_values=flag_values)
    flags.DEFINE_integer("uncached_repeats", 1, "Timed runs per cache-off setting.", flag_values=flag_values)
    flags.DEFINE_string("file", None, "Throughput mode: translate the lines of this file (needs "
                        "--workdir) instead of the fixed shapes.", flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "Throughput mode: the train.py workdir to translate with.",
                        flag_values=flag_values)
    flags.DEFINE_integer("num_sentences", None, "Throughput mode: the first N lines (default: all).",
                         flag_values=flag_values)
    flags.DEFINE_integer("average_last", 0, "Throughput mode: average the last N checkpoints first.",
                         flag_values=flag_values)
    flags.DEFINE_integer("tokens_per_batch", None,
                         "Throughput mode: the decoding batch budget (translation.plan_batches); "
                         "default: the model's (translation.default_tokens_per_batch).",
                         flag_values=flag_values)
    flags.DEFINE_integer("peak_repeats", 20, "Timed runs of the 2048^3 matmul peak; MFU divides by the "
                         "best of them.", flag_values=flag_values)


def _positive_ints(values: list[str] | None, flag: str) -> list[int] | None:
    if values is None:
        return None
    try:
        numbers = [int(v) for v in values]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise ConfigError(f"{flag} takes comma-separated positive integers, e.g. 32,128; got {values!r}")
    return numbers


def main(argv: list[str]) -> None:
    values = flags.FLAGS
    if values.file or values.workdir:
        if not (values.file and values.workdir):
            raise ConfigError("--file and --workdir go together (a text file and the model to translate it)")
        for flag, path, check in (("file", values.file, os.path.isfile),
                                  ("workdir", values.workdir, os.path.isdir)):
            if not check(path):
                raise MissingFileError(f"--{flag}={path}: not found")
        beam_size = None if values["beam_size"].using_default_value else values.beam_size
        bench_throughput(values.file, values.workdir, num_sentences=values.num_sentences,
                         beam_size=beam_size, average_last=values.average_last,
                         tokens_per_batch=values.tokens_per_batch, repeats=values.repeats)
        return
    names = presets.check_names(values.presets, presets.DECODE_PRESETS, "--presets")
    searches = presets.check_names(values.searches, dict.fromkeys(SEARCHES), "--searches")
    new_tokens = _positive_ints(values.new_tokens, "--new_tokens")
    peak = timing.matmul_peak(values.peak_repeats)
    print(json.dumps(peak.record()), flush=True)
    run(names, peak, searches=searches, new_tokens=new_tokens, beam_size=values.beam_size,
        uncached=values.uncached, repeats=values.repeats, uncached_repeats=values.uncached_repeats)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, keep_freed_memory=False)  # decoding: see runtime/host_memory.py
