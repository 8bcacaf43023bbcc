"""Scoring a model on a split: per-subword perplexity, translations and BLEU (both protocols).

Shared by the training loop (periodic dev metrics, the final test report) and ``evaluate.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from transformer_jax import bleu, decode
from transformer_jax.model import ModelConfig, Transformer


@functools.lru_cache(maxsize=8)
def _eval_fn(model_config: ModelConfig, label_smoothing: float):
    from transformer_jax.train_lib import eval_step

    model = Transformer(model_config.replace(deterministic=True, decode=False))
    return jax.jit(functools.partial(eval_step, model=model, label_smoothing=label_smoothing))


def perplexity(params, model_config: ModelConfig, batches, *, label_smoothing: float = 0.0) -> dict:
    """Per-token (per-subword) loss, NLL, accuracy and perplexity of the references in ``batches``.

    Args:
      batches: ``data.EvalBatch`` items with int32[B, S] ``inputs`` and int32[B, T] ``targets``.
    """
    from transformer_jax.train_lib import accumulate_metrics, summarize

    fn = _eval_fn(model_config, float(label_smoothing))
    sums = None
    for b in batches:
        sums = accumulate_metrics(sums, fn(params, {"inputs": b.inputs, "targets": b.targets}))
    return summarize(sums)


def _in_split_order(batches, per_batch_items) -> list:
    """Reorders per-batch lists (bucketed order) back into the split's own line order."""
    indexed = [(int(i), item) for b, items in zip(batches, per_batch_items, strict=True)
               for i, item in zip(b.indices, items, strict=True)]
    return [item for _, item in sorted(indexed, key=lambda pair: pair[0])]


def translate(params, model_config: ModelConfig, tokenizer, batches, *, beam_size: int = 4,
              alpha: float = 0.6, max_extra_len: int = 50) -> list[str]:
    """Detokenized translations of every real row of ``batches``, in the split's line order.

    ``beam_size=1`` is greedy search; otherwise beam search with the GNMT length penalty ``alpha``.
    """
    per_batch = []
    for b in batches:
        if beam_size == 1:
            tokens = decode.greedy_search(params, model_config, b.inputs, max_extra_len=max_extra_len)
        else:
            tokens, _ = decode.beam_search(params, model_config, b.inputs, beam_size=beam_size,
                                           alpha=alpha, max_extra_len=max_extra_len)
        per_batch.append(tokenizer.decode_batch(np.asarray(tokens)[: b.num_real]))
    return _in_split_order(batches, per_batch)


def references_and_sources(batches) -> tuple[list[str], list[str]]:
    """The reference and source texts of ``batches``, in the split's line order."""
    return (_in_split_order(batches, [b.target_texts for b in batches]),
            _in_split_order(batches, [b.source_texts for b in batches]))


def translate_and_score(params, model_config: ModelConfig, tokenizer, batches, *,
                        beam_size: int = 4, alpha: float = 0.6, max_extra_len: int = 50,
                        target_lang: str = "de") -> dict[str, Any]:
    """Translations plus sacreBLEU and the paper's tokenized compound-split BLEU."""
    hypotheses = translate(params, model_config, tokenizer, batches, beam_size=beam_size,
                           alpha=alpha, max_extra_len=max_extra_len)
    references, sources = references_and_sources(batches)
    sacre = bleu.sacrebleu_score(hypotheses, references)
    tokenized = bleu.tokenized_bleu(hypotheses, references, target_lang)
    return {"sacrebleu": sacre.score, "sacrebleu_signature": sacre.signature,
            "tokenized_bleu": tokenized.score, "hypotheses": hypotheses,
            "references": references, "sources": sources}


def final_report(trainer, config) -> dict[str, Any]:
    """The end-of-training evaluation on ``config.final_eval_split`` with the paper's beam settings.

    For the synthetic task it also scores the two baselines (copy the source; word-by-word lexicon)
    so the printed BLEU has a yardstick.
    """
    from transformer_jax import data as data_lib

    split = config.final_eval_split
    batches = data_lib.make_eval_batches(config.data, trainer.tokenizer, split)
    ppl = perplexity(trainer.state.params, trainer.model_config, batches)
    scores = translate_and_score(
        trainer.state.params, trainer.model_config, trainer.tokenizer, batches,
        beam_size=config.final_beam_size, alpha=config.final_alpha,
        target_lang=getattr(config.data, "tgt_lang", "de"))
    report = {f"{split}_ppl": ppl["ppl"], f"{split}_sacrebleu": scores["sacrebleu"],
              f"{split}_tokenized_bleu": scores["tokenized_bleu"],
              "sacrebleu_signature": scores["sacrebleu_signature"]}
    if config.data.source == "synthetic":
        pairs = list(zip(scores["sources"], scores["references"], strict=True))
        for name, baseline in (("copy", data_lib.copy_baseline(pairs)),
                               ("lexicon", data_lib.lexicon_baseline(pairs, config.data.synthetic_seed))):
            report[f"{split}_sacrebleu_{name}_baseline"] = bleu.sacrebleu_score(
                baseline, scores["references"]).score
    for source, hypothesis, reference in list(zip(
            scores["sources"], scores["hypotheses"], scores["references"], strict=True))[:3]:
        print(f"  source:     {source}\n  hypothesis: {hypothesis}\n  reference:  {reference}")
    return report


