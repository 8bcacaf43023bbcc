"""The embedded default: a small Transformer on the built-in synthetic translation task.

Runs with nothing but pip: no files, no network. `python train.py` trains it on 2 CPU cores in a few
minutes and prints its test BLEU beside two baselines (copying the source, word-by-word lexicon).
Every other config starts from this one and overrides what differs.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from transformer_jax.data.config import default_data_config
from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig


def model_config(**overrides) -> ml_collections.ConfigDict:
    """``config.model``: every settable ModelConfig field at its default (the paper's base), overridden.

    Fields whose default is None (``d_k``, ``d_v``: "derive it") become int
    placeholders, so ``--config.model.d_k=64`` still parses.
    """
    fields = ModelConfig.settable_defaults()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"{unknown} are not ModelConfig fields; expected some of {sorted(fields)}")
    fields.update(overrides)
    return ml_collections.ConfigDict(
        {name: config_dict.placeholder(int) if value is None else value for name, value in fields.items()})


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "default"  # identifies the paper row to compare with in evaluate.py (none here)
    config.seed = 0  # parameter init, dropout and data order

    # Data: see transformer_jax/data/config.py for every field.
    config.data = ml_collections.ConfigDict(dataclasses.asdict(default_data_config(
        source="synthetic",  # the embedded toy language pair
        vocab_size=1000,  # shared SentencePiece BPE vocabulary
        max_len=64,  # longest example, in tokens including EOS
        tokens_per_batch=2048,  # padded source (and target) tokens per global batch
        length_buckets=(16, 32, 48, 64),  # padded lengths: one compiled program each
    )))

    # Model: overrides of ModelConfig (transformer_jax/model/config.py documents every field; its defaults are
    # the paper's base model). config.model holds every ModelConfig field, so any can be set from here
    # or from the command line, e.g. --config.model.attention_impl=blockwise.
    config.model = model_config(
        d_model=128,  # model width
        d_ff=512,  # inner size of the position-wise feed-forward network
        num_heads=4,  # h
        num_encoder_layers=3,  # N for the encoder
        num_decoder_layers=3,  # N for the decoder
        # flax's default axes on the head-split attention kernels: attention starts near uniform. On this
        # 1000-step task the matrices' own fans lose 5 dev BLEU over 3 seeds (docs/translation.md).
        attention_init="narrow",
    )

    # Optimization (section 5.3): Adam and the warmup / inverse-square-root schedule.
    config.train = ml_collections.ConfigDict()
    config.train.num_steps = 1000  # total optimizer steps
    config.train.warmup_steps = 400  # paper: 4000
    # Multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): 0.5 peaks at 2.2e-3 here; at 2.0
    # this post-norm model stalls at ~33% token accuracy.
    config.train.learning_rate_scale = 0.5
    # > 0: the last cooldown_steps updates also ramp the rate linearly down to 0 (not in the paper).
    config.train.cooldown_steps = 0
    config.train.adam_b1 = paper.ADAM["b1"]  # 0.9
    config.train.adam_b2 = paper.ADAM["b2"]  # 0.98
    config.train.adam_eps = paper.ADAM["eps"]  # 1e-9
    config.train.label_smoothing = paper.BASE_TRAIN["label_smoothing"]  # epsilon_ls 0.1 (section 5.4)
    config.train.grad_accum_steps = 1  # micro-batches per update; each batch is split this many ways
    config.train.max_grad_norm = 0.0  # global norm clipping; 0 disables it (the paper does not clip)
    # > 0: the loss forms the logits of at most this many target tokens at a time (same loss and gradients,
    # less memory: docs/wmt.md); 0 forms a whole micro-batch's [tokens, vocab] logits at once.
    config.train.loss_chunk_tokens = 0

    # Logging, evaluation and checkpoints.
    config.log_every_steps = 50  # host syncs only at these steps
    config.eval_every_steps = 500  # dev loss / PPL and dev BLEU
    config.eval_bleu_examples = 200  # dev sentences decoded for the periodic BLEU (greedy)
    config.dev_bleu_protocol = "sacrebleu"  # periodic dev BLEU: "sacrebleu", "tokenized" or "multi30k"
    config.final_eval_split = "test"  # split decoded and scored at the end ("" skips)
    config.final_beam_size = paper.BEAM_SIZE  # beam for the final evaluation
    config.final_alpha = paper.LENGTH_PENALTY_ALPHA  # GNMT length penalty
    config.final_max_extra_len = paper.MAX_EXTRA_LEN  # longest output = input length + this
    config.final_average_last = 1  # score the mean of the newest N checkpoints (paper: 5 base, 20 big)
    config.checkpoint_every_steps = 500  # save every N steps (0: off)
    config.checkpoint_every_minutes = 10.0  # and every M minutes (paper averaged 10-minute checkpoints)
    config.checkpoint_keep = 5  # how many recent checkpoints to keep
    config.peak_tflops_per_device = 0.0  # MFU denominator; 0: measure this device's matmul peak at start-up
    config.profile_start_step = 0  # write a jax.profiler trace from this step (0: off)
    config.profile_num_steps = 5  # for this many steps
    # The device train.py must find before it starts: "any" (the CPU too), "accelerator" (GPU or TPU),
    # "gpu" or "tpu". Anything but "any" stops a run that JAX would silently put on the CPU.
    config.platform = "any"

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
