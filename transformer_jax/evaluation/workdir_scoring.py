"""The workdir drivers of evaluate.py and the translate command: restore a ``train.py`` workdir, average its
checkpoints, decode, write the outputs.

Both restore the checkpoint and take the run config's decoding defaults the same way (:func:`_restore`),
average with ``restore.averaged_params`` and decode through ``translation.decode_ids`` (its planner and
cache budget) or a CTranslate2 engine's ``decode_ids``. What differs is what they read and write:
:func:`evaluate_workdir` scores a split or a file pair through the run's task (``tasks.task_for``) and
writes the outputs and numbers; :func:`translate_workdir` translates the lines of a text file (or stdin)
into one output file (or stdout), replaced whole or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.restore import Restored, averaged_params, restore_workdir
from transformer_jax.data.sources import read_parallel_numbered
from transformer_jax.data.treebank import is_parsing
from transformer_jax.evaluation import by_length as length_lib
from transformer_jax.evaluation import (
    ctranslate2_engine,
    evaluate_args,
    reference_scores,
    scoring,
    tasks,
    translation,
)
from transformer_jax.evaluation.translation import Settings
from transformer_jax.model import ensemble as ensemble_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ensemble import Ensemble
from transformer_jax.runtime import provenance
from transformer_jax.runtime.errors import ConfigError, DataError, MissingFileError
from transformer_jax.runtime.output_file import OutputFile, refuse_the_input, stop_signals_held, write_stdout


def _settings(defaults: Settings, beam_size: int | None, alpha: float | None,
              max_extra_len: int | None) -> Settings:
    """``defaults`` with the settings given (not None) in their place."""
    return Settings(beam_size=defaults.beam_size if beam_size is None else beam_size,
                    alpha=defaults.alpha if alpha is None else alpha,
                    max_extra_len=defaults.max_extra_len if max_extra_len is None else max_extra_len)


def _restore(workdir: str, step: int | None, average_last: int | None, beam_size: int | None,
             alpha: float | None, max_extra_len: int | None) -> tuple[Restored, Settings, int]:
    """(restored, settings, average_last): ``workdir`` at ``step`` (its latest good one for None), and the
    settings and averaging left at None taken from the run config's ``final_*`` (as its final report)."""
    restored = restore_workdir(workdir, step)
    final = restored.run.eval
    defaults = Settings(final.final_beam_size, final.final_alpha, final.final_max_extra_len)
    return (restored, _settings(defaults, beam_size, alpha, max_extra_len),
            final.final_average_last if average_last is None else average_last)


