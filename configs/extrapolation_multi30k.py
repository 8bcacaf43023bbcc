"""Length extrapolation on Multi30k EN->DE: train on the short pairs only, score test2016 by source length.

    python -m transformer_jax.data.prepare multi30k --dir=data/multi30k  # once
    python train.py --config=configs/extrapolation_multi30k.py --config.data.dir=data/multi30k \\
        --config.model.position_encoding=rotary --workdir=runs/extrapolation_m30k/rotary-0
    python evaluate.py --workdir=runs/extrapolation_m30k/rotary-0 --by_length --length_buckets=16,24,32

Training keeps the pairs of at most 16 tokens a side (``data.max_len``, about 12 words); val and test keep
every length, so test2016's longest sentences (up to 32 words, about 40 tokens) are 2-3x beyond training.
The model is configs/multi30k.py's with 2+2 layers, trained for a ninth of its updates, to fit the grid of
schemes on a CPU.
docs/positions.md has the results.
"""

from configs import multi30k as multi30k_lib


def get_config():
    config = multi30k_lib.get_config()
    config.name = "extrapolation_multi30k"
    config.data.max_len = 16  # train pairs longer than this (either side, EOS included) are dropped
    config.data.length_buckets = (8, 16)  # the training batches' padded lengths
    config.model.max_len = 128  # the learned table's rows (no other scheme has a table)
    # Half the layers and a ninth of configs/multi30k.py's updates, so that the grid of schemes fits a CPU.
    config.model.num_encoder_layers = 2
    config.model.num_decoder_layers = 2
    config.train.num_steps = 600
    config.train.warmup_steps = 300
    config.train.cooldown_steps = 200
    config.eval_every_steps = 600  # dev BLEU once, at the end
    config.checkpoint_every_steps = 300
    config.final_average_last = 1
    config.final_eval_split = ""  # test is scored by length: evaluate.py --by_length
    config.final_max_extra_len = 20
    return config
