"""Benchmark suite: train-step MFU, cached decoding and attention memory, one JSON line each.

    python -m transformer_jax.benchmark [--presets tiny base big] [--skip_decode] [--skip_attention]

The yardstick is the hardware's own limit measured in the same run: a jitted 2048^3 matmul (float32
on CPU, bfloat16 on an accelerator), median of 10. MFU = achieved FLOP/s / that peak. FLOPs come from
XLA's cost analysis of the compiled step and are checked against the analytic count in ``flops.py``.

Presets:
  tiny: vocab 8000, d_model 256, d_ff 1024, 4 heads, 3+3 layers, batch 64 x 32 source/target tokens.
  base: the paper's base model, vocab 32000, batch 16 x 64.
  big:  the paper's big model; FLOP count only on CPU (too slow to time there).

Decoding (tiny preset): 16 sources of length 32, 32 new tokens, greedy and beam 4, cache on. XLA
counts a while-loop body once, so decode FLOPs are the analytic per-token count times the steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import decode, flops, train_lib
from transformer_jax.model import ModelConfig, Transformer, init_params

PRESETS = {
    "tiny": dict(model=dict(vocab_size=8000, d_model=256, d_ff=1024, num_heads=4,
                            num_encoder_layers=3, num_decoder_layers=3), batch=64, length=32),
    "base": dict(model=dict(vocab_size=32000, d_model=512, d_ff=2048, num_heads=8,
                            num_encoder_layers=6, num_decoder_layers=6), batch=16, length=64),
    "big": dict(model=dict(vocab_size=32000, d_model=1024, d_ff=4096, num_heads=16,
                           num_encoder_layers=6, num_decoder_layers=6, dropout_rate=0.3),
                batch=16, length=64),
}


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(repeats: int = 10) -> tuple[float, str]:
    """FLOP/s of a jitted 2048^3 matmul on the default device, and its dtype."""
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    return 2 * n**3 / _median_seconds(lambda: matmul(a, b), repeats), jnp.dtype(dtype).name


def _record(preset, measured, seconds, tokens, gflop, peak, **extra) -> dict:
    return dict(preset=preset, measured=measured, median_s=round(seconds, 5),
                tokens_per_s=round(tokens / seconds, 1), gflop=round(gflop, 3),
                mfu=round(gflop * 1e9 / seconds / peak, 4), peak_gflops=round(peak / 1e9, 1),
                jax=jax.__version__, backend=jax.default_backend(), **extra)


def bench_train_step(preset: str, peak: float, *, dtype: str, repeats: int, time_it: bool = True):
    """The full train step: dropout forward, label-smoothed loss, grad, Adam update, donated state."""
    spec = PRESETS[preset]
    cfg = ModelConfig(**{"dropout_rate": 0.1, **spec["model"]}, max_len=256, dtype=dtype)
    batch, length = spec["batch"], spec["length"]
    tx = optax.adam(1e-4, b1=0.9, b2=0.98, eps=1e-9)
    step = jax.jit(functools.partial(train_lib.train_step, model=Transformer(cfg), tx=tx,
                                     label_smoothing=0.1), donate_argnums=0)
    rng = np.random.default_rng(0)
    data = {k: jnp.asarray(rng.integers(4, cfg.vocab_size, size=(batch, length)), jnp.int32)
            for k in ("inputs", "targets")}
    analytic = flops.train_step_flops(cfg, batch, length, length) / 1e9
    if not time_it:
        state = jax.eval_shape(lambda: _fresh_state(cfg, tx))
        xla = step.lower(state, data).compile().cost_analysis()["flops"] / 1e9
        return dict(preset=preset, measured="train_step_flops_only", xla_gflop=round(xla, 2),
                    analytic_gflop=round(analytic, 2), jax=jax.__version__, params=_count(state))
    state = _fresh_state(cfg, tx)
    compiled = step.lower(state, data).compile()
    xla = compiled.cost_analysis()["flops"] / 1e9
    holder = {"state": state}

    def run():
        holder["state"], sums = compiled(holder["state"], data)
        return sums

    run()  # warm-up
    seconds = _median_seconds(run, repeats)
    return _record(preset, f"train_step_{dtype}", seconds, batch * length, xla, peak,
                   analytic_gflop=round(analytic, 3), xla_over_analytic=round(xla / analytic, 3),
                   batch=batch, length=length, params=_count(holder["state"]))


def _fresh_state(cfg, tx):
    params = init_params(cfg, rng=jax.random.key(0))
    return train_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                                rng=jax.random.PRNGKey(0))


def _count(state) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))


def bench_decode(peak: float, *, repeats: int, batch: int = 16, src_len: int = 32, new_tokens: int = 32):
    """Cached greedy and beam-4 decoding on the tiny preset, in generated tokens/s (best beam)."""
    cfg = ModelConfig(**PRESETS["tiny"]["model"], max_len=256, deterministic=True)
    params = init_params(cfg, rng=jax.random.key(0))
    inputs = np.random.default_rng(0).integers(4, cfg.vocab_size, size=(batch, src_len)).astype(np.int32)
    records = []
    for name, beam in (("greedy", 1), ("beam4", 4)):
        if beam == 1:
            run = lambda: decode.greedy_search(params, cfg, inputs, max_len=new_tokens, min_len=new_tokens)
        else:
            run = functools.partial(lambda b: decode.beam_search(
                params, cfg, inputs, beam_size=b, max_len=new_tokens, min_len=new_tokens)[0], beam)
        jax.block_until_ready(run())  # compile
        seconds = _median_seconds(run, repeats)
        gflop = flops.decode_flops(cfg, batch, src_len, new_tokens, beam_size=beam,
                                   cache_len=new_tokens) / 1e9
        records.append(_record("tiny", f"decode_{name}_cached", seconds, batch * new_tokens, gflop, peak,
                               batch=batch, src_len=src_len, new_tokens=new_tokens))
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "base", "big"], choices=list(PRESETS))
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: f32 on CPU, else bf16)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip_decode", action="store_true")
    parser.add_argument("--skip_attention", action="store_true")
    parser.add_argument("--attention_lengths", default="256,512,1024,2048,4096,8192")
    args = parser.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    peak, peak_dtype = matmul_peak()
    print(json.dumps(dict(measured="matmul_peak_2048", dtype=peak_dtype, peak_gflops=round(peak / 1e9, 1),
                          jax=jax.__version__, backend=jax.default_backend())), flush=True)
    for preset in args.presets:
        time_it = not (preset == "big" and on_cpu)
        print(json.dumps(bench_train_step(preset, peak, dtype=dtype, repeats=args.repeats,
                                          time_it=time_it)), flush=True)
    if not args.skip_decode:
        for record in bench_decode(peak, repeats=args.repeats):
            print(json.dumps(record), flush=True)
    if not args.skip_attention:
        from transformer_jax import attention_benchmark

        attention_benchmark.run([int(n) for n in args.attention_lengths.split(",")], block_size=512,
                                skip_timing=False, max_dense_seconds=30.0)


if __name__ == "__main__":
    main()