def evaluate_workdir(workdir: str, *, step: int | None = None, average_last: int | None = None,
                     split: str = "test", source_file: str | None = None,
                     reference_file: str | None = None, beam_size: int | None = None,
                     alpha: float | None = None,
                     max_extra_len: int | None = None, output_dir: str | None = None,
                     overwrite: bool = False, engine: str = "jax", threads: int | None = None,
                     quantization: str | None = None, ensemble: Sequence[str] = (),
                     by_length: bool = False, length_buckets: Sequence[int] | None = None) -> dict[str, Any]:
    """Restores a training workdir and scores it: PPL, sacreBLEU, tokenized BLEU, paper table.

    The run's task (``tasks.task_for``) scores the outputs: a translation run through
    ``scoring.evaluate_restored``, a parsing run through ``parsing.evaluate_restored`` (EVALB F1,
    precision, recall, exact match, repairs, the right-branching baseline and Table 4).

    Writes the translations to ``<output_dir>/<name>-<step>.txt`` and the numbers to
    ``<output_dir>/<name>-<step>.json`` (``evaluate_args.output_stem``: name is the split or the source
    file's base name; ``-avg<N>`` is appended when averaging); returns them with a markdown table beside
    the paper's row. Every argument, the input files and the output folder's writability are checked
    before anything is restored, and an existing result is never replaced unless ``overwrite``. The
    numbers carry ``provenance`` (this process's host, code and settings: ``runtime.provenance``) and
    ``run_provenance`` (the training run's ``provenance.json``).

    Args:
      workdir: a directory written by ``train.py`` (checkpoints, tokenizer, config).
      step: the checkpoint to score; None for the latest good one.
      average_last: average the parameters of the last N checkpoints (ending at ``step``) first; None
        takes the run config's ``final_average_last`` (as the training's final report did); 0 or 1: none.
        The steps averaged are returned (and written) as ``averaged_steps``.
      split: "dev" or "test" of the run's data config; ignored when files are given.
      source_file, reference_file: score on these line-aligned files instead.
      beam_size, alpha, max_extra_len: decoding settings (see ``translate``); None takes the run
        config's ``final_beam_size``, ``final_alpha``, ``final_max_extra_len`` (input + 300 for parsing).
      output_dir: where the outputs go; None for ``<workdir>/eval``.
      overwrite: replace an existing result of the same checkpoint and inputs (else UserError).
      engine: "jax" (the reference) or "ctranslate2": the averaged parameters are exported to a
        temporary CTranslate2 model of weight type ``quantization`` (None: the export's default) and
        decoded with it on ``threads`` CPU threads; perplexity stays JAX's. Outputs are named
        ``...-ctranslate2``.
      ensemble: more workdirs whose models decode together with ``workdir``'s (``model.ensemble``: the
        mean of their distributions), each at its latest good checkpoint with the same averaging; they
        must have the same model shape and tokenizer. Perplexity is the ensemble's; outputs are named
        ``...-ens<M>-<key>``, key a hash of the models' workdirs and steps.
      by_length: also score each bucket of source length (``by_length``: BLEU in the run's
        dev_bleu_protocol, or F1), as ``by_length`` in the numbers, a ``length_table`` to print and a
        plot ``<name>-<step>...-by_length.png`` beside the JSON.
      length_buckets: the buckets' edges in source tokens (EOS included), the last bucket open; None:
        ``by_length.DEFAULT_EDGES``. Only with ``by_length``.
    """
    out_dir = output_dir or evaluate_args.default_output_dir(workdir)
    _check_engine(engine, threads, quantization)
    evaluate_args.check_arguments(
        workdir, step=step, average_last=average_last, split=split, source_file=source_file,
        reference_file=reference_file, beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len,
        output_dir=out_dir, ensemble=ensemble, by_length=by_length, length_buckets=length_buckets)
    if ensemble and engine != "jax":
        raise ConfigError(f"--ensemble decodes with --engine=jax; got --engine={engine}")
    from_config = average_last is None
    started_on = provenance.collect(peak_missing="evaluate.py measures no matmul peak")
    restored, settings, average_last = _restore(workdir, step, average_last, beam_size, alpha, max_extra_len)
    run, tokenizer, model_config = restored.run, restored.tokenizer, restored.model_config
    beam_size, alpha, max_extra_len = settings.beam_size, settings.alpha, settings.max_extra_len
    max_source_length = _decodable_length(model_config, run.data, max_extra_len, engine)
    task = tasks.task_for(run.data)
    if engine not in task.engines:
        raise ConfigError(f"--engine={engine}: a {task.name} run decodes with {' or '.join(task.engines)}; "
                          "leave --engine out")
    if engine == "ctranslate2":
        ctranslate2_engine.check_exportable(model_config)
    # The other models are checked against the first before any output is claimed.
    members = [_ensemble_member(restored, d, average_last, from_config) for d in ensemble]
    others = [(d, steps) for d, (_, steps) in zip(ensemble, members, strict=True)]
    stem = evaluate_args.output_stem(out_dir, split=split, step=restored.step, source_file=source_file,
                                     average_last=average_last, engine=engine,
                                     ensemble=[(workdir, restored.step), *others])
    with contextlib.ExitStack() as stack:
        # Claimed before anything is decoded: a second evaluate.py of the same outputs is refused now.
        txt_path, json_path = stack.enter_context(evaluate_args.claimed_outputs(stem, overwrite=overwrite))
        split, batches = _split_batches(run.data, tokenizer, split, source_file, reference_file,
                                        model_config.position_limit, max_source_length)
        params, averaged_steps = averaged_params(restored, average_last, from_config=from_config)
        if members:
            params = Ensemble((params, *(p for p, _ in members)))
        ppl = scoring.perplexity(params, model_config, batches)
        decode_fn, engine_info = None, {}
        if engine == "ctranslate2":
            export_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ctranslate2-"))
            quantization = quantization or ctranslate2_engine.default_quantization(model_config.d_model)
            ctranslate2_engine.write_model(params, model_config, export_dir, quantization=quantization,
                                           pieces=ctranslate2_engine.workdir_pieces(tokenizer), record={})
            translator = ctranslate2_engine.Engine(export_dir, threads=threads or 0)
            decode_fn = translator.decode_ids
            engine_info = {"quantization": quantization, "compute_type": translator.compute_type,
                           "threads": threads}
        lines, results, table = task.evaluate_restored(
            restored, params, batches, ppl, split=split, average_last=average_last,
            averaged_steps=averaged_steps, source_file=source_file, reference_file=reference_file,
            beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len,
            decode_fn=decode_fn, engine=engine, engine_info=engine_info)
        if members:
            steps = [averaged_steps] + [member_steps for _, member_steps in members]
            results["ensemble"] = [{"workdir": d, "averaged_steps": s}
                                   for d, s in zip((workdir, *ensemble), steps, strict=True)]
        results["provenance"] = {**started_on, "config_sha256": provenance.config_hash(run.saved)}
        results["run_provenance"] = (provenance.read(os.path.join(workdir, provenance.FILENAME))
                                     or provenance.unknown(f"{workdir} has no readable {provenance.FILENAME} "
                                                           "(trained before provenance was recorded)"))
        extra = {}
        if by_length:
            results["by_length"], extra["length_table"] = _score_by_length(
                task, run, split, batches, lines,
                length_lib.check_edges(length_buckets) if length_buckets else length_lib.DEFAULT_EDGES,
                stem + "-by_length.png")
        with stop_signals_held():  # the translations and their scores, together or neither
            _write(txt_path, "".join(line + "\n" for line in lines))
            _write(json_path, json.dumps(results, indent=1))
    return {**results, "table": table, **extra, "outputs": (txt_path, json_path)}


