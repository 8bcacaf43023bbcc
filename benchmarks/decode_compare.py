"""Times evaluate.py's decoding (``scoring.translate`` on a split) in whichever tree PYTHONPATH picks.

    PYTHONPATH=TREE python benchmarks/decode_compare.py WORKDIR [SPLIT] [BEAM] [NUM] [OUT.txt]

Prints one JSON line: wall and process CPU seconds of the search (compilation included, as
evaluate.py's decode_seconds), sentences/s by each, and the Multi30k-convention BLEU of the outputs.
CPU seconds are the fairer figure on a machine shared with other jobs.
"""

import json
import sys
import time

import jax

from transformer_jax import data as data_lib
from transformer_jax.checkpoints.restore import restore_workdir
from transformer_jax.evaluation import bleu, scoring


def main(workdir, split="test", beam="5", num="0", out=None):
    restored = restore_workdir(workdir)
    config = restored.config
    max_length = restored.model_config.max_len - config.final_max_extra_len
    batches = data_lib.make_eval_batches(config.data, restored.tokenizer, split,
                                         max_examples=int(num) or None, max_length=max_length)
    wall, cpu = time.perf_counter(), time.process_time()
    hypotheses = scoring.translate(restored.params, restored.model_config, restored.tokenizer, batches,
                                   beam_size=int(beam), alpha=config.final_alpha,
                                   max_extra_len=config.final_max_extra_len)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    references, _ = scoring.references_and_sources(batches)
    score = bleu.score_all(hypotheses, references, config.data.tgt_lang)["multi30k"].score
    if out:
        with open(out, "w") as f:
            f.writelines(h + "\n" for h in hypotheses)
    n = len(hypotheses)
    print(json.dumps(dict(tree=scoring.__file__.split("/transformer_jax/")[0], split=split, beam=int(beam),
                          sentences=n, wall_s=round(wall, 2), cpu_s=round(cpu, 2),
                          sentences_per_wall_s=round(n / wall, 2), sentences_per_cpu_s=round(n / cpu, 2),
                          multi30k_bleu=round(score, 3), jax=jax.__version__)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
