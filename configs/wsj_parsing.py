"""Table 4: English constituency parsing on the WSJ part of the Penn Treebank (WSJ only: 91.3 F1).

    python train.py --config=configs/wsj_parsing.py \
        --config.data.dir=data/wsj --workdir=runs/wsj_parsing

Section 6.3 of the paper: a 4-layer Transformer with d_model 1024 trained on WSJ sections 02-21
(about 40k sentences), a 16k vocabulary, beam 21, alpha 0.3, maximum output length = input length
+ 300; everything else as the EN-DE base model. Figures come from `transformer_jax.evaluation.paper`. The
paper tuned dropout (attention and residual), learning rates and the beam size on section 22 but
does not give the tuned values, so those stay at the base model's. Bring WSJ from LDC (LDC99T42):
data.dir is its parsed/mrg/wsj folder (wsj/NN/wsj_NNNN.mrg); a flat folder of wsj_NNNN.mrg works too.
"""

from configs import default as default_lib
from transformer_jax.evaluation import paper


def get_config():
    config = default_lib.get_config()
    config.name = "wsj_parsing"  # evaluate.py compares it with the paper's Table 4

    config.data.source = "ptb"  # Penn Treebank .mrg files (transformer_jax/data/treebank.py)
    config.data.dir = "treebank_3/parsed/mrg/wsj"  # LDC's folder; override with --config.data.dir
    config.data.ptb_train_files = "02-21"  # WSJ sections: the standard split (~40k sentences)
    config.data.ptb_dev_files = "22"  # the paper's development set
    config.data.ptb_test_files = "23"  # Table 4 reports F1 on section 23
    # The words are the target's leaves and decoding copies them, so every tree has exactly the input as
    # its yield (as configs/ptb_sample.py; docs/parsing.md). tree_leaves="tags" with keep_pos_tags=False
    # gives the paper's linearization with XX placeholders (Vinyals & Kaiser et al., 2014).
    config.data.tree_leaves = "words"
    config.data.keep_pos_tags = False
    config.data.vocab_size = paper.PARSING_VOCAB_WSJ_ONLY  # 16k shared vocabulary (WSJ only)
    config.data.tokenizer_train_examples = 1_000_000  # all of WSJ's train sentences
    config.data.max_len = 512  # linearized trees: ~3 target tokens per word; longer pairs are dropped
    config.data.tokens_per_batch = paper.TOKENS_PER_BATCH  # ~25k source + 25k target tokens, as EN-DE base
    config.data.length_buckets = (32, 64, 96, 128, 160, 192, 256, 320, 384, 512)
    # A target is ~3x its source: batch pairs by both lengths, so sources are not padded to the target's.
    config.data.bucket_by_source = True

    config.model = default_lib.model_config(
        num_encoder_layers=paper.PARSING_NUM_LAYERS,  # 4 layers (encoder and decoder)
        num_decoder_layers=paper.PARSING_NUM_LAYERS,
        d_model=paper.PARSING_D_MODEL,  # 1024; d_ff, h and P_drop stay the base model's (2048, 8, 0.1)
    )
    # Positions cover the longest input plus the output allowance (input + 300).
    config.model.max_len = config.data.max_len + paper.PARSING_MAX_EXTRA_LEN

    config.train.num_steps = paper.BASE_TRAIN["num_steps"]  # the paper gives none for parsing: base's 100k
    config.train.warmup_steps = paper.WARMUP_STEPS  # 4000, as EN-DE base
    config.train.learning_rate_scale = 1.0  # the paper's schedule (it tuned the rate, value not given)
    config.train.label_smoothing = paper.BASE_TRAIN["label_smoothing"]  # 0.1, as EN-DE base

    config.final_eval_split = "test"  # section 23
    config.final_beam_size = paper.PARSING_BEAM_SIZE  # 21
    config.final_alpha = paper.PARSING_LENGTH_PENALTY_ALPHA  # 0.3
    config.final_max_extra_len = paper.PARSING_MAX_EXTRA_LEN  # longest output = input length + 300

    config.log_every_steps = 100
    config.eval_every_steps = 5000
    config.checkpoint_every_steps = 0  # by time, as the EN-DE base model
    config.checkpoint_every_minutes = 10.0
    config.checkpoint_keep = 20
    return config
