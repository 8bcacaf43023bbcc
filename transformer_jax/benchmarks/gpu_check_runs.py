"""Steps 4-6 of ``gpu_check``: the model on the device.

  4. the preflight (``preflight.py``) of configs/wmt14_en_de_base.py in bfloat16, fused and dense: step
     time, non-pad target tokens/s, MFU, compiled memory.
  5. a short real run: the paper's base model on Multi30k (prepared beforehand into ``--multi30k_dir``)
     in bfloat16 with fused attention, through the training loop for ``--train_minutes`` after its first
     logged steps (then stopped as a preemption stops a run: a checkpoint is saved), its loss going down;
     then the test set decoded greedily and with the config's beam, and scored, through evaluate.py's code.
  6. the projection of configs/wmt14_en_de_base.py's ``train.num_steps`` on this device from step 4,
     beside the paper's 12 hours on 8 P100s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

from transformer_jax.benchmarks.gpu_check_steps import (
    GB,
    NOT_RUN,
    NotRun,
    Options,
    Row,
    StepFailed,
    need_accelerator,
)
from transformer_jax.runtime import errors

# Step 4 ------------------------------------------------------------------------------------------------

# --quick: the preflight's run on a tiny model of the default config.
QUICK_PREFLIGHT = ["--config.data.vocab_size=120", "--config.data.tokens_per_batch=256",
                   "--config.data.length_buckets=(8,16)", "--config.data.max_len=16",
                   "--config.model.d_model=32", "--config.model.d_ff=64",
                   "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
                   "--config.model.num_decoder_layers=1", "--config.train.num_steps=100000"]


def _preflight_run(options: Options, impl: str):
    from transformer_jax import run_config

    overrides = [f"--config.model.attention_impl={impl}", "--config.model.dtype=bfloat16",
                 "--config.platform=any"]
    if options.quick:
        config, _ = run_config.load_config(options.config_path("default.py"), QUICK_PREFLIGHT + overrides)
    else:
        config, _ = run_config.load_config(options.config_path("wmt14_en_de_base.py"), overrides)
    return run_config.build_run_config(config, environment=False)


def step_preflight(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax.benchmarks import preflight

    need_accelerator(options, earlier)
    pf_options = preflight.Options(repeats=2 if options.quick else 5, peak_repeats=1 if options.quick else 10)
    details, parts, failed = {}, [], []
    for impl in ("fused", "dense"):
        lines = []
        try:
            record = preflight.preflight(_preflight_run(options, impl), pf_options, say=_collect(lines))
        except Exception as e:  # one kernel failing still leaves the other's numbers
            details[impl] = {"error": errors.short_error(e), "lines": lines}
            failed.append(f"{impl}: {errors.short_error(e, 200)}")
            continue
        details[impl] = {**record, "lines": lines}
        compiled = record.get("compiled_bytes")
        parts.append(f"{impl} {record['step_seconds']:.3g} s/step, {record['tokens_per_second']:,.0f} tok/s, "
                     f"MFU {record['mfu']:.1%}" + (f", {compiled / GB:.2f} GB" if compiled else ""))
    first = next((details[i] for i in ("fused", "dense") if "step_seconds" in details[i]), None)
    shape = (f" (batch of {first['grad_accum_steps']} x {first['micro_rows']} rows at the "
             f"{first['length']}-token bucket, peak {first['peak_tflops']:.3g} TFLOP/s)") if first else ""
    summary = "; ".join(parts) + shape
    if failed:
        raise StepFailed("; ".join(failed) + (f" [{summary}]" if parts else ""), details)
    return summary, details


def _collect(lines: list[str]) -> Callable[[str], None]:
    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    return say


# Step 5 ------------------------------------------------------------------------------------------------

# The paper's base model on Multi30k, in bfloat16 with fused attention; stopped --train_minutes after its
# first logged steps. Two length buckets: two train programs to compile, and few decoding ones.
BASE_ON_MULTI30K = ["--config.data.length_buckets=(32,64)", "--config.data.tokens_per_batch=8192",
                    "--config.model.d_model=512", "--config.model.d_ff=2048", "--config.model.num_heads=8",
                    "--config.model.num_encoder_layers=6", "--config.model.num_decoder_layers=6",
                    "--config.model.dropout_rate=0.1", "--config.train.num_steps=100000",
                    "--config.train.warmup_steps=800", "--config.train.cooldown_steps=0",
                    "--config.train.learning_rate_scale=1.0", "--config.log_every_steps=50"]
# --quick: a tiny model on the synthetic task for 30 steps.
QUICK_TRAIN = ["--config.data.synthetic_train_size=400", "--config.data.synthetic_dev_size=16",
               "--config.data.synthetic_test_size=16", "--config.data.vocab_size=120",
               "--config.data.tokens_per_batch=512", "--config.data.length_buckets=(32,)",
               "--config.data.max_len=32", "--config.data.synthetic_max_words=12",
               "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
               "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
               "--config.train.num_steps=30", "--config.train.warmup_steps=5", "--config.log_every_steps=10",
               "--config.final_beam_size=2", "--config.peak_tflops_per_device=1.0"]
COMMON_TRAIN = ["--config.model.dtype=bfloat16", "--config.model.attention_impl=fused",
                "--config.platform=any",
                "--config.eval_every_steps=0", "--config.eval_bleu_examples=0", "--config.final_eval_split=",
                "--config.checkpoint_every_steps=0", "--config.checkpoint_every_minutes=0",
                "--config.final_average_last=1"]


def _train_config(options: Options, workdir: str):
    from transformer_jax import run_config

    cache = [f"--config.data.cache_dir={os.path.join(os.path.abspath(options.out), 'data_cache')}"]
    if options.quick:
        return run_config.load_config(options.config_path("default.py"), QUICK_TRAIN + COMMON_TRAIN)[0]
    folder = os.path.abspath(options.multi30k_dir)
    if not all(os.path.isfile(os.path.join(folder, f"{split}.{lang}"))
               for split in ("train", "val", "test") for lang in ("en", "de")):
        raise StepFailed(f"no Multi30k in --multi30k_dir={options.multi30k_dir} (train/val/test .en/.de): "
                         "prepare it before going offline: python -m transformer_jax.data.prepare multi30k "
                         f"--dir={options.multi30k_dir}")
    overrides = [f"--config.data.dir={folder}"] + cache + BASE_ON_MULTI30K + COMMON_TRAIN
    return run_config.load_config(options.config_path("multi30k.py"), overrides)[0]


@contextlib.contextmanager
def _stop_after(seconds: float | None, started: Callable[[], bool]):
    """Sends this process SIGTERM ``seconds`` after ``started()`` turns true (polled each second): the
    training loop then saves a checkpoint and stops, as when a cluster preempts it."""
    done = threading.Event()

    def countdown():
        while not done.wait(1.0) and not started():
            pass
        if not done.wait(seconds):
            os.kill(os.getpid(), signal.SIGTERM)

    if seconds:
        threading.Thread(target=countdown, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _losses(workdir: str) -> list[tuple[int, float]]:
    rows = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if "train_loss" in row:
                    rows.append((row["step"], row["train_loss"]))
    return rows


def step_train(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax import run_config
    from transformer_jax.evaluation import workdir_scoring
    from transformer_jax.training import loop

    need_accelerator(options, earlier)
    workdir = os.path.join(os.path.abspath(options.out), "train")
    config = _train_config(options, workdir)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run each time
    run = run_config.build_run_config(config)
    started = time.time()
    with _stop_after(None if options.quick else 60 * options.train_minutes, lambda: bool(_losses(workdir))):
        final = loop.train_and_evaluate(run, workdir)
    train_seconds = time.time() - started
    losses = _losses(workdir)
    details = {"workdir": workdir, "steps": final.get("step"), "train_seconds": train_seconds,
               "losses": losses, "model": dataclasses.asdict(run.model)}
    if not final.get("step"):
        raise StepFailed(f"no training step finished in {train_seconds:.0f} s (see the log)", details)
    scores = {}
    for name, beam in (("greedy", 1), ("beam", None)):  # None: the config's final_beam_size and alpha
        result = workdir_scoring.evaluate_workdir(workdir, split="test", beam_size=beam, average_last=0,
                                                  output_dir=os.path.join(workdir, f"eval-{name}"),
                                                  overwrite=True)
        scores[name] = {k: result.get(k) for k in ("sacrebleu", "multi30k_bleu", "tokenized_bleu", "ppl",
                                                   "beam_size", "alpha")}
    details["test"] = scores
    beam_size = run.eval.final_beam_size
    first, last = (losses[0], losses[-1]) if losses else ((0, float("nan")), (0, float("nan")))
    summary = (f"{final['step']:,} steps in {train_seconds:.0f} s ({run.model.d_model}-wide, "
               f"{run.model.num_encoder_layers}+{run.model.num_decoder_layers} layers): loss "
               f"{first[1]:.3g} at step {first[0]} -> {last[1]:.3g} at step {last[0]}; test BLEU greedy "
               f"{scores['greedy']['sacrebleu']:.1f}, beam {beam_size} {scores['beam']['sacrebleu']:.1f} "
               f"(sacreBLEU), test PPL {scores['greedy']['ppl']:.3g}")
    if len(losses) < 2 or not last[1] < first[1]:
        raise StepFailed(f"the training loss did not go down: {summary}", details)
    return summary, details


# Step 6 ------------------------------------------------------------------------------------------------


def step_projection(options: Options, earlier: dict[str, Row]) -> tuple[str, dict]:
    from transformer_jax import run_config
    from transformer_jax.data.batching import bucket_batch_sizes
    from transformer_jax.evaluation import paper
    from transformer_jax.model import flops

    need_accelerator(options, earlier)
    measured = earlier.get("preflight", Row(0, "preflight", NOT_RUN, "")).details
    impl = next((i for i in ("fused", "dense") if "step_seconds" in measured.get(i, {})), None)
    if impl is None:
        raise NotRun("it projects step 4's measured step, and step 4 measured none")
    config, _ = run_config.load_config(options.config_path("wmt14_en_de_base.py"), ["--config.platform=any"])
    run = run_config.build_run_config(config, environment=False)
    paper_hours, hardware = paper.TRAINING_HOURS["base"], paper.TRAINING_HARDWARE
    record = measured[impl]
    count = record["device_count"]
    if options.quick:  # step 4 measured a tiny model: scale the base model's FLOPs by its FLOP/s
        length = sorted(run.data.length_buckets)[len(run.data.length_buckets) // 2]
        rows = bucket_batch_sizes([length], run.data.tokens_per_batch, 1)[0]
        achieved = record["mfu"] * record["peak_tflops"] * 1e12 * count
        step_seconds = flops.train_step_flops(run.model, rows, length, length) / achieved
        how = f"estimated from the tiny model's {achieved / 1e12:.3g} TFLOP/s ({impl})"
    else:
        step_seconds = record["step_seconds"]
        how = f"measured: {impl} attention, {step_seconds:.3g} s a step"
    hours = step_seconds * run.train.num_steps / 3600
    details = {"num_steps": run.train.num_steps, "attention_impl": impl, "step_seconds": step_seconds,
               "hours": hours, "device_count": count, "paper_hours": paper_hours, "paper_hardware": hardware,
               "paper_step_seconds": paper.STEP_SECONDS["base"], "quick": options.quick}
    for other in ("fused", "dense"):
        if other != impl and "projected_hours" in measured.get(other, {}) and not options.quick:
            details[f"hours_{other}"] = measured[other]["projected_hours"]
    from transformer_jax.benchmarks.preflight import duration

    summary = (f"{run.train.num_steps:,} steps of {config.name}: {duration(hours * 3600)} on {count} "
               f"device(s) ({how}); the paper: {duration(paper_hours * 3600)} on {hardware} "
               f"({paper.STEP_SECONDS['base']} s a step); x{paper_hours / hours:.2g} the paper's speed")
    return summary, details
