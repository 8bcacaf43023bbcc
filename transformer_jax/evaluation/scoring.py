"""Scoring a model on a split: per-subword perplexity, translations and BLEU (three protocols).

Every function takes what it scores explicitly: parameters, the ModelConfig, the tokenizer, the batches
(``data.EvalBatch``) and the decoding settings (the paper's by default: ``paper.BEAM_SIZE``,
``paper.LENGTH_PENALTY_ALPHA``, ``paper.MAX_EXTRA_LEN``). Used by the training loop (periodic dev
metrics, the final report) and by ``evaluate.py`` (``workdir_scoring.evaluate_workdir``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from transformer_jax.evaluation import (
    bleu,
    paper,
    paper_tables,
    translation,
)
from transformer_jax.model import loss
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID


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


def decode_batches(params, model_config: ModelConfig, batches, settings: translation.Settings, *,
                   decode_fn=None, constraint=None,
                   tokens_per_batch: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(sources, outputs) of every real row of ``batches``, in the split's line order.

    The sources (int32[len_i], EOS included) are re-batched by the decoding budget and searched by
    ``translation.decode_ids`` (the path of the translate command; ``tokens_per_batch`` its budget),
    under ``constraint`` if given, or decoded by ``decode_fn(ids, settings)`` (another engine's
    ``decode_ids``). Outputs are int32[len_i + max_extra_len] in ``decode``'s convention.
    """
    ids = [row[row != PAD_ID] for b in batches for row in np.asarray(b.inputs)[: b.num_real]]
    if decode_fn is None:
        outputs = translation.decode_ids(params, model_config, ids, settings, constraint=constraint,
                                         tokens_per_batch=tokens_per_batch)
    else:
        outputs = decode_fn(ids, settings)
    indices = [int(i) for b in batches for i in b.indices]
    order = sorted(range(len(ids)), key=indices.__getitem__)
    return [ids[k] for k in order], [outputs[k] for k in order]


def translate(params, model_config: ModelConfig, tokenizer, batches, *,
              beam_size: int = paper.BEAM_SIZE, alpha: float = paper.LENGTH_PENALTY_ALPHA,
              max_extra_len: int = paper.MAX_EXTRA_LEN, decode_fn=None) -> list[str]:
    """Detokenized translations of every real row of ``batches``, in the split's line order.

    ``beam_size=1`` is greedy search; otherwise beam search with the GNMT length penalty ``alpha``.
    Outputs are at most (input length + ``max_extra_len``) tokens long (:func:`decode_batches`).
    """
    settings = translation.Settings(beam_size=beam_size, alpha=alpha, max_extra_len=max_extra_len)
    _, outputs = decode_batches(params, model_config, batches, settings, decode_fn=decode_fn)
    return tokenizer.decode_batch(outputs)


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


def evaluate_restored(restored, params, batches, ppl: dict, *, split: str, average_last: int,
                      averaged_steps: list[int], source_file: str | None, reference_file: str | None,
                      beam_size: int, alpha: float, max_extra_len: int,
                      decode_fn=None, engine: str = "jax",
                      engine_info: dict | None = None) -> tuple[list[str], dict[str, Any], str]:
    """``workdir_scoring.evaluate_workdir`` for a translation run: BLEU in every protocol and the
    paper's row beside them.

    Returns (the translations, the numbers, the markdown table), for ``evaluate_workdir`` to write.
    ``decode_fn`` decodes instead of the JAX engine (``engine`` names it, and ``engine_info`` is added
    to the numbers).
    """
    run, model_config = restored.run, restored.model_config
    scores = translate_and_score(params, model_config, restored.tokenizer, batches, beam_size=beam_size,
                                 alpha=alpha, max_extra_len=max_extra_len, target_lang=run.data.tgt_lang,
                                 decode_fn=decode_fn)
    results = {
        "config": run.name, "split": split, "step": restored.step, "average_last": average_last,
        "averaged_steps": averaged_steps,
        "beam_size": beam_size, "alpha": alpha, "num_sentences": len(scores["hypotheses"]),
        "ppl": ppl["ppl"], "nll": ppl["nll"], "sacrebleu": scores["sacrebleu"],
        "sacrebleu_signature": scores["sacrebleu_signature"],
        "tokenized_bleu": scores["tokenized_bleu"], "multi30k_bleu": scores["multi30k_bleu"],
        "decode_seconds": round(scores["decode_seconds"], 2),
        "sentences_per_second": round(len(scores["hypotheses"]) / scores["decode_seconds"], 2),
        "source_file": source_file, "reference_file": reference_file, "engine": engine,
        **(engine_info or {}),
    }
    table_split = split if split in ("dev", "test") else "test"
    return (scores["hypotheses"], results,
            paper_tables.paper_comparison_table(run.name, table_split, results, run=run))
