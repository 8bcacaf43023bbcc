"""The training loop of section 5: build once, train (resuming), evaluate, checkpoint.

Data flow: config -> ``validate_config`` -> ``setup`` (tokenizer, ModelConfig, optimizer, data iterator,
the TrainState sharded over the mesh, the compiled step from ``steps.make_train_step``) -> ``train_loop``,
which carries the state explicitly (``state, sums = trainer.train_step(state, batch)``) and logs,
evaluates and checkpoints every N steps -> the final dev and test evaluation.

The loss and the pure steps are in ``steps.py``; the state and optimizer in ``train_state.py``.

Faults: before anything is built, a workdir with checkpoints must hold the same model config and tokenizer
(``restore.check_workdir``). A non-finite loss, or a state with NaN/inf about to be saved, stops the run
naming the step and the last checkpoint that exists; any exception first waits for a save in flight. One
PreemptionGuard covers every phase (see ``preemption.py``): SIGTERM / SIGINT exit 0 with a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

from transformer_jax import data as data_lib
from transformer_jax.checkpoints import restore
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.integrity import NonFiniteStateError
from transformer_jax.checkpoints.manager import Checkpointer
from transformer_jax.evaluation import paper_tables, parsing, scoring
from transformer_jax.model import flops, loss
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.run_config import model_config_from, validate_config
from transformer_jax.runtime import sharding, timing
from transformer_jax.training import steps
from transformer_jax.training.metric_writer import MetricWriter
from transformer_jax.training.preemption import Preempted, PreemptionGuard
from transformer_jax.training.train_state import (
    TrainState,
    abstract_state,
    create_train_state,
    make_optimizer,
    schedule_from_config,
)
from transformer_jax.training.workdir_lock import WorkdirLock


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What the loop needs, built once from the config by ``setup``. It holds no training state."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: jax.sharding.Mesh
    rules: tuple
    tokenizer: data_lib.Tokenizer
    model_config: ModelConfig
    tx: optax.GradientTransformation
    schedule: Callable  # optimizer step (from 0) -> learning rate
    state_sharding: Any
    train_step: steps.TrainStepFn  # (state, global batch) -> (state, metric sums); donates the state
    peak_flops: float  # per device: config.peak_tflops_per_device, or the matmul peak measured at start-up

    @functools.cached_property
    def dev_batches(self) -> list:
        """The whole dev split, read and tokenized once per run."""
        return data_lib.make_eval_batches(self.config.data, self.tokenizer, "dev")

    @functools.cached_property
    def dev_bleu_batches(self) -> list:
        """The dev sentences decoded for the periodic BLEU."""
        return data_lib.make_eval_batches(self.config.data, self.tokenizer, "dev",
                                          max_examples=self.config.eval_bleu_examples)


def _shared_tokenizer(data_config, workdir: str) -> data_lib.Tokenizer:
    """The run's tokenizer; with several processes, process 0 trains it and the others then load it."""
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            data_lib.load_or_train_tokenizer(data_config, workdir)
        multihost_utils.sync_global_devices("tokenizer ready")
    return data_lib.load_or_train_tokenizer(data_config, workdir)


def setup(config: ml_collections.ConfigDict,
          workdir: str) -> tuple[Trainer, TrainState, data_lib.TrainIterator]:
    """Builds the Trainer, the freshly initialized (sharded) TrainState and the training data iterator."""
    mesh = sharding.make_mesh(config.sharding.mesh_shape)
    rules = sharding.rules_from_config(config.sharding.logical_axis_rules)
    tokenizer = _shared_tokenizer(config.data, workdir)
    model_config = model_config_from(config, tokenizer.vocab_size)
    tx = make_optimizer(config, model_config.d_model)
    train_iter = data_lib.make_train_iterator(
        config.data, tokenizer, seed=config.seed, process_index=jax.process_index(),
        process_count=jax.process_count(),
        batch_multiple=mesh.shape["data"] * config.train.grad_accum_steps)
    state, state_sharding = create_train_state(model_config, tx, mesh, rules, seed=config.seed)
    train_step = steps.make_train_step(
        model_config, tx, mesh, rules, state_sharding, label_smoothing=config.train.label_smoothing,
        grad_accum_steps=config.train.grad_accum_steps)
    schedule = schedule_from_config(config, model_config.d_model)
    trainer = Trainer(config, workdir, mesh, rules, tokenizer, model_config, tx, schedule,
                      state_sharding, train_step, _peak_flops(config))
    return trainer, state, train_iter


