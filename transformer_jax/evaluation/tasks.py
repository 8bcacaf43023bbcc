"""The task a run trains for, chosen once from its data config: translation (BLEU) or parsing (F1).

A task gives the two evaluations the training loop runs and the one evaluate.py runs, so neither
branches on the task:

    task = task_for(data_config)
    task.dev_scores(params, ...)        # periodic dev evaluation: greedy BLEU, or greedy bracket F1
    task.final_report(params, ...)      # end of training, on eval.final_eval_split: BLEU or F1 and Table 4
    task.evaluate_restored(restored, ...)  # evaluate.py: (outputs, numbers, table) to write

The first two return flat ``{name: number}`` dicts that the loop logs and ``paper_tables.final_summary``
prints.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from transformer_jax import data as data_lib
from transformer_jax.data.config import DataConfig
from transformer_jax.evaluation import bleu, evalb, parsing, scoring
from transformer_jax.model.config import ModelConfig
from transformer_jax.run_config import EvalConfig

# A BLEU protocol -> its name in by-length tables and plots.
BLEU_NAMES = {"sacrebleu": "sacreBLEU", "tokenized": "tok. BLEU", "multi30k": "M30k BLEU"}


class Task(Protocol):
    name: str
    engines: tuple[str, ...]  # the decoders evaluate.py may use (``translation.ENGINES``)

    def dev_scores(self, params: Any, model_config: ModelConfig, tokenizer: data_lib.Tokenizer,
                   data: DataConfig, eval_config: EvalConfig, batches: list) -> dict[str, float]:
        """Greedy scores on ``batches`` (a sample of the dev split)."""

    def final_report(self, params: Any, model_config: ModelConfig, tokenizer: data_lib.Tokenizer,
                     data: DataConfig, eval_config: EvalConfig, batches: list, *, split: str,
                     run_name: str) -> dict[str, Any]:
        """Scores on ``batches`` of ``split`` with the final beam settings, keyed ``{split}_<measure>``."""

    def evaluate_restored(self, restored: Any, params: Any, batches: list, ppl: dict,
                          **settings: Any) -> tuple[list[str], dict[str, Any], str]:
        """evaluate.py's (output lines, numbers, markdown table) of a restored workdir
        (``scoring.evaluate_restored``)."""

    def length_scorer(self, data: DataConfig, eval_config: EvalConfig, split: str, batches: list
                      ) -> tuple[str, list, Any]:
        """(the measure's name, the references in split order, ``scorer(outputs, references) -> float``):
        the corpus score of a subset of the outputs, for ``evaluate.py --by_length``."""


@dataclasses.dataclass(frozen=True)
class TranslationTask:
    name: str = "translation"
    engines: tuple[str, ...] = ("jax", "ctranslate2")

    def dev_scores(self, params, model_config, tokenizer, data, eval_config, batches):
        scores = scoring.translate_and_score(
            params, model_config, tokenizer, batches, beam_size=1,
            max_extra_len=eval_config.final_max_extra_len, target_lang=data.tgt_lang)
        return {"dev_bleu": scores[scoring.BLEU_KEYS[eval_config.dev_bleu_protocol]]}

    def final_report(self, params, model_config, tokenizer, data, eval_config, batches, *, split,
                     run_name):
        """sacreBLEU, the paper's tokenized BLEU and the Multi30k convention; the synthetic task's
        baselines (copy the source; word-by-word lexicon) beside them. Prints three translations."""
        scores = scoring.translate_and_score(
            params, model_config, tokenizer, batches, beam_size=eval_config.final_beam_size,
            alpha=eval_config.final_alpha, max_extra_len=eval_config.final_max_extra_len,
            target_lang=data.tgt_lang)
        results = {f"{split}_sacrebleu": scores["sacrebleu"],
                   f"{split}_tokenized_bleu": scores["tokenized_bleu"],
                   f"{split}_multi30k_bleu": scores["multi30k_bleu"],
                   "sacrebleu_signature": scores["sacrebleu_signature"]}
        if data.source == "synthetic":
            pairs = list(zip(scores["sources"], scores["references"], strict=True))
            for name, baseline in (("copy", data_lib.copy_baseline(pairs)),
                                   ("lexicon", data_lib.lexicon_baseline(pairs, data.synthetic_seed))):
                results[f"{split}_sacrebleu_{name}_baseline"] = bleu.sacrebleu_score(
                    baseline, scores["references"]).score
        for source, hypothesis, reference in list(zip(
                scores["sources"], scores["hypotheses"], scores["references"], strict=True))[:3]:
            print(f"  source:     {source}\n  hypothesis: {hypothesis}\n  reference:  {reference}")
        return results


    def evaluate_restored(self, restored, params, batches, ppl, **settings):
        return scoring.evaluate_restored(restored, params, batches, ppl, **settings)

    def length_scorer(self, data, eval_config, split, batches):
        """The run's dev_bleu_protocol, on the detokenized outputs and the raw references."""
        protocol = eval_config.dev_bleu_protocol
        references, _ = scoring.references_and_sources(batches)

        def scorer(hypotheses, refs):
            return bleu.score_all(hypotheses, refs, data.tgt_lang, protocols=(protocol,))[protocol].score

        return BLEU_NAMES[protocol], references, scorer


@dataclasses.dataclass(frozen=True)
class ParsingTask:
    name: str = "parsing"
    engines: tuple[str, ...] = ("jax",)  # the tree constraint is JAX's

    def dev_scores(self, params, model_config, tokenizer, data, eval_config, batches):
        return parsing.dev_scores(params, model_config, tokenizer, data, batches,
                                  max_extra_len=eval_config.final_max_extra_len)

    def final_report(self, params, model_config, tokenizer, data, eval_config, batches, *, split,
                     run_name):
        """EVALB F1, precision, recall, exact match, repairs and right-branching; prints Table 4."""
        return parsing.final_report(
            params, model_config, tokenizer, data, batches, split=split,
            beam_size=eval_config.final_beam_size, alpha=eval_config.final_alpha,
            max_extra_len=eval_config.final_max_extra_len, config_name=run_name)


    def evaluate_restored(self, restored, params, batches, ppl, *, decode_fn=None, engine="jax",
                          engine_info=None, reference_file=None, **settings):
        del decode_fn, engine, engine_info, reference_file  # JAX's tree-constrained search; no files
        return parsing.evaluate_restored(restored, params, batches, ppl, **settings)

    def length_scorer(self, data, eval_config, split, batches):
        """EVALB F1 of the outputs (repaired as ``parsing.score_batches`` does) against the gold trees."""
        trees = data_lib.get_source(data).trees(split)
        gold = [trees[i] for i in sorted(int(i) for b in batches for i in b.indices)]

        def scorer(outputs, gold_trees):
            return evalb.score_outputs(outputs, gold_trees, word_leaves=data.tree_leaves == "words")["f1"]

        return "F1", gold, scorer


def task_for(data: DataConfig) -> Task:
    """The task of a data config: parsing for treebank sources, translation otherwise."""
    return ParsingTask() if data_lib.is_parsing(data) else TranslationTask()
