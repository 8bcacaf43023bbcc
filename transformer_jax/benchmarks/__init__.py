"""Speed and memory benchmarks; each prints one JSON line per measurement (the preflight: readable lines).

    python -m transformer_jax.benchmarks              # the suite: peak, train step, decoding, attention
    python -m transformer_jax.benchmarks.train_step   # train-step tokens/s and MFU per preset
    python -m transformer_jax.benchmarks.decoding     # greedy / beam tokens/s, cache on and off
    python -m transformer_jax.benchmarks.attention    # dense vs blockwise attention memory and time
    python -m transformer_jax.benchmarks.data         # the data pipeline's starts, memory and batches/s
    python -m transformer_jax.benchmarks.preflight --config=configs/X.py  # what this device will do with X
    python -m transformer_jax.benchmarks.gpu_check    # a new GPU's first ten minutes: one table of numbers

Modules: ``presets`` (the model and run shapes, as ModelConfig overrides), ``timing`` (wall-clock
helpers and the matmul peak that MFU is measured against), one module per benchmark, ``__main__``.
"""