def _score_by_length(task, run, split: str, batches, outputs: list[str], edges: Sequence[int],
                     png_path: str) -> tuple[dict[str, Any], str]:
    """(the numbers, the printed table) of ``outputs`` by source length; draws the plot at ``png_path``."""
    measure, references, scorer = task.length_scorer(run.data, run.eval, split, batches)
    train_max_len = run.data.max_len
    rows = length_lib.score_by_length(length_lib.source_lengths(batches), outputs, references, edges, scorer,
                                      train_max_len=train_max_len)
    length_lib.plot_by_length({run.name: rows}, png_path, measure, train_max_len=train_max_len,
                              title=f"{run.name}: {split} by source length")
    numbers = {"measure": measure, "length_unit": length_lib.LENGTH_UNIT, "edges": list(edges),
               "train_max_len": train_max_len, "buckets": rows, "plot": png_path}
    return numbers, length_lib.length_table(rows, measure, train_max_len=train_max_len)


def _ensemble_member(first: Restored, workdir: str, average_last: int, from_config: bool
                     ) -> tuple[Any, list[int]]:
    """(params, averaged steps) of ``workdir``'s latest good checkpoint, averaged as ``first``'s;
    ConfigError unless its model shape (``ensemble.shape_differences``) and tokenizer are ``first``'s (the
    ids must mean the same); it may differ in how it was trained (dropout) or is computed (dtype)."""
    restored = restore_workdir(workdir, None)
    differ = ensemble_lib.shape_differences(first.model_config, restored.model_config)
    if differ:
        raise ConfigError(f"--ensemble={workdir}: its model differs from --workdir's: {', '.join(differ)}; "
                          "an ensemble needs models of one shape")
    if restored.tokenizer.sha256 != first.tokenizer.sha256:
        raise ConfigError(f"--ensemble={workdir}: its tokenizer differs from --workdir's, so the same id "
                          "means another piece; ensemble runs trained on the same data and vocabulary")
    return averaged_params(restored, average_last, from_config=from_config)


