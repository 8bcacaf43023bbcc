"""Scoring a model on a split: per-subword perplexity, translations and BLEU (three protocols).

Every function takes what it scores explicitly: parameters, the ModelConfig, the tokenizer, the batches
(``data.EvalBatch``) and the decoding settings (the paper's by default: ``paper.BEAM_SIZE``,
``paper.LENGTH_PENALTY_ALPHA``, ``paper.MAX_EXTRA_LEN``). Used by the training loop (periodic dev
metrics, the final report) and by ``evaluate.py`` (``evaluate_workdir``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from typing import Any

import numpy as np

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.restore import averaged_params, restore_workdir
from transformer_jax.data.sources import read_parallel_numbered
from transformer_jax.evaluation import (
    bleu,
    ctranslate2_engine,
    evaluate_args,
    paper,
    paper_tables,
    parsing,
    translation,
)
from transformer_jax.model import loss
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.runtime.errors import ConfigError


def perplexity(params, model_config: ModelConfig, batches, *, label_smoothing: float = 0.0) -> dict:
    """Per-token (per-subword) loss, NLL, accuracy and perplexity of the references in ``batches``.

    Args:
      params: the model parameters.
      model_config: the model (evaluated deterministically).
      batches: ``data.EvalBatch`` items with int32[B, S] ``inputs`` and int32[B, T] ``targets``.
      label_smoothing: eps_ls for the reported ``loss``; ``nll`` and ``ppl`` never smooth.
    """
    fn = loss.make_eval_step(model_config, float(label_smoothing))
    sums = None
    for b in batches:
        sums = loss.accumulate_metrics(sums, fn(params, {"inputs": b.inputs, "targets": b.targets}))
    return loss.summarize(sums)


def _in_split_order(batches, per_batch_items) -> list:
    """Reorders per-batch lists (bucketed order) back into the split's own line order."""
    indexed = [(int(i), item) for b, items in zip(batches, per_batch_items, strict=True)
               for i, item in zip(b.indices, items, strict=True)]
    return [item for _, item in sorted(indexed, key=lambda pair: pair[0])]


def translate(params, model_config: ModelConfig, tokenizer, batches, *,
              beam_size: int = paper.BEAM_SIZE, alpha: float = paper.LENGTH_PENALTY_ALPHA,
              max_extra_len: int = paper.MAX_EXTRA_LEN, decode_fn=None) -> list[str]:
    """Detokenized translations of every real row of ``batches``, in the split's line order.

    ``beam_size=1`` is greedy search; otherwise beam search with the GNMT length penalty ``alpha``.
    Outputs are at most (input length + ``max_extra_len``) tokens long. The sources are re-batched by
    the decoding token budget (``translation.decode_ids``, the path of the translate command), or
    decoded by ``decode_fn(ids, settings)`` (another engine's ``decode_ids``).
    """
    ids = [row[row != PAD_ID] for b in batches for row in np.asarray(b.inputs)[: b.num_real]]
    settings = translation.Settings(beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len)
    if decode_fn is None:
        outputs = translation.decode_ids(params, model_config, ids, settings)
    else:
        outputs = decode_fn(ids, settings)
    texts = tokenizer.decode_batch(outputs)
    per_batch, start = [], 0
    for b in batches:
        per_batch.append(texts[start:start + b.num_real])
        start += b.num_real
    return _in_split_order(batches, per_batch)


def references_and_sources(batches) -> tuple[list[str], list[str]]:
    """The reference and source texts of ``batches``, in the split's line order."""
    return (_in_split_order(batches, [b.target_texts for b in batches]),
            _in_split_order(batches, [b.source_texts for b in batches]))


# A protocol of ``protocols.BLEU_PROTOCOLS`` -> the key of ``translate_and_score`` (and of evaluate.py's
# JSON) that holds its score.
BLEU_KEYS = {"sacrebleu": "sacrebleu", "tokenized": "tokenized_bleu", "multi30k": "multi30k_bleu"}


