"""Multi30k EN->DE at the published small Transformer's budget: the side-by-side with the 41.0 anchor.

    python -m transformer_jax.data.prepare multi30k --dir=data/multi30k
    python train.py --config=configs/multi30k_anchor.py --config.data.dir=data/multi30k --workdir=runs/anchor

The anchor (docs/multi30k.md; fairseq, LividWo/Revisit-MMT ``transformer_tiny``) trained the hour
recipe's model (4+4 layers, d_model 128, FFN 256, 4 heads, dropout 0.3) on lowercased, Moses-tokenized
text with a joint BPE of 10k merges, for 8,000 updates of 2 x 4,096 tokens (about 65M tokens, 2.8x the
hour recipe's), Adam (0.9, 0.98) at lr 0.005 with 2,000 warmup steps and an inverse-square-root decay,
label smoothing 0.1 and clip-norm 25, and scored the average of its last 10 epoch checkpoints with beam
5. This config takes each of those, on this codebase's pre-norm model, and scores test2016 41.02 in the
Multi30k convention (seed 0; docs/multi30k.md). It is an accelerator run: on 2 CPU cores its 8,000 updates
of 8,192 tokens took 1 h 45 min (0.77 s an update; 1.1 s on a slower day); it resumes from its latest
checkpoint when rerun with the same --workdir.
"""

from configs import multi30k as multi30k_lib


def get_config():
    config = multi30k_lib.get_config()
    config.name = "multi30k_anchor"
    config.data.text_form = "moses_lc"  # the anchor's text: lowercased, Moses-normalized and tokenized
    config.data.vocab_size = 10000  # its joint BPE: 10k merges
    config.data.tokens_per_batch = 8192  # 2 GPUs x 4,096 tokens

    config.train.num_steps = 8000
    config.train.warmup_steps = 2000
    config.train.cooldown_steps = 0  # inverse square root to the end, as the anchor
    # peak 2.53 * 128^-0.5 * 2000^-0.5 = 5.0e-3, the anchor's lr, reached at the end of warmup
    config.train.learning_rate_scale = 2.53
    config.train.max_grad_norm = 25.0

    # An epoch of the 29k pairs is 73 batches of 8,192 tokens here: the final model is the mean of the
    # last 10 checkpoints, 80 updates apart, as the anchor averaged its last 10 epochs.
    config.eval_every_steps = 2000
    config.checkpoint_every_steps = 80
    config.checkpoint_keep = 10
    config.final_average_last = 10
    return config