def _write(path: str, text: str) -> None:
    """``text`` to ``path``, replaced whole or not at all (as the translate command's ``--output``)."""
    with OutputFile(path, flag="--output_dir") as out:
        out.write(text)


def _split_batches(data_config, tokenizer, split: str, source_file: str | None,
                   reference_file: str | None, max_length: int | None, max_source_length: int | None
                   ) -> tuple[str, list]:
    """(split name, batches): the run's ``split`` (every pair, whatever ``data.max_len``: it drops train
    pairs only), or the given file pair (named after newstest).

    A pair over ``max_length`` tokens on either side, or a source over ``max_source_length``, raises
    DataError naming its file and line; None is no limit (a model without a position table).
    """
    limits = {"max_length": max_length, "max_source_length": max_source_length}
    if not (source_file or reference_file):
        return split, data_lib.make_eval_batches(data_config, tokenizer, split, **limits)
    if not (source_file and reference_file):
        raise ConfigError("--source_file and --reference_file go together; got only one")
    pairs, lines = read_parallel_numbered(source_file, reference_file)
    name = os.path.basename(source_file)
    split = "test" if "newstest2014" in name else "dev" if "newstest2013" in name else "files"
    return split, data_lib.make_eval_batches(data_config, tokenizer, split, pairs=pairs, **limits,
                                             locations=[f"{source_file}:{n}" for n in lines])



def _check_engine(engine: str, threads: int | None, quantization: str | None) -> None:
    """ConfigError for an unknown engine, or CTranslate2's flags (or a missing install) without it."""
    if engine not in translation.ENGINES:
        raise ConfigError(f"--engine={engine}: expected one of {', '.join(translation.ENGINES)}")
    if engine == "jax":
        for flag, value in (("threads", threads), ("quantization", quantization)):
            if value is not None:
                raise ConfigError(f"--{flag} applies to --engine=ctranslate2")
        return
    ctranslate2_engine.import_ctranslate2()
    if threads is not None and threads < 0:
        raise ConfigError(f"--threads={threads}: expected >= 0 (0: CTranslate2's default)")
    ctranslate2_engine.check_threads(threads)
    if quantization is not None and quantization not in ctranslate2_engine.QUANTIZATIONS:
        raise ConfigError(f"--quantization={quantization}: expected one of "
                          f"{', '.join(ctranslate2_engine.QUANTIZATIONS)}")


def _decodable_length(model_config: ModelConfig, data_config, max_extra_len: int,
                      engine: str = "jax") -> int | None:
    """The longest padded input that leaves room for ``max_extra_len`` output positions in what
    ``engine`` decodes (``translation.source_limit``); None when nothing bounds it (any length decodes).

    Raises ConfigError when not even the largest length bucket fits (``--max_extra_len`` too large).
    """
    limit = translation.source_limit(model_config, max_extra_len, engine)
    if limit is None:
        return None
    largest = max(data_config.length_buckets)
    if largest > limit:
        room = limit + max_extra_len - largest
        holder = translation.limit_holder(model_config, engine)
        raise ConfigError(
            f"--max_extra_len={max_extra_len}: {holder}, which leaves room for at most {room} output "
            f"positions beyond the largest length bucket {largest}; pass "
            f"--max_extra_len={max(room, 0)} or less")
    return limit