def translate_and_score(params, model_config: ModelConfig, tokenizer, batches, *,
                        beam_size: int = paper.BEAM_SIZE, alpha: float = paper.LENGTH_PENALTY_ALPHA,
                        max_extra_len: int = paper.MAX_EXTRA_LEN,
                        target_lang: str = "de", decode_fn=None) -> dict[str, Any]:
    """Translations scored under every protocol of ``protocols.BLEU_PROTOCOLS``, against the raw references.

    Returns:
      ``sacrebleu`` (13a, cased), ``tokenized_bleu`` (the paper's compound-split BLEU), ``multi30k_bleu``
      (the Multi30k literature's lowercased, normalized, Moses-tokenized BLEU), ``sacrebleu_signature``,
      ``decode_seconds`` (wall time of the search, compilation included) and the ``hypotheses``,
      ``references`` and ``sources`` in the split's line order.
    """
    start = time.perf_counter()
    hypotheses = translate(params, model_config, tokenizer, batches, beam_size=beam_size,
                           alpha=alpha, max_extra_len=max_extra_len, decode_fn=decode_fn)
    decode_seconds = time.perf_counter() - start
    references, sources = references_and_sources(batches)
    scores = bleu.score_all(hypotheses, references, target_lang)
    return {"sacrebleu": scores["sacrebleu"].score, "sacrebleu_signature": scores["sacrebleu"].signature,
            "tokenized_bleu": scores["tokenized"].score, "multi30k_bleu": scores["multi30k"].score,
            "decode_seconds": decode_seconds, "hypotheses": hypotheses, "references": references,
            "sources": sources}


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


def evaluate_workdir(workdir: str, *, step: int | None = None, average_last: int | None = None,
                     split: str = "test", source_file: str | None = None,
                     reference_file: str | None = None, beam_size: int | None = None,
                     alpha: float | None = None,
                     max_extra_len: int | None = None, output_dir: str | None = None,
                     overwrite: bool = False, engine: str = "jax", threads: int | None = None,
                     quantization: str | None = None) -> dict[str, Any]:
    """Restores a training workdir and scores it: PPL, sacreBLEU, tokenized BLEU, paper table.

    A parsing run (``data.is_parsing``) is scored by ``parsing.evaluate_restored`` instead:
    EVALB F1, precision, recall, exact match, repairs, the right-branching baseline and Table 4.

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
    if engine != "jax" and data_lib.is_parsing(run.data):
        raise ConfigError(f"--engine={engine}: a parsing run decodes with the tree constraint, which only "
                          "the JAX engine has; leave --engine out")
    stem = evaluate_args.output_stem(out_dir, split=split, step=restored.step, source_file=source_file,
                                     average_last=average_last, engine=engine)
    txt_path, json_path = evaluate_args.claim_outputs(stem, overwrite=overwrite)
    params, averaged_steps = averaged_params(restored, average_last, from_config=from_config)
    split, batches = _split_batches(run.data, tokenizer, split, source_file, reference_file,
                                    max_length)
    ppl = perplexity(params, model_config, batches)
    if data_lib.is_parsing(run.data):  # F1 and Table 4, not BLEU (parsing.py)
        return parsing.evaluate_restored(
            restored, params, batches, ppl, split=split, average_last=average_last,
            averaged_steps=averaged_steps, source_file=source_file, beam_size=beam_size, alpha=alpha,
            max_extra_len=max_extra_len, outputs=(txt_path, json_path))
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
        scores = translate_and_score(params, model_config, tokenizer, batches, beam_size=beam_size,
                                     alpha=alpha, max_extra_len=max_extra_len,
                                     target_lang=run.data.tgt_lang, decode_fn=decode_fn)
    results = {
        "config": run.name, "split": split, "step": restored.step, "average_last": average_last,
        "averaged_steps": averaged_steps,
        "beam_size": beam_size, "alpha": alpha, "num_sentences": len(scores["hypotheses"]),
        "ppl": ppl["ppl"], "nll": ppl["nll"], "sacrebleu": scores["sacrebleu"],
        "sacrebleu_signature": scores["sacrebleu_signature"],
        "tokenized_bleu": scores["tokenized_bleu"], "multi30k_bleu": scores["multi30k_bleu"],
        "decode_seconds": round(scores["decode_seconds"], 2),
        "sentences_per_second": round(len(scores["hypotheses"]) / scores["decode_seconds"], 2),
        "source_file": source_file, "reference_file": reference_file, "engine": engine, **engine_info,
    }
    with open(txt_path, "w") as f:
        f.writelines(h + "\n" for h in scores["hypotheses"])
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    table_split = split if split in ("dev", "test") else "test"
    results["table"] = paper_tables.paper_comparison_table(run.name, table_split, results)
    results["outputs"] = (txt_path, json_path)
    return results


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
