"""Length extrapolation on the synthetic task: train on short pairs, score test sentences up to 3x longer.

Section 3.5 of the paper chose the sinusoid because it "may allow the model to extrapolate to sequence lengths
longer than the ones encountered during training". This config measures that for every position scheme:

    python train.py --config=configs/extrapolation.py --config.model.position_encoding=rotary \\
        --config.seed=1 --workdir=runs/extrapolation/rotary-1
    python evaluate.py --workdir=runs/extrapolation/rotary-1 --by_length

Training keeps the pairs of at most 16 tokens a side (``data.max_len``; about 11 words); the test split is the
stream's first 800 sentences of 8 words or more, up to 40 words (about 50 tokens): a third of it is
within the training lengths, the rest up to 3x beyond. ``model.max_len`` sizes the learned table only (every
other scheme takes any length): it has rows up to 128, of which training reaches the first 16.
docs/positions.md has the results.
"""

from configs import default as default_lib


def get_config():
    config = default_lib.get_config()
    config.name = "extrapolation"
    config.data.max_len = 16  # train pairs longer than this (either side, EOS included) are dropped
    config.data.length_buckets = (8, 16)  # the training batches' padded lengths
    config.data.synthetic_test_size = 800
    config.data.synthetic_test_min_words = 8  # the test split: sentences of 8 to 40 words
    config.data.tokens_per_batch = 1024
    # A smaller model than the default's, so that 6 schemes x 3 seeds fit under an hour on 2 cores.
    config.model.d_model = 64
    config.model.d_ff = 256
    config.model.num_encoder_layers = 2
    config.model.num_decoder_layers = 2
    config.model.max_len = 128  # the learned table's rows (no other scheme has a table)
    config.train.num_steps = 800
    config.train.warmup_steps = 300
    config.train.learning_rate_scale = 1.0
    config.eval_every_steps = 800  # dev BLEU once, at the end
    config.final_eval_split = ""  # test is scored by length: evaluate.py --by_length
    config.final_max_extra_len = 20  # outputs up to the source length + 20 tokens
    return config
