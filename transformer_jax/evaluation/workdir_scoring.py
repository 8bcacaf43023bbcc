"""evaluate.py's logic: restore a ``train.py`` workdir, average its checkpoints and score it on a split or on
files, through the run's task (``tasks.task_for``), with the JAX decoder or a CTranslate2 export."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.restore import averaged_params, restore_workdir
from transformer_jax.data.sources import read_parallel_numbered
from transformer_jax.evaluation import ctranslate2_engine, evaluate_args, scoring, tasks, translation
from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime.errors import ConfigError


def evaluate_workdir(workdir: str, *, step: int | None = None, average_last: int | None = None,
                     split: str = "test", source_file: str | None = None,
                     reference_file: str | None = None, beam_size: int | None = None,
                     alpha: float | None = None,
                     max_extra_len: int | None = None, output_dir: str | None = None,
                     overwrite: bool = False, engine: str = "jax", threads: int | None = None,
                     quantization: str | None = None) -> dict[str, Any]:
    """Restores a training workdir and scores it: PPL, sacreBLEU, tokenized BLEU, paper table.

    The run's task (``tasks.task_for``) scores the outputs: a translation run through
    ``scoring.evaluate_restored``, a parsing run through ``parsing.evaluate_restored`` (EVALB F1,
    precision, recall, exact match, repairs, the right-branching baseline and Table 4).

    Writes the translations to ``<output_dir>/<name>-<step>.txt`` and the numbers to
    ``<output_dir>/<name>-<step>.json`` (``evaluate_args.output_stem``: name is the split or the source
    file's base name; ``-avg<N>`` is appended when averaging); returns them with a markdown table beside
    the paper's row. Every argument, the input files and the output folder's writability are checked
    before anything is restored, and an existing result is never replaced unless ``overwrite``.

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
    """
    out_dir = output_dir or evaluate_args.default_output_dir(workdir)
    _check_engine(engine, threads, quantization)
    evaluate_args.check_arguments(
        workdir, step=step, average_last=average_last, split=split, source_file=source_file,
        reference_file=reference_file, beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len,
        output_dir=out_dir)
    restored = restore_workdir(workdir, step)
    run, tokenizer, model_config = restored.run, restored.tokenizer, restored.model_config
    beam_size = run.eval.final_beam_size if beam_size is None else beam_size
    alpha = run.eval.final_alpha if alpha is None else alpha
    max_extra_len = run.eval.final_max_extra_len if max_extra_len is None else max_extra_len
    from_config = average_last is None
    average_last = run.eval.final_average_last if from_config else average_last
    max_length = _decodable_length(model_config, run.data, max_extra_len)
    task = tasks.task_for(run.data)
    if engine not in task.engines:
        raise ConfigError(f"--engine={engine}: a {task.name} run decodes with {' or '.join(task.engines)}; "
                          "leave --engine out")
    stem = evaluate_args.output_stem(out_dir, split=split, step=restored.step, source_file=source_file,
                                     average_last=average_last, engine=engine)
    txt_path, json_path = evaluate_args.claim_outputs(stem, overwrite=overwrite)
    params, averaged_steps = averaged_params(restored, average_last, from_config=from_config)
    split, batches = _split_batches(run.data, tokenizer, split, source_file, reference_file,
                                    max_length)
    ppl = scoring.perplexity(params, model_config, batches)
    with contextlib.ExitStack() as stack:
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
        return task.evaluate_restored(
            restored, params, batches, ppl, split=split, average_last=average_last,
            averaged_steps=averaged_steps, source_file=source_file, reference_file=reference_file,
            beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len, outputs=(txt_path, json_path),
            decode_fn=decode_fn, engine=engine, engine_info=engine_info)


def _split_batches(data_config, tokenizer, split: str, source_file: str | None,
                   reference_file: str | None, max_length: int) -> tuple[str, list]:
    """(split name, batches): the run's ``split``, or the given file pair (named after newstest).

    A pair longer than ``max_length`` tokens raises DataError naming its file and line.
    """
    if not (source_file or reference_file):
        return split, data_lib.make_eval_batches(data_config, tokenizer, split, max_length=max_length)
    if not (source_file and reference_file):
        raise ConfigError("--source_file and --reference_file go together; got only one")
    pairs, lines = read_parallel_numbered(source_file, reference_file)
    name = os.path.basename(source_file)
    split = "test" if "newstest2014" in name else "dev" if "newstest2013" in name else "files"
    return split, data_lib.make_eval_batches(data_config, tokenizer, split, pairs=pairs,
                                             max_length=max_length,
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
    if quantization is not None and quantization not in ctranslate2_engine.QUANTIZATIONS:
        raise ConfigError(f"--quantization={quantization}: expected one of "
                          f"{', '.join(ctranslate2_engine.QUANTIZATIONS)}")


def _decodable_length(model_config: ModelConfig, data_config, max_extra_len: int) -> int:
    """The longest padded input that leaves room for ``max_extra_len`` output positions.

    Raises ConfigError when not even the largest length bucket fits (``--max_extra_len`` too large).
    """
    largest = max(data_config.length_buckets)
    if largest + max_extra_len > model_config.max_len:
        raise ConfigError(
            f"--max_extra_len={max_extra_len}: the model's max_len={model_config.max_len} leaves room "
            f"for at most {model_config.max_len - largest} output positions beyond the largest length "
            f"bucket {largest}; pass --max_extra_len={max(model_config.max_len - largest, 0)} or less")
    return model_config.max_len - max_extra_len
