"""Decoding throughput: greedy and beam search, with the key/value cache and (optionally) without.

    python -m transformer_jax.benchmarks.decoding [--presets=tiny,base] [--new_tokens=32,128] [--uncached]
    python -m transformer_jax.benchmarks.decoding --file=test.en --workdir=DIR [--num_sentences=1000]
    ... [--engines=jax,ctranslate2] [--quantizations=float32,int8] [--threads=2]

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

``--engines=jax,ctranslate2`` adds CTranslate2 (the ``serve`` extra) beside the JAX decoder, one record
per ``--quantizations`` weight type, on ``--threads`` CPU threads: the same random preset model exported
(EOS held back by its ``min_decoding_length``, so every sequence gets ``new_tokens`` tokens), or in
throughput mode the same averaged checkpoint exported. Its first pass includes loading the model.

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
from transformer_jax.evaluation import ctranslate2_engine, decode, paper, translation
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


def _exported_engine(params, cfg: ModelConfig, pieces: list[str], quantization: str, threads: int, folder):
    """A ``ctranslate2_engine.Engine`` over ``params`` exported as ``quantization`` into ``folder``."""
    out_dir = os.path.join(folder, quantization)
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization=quantization, record={})
    return ctranslate2_engine.Engine(out_dir, threads=threads)


def bench_ctranslate2(name: str, preset: presets.DecodePreset, *, kind: str, new_tokens: list[int],
                      beam_size: int, quantizations: list[str], threads: int, repeats: int) -> list[dict]:
    """``bench_decode``'s records for CTranslate2: the same random model exported, each weight type."""
    import tempfile

    cfg, params, inputs = model_and_inputs(preset, max(new_tokens))
    beams = beam_size if kind == "beam" else 1
    pieces = [f"t{i}" for i in range(cfg.vocab_size)]
    sources = [[pieces[i] for i in row] for row in inputs]
    records = []
    with tempfile.TemporaryDirectory() as folder:
        for quantization in quantizations:
            engine = _exported_engine(params, cfg, pieces, quantization, threads, folder)
            for n in new_tokens:
                search = lambda n=n, engine=engine: engine.translator.translate_batch(  # noqa: E731
                    sources, beam_size=beams, max_input_length=0, max_decoding_length=n,
                    min_decoding_length=n, length_penalty=0.0)
                times = timing.time_calls(search, repeats)
                seconds = statistics.median(times)
                records.append(dict(
                    preset=name, measured=f"decode_{'greedy' if beams == 1 else f'beam{beams}'}_ctranslate2",
                    engine="ctranslate2", quantization=quantization, compute_type=engine.compute_type,
                    threads=threads, batch=preset.batch, src_len=preset.src_len, new_tokens=n,
                    beam_size=beams, median_s=round(seconds, 5), best_s=round(min(times), 5),
                    generated_tokens_per_s=round(preset.batch * n / seconds, 1)))
    return records


def run(names: list[str], peak: timing.Peak | None, *, searches=SEARCHES, new_tokens: list[int] | None = None,
        beam_size: int = paper.BEAM_SIZE, uncached: bool = False, repeats: int,
        uncached_repeats: int = 1, engines=("jax",), quantizations=("float32",),
        threads: int = 0) -> list[dict]:
    """Benchmarks the named presets (each at its own ``new_tokens`` unless given); prints the records."""
    records = []
    for name in names:
        preset = presets.DECODE_PRESETS[name]
        for kind in searches:
            if "ctranslate2" in engines:
                for record in bench_ctranslate2(name, preset, kind=kind,
                                                new_tokens=new_tokens or [preset.new_tokens],
                                                beam_size=beam_size, quantizations=list(quantizations),
                                                threads=threads, repeats=repeats):
                    print(json.dumps(record), flush=True)
                    records.append(record)
            if "jax" not in engines:
                continue
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
                     repeats: int, engines=("jax",), quantizations=("float32",),
                     threads: int = 0) -> list[dict]:
    """Translates the first ``num_sentences`` lines of ``path`` with ``workdir``; one record per engine
    (and per CTranslate2 weight type).

    ``beam_size`` None takes the run config's (with its alpha and max_extra_len).
    """
    import tempfile

    from transformer_jax.checkpoints.restore import averaged_params, restore_workdir

    lines = translation.read_lines(path)[:num_sentences]
    restored = restore_workdir(workdir)
    final = restored.run.eval
    params, _ = averaged_params(restored, average_last)
    if tokens_per_batch is None:
        tokens_per_batch = translation.default_tokens_per_batch(restored.model_config)
    settings = translation.Settings(
        beam_size=final.final_beam_size if beam_size is None else beam_size,
        alpha=final.final_alpha, max_extra_len=final.final_max_extra_len)
    common = dict(measured="translate_throughput", file=os.path.basename(path), num_sentences=len(lines),
                  beam_size=settings.beam_size, alpha=settings.alpha,
                  params=sum(x.size for x in jax.tree.leaves(params)))
    records = []
    if "jax" in engines:
        records.append(_time_translation(
            lambda: translation.translate_texts(params, restored.model_config, restored.tokenizer, lines,
                                                settings, truncate=True, tokens_per_batch=tokens_per_batch),
            restored.tokenizer, repeats,
            dict(common, engine="jax", tokens_per_batch=tokens_per_batch, jax=jax.__version__,
                 backend=jax.default_backend())))
    if "ctranslate2" in engines:
        pieces = ctranslate2_engine.workdir_pieces(restored.tokenizer)
        with tempfile.TemporaryDirectory() as folder:
            for quantization in quantizations:
                record = dict(common, engine="ctranslate2", quantization=quantization, threads=threads)
                engine = None

                def translate_once(quantization=quantization, record=record):
                    nonlocal engine
                    if engine is None:  # the first pass loads the model
                        engine = _exported_engine(params, restored.model_config, pieces, quantization,
                                                  threads, folder)
                        record["compute_type"] = engine.compute_type
                    return translation.translate_texts(None, restored.model_config, restored.tokenizer,
                                                       lines, settings, truncate=True,
                                                       decode_fn=engine.decode_ids)

                records.append(_time_translation(translate_once, restored.tokenizer, repeats, record))
    return records