def _check_flags(workdir: str, *, step, average_last, beam_size, alpha, max_extra_len, tokens_per_batch,
                 engine: str, threads, export_dir) -> None:
    """ConfigError (MissingFileError for the workdir) for a flag of translate out of its range, or not for
    ``engine``; nothing is read but the workdir's existence."""
    for flag, value, minimum, what in (
            ("step", step, 0, "a saved checkpoint step; leave it out for the latest"),
            ("average_last", average_last, 0, "0 or 1: no averaging; N: the last N checkpoints"),
            ("beam_size", beam_size, 1, "1 is greedy search"),
            ("alpha", alpha, 0, "the GNMT length penalty; 0 turns it off"),
            ("max_extra_len", max_extra_len, 0, "outputs may be input length + this long"),
            ("tokens_per_batch", tokens_per_batch, 1, "decoder rows x cache positions per batch"),
            ("threads", threads, 0, "CPU threads of CTranslate2; 0: its default")):
        evaluate_args.check_at_least(flag, value, minimum, what, integer=flag != "alpha")
    if engine not in translation.ENGINES:
        raise ConfigError(f"--engine={engine}: expected one of {', '.join(translation.ENGINES)}")
    if engine == "jax":
        for flag, value in (("threads", threads), ("export_dir", export_dir)):
            if value is not None:
                raise ConfigError(f"--{flag} applies to --engine=ctranslate2; the JAX engine uses every "
                                  "core and the workdir's checkpoints")
    else:
        if tokens_per_batch is not None:
            raise ConfigError("--tokens_per_batch applies to the JAX engine; CTranslate2 plans its own "
                              "batches")
        ctranslate2_engine.import_ctranslate2()  # the install hint before anything is read
        ctranslate2_engine.check_threads(threads)
    if not os.path.isdir(workdir):
        raise MissingFileError(f"--workdir={workdir}: no such directory; pass the --workdir of a "
                               "train.py run")


def translate_workdir(workdir: str, *, input_path: str | None = None, output_path: str | None = None,
                      step: int | None = None, average_last: int | None = None,
                      beam_size: int | None = None,
                      alpha: float | None = None, max_extra_len: int | None = None,
                      truncate: bool = False, tokens_per_batch: int | None = None,
                      show_progress: bool | None = None, engine: str = "jax", threads: int | None = None,
                      export_dir: str | None = None) -> dict[str, Any]:
    """Translates the lines of ``input_path`` (or stdin) with a ``train.py`` workdir, into ``output_path``.

    Writes one translation a line, in the input order, to ``output_path`` or stdout.

    Settings left at None take the run config's ``final_average_last``, ``final_beam_size``,
    ``final_alpha`` and ``final_max_extra_len``. Every flag, the output path and the input are checked
    before the model is restored; ``output_path`` is replaced whole at the end, or not at all. The
    progress bar (stderr) shows by default when the input is a file or redirected.

    ``engine="ctranslate2"`` decodes with the export in ``export_dir`` (default
    ``<workdir>/export/ctranslate2``, made first when missing) on ``threads`` CPU threads
    (``ctranslate2_engine``); the JAX engine is the reference.

    Returns:
      ``num_sentences``, ``decode_seconds`` (search and detokenization, compilation included),
      ``sentences_per_second`` and ``target_tokens_per_second`` (SentencePiece tokens of the outputs).
    """
    _check_flags(workdir, step=step, average_last=average_last, beam_size=beam_size, alpha=alpha,
                 max_extra_len=max_extra_len, tokens_per_batch=tokens_per_batch, engine=engine,
                 threads=threads, export_dir=export_dir)
    if output_path is not None:
        refuse_the_input(output_path, input_path)
    # The output path is checked (and its temporary file made) before anything is read or decoded.
    with OutputFile(output_path) if output_path is not None else contextlib.nullcontext() as output:
        lines = translation.read_lines(input_path)
        if engine == "jax":
            model = _jax_model(workdir, step, average_last, beam_size, alpha, max_extra_len, tokens_per_batch)
        else:
            model = _exported_model(workdir, export_dir, step, average_last, beam_size, alpha, max_extra_len,
                                    threads)
        return _translate_lines(model, lines, output, input_path=input_path, truncate=truncate,
                                show_progress=show_progress)


