"""The train-step memory estimate (``training/memory.py``) beside XLA's own count, one JSON line per case.

    python -m transformer_jax.benchmarks.memory [--cases=tiny_8k,tiny_37k,...]

Each case compiles the library's train step (``steps.make_train_step``, one device) for abstract
arguments, so nothing is allocated: the paper's 25k-token batch with a 37k vocabulary is measured on a
small host too. XLA's peak is the compiled program's arguments + outputs - donated (aliased) outputs +
its temporary buffers (``memory_analysis()``); on a CPU that matches the process's resident growth when
the step runs. ``ratio`` is the estimate over that peak.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.runtime import errors, sharding
from transformer_jax.training import memory, steps
from transformer_jax.training.train_state import TrainState

_TINY = dict(d_model=64, d_ff=256, num_heads=4, num_encoder_layers=1, num_decoder_layers=1)
_SMALL_BASE = dict(d_model=512, d_ff=2048, num_heads=8, num_encoder_layers=2, num_decoder_layers=2)


@dataclasses.dataclass(frozen=True)
class Case:
    model: dict  # ModelConfig fields
    rows: int
    length: int  # source and target
    grad_accum_steps: int = 1
    loss_chunk_tokens: int = 0


CASES = {
    "tiny_8k": Case(dict(_TINY, vocab_size=8000), rows=64, length=64),
    "tiny_37k": Case(dict(_TINY, vocab_size=37000), rows=64, length=64),
    "tiny_37k_accum2": Case(dict(_TINY, vocab_size=37000), rows=64, length=64, grad_accum_steps=2),
    "tiny_37k_chunks": Case(dict(_TINY, vocab_size=37000), rows=64, length=64, loss_chunk_tokens=512),
    "small_base": Case(dict(_SMALL_BASE, vocab_size=4000), rows=16, length=32),
    "small_base_blockwise": Case(dict(_SMALL_BASE, vocab_size=4000, attention_impl="blockwise",
                                      attention_block_size=64), rows=8, length=256),
    # The paper's batch (~25k tokens, a 37k vocabulary) with the tiny model, at the longest bucket.
    "paper_batch_tiny": Case(dict(_TINY, vocab_size=37000), rows=97, length=256),
    "paper_batch_tiny_chunks": Case(dict(_TINY, vocab_size=37000), rows=97, length=256,
                                    loss_chunk_tokens=4096),
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.memory``."""
    flags.DEFINE_list("cases", list(CASES), f"Comma-separated cases to compile and count, of {list(CASES)}.",
                      flag_values=flag_values)


def xla_peak(case: Case) -> int:
    """Bytes of the compiled step: arguments + outputs - aliased outputs + temporaries."""
    cfg = ModelConfig(**case.model)
    tx = optax.adam(1e-4, **paper.ADAM)
    params = jax.eval_shape(lambda key: init_params(cfg, rng=key), jax.random.key(0))
    state = jax.eval_shape(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                                                rng=jax.random.PRNGKey(0)), params)
    mesh = sharding.make_mesh((1, 1), jax.devices()[:1])
    step = steps.make_train_step(cfg, tx, mesh, (), NamedSharding(mesh, PartitionSpec()),
                                 label_smoothing=paper.BASE_TRAIN["label_smoothing"],
                                 grad_accum_steps=case.grad_accum_steps,
                                 loss_chunk_tokens=case.loss_chunk_tokens)
    batch = {k: jax.ShapeDtypeStruct((case.rows, case.length), jnp.int32) for k in ("inputs", "targets")}
    m = step.lower(state, batch).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def run_case(name: str) -> dict:
    case = CASES[name]
    estimate = memory.train_step_memory(
        ModelConfig(**case.model), rows=case.rows, src_len=case.length, tgt_len=case.length,
        grad_accum_steps=case.grad_accum_steps, loss_chunk_tokens=case.loss_chunk_tokens,
        platform=jax.default_backend())
    peak = xla_peak(case)
    gib = lambda n: round(n / memory.GIB, 4)  # noqa: E731
    return {"case": name, "rows": case.rows, "length": case.length, "grad_accum_steps": case.grad_accum_steps,
            "loss_chunk_tokens": case.loss_chunk_tokens, "vocab": case.model["vocab_size"],
            "estimate_gib": gib(estimate.total), "xla_peak_gib": gib(peak),
            "ratio": round(estimate.total / peak, 3), "logits_gib": gib(estimate.logits),
            "activations_gib": gib(estimate.activations),
            "backend": jax.default_backend(), "jax": jax.__version__}


def main(argv: list[str]) -> None:
    cases = flags.FLAGS.cases
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise errors.ConfigError(f"--cases: unknown {unknown}; expected some of {list(CASES)}")
    for name in cases:
        print(json.dumps(run_case(name)), flush=True)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
