"""The embedded default: a small Transformer on the built-in synthetic translation task.

Runs with nothing but pip: no files, no network. `python train.py` trains it on 2 CPU cores in a few
minutes and prints its test BLEU beside two baselines (copying the source, word-by-word lexicon).
Every other config starts from this one and overrides what differs.
"""

import ml_collections

from transformer_jax.data.config import default_data_config


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "default"  # identifies the paper row to compare with in evaluate.py (none here)
    config.seed = 0  # parameter init, dropout and data order

    # Data: see transformer_jax/data/config.py for every field.
    config.data = default_data_config(
        source="synthetic",  # the embedded toy language pair
        vocab_size=1000,  # shared SentencePiece BPE vocabulary
        max_len=64,  # longest example, in tokens including EOS
        tokens_per_batch=2048,  # padded source (and target) tokens per global batch
        length_buckets=(16, 32, 48, 64),  # padded lengths: one compiled program each
    )

    # Model (paper names; see transformer_jax/model.py). 0 for d_k / d_v means d_model // num_heads.
    config.model = ml_collections.ConfigDict()
    config.model.d_model = 128  # model width
    config.model.d_ff = 512  # inner size of the position-wise feed-forward network
    config.model.num_heads = 4  # h
    config.model.d_k = 0  # query/key size per head (0: d_model // num_heads)
    config.model.d_v = 0  # value size per head (0: d_model // num_heads)
    config.model.num_encoder_layers = 3  # N for the encoder
    config.model.num_decoder_layers = 3  # N for the decoder
    config.model.dropout_rate = 0.1  # P_drop on sub-layer outputs and embedding sums
    config.model.attention_dropout_rate = 0.0  # not in the paper
    config.model.max_len = 256  # longest position: source, target, or decoded output (input + 50)
    config.model.position_encoding = "sinusoidal"  # or "learned" (Table 3 row E)
    config.model.norm_style = "post"  # "post" as in the paper, or "pre"
    config.model.attention_impl = "dense"  # or "blockwise" (memory-efficient, long sequences)
    config.model.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (params stay float32)
    config.model.attention_witness = False  # check every attention map at run time (slow; debugging)

    # Optimization (section 5.3): Adam and the warmup / inverse-square-root schedule.
    config.train = ml_collections.ConfigDict()
    config.train.num_steps = 1000  # total optimizer steps
    config.train.warmup_steps = 400  # paper: 4000
    # Multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): 0.5 peaks at 2.2e-3 here; at 2.0
    # this post-norm model stalls at ~33% token accuracy.
    config.train.learning_rate_scale = 0.5
    config.train.adam_b1 = 0.9  # paper: 0.9
    config.train.adam_b2 = 0.98  # paper: 0.98
    config.train.adam_eps = 1e-9  # paper: 1e-9
    config.train.label_smoothing = 0.1  # epsilon_ls (section 5.4)
    config.train.grad_accum_steps = 1  # micro-batches per update; each batch is split this many ways
    config.train.max_grad_norm = 0.0  # global norm clipping; 0 disables it (the paper does not clip)

    # Logging, evaluation and checkpoints.
    config.log_every_steps = 50  # host syncs only at these steps
    config.eval_every_steps = 500  # dev loss / PPL and dev BLEU
    config.eval_bleu_examples = 200  # dev sentences decoded for the periodic BLEU (greedy)
    config.final_eval_split = "test"  # split decoded and scored at the end ("" skips)
    config.final_beam_size = 4  # beam for the final evaluation (paper: 4)
    config.final_alpha = 0.6  # length penalty (paper: 0.6)
    config.checkpoint_every_steps = 500  # save every N steps (0: off)
    config.checkpoint_every_minutes = 10.0  # and every M minutes (paper averaged 10-minute checkpoints)
    config.checkpoint_keep = 5  # how many recent checkpoints to keep
    config.peak_tflops_per_device = 0.33  # for MFU: this 2-core CPU's measured f32 matmul peak
    config.profile_start_step = 0  # write a jax.profiler trace from this step (0: off)
    config.profile_num_steps = 5  # for this many steps

    # Sharding: a ('data', 'model') mesh; -1 fills the remaining devices.
    config.sharding = ml_collections.ConfigDict()
    config.sharding.mesh_shape = (-1, 1)  # (data, model)
    config.sharding.logical_axis_rules = (  # logical axis -> mesh axis (None: replicated)
        ("batch", "data"),
        ("length", None),
        ("embed", None),  # "data" here would be FSDP-style parameter sharding
        ("heads", "model"),
        ("kv", None),
        ("mlp", "model"),
        ("vocab", "model"),
    )
    return config