def score_workdir(workdir: str, *, references_path: str, input_path: str | None = None,
                  output_path: str | None = None, step: int | None = None, average_last: int | None = None,
                  tokens_per_batch: int | None = None, show_progress: bool | None = None,
                  engine: str = "jax", threads: int | None = None,
                  export_dir: str | None = None) -> dict[str, Any]:
    """Scores each (line of ``input_path`` or stdin, same line of ``references_path``) pair with a
    ``train.py`` workdir's model: one line a pair to ``output_path`` or stdout
    (``reference_scores.format_scores``: the sum, then each reference token's and EOS's log-probability).

    The model, its averaging and the engines are translate's (:func:`translate_workdir`); every flag, the
    output path and both inputs are checked before the model is restored, and ``output_path`` is replaced
    whole at the end, or not at all.

    Returns:
      ``num_sentences``, ``score_seconds`` (compilation included), ``sentences_per_second`` and
      ``target_tokens_per_second`` (the references' tokens, EOS included).
    """
    _check_flags(workdir, step=step, average_last=average_last, beam_size=None, alpha=None,
                 max_extra_len=None, tokens_per_batch=tokens_per_batch, engine=engine, threads=threads,
                 export_dir=export_dir)
    if output_path is not None:
        refuse_the_input(output_path, input_path)
        refuse_the_input(output_path, references_path, input_flag="--references")
    with OutputFile(output_path) if output_path is not None else contextlib.nullcontext() as output:
        sources = translation.read_lines(input_path)
        references = translation.read_lines(references_path, flag="--references")
        name = input_path or "<stdin>"
        if len(references) != len(sources):
            raise DataError(f"--references={references_path} has {len(references)} lines and {name} has "
                            f"{len(sources)}; expected one reference a source line")
        if engine == "jax":
            model = _jax_model(workdir, step, average_last, None, None, None, tokens_per_batch)
        else:
            model = _exported_model(workdir, export_dir, step, average_last, None, None, None, threads)
        limit = translation.decodable_positions(model.model_config, model.engine)
        why = "" if limit is None else translation.limit_holder(model.model_config, model.engine)
        ids, reference_ids = reference_scores.pair_ids(
            model.tokenizer, sources, references, max_length=limit, why=why,
            locations=[f"{name}:{n} and {references_path}:{n}" for n in range(1, len(sources) + 1)])
        if show_progress is None:
            show_progress = input_path is not None or not sys.stdin.isatty()
        start = time.perf_counter()
        with translation.progress_bar(len(ids), show_progress) as bar:
            if model.score_fn is None:
                scores = reference_scores.score_ids(model.params, model.model_config, ids, reference_ids,
                                                    tokens_per_batch=model.tokens_per_batch,
                                                    progress=bar.update)
            else:
                scores = model.score_fn(ids, reference_ids)
                bar.update(len(ids))
        seconds = time.perf_counter() - start
        text = reference_scores.format_scores(scores)
        if output is None:
            write_stdout(text)
        else:
            output.write(text)
    tokens = sum(len(s) for s in scores)
    return {"num_sentences": len(ids), "score_seconds": seconds, "sentences_per_second": len(ids) / seconds,
            "target_tokens_per_second": tokens / seconds, "step": model.step,
            "average_last": model.average_last, "engine": model.engine,
            **({"compute_type": model.compute_type} if model.compute_type else {})}


@dataclasses.dataclass(frozen=True)
class _Model:
    """What translating needs from a model, whichever engine decodes: see ``translate_texts``."""

    params: Any
    model_config: ModelConfig
    tokenizer: Any
    settings: Settings
    step: int
    average_last: int
    engine: str
    tokens_per_batch: int | None = None  # the JAX engine's batch budget
    decode_fn: Callable[..., list[np.ndarray]] | None = None  # another engine's decode_ids
    score_fn: Callable[..., list[np.ndarray]] | None = None  # and its score (reference_scores.score_ids)
    compute_type: str | None = None  # CTranslate2's, as it runs on this machine


def _jax_model(workdir: str, step, average_last, beam_size, alpha, max_extra_len, tokens_per_batch) -> _Model:
    restored, settings, average_last = _restore(workdir, step, average_last, beam_size, alpha, max_extra_len)
    if is_parsing(restored.run.data):
        raise ConfigError(f"--workdir={workdir} is a parsing run; translate decodes translation runs. "
                          f"Parse with: python evaluate.py --workdir={workdir} (trees over the input words)")
    params, _ = averaged_params(restored, average_last)
    return _Model(params, restored.model_config, restored.tokenizer, settings, restored.step, average_last,
                  "jax", tokens_per_batch=tokens_per_batch)