def _peak_flops(config: ml_collections.ConfigDict) -> float:
    """The MFU denominator per device: the config's figure, or else this device's measured matmul peak."""
    if config.peak_tflops_per_device:
        return config.peak_tflops_per_device * 1e12
    peak = timing.matmul_peak(repeats=10)
    if jax.process_index() == 0:
        print(f"MFU is against this device's measured {peak.dtype} matmul peak: "
              f"{peak.best_flops / 1e12:.3g} TFLOP/s (best of {peak.repeats}; median "
              f"{peak.median_flops / 1e12:.3g}); set config.peak_tflops_per_device to use another.")
    return peak.best_flops


def evaluate_dev(trainer: Trainer, params) -> dict[str, float]:
    """Dev loss / PPL over the dev split and greedy BLEU on a sample of it.

    Runs in single-process jobs only; a multi-host job is scored afterwards by ``evaluate.py``.
    """
    if jax.process_count() > 1:
        return {}
    config = trainer.config
    metrics = scoring.perplexity(params, trainer.model_config, trainer.dev_batches,
                                    label_smoothing=config.train.label_smoothing)
    results = {f"dev_{k}": v for k, v in metrics.items()}
    if config.eval_bleu_examples and data_lib.is_parsing(config.data):  # greedy dev F1, not BLEU
        results.update(parsing.dev_scores(
            params, trainer.model_config, trainer.tokenizer, config.data, trainer.dev_bleu_batches,
            max_extra_len=config.final_max_extra_len))
    elif config.eval_bleu_examples:
        scores = scoring.translate_and_score(
            params, trainer.model_config, trainer.tokenizer, trainer.dev_bleu_batches,
            beam_size=1, max_extra_len=config.final_max_extra_len, target_lang=config.data.tgt_lang)
        results["dev_bleu"] = scores[scoring.BLEU_KEYS[config.dev_bleu_protocol]]
    return results


def resume(ckpt: Checkpointer, state: TrainState, train_iter: data_lib.TrainIterator) -> TrainState:
    """The newest good checkpoint's state (laid out like ``state``), if any; also rewinds the data."""
    if ckpt.latest_step() is None:
        return state
    state, data_state, _, step = ckpt.restore(abstract_state(state))
    train_iter.set_state(data_state)
    logging.info("Resumed from %s at step %d", ckpt.directory, step)
    if jax.process_index() == 0:
        print(f"Resuming from step {step} in {os.path.dirname(ckpt.directory)}")
    return state