def _time_translation(translate_once, tokenizer, repeats: int, record: dict) -> dict:
    """Times a first pass and ``repeats`` more of ``translate_once``; prints and returns ``record`` with
    the sentences/s and target tokens/s of the first and the median pass."""
    start = time.perf_counter()
    outputs = translate_once()
    first_s = time.perf_counter() - start
    times = timing.time_calls(translate_once, repeats) if repeats else [first_s]
    seconds = statistics.median(times)
    target_tokens = sum(len(ids) for ids in tokenizer.encode_text(outputs, side="target"))
    n = record["num_sentences"]
    record.update(first_s=_sig(first_s), first_sentences_per_s=round(n / first_s, 2), median_s=_sig(seconds),
                  best_s=_sig(min(times)), sentences_per_s=round(n / seconds, 2),
                  target_tokens_per_s=round(target_tokens / seconds, 1), target_tokens=target_tokens)
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
                         "Throughput mode: the decoding batch budget (translation.batch_rows); "
                         "default: the model's (translation.default_tokens_per_batch).",
                         flag_values=flag_values)
    flags.DEFINE_list("engines", ["jax"], "Comma-separated decoders, of jax and ctranslate2 (the exported "
                      "model; needs the serve extra).", flag_values=flag_values)
    flags.DEFINE_list("quantizations", ["float32"],
                      f"CTranslate2 weight types to time, of {list(ctranslate2_engine.QUANTIZATIONS)}.",
                      flag_values=flag_values)
    flags.DEFINE_integer("threads", 0, "CTranslate2's CPU threads (0: its default, all cores).",
                         flag_values=flag_values)
    flags.DEFINE_integer("peak_repeats", 20, "Timed runs of the matmul peak; MFU divides by the "
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
    engines = presets.check_names(values.engines, dict.fromkeys(translation.ENGINES), "--engines")
    quantizations = presets.check_names(values.quantizations, dict.fromkeys(ctranslate2_engine.QUANTIZATIONS),
                                        "--quantizations")
    if "ctranslate2" in engines:
        ctranslate2_engine.import_ctranslate2()
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
                         tokens_per_batch=values.tokens_per_batch, repeats=values.repeats, engines=engines,
                         quantizations=quantizations, threads=values.threads)
        return
    names = presets.check_names(values.presets, presets.DECODE_PRESETS, "--presets")
    searches = presets.check_names(values.searches, dict.fromkeys(SEARCHES), "--searches")
    new_tokens = _positive_ints(values.new_tokens, "--new_tokens")
    peak = timing.matmul_peak(values.peak_repeats)
    print(json.dumps(peak.record()), flush=True)
    run(names, peak, searches=searches, new_tokens=new_tokens, beam_size=values.beam_size,
        uncached=values.uncached, repeats=values.repeats, uncached_repeats=values.uncached_repeats,
        engines=engines, quantizations=quantizations, threads=values.threads)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main, keep_freed_memory=False)  # decoding: see runtime/host_memory.py
