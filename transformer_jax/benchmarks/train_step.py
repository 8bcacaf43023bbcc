"""Train-step throughput and MFU per preset, one JSON line each.

    python -m transformer_jax.benchmarks.train_step [--presets=tiny,base,big] [--dtype=bfloat16]

The step is the full one: dropout forward, label-smoothed loss, gradients, Adam update, donated state.
Throughput is non-pad target tokens per second of the median step (the batch is random tokens without
padding, so that is batch x length). FLOPs come from XLA's cost analysis of the compiled step, with the
analytic matmul count of ``flops.py`` beside them; MFU divides by the best run of the matmul peak
(``transformer_jax.runtime.timing.matmul_peak``), and the record carries that peak. The ``big`` preset is too
slow to time on a CPU, so there it reports FLOPs only.
"""

from __future__ import annotations

import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from transformer_jax.benchmarks import presets
from transformer_jax.evaluation import paper
from transformer_jax.model import flops
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.model.transformer import init_params
from transformer_jax.runtime import errors, sharding, timing
from transformer_jax.training import steps
from transformer_jax.training.train_state import TrainState

DTYPES = ("float32", "bfloat16")


def default_dtype() -> str:
    """float32 on CPU, bfloat16 on an accelerator."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-4, **paper.ADAM)  # the rate does not change the step's cost


def fresh_state(cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """A TrainState at step 0 on the default device (parameters from ``init_params``, seed 0)."""
    params = init_params(cfg, rng=jax.random.key(0))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.PRNGKey(0))


def one_device_step(cfg: ModelConfig, tx: optax.GradientTransformation, *,
                    label_smoothing: float = paper.BASE_TRAIN["label_smoothing"],
                    grad_accum_steps: int = 1, loss_chunk_tokens: int = 0) -> steps.TrainStepFn:
    """The library's compiled, donated train step on a 1x1 mesh (MFU is per device)."""
    mesh = sharding.make_mesh((1, 1), jax.devices()[:1])
    replicated = NamedSharding(mesh, PartitionSpec())
    return steps.make_train_step(cfg, tx, mesh, (), replicated, label_smoothing=label_smoothing,
                                 grad_accum_steps=grad_accum_steps, loss_chunk_tokens=loss_chunk_tokens)


def _param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def bench_train_step(name: str, preset: presets.TrainPreset, peak: timing.Peak | None, *, dtype: str,
                     repeats: int) -> dict:
    """Times one preset's train step (or, with ``peak=None``, only counts its FLOPs); returns the record.

    The batch is {"inputs", "targets"}: int32[batch, length] random ids >= 4 (no padding).
    """
    cfg = presets.model_config(preset.model, dtype=dtype)
    batch, length = preset.batch, preset.length
    tx = _optimizer()
    step = one_device_step(cfg, tx)
    rng = np.random.default_rng(0)
    data = {k: jnp.asarray(rng.integers(PAD_ID + 4, cfg.vocab_size, size=(batch, length)), jnp.int32)
            for k in ("inputs", "targets")}
    analytic = flops.train_step_flops(cfg, batch, length, length)
    common = dict(batch=batch, length=length, analytic_gflop=round(analytic / 1e9, 3),
                  jax=jax.__version__, backend=jax.default_backend())
    if peak is None:
        state = jax.eval_shape(lambda: fresh_state(cfg, tx))
        xla = step.lower(state, data).compile().cost_analysis()["flops"]
        return dict(preset=name, measured="train_step_flops_only", xla_gflop=round(xla / 1e9, 3),
                    xla_over_analytic=round(xla / analytic, 3), params=_param_count(state.params), **common)
    state = fresh_state(cfg, tx)
    compiled = step.lower(state, data).compile()
    xla = compiled.cost_analysis()["flops"]
    holder = {"state": state}

    def run():
        holder["state"], sums = compiled(holder["state"], data)
        return sums

    run()  # warm-up
    times = timing.time_calls(run, repeats)
    seconds = statistics.median(times)
    target_tokens = int(np.sum(np.asarray(data["targets"]) != PAD_ID))
    return dict(preset=name, measured=f"train_step_{dtype}", median_s=round(seconds, 5),
                best_s=round(min(times), 5), target_tokens_per_s=round(target_tokens / seconds, 1),
                **timing.mfu_fields(xla, seconds, peak),
                xla_over_analytic=round(xla / analytic, 3), params=_param_count(holder["state"].params),
                **common)


def run(names: list[str], peak: timing.Peak, *, dtype: str, repeats: int) -> list[dict]:
    """Benchmarks the named presets (``big`` on a CPU: FLOPs only); prints and returns the records."""
    records = []
    for name in names:
        flops_only = name == "big" and jax.default_backend() == "cpu"
        record = bench_train_step(name, presets.TRAIN_PRESETS[name], None if flops_only else peak,
                                  dtype=dtype, repeats=repeats)
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.train_step``."""
    flags.DEFINE_list("presets", list(presets.TRAIN_PRESETS),
                      f"Comma-separated train presets to run, of {list(presets.TRAIN_PRESETS)} "
                      "(see transformer_jax/benchmarks/presets.py; 'big' counts FLOPs only on a CPU).",
                      flag_values=flag_values)
    flags.DEFINE_enum("dtype", None, DTYPES,
                      "Compute dtype of the model (parameters stay float32). Default: float32 on CPU, "
                      "bfloat16 on an accelerator.", flag_values=flag_values)
    flags.DEFINE_integer("repeats", 10, "Timed steps per preset, after one warm-up step; the median is "
                         "reported.", flag_values=flag_values)
    flags.DEFINE_integer("peak_repeats", 20, "Timed runs of the matmul peak; MFU divides by the "
                         "best of them.", flag_values=flag_values)


def main(argv: list[str]) -> None:
    values = flags.FLAGS
    names = presets.check_names(values.presets, presets.TRAIN_PRESETS, "--presets")
    peak = timing.matmul_peak(values.peak_repeats)
    print(json.dumps(peak.record()), flush=True)
    run(names, peak, dtype=values.dtype or default_dtype(), repeats=values.repeats)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