def _exported_model(workdir: str, export_dir, step, average_last, beam_size, alpha, max_extra_len,
                    threads) -> _Model:
    from transformer_jax.data.text_form import TextForm
    from transformer_jax.data.tokenizer import Tokenizer

    export_dir = export_dir or ctranslate2_engine.default_export_dir(workdir)
    ctranslate2_engine.recover_leftovers(export_dir)  # an export killed mid-way
    if not os.path.isfile(os.path.join(export_dir, ctranslate2_engine.RECORD_FILE)):
        print(f"exporting the model to {export_dir} first (once; python -m transformer_jax.export)",
              file=sys.stderr)
        ctranslate2_engine.export_workdir(workdir, out_dir=export_dir, step=step, average_last=average_last,
                                          out_flag="--export_dir")
    record = ctranslate2_engine.read_record(export_dir, workdir)
    missing = [k for k in ("step", "average_last", "decoding", "text_form", "model") if k not in record]
    if missing:
        raise ctranslate2_engine.DamagedExportError(
            f"the CTranslate2 export in {export_dir} is damaged: its {ctranslate2_engine.RECORD_FILE} lacks "
            f"{', '.join(missing)}. Make it again with: "
            f"{ctranslate2_engine.export_command(export_dir, workdir)}")
    ctranslate2_engine.check_export_of(workdir, export_dir, record)
    for flag, value in (("step", step), ("average_last", average_last)):
        if value is not None and value != record[flag]:
            raise ConfigError(
                f"--{flag}={value}, but {export_dir} holds {flag} {record[flag]}; export that model first: "
                f"python -m transformer_jax.export --workdir={workdir} --{flag}={value}")
    latest = _latest_checkpoint_step(workdir)
    if step is None and latest is not None and latest > record["step"]:
        print(f"note: {export_dir} is step {record['step']}; the workdir has step {latest} (export again "
              f"to use it: python -m transformer_jax.export --workdir={workdir})", file=sys.stderr)
    engine = ctranslate2_engine.Engine(export_dir, threads=threads or 0, workdir=workdir)
    tokenizer = Tokenizer.from_file(os.path.join(export_dir, ctranslate2_engine.TOKENIZER_FILE),
                                    text_form=TextForm(**record["text_form"]))
    decoding = record["decoding"]
    defaults = Settings(decoding["beam_size"], decoding["alpha"], decoding["max_extra_len"])
    return _Model(None, ModelConfig(**record["model"]), tokenizer,
                  _settings(defaults, beam_size, alpha, max_extra_len), record["step"],
                  record["average_last"], "ctranslate2", decode_fn=engine.decode_ids, score_fn=engine.score,
                  compute_type=engine.compute_type)


def _latest_checkpoint_step(workdir: str) -> int | None:
    """The newest step folder in the workdir's checkpoints (by name; nothing is read), or None."""
    try:
        names = os.listdir(os.path.join(workdir, "checkpoints"))
    except OSError:
        return None
    return max((int(n) for n in names if n.isdigit()), default=None)


def _translate_lines(model: _Model, lines: list[str], output: OutputFile | None, *, input_path, truncate,
                     show_progress) -> dict[str, Any]:
    settings = model.settings
    name = input_path or "<stdin>"
    if show_progress is None:
        show_progress = input_path is not None or not sys.stdin.isatty()
    start = time.perf_counter()
    with translation.progress_bar(len(lines), show_progress) as bar:
        translations = translation.translate_texts(
            model.params, model.model_config, model.tokenizer, lines, settings, truncate=truncate,
            tokens_per_batch=model.tokens_per_batch, locations=[f"{name}:{i + 1}" for i in range(len(lines))],
            progress=bar.update, decode_fn=model.decode_fn)
    seconds = time.perf_counter() - start
    text = "".join(t + "\n" for t in translations)
    if output is None:
        write_stdout(text)
    else:
        output.write(text)
    target_tokens = sum(len(ids) for ids in model.tokenizer.encode_text(translations, side="target"))
    return {"num_sentences": len(lines), "decode_seconds": seconds,
            "sentences_per_second": len(lines) / seconds, "target_tokens_per_second": target_tokens / seconds,
            "beam_size": settings.beam_size, "alpha": settings.alpha, "step": model.step,
            "average_last": model.average_last, "engine": model.engine,
            **({"compute_type": model.compute_type} if model.compute_type else {})}
