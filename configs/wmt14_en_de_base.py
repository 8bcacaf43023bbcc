"""The paper's base model on WMT 2014 EN->DE (Table 2: 27.3 BLEU; Table 3 base: 4.92 PPL, 25.8 BLEU).

Every hyperparameter is the paper's (section 5 and Table 3): N=6, d_model=512, d_ff=2048, h=8,
P_drop=0.1, eps_ls=0.1, Adam(0.9, 0.98, 1e-9), warmup 4000, ~25k source + 25k target tokens per
step, 100k steps, a shared 37k BPE vocabulary, checkpoints every 10 minutes (the last 5 averaged).
Needs TFDS wmt14_translate prepared in data.tfds_data_dir (see docs/wmt.md).
"""

from configs import default as default_lib
from transformer_jax.evaluation import paper


def get_config():
    config = default_lib.get_config()
    config.name = "wmt14_en_de_base"
    config.data.source = "tfds"
    config.data.tfds_name = "wmt14_translate/de-en"
    config.data.src_lang = "en"
    config.data.tgt_lang = "de"
    config.data.vocab_size = paper.VOCAB_EN_DE  # shared BPE (section 5.1)
    config.data.tokenizer_train_examples = 2_000_000  # sentences sampled to train SentencePiece
    config.data.max_len = 256  # tensor2tensor's max_length at release
    config.data.tokens_per_batch = paper.TOKENS_PER_BATCH  # ~25k source and target tokens (section 5.1)
    config.data.length_buckets = (16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)

    config.model = default_lib.model_config()  # ModelConfig's defaults are the paper's base model
    # Positions cover the longest bucket plus the decoding allowance (input + 50), as evaluation needs.
    config.model.max_len = config.data.length_buckets[-1] + paper.MAX_EXTRA_LEN

    config.train.update(paper.BASE_TRAIN)  # label smoothing 0.1, 100k steps
    config.train.warmup_steps = paper.WARMUP_STEPS
    config.train.learning_rate_scale = 1.0  # the paper's schedule exactly

    config.log_every_steps = 100
    config.eval_every_steps = 5000
    config.eval_bleu_examples = 500
    config.dev_bleu_protocol = "tokenized"  # the paper's BLEU (Tables 2 and 3), newstest2013 being dev
    config.checkpoint_every_steps = 0  # by time instead, as the paper did
    config.checkpoint_every_minutes = 10.0
    config.checkpoint_keep = 20  # enough to average the last 5 (base) or 20 (big)
    config.final_average_last = paper.AVERAGE_LAST["base"]
    # 100k steps of 25k tokens: stop, in one line, rather than train on a CPU that JAX fell back to
    # (--config.platform=any to run it here anyway, e.g. shrunk by overrides).
    config.platform = "accelerator"
    return config