@dataclasses.dataclass(frozen=True)
class Restored:
    """A trained model read back from a ``train.py`` workdir.

    Attributes:
      config: the run's ml_collections config.
      tokenizer: the run's SentencePiece tokenizer.
      model_config: the run's ModelConfig.
      params: the parameters.
      step: the checkpoint step.
      checkpoint_dir: where the checkpoints are (for averaging).
      abstract_state: the restore target (shapes and dtypes of the whole TrainState).
    """

    config: Any
    tokenizer: Any
    model_config: ModelConfig
    params: Any
    step: int
    checkpoint_dir: str
    abstract_state: Any


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """Reads the config, tokenizer and parameters of ``workdir`` (by default its latest good step)."""
    import os

    import ml_collections

    from transformer_jax import checkpoint as checkpoint_lib
    from transformer_jax import data as data_lib
    from transformer_jax import train_lib

    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), save_every_steps=None,
                                       save_every_minutes=None, read_only=True)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}; train first with train.py")
        config = ml_collections.ConfigDict(ckpt.restore_config(step))
        if not os.path.isdir(os.path.join(workdir, "tokenizer")):
            raise FileNotFoundError(f"no tokenizer in {workdir}/tokenizer; is {workdir} a train.py workdir?")
        tokenizer = data_lib.load_or_train_tokenizer(config.data, workdir)
        model_config = train_lib.model_config_from(config, tokenizer.vocab_size)
        target = train_lib.abstract_train_state(
            model_config, train_lib.make_optimizer(config, model_config.d_model))
        state, _, _, restored_step = ckpt.restore(target, step)
        return Restored(config, tokenizer, model_config, state.params, int(restored_step),
                        ckpt.directory, target)
    finally:
        ckpt.close()


def evaluate_workdir(workdir: str, *, step: int | None = None, average_last: int = 0,
                     split: str = "test", source_file: str | None = None,
                     reference_file: str | None = None, beam_size: int = 4, alpha: float = 0.6,
                     max_extra_len: int = 50) -> dict[str, Any]:
    """Restores a training workdir and scores it: PPL, sacreBLEU, tokenized BLEU, paper table.

    Writes the translations to ``<workdir>/eval/<split>-<step>.txt`` and the numbers to
    ``<workdir>/eval/<split>-<step>.json``; returns them with a markdown table beside the paper's row.

    Args:
      workdir: a directory written by ``train.py`` (checkpoints, tokenizer, config).
      step: the checkpoint to score; None for the latest good one.
      average_last: average the parameters of the last N checkpoints (ending at ``step``) first.
      split: "dev" or "test" of the run's data config; ignored when files are given.
      source_file, reference_file: score on these line-aligned files instead.
    """
    import json
    import os

    from transformer_jax import checkpoint as checkpoint_lib
    from transformer_jax import data as data_lib
    from transformer_jax import report

    restored = restore_workdir(workdir, step)
    config, tokenizer, model_config = restored.config, restored.tokenizer, restored.model_config
    params = restored.params
    if average_last > 1:
        steps = [s for s in checkpoint_lib.Checkpointer(
            restored.checkpoint_dir, save_every_steps=None, save_every_minutes=None,
            read_only=True).all_steps() if s <= restored.step]
        if len(steps) < average_last:
            raise ValueError(f"--average_last={average_last} needs {average_last} checkpoints up to step "
                             f"{restored.step} in {restored.checkpoint_dir}; found {len(steps)}: {steps}")
        params = checkpoint_lib.average_checkpoints(restored.checkpoint_dir, restored.abstract_state,
                                                    average_last, steps=steps[-average_last:])

    if source_file or reference_file:
        if not (source_file and reference_file):
            raise ValueError("--source_file and --reference_file go together; got only one")
        pairs = data_lib.read_parallel(source_file, reference_file)
        name = os.path.basename(source_file)
        split = "test" if "newstest2014" in name else "dev" if "newstest2013" in name else "files"
        batches = data_lib.make_eval_batches(config.data, tokenizer, split, pairs=pairs)
    else:
        batches = data_lib.make_eval_batches(config.data, tokenizer, split)
    ppl = perplexity(params, model_config, batches)
    scores = translate_and_score(params, model_config, tokenizer, batches, beam_size=beam_size,
                                 alpha=alpha, max_extra_len=max_extra_len,
                                 target_lang=config.data.tgt_lang)
    results = {
        "config": config.name, "split": split, "step": restored.step, "average_last": average_last,
        "beam_size": beam_size, "alpha": alpha, "num_sentences": len(scores["hypotheses"]),
        "ppl": ppl["ppl"], "nll": ppl["nll"], "sacrebleu": scores["sacrebleu"],
        "sacrebleu_signature": scores["sacrebleu_signature"],
        "tokenized_bleu": scores["tokenized_bleu"],
        "source_file": source_file, "reference_file": reference_file,
    }
    out_dir = os.path.join(workdir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{split}-{restored.step}")
    with open(stem + ".txt", "w") as f:
        f.writelines(h + "\n" for h in scores["hypotheses"])
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    table_split = split if split in ("dev", "test") else "test"
    results["table"] = report.paper_comparison_table(config.name, table_split, results)
    results["outputs"] = (stem + ".txt", stem + ".json")
    return results