def train_loop(trainer: Trainer, state: TrainState, train_iter: data_lib.TrainIterator,
               ckpt: Checkpointer, writer: MetricWriter,
               guard: PreemptionGuard | None = None) -> tuple[TrainState, int, bool]:
    """Trains from ``state.step`` to ``config.train.num_steps``; returns (state, step, preempted).

    Logs every ``log_every_steps`` (the only host syncs), evaluates on dev every ``eval_every_steps`` and
    saves when the Checkpointer says so, at the end, and on SIGTERM / SIGINT (then stops early). Each save
    first checks the state for NaN/inf on the device (NonFiniteStateError: nothing saved, the run stops).
    """
    config, mesh = trainer.config, trainer.mesh
    num_steps, step = config.train.num_steps, int(jax.device_get(state.step))
    profile_start = config.profile_start_step  # 0: no profile
    profile_stop = profile_start + config.profile_num_steps
    config_dict = json.loads(config.to_json_best_effort())
    sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
    preempted = profiling = False
    metadata = {"tokenizer_sha256": trainer.tokenizer.sha256}
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(nn.logical_axis_rules(trainer.rules))
        guard = guard or stack.enter_context(PreemptionGuard())
        while step < num_steps and not preempted:
            if profile_start and step == profile_start:
                jax.profiler.start_trace(os.path.join(trainer.workdir, "profile"))
                profiling = True
            local = next(train_iter)
            state, step_sums = trainer.train_step(state, sharding.global_batch(local, mesh))
            step += 1
            sums = loss.accumulate_metrics(sums, step_sums)
            (batch, src_len), tgt_len = local["inputs"].shape, local["targets"].shape[1]
            interval_flops += flops.train_step_flops(
                trainer.model_config, batch * jax.process_count(), src_len, tgt_len)
            interval_tokens += int(np.count_nonzero(local["targets"] != PAD_ID)) * jax.process_count()
            if profiling and step == profile_stop:
                jax.profiler.stop_trace()
                profiling = False
            if step % config.log_every_steps == 0 or step == num_steps:
                summary = _check_and_summarize(sums, ckpt)
                elapsed = time.time() - interval_start
                summary.update(
                    learning_rate=float(trainer.schedule(step - 1)),
                    tokens_per_sec=interval_tokens / elapsed,
                    mfu=interval_flops / elapsed / jax.device_count() / trainer.peak_flops,
                    peak_tflops=trainer.peak_flops / 1e12,
                    steps_per_sec=(step - writer.last_step) / elapsed)
                writer.write(step, {f"train_{k}": v for k, v in summary.items()})
                sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
            if config.eval_every_steps and step % config.eval_every_steps == 0 and step < num_steps:
                writer.write(step, evaluate_dev(trainer, state.params))
                interval_start = time.time()
            preempted = guard.should_stop(step)
            if preempted or ckpt.should_save(step) or step == num_steps:
                if sums is not None:
                    _check_and_summarize(dict(sums), ckpt)  # never save a non-finite state
                ckpt.save(step, state, data_state=train_iter.get_state(), config=config_dict,
                          force=preempted or step == num_steps, metadata=metadata)
    if profiling:  # the run ended inside the profiled range
        jax.profiler.stop_trace()
    return state, step, preempted


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (resuming from ``workdir`` if it holds checkpoints), evaluates, and returns final metrics.

    SIGTERM / SIGINT from here on end the run cleanly in every phase (exit 0 from train.py): see
    ``preemption.py``. The returned dict then holds ``{"preempted": True, "step": ...}``.
    """
    with PreemptionGuard() as guard:
        validate_config(config)
        os.makedirs(workdir, exist_ok=True)
        with WorkdirLock(workdir, enabled=jax.process_index() == 0):
            return _train_locked(config, workdir, guard)


def _train_locked(config: ml_collections.ConfigDict, workdir: str, guard: PreemptionGuard) -> dict[str, Any]:
    started = time.time()
    is_main = jax.process_index() == 0
    if not restore.has_checkpoints(workdir):  # fresh: the tokenizer and its corpus checks come first, so a
        _shared_tokenizer(config.data, workdir)  # vocab_size the corpus cannot fill leaves no checkpoints/
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                        save_every_steps=config.checkpoint_every_steps or None,
                        save_every_minutes=config.checkpoint_every_minutes or None,
                        max_to_keep=config.checkpoint_keep)
    # ``with ckpt``: on any exception, a save in flight is finished before the process exits.
    with ckpt:
        restore.check_workdir(ckpt, config, workdir)  # same model and tokenizer, before anything compiles
        trainer, state, train_iter = setup(config, workdir)
        state = resume(ckpt, state, train_iter)
        step = int(jax.device_get(state.step))
        writer = MetricWriter(workdir, enabled=is_main, total_steps=config.train.num_steps,
                              initial_step=step)
        with contextlib.closing(writer):
            if guard.should_stop(step):  # the signal came during setup: nothing new to save
                _say(is_main, f"Stopped by {guard.signal_name} during setup, before step {step + 1}; "
                     f"nothing new to save. {ckpt.last_good_message()} Run the same command again to "
                     "resume.")
                return {"preempted": True, "step": step}
            if is_main:
                print(f"Model: {sum(x.size for x in jax.tree.leaves(state.params)):,} parameters; "
                      f"mesh {dict(trainer.mesh.shape)}; {jax.device_count()} devices, "
                      f"{jax.process_count()} processes")
            state, step, preempted = train_loop(trainer, state, train_iter, ckpt, writer, guard)
            ckpt.wait()
            if preempted:
                _say(is_main, f"Preempted: saved a checkpoint at step {step} in {ckpt.directory}; "
                     f"run the same command again to resume.")
                return {"preempted": True, "step": step}
            try:
                with guard.interrupting() if jax.process_count() == 1 else contextlib.nullcontext():
                    final = _final_evaluation(trainer, state, step, started, ckpt)
            except Preempted:
                _say(is_main, f"Stopped by {guard.signal_name} during the final evaluation. Training is "
                     f"done and checkpoint step {step} is saved in {ckpt.directory}; score it with "
                     f"evaluate.py --workdir={workdir}, or run the same command again.")
                return {"preempted": True, "step": step}
            writer.write(step, {k: v for k, v in final.items() if isinstance(v, (int, float))})
    if is_main:
        path = os.path.join(workdir, "final.json")
        with open(path, "w") as f:
            json.dump(final, f, indent=1, default=str)
        if config.final_eval_split:
            print(paper_tables.final_summary(final, config))
        print(f"All final numbers: {path}")
    return final


def _final_evaluation(trainer: Trainer, state: TrainState, step: int, started: float,
                      ckpt: Checkpointer) -> dict[str, Any]:
    """Dev metrics and the report on ``config.final_eval_split`` (single-process runs) of the final model.

    The final model is the final state's parameters, or with ``config.final_average_last`` N > 1 the
    mean of the newest N checkpoints (the paper averages the last 5 or 20; fewer are averaged, and the
    count reported, when the run saved fewer).
    """
    config = trainer.config
    final = {"step": step, "train_seconds": time.time() - started}
    params = state.params
    saved = [s for s in ckpt.all_steps() if s <= step]
    if config.final_average_last > 1 and len(saved) > 1:
        chosen = saved[-config.final_average_last:]
        params = average_checkpoints(ckpt.directory, abstract_state(state), len(chosen), steps=chosen)
        final["averaged_checkpoints"] = len(chosen)
        final["averaged_steps"] = chosen
    with jax.set_mesh(trainer.mesh), nn.logical_axis_rules(trainer.rules):
        final.update(evaluate_dev(trainer, params))
    if config.final_eval_split and jax.process_count() == 1:
        final.update(scoring.final_report(
            params, trainer.model_config, trainer.tokenizer, config.data,
            split=config.final_eval_split, beam_size=config.final_beam_size, alpha=config.final_alpha,
            max_extra_len=config.final_max_extra_len))
    return final


def _say(is_main: bool, message: str) -> None:
    if is_main:
        print(message, flush=True)


def _check_and_summarize(sums: dict, ckpt: Checkpointer) -> dict[str, float]:
    """Host sync: raises on a non-finite loss (naming the step), else returns per-token metrics."""
    bad_step = int(jax.device_get(sums["bad_step"]))
    if bad_step != steps.NO_BAD_STEP:
        raise NonFiniteStateError(
            f"non-finite training loss at step {bad_step}; stopping. {ckpt.last_good_message()} Lower the "
            "learning rate (train.learning_rate_scale) or check the data, then run again to resume from it.")
    return loss.summarize({k: v for k, v in sums.items() if k != "bad_step"})
