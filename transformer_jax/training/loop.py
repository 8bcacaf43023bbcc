"""The training loop of section 5: build once, train (resuming), evaluate, checkpoint.

Data flow: a RunConfig (``run_config.build_run_config``: the config file read once, validated) ->
``setup`` (tokenizer, ModelConfig, the one schedule and optimizer, data iterator, the TrainState sharded
over the mesh, the compiled step from ``steps.make_train_step``) -> ``train_loop``, which carries the
state explicitly (``state, sums = trainer.train_step(state, batch)``) and logs, evaluates and
checkpoints every N steps -> the final dev and test evaluation. What is evaluated, and how, is the
run's task (``evaluation.tasks``: translation or parsing), chosen once in ``setup``.

The loss and the pure steps are in ``steps.py``; the state and optimizer in ``train_state.py``. Each start
appends where it ran to ``<workdir>/provenance.json`` (``runtime.provenance``), which ``final.json`` carries.

Faults: before anything is built, a workdir with checkpoints must hold the same model config and tokenizer
(``restore.check_workdir``). A non-finite loss, or a state with NaN/inf about to be saved, stops the run
naming the step and the last checkpoint that exists; any exception first waits for a save in flight. One
PreemptionGuard covers every phase (see ``preemption.py``): SIGTERM / SIGINT exit 0 with a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from transformer_jax import data as data_lib
from transformer_jax.checkpoints import restore
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.integrity import NonFiniteStateError
from transformer_jax.checkpoints.manager import Checkpointer
from transformer_jax.evaluation import paper_tables, scoring
from transformer_jax.evaluation.tasks import Task, task_for
from transformer_jax.model import flops, loss
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID
from transformer_jax.run_config import RunConfig
from transformer_jax.runtime import errors, provenance, sharding, timing
from transformer_jax.training import memory, steps
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

    run: RunConfig  # its ``model`` has the tokenizer's vocab_size
    workdir: str
    mesh: jax.sharding.Mesh
    rules: tuple
    tokenizer: data_lib.Tokenizer
    task: Task  # translation or parsing: the dev evaluation and the final report
    tx: optax.GradientTransformation
    schedule: Callable  # optimizer step (from 0) -> learning rate
    state_sharding: Any
    train_step: steps.TrainStepFn  # (state, global batch) -> (state, metric sums); donates the state
    peak_flops: float  # per device: loop.peak_tflops_per_device, or the matmul peak measured at start-up
    measured_peak: timing.Peak | None  # the peak measured at start-up; None when the config set peak_flops
    dev_batches: list  # the whole dev split: perplexity
    dev_decode_batches: list  # its first eval.eval_bleu_examples: the periodic greedy BLEU (or F1)
    final_batches: list  # eval.final_eval_split, scored after training

    @property
    def model_config(self) -> ModelConfig:
        return self.run.model


def _eval_batches(run: RunConfig, tokenizer: data_lib.Tokenizer) -> tuple[list, list, list]:
    """``Trainer``'s dev, dev-decode and final batches, read at start-up so that an example the model
    cannot take (DataError naming its file and line) stops the run before anything compiles.

    Multi-process runs evaluate nothing (``evaluate.py`` scores them): three empty lists.
    """
    if jax.process_count() > 1:
        return [], [], []
    # Only a learned position table bounds a length (None: any); dev and test keep every pair whatever
    # data.max_len, which drops train pairs only.
    max_len, ev = run.model.position_limit, run.eval
    decodable = {"max_length": max_len,
                 "max_source_length": None if max_len is None else max_len - ev.final_max_extra_len}
    dev = data_lib.make_eval_batches(run.data, tokenizer, "dev", max_length=max_len)
    dev_decode = data_lib.make_eval_batches(run.data, tokenizer, "dev", max_examples=ev.eval_bleu_examples,
                                            **decodable) if ev.eval_bleu_examples else []
    final = data_lib.make_eval_batches(run.data, tokenizer, ev.final_eval_split,
                                       **decodable) if ev.final_eval_split else []
    return dev, dev_decode, final


def _shared_tokenizer(data_config, workdir: str) -> data_lib.Tokenizer:
    """The run's tokenizer; with several processes, process 0 trains it and the others then load it."""
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            data_lib.load_or_train_tokenizer(data_config, workdir)
        multihost_utils.sync_global_devices("tokenizer ready")
    return data_lib.load_or_train_tokenizer(data_config, workdir)


def setup(run: RunConfig, workdir: str) -> tuple[Trainer, TrainState, data_lib.TrainIterator]:
    """Builds the Trainer, the freshly initialized (sharded) TrainState and the training data iterator."""
    mesh = sharding.make_mesh(run.sharding.mesh_shape)
    rules = sharding.rules_from_config(run.sharding.logical_axis_rules)
    tokenizer = _shared_tokenizer(run.data, workdir)
    schedule = schedule_from_config(run.train, run.model.d_model)
    tx = make_optimizer(run.train, schedule)
    train_iter = data_lib.make_train_iterator(
        run.data, tokenizer, seed=run.seed, process_index=jax.process_index(),
        process_count=jax.process_count(),
        batch_multiple=mesh.shape["data"] * run.train.grad_accum_steps, cache_fallback=workdir)
    eval_batches = _eval_batches(run, tokenizer)
    state, state_sharding = create_train_state(run.model, tx, mesh, rules, seed=run.seed)
    train_step = steps.make_train_step(
        run.model, tx, mesh, rules, state_sharding, label_smoothing=run.train.label_smoothing,
        grad_accum_steps=run.train.grad_accum_steps, loss_chunk_tokens=run.train.loss_chunk_tokens)
    trainer = Trainer(run, workdir, mesh, rules, tokenizer, task_for(run.data), tx, schedule,
                      state_sharding, train_step, *_peak_flops(run.loop.peak_tflops_per_device),
                      *eval_batches)
    return trainer, state, train_iter


def _peak_flops(peak_tflops_per_device: float) -> tuple[float, timing.Peak | None]:
    """(the MFU denominator per device, the peak measured for it): the config's figure and None, or else
    this device's measured matmul peak."""
    if peak_tflops_per_device:
        return peak_tflops_per_device * 1e12, None
    peak = timing.matmul_peak(repeats=10)
    if jax.process_index() == 0:
        print(f"MFU is against this device's measured {peak.label} matmul peak ({peak.size}^3): "
              f"{peak.best_flops / 1e12:.3g} TFLOP/s (best of {peak.repeats}; median "
              f"{peak.median_flops / 1e12:.3g}); set config.peak_tflops_per_device to use another.")
    return peak.best_flops, peak


def evaluate_dev(trainer: Trainer, params) -> dict[str, float]:
    """Dev loss / PPL over the dev split and greedy BLEU on a sample of it.

    Runs in single-process jobs only; a multi-host job is scored afterwards by ``evaluate.py``.
    """
    if jax.process_count() > 1:
        return {}
    run = trainer.run
    metrics = scoring.perplexity(params, run.model, trainer.dev_batches,
                                 label_smoothing=run.train.label_smoothing)
    results = {f"dev_{k}": v for k, v in metrics.items()}
    if run.eval.eval_bleu_examples:
        results.update(trainer.task.dev_scores(params, run.model, trainer.tokenizer, run.data, run.eval,
                                               trainer.dev_decode_batches))
    return results


def resume(ckpt: Checkpointer, state: TrainState, train_iter: data_lib.TrainIterator) -> TrainState:
    """The newest good checkpoint's state (laid out like ``state``), if any; also rewinds the data."""
    if ckpt.reader.latest_step() is None:
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
    run, mesh = trainer.run, trainer.mesh
    num_steps, step = run.train.num_steps, int(jax.device_get(state.step))
    profile_start = run.loop.profile_start_step  # 0: no profile
    profile_stop = profile_start + run.loop.profile_num_steps
    eval_every = run.eval.eval_every_steps
    sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
    preempted = profiling = mfu_explained = False
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
            try:
                state, step_sums = trainer.train_step(state, sharding.global_batch(local, mesh))
            except jax.errors.JaxRuntimeError as e:  # out of memory compiling or running it: one line
                if memory.is_out_of_memory(e):
                    raise memory.out_of_memory_error(
                        run, local["inputs"].shape[0] * jax.process_count(), local["inputs"].shape[1],
                        local["targets"].shape[1], e) from e
                raise
            step += 1
            sums = loss.accumulate_metrics(sums, step_sums)
            (batch, src_len), tgt_len = local["inputs"].shape, local["targets"].shape[1]
            interval_flops += flops.train_step_flops(
                trainer.model_config, batch * jax.process_count(), src_len, tgt_len)
            interval_tokens += int(np.count_nonzero(local["targets"] != PAD_ID)) * jax.process_count()
            if profiling and step == profile_stop:
                jax.profiler.stop_trace()
                profiling = False
            if step % run.loop.log_every_steps == 0 or step == num_steps:
                summary = _check_and_summarize(sums, ckpt)
                elapsed = time.time() - interval_start
                summary.update(
                    learning_rate=float(trainer.schedule(step - 1)),
                    tokens_per_sec=interval_tokens / elapsed,
                    mfu=interval_flops / elapsed / jax.device_count() / trainer.peak_flops,
                    peak_tflops=trainer.peak_flops / 1e12,
                    steps_per_sec=(step - writer.last_step) / elapsed)
                writer.write(step, {f"train_{k}": v for k, v in summary.items()})
                if summary["mfu"] > 1 and not mfu_explained:
                    _say(jax.process_index() == 0, _mfu_above_one(summary["mfu"], trainer))
                    mfu_explained = True
                sums, interval_flops, interval_tokens, interval_start = None, 0.0, 0, time.time()
            if eval_every and step % eval_every == 0 and step < num_steps:
                writer.write(step, evaluate_dev(trainer, state.params))
                interval_start = time.time()
            preempted = guard.should_stop(step)
            scheduled = ckpt.should_save(step) or step == num_steps
            if preempted or scheduled:
                if sums is not None:
                    _check_and_summarize(dict(sums), ckpt)  # never save a non-finite state
                # A save forced off the schedule is marked: it is kept to resume from, not averaged.
                ckpt.save(step, state, data_state=train_iter.get_state(), config=dict(run.saved),
                          force=True, metadata=metadata, preemption=not scheduled)
    if profiling:  # the run ended inside the profiled range
        jax.profiler.stop_trace()
    return state, step, preempted


def train_and_evaluate(run: RunConfig, workdir: str) -> dict[str, Any]:
    """Trains (resuming from ``workdir`` if it holds checkpoints), evaluates, and returns final metrics.

    ``run`` comes from ``run_config.build_run_config``, which checked the whole config and every input
    file before anything is built.

    SIGTERM / SIGINT from here on end the run cleanly in every phase (exit 0 from train.py): see
    ``preemption.py``. The returned dict then holds ``{"preempted": True, "step": ...}``.

    On a CPU, a host that cannot hold the largest train step stops the run first, in one line
    (``memory.check_host_memory``), before a workdir, a tokenizer or the data is made.
    """
    memory.check_host_memory(run)
    created = not os.path.isdir(workdir)
    with PreemptionGuard() as guard:
        os.makedirs(workdir, exist_ok=True)
        try:
            with WorkdirLock(workdir, enabled=jax.process_index() == 0):
                return _train_locked(run, workdir, guard)
        except Exception:
            if created and jax.process_index() == 0:
                _remove_empty_folders(workdir)  # a run that failed before writing a file leaves no folder
            raise


def _remove_empty_folders(top: str) -> None:
    """Removes ``top`` and the folders under it that hold no file; a folder with a file stays."""
    for folder, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):  # not empty
            os.rmdir(folder)


def _train_locked(run: RunConfig, workdir: str, guard: PreemptionGuard) -> dict[str, Any]:
    started = time.time()
    is_main = jax.process_index() == 0
    policy = run.checkpoint
    if not restore.has_checkpoints(workdir):  # fresh: the tokenizer and its corpus checks come first, so a
        _shared_tokenizer(run.data, workdir)  # vocab_size the corpus cannot fill leaves no checkpoints/
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                        save_every_steps=policy.checkpoint_every_steps or None,
                        save_every_minutes=policy.checkpoint_every_minutes or None,
                        max_to_keep=policy.checkpoint_keep)
    # ``with ckpt``: on any exception, a save in flight is finished before the process exits.
    with ckpt:
        restore.check_workdir(ckpt.reader, run, workdir)  # same model and tokenizer, before anything compiles
        trainer, state, train_iter = setup(run, workdir)
        history = _record_provenance(run, trainer, workdir) if is_main else None
        state = resume(ckpt, state, train_iter)
        step = int(jax.device_get(state.step))
        final_path = os.path.join(workdir, "final.json")
        if is_main and step < run.train.num_steps and os.path.exists(final_path):
            os.remove(final_path)  # it described a shorter run; it is written again at the end
        writer = MetricWriter(workdir, enabled=is_main, total_steps=run.train.num_steps,
                              initial_step=step)
        with contextlib.closing(writer):
            if guard.should_stop(step):  # the signal came during setup: nothing new to save
                _say(is_main, f"Stopped by {guard.signal_name} during setup, before step {step + 1}; "
                     f"nothing new to save. {ckpt.last_good_message()} Run the same command again to "
                     "resume.")
                return {"preempted": True, "step": step}
            if is_main:
                _say(is_main, f"Model: {sum(x.size for x in jax.tree.leaves(state.params)):,} parameters; "
                     f"mesh {dict(trainer.mesh.shape)}; {jax.device_count()} devices, "
                     f"{jax.process_count()} processes")
                _say(is_main, "Memory: the largest train step needs about "
                     f"{memory.largest_step_memory(run).describe()} (estimated)")
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
        final["provenance"] = history
        with open(f"{final_path}.tmp", "w") as f:  # whole or absent: Slurm scripts read it as "done"
            json.dump(final, f, indent=1, default=str)
        os.replace(f"{final_path}.tmp", final_path)
        if run.eval.final_eval_split and jax.process_count() == 1:
            print(paper_tables.final_summary(final, run.data, run.eval))
            print(f"Ran on {provenance.describe(history)}")
        elif jax.process_count() > 1:
            print(f"Trained with {jax.process_count()} processes; score the result with one: "
                  f"python evaluate.py --workdir={workdir}")
        print(f"All final numbers: {final_path}")
    return final


def _record_provenance(run: RunConfig, trainer: Trainer, workdir: str) -> dict[str, Any]:
    """Appends this start to ``<workdir>/provenance.json`` (the first start's record is kept whole);
    returns the whole history, which ``final.json`` carries."""
    record = provenance.collect(config=run.saved, peak=trainer.measured_peak,
                                peak_missing="config.peak_tflops_per_device set the MFU denominator")
    return provenance.record_start(workdir, record)


def _final_evaluation(trainer: Trainer, state: TrainState, step: int, started: float,
                      ckpt: Checkpointer) -> dict[str, Any]:
    """Dev metrics and the report on ``config.final_eval_split`` (single-process runs) of the final model.

    The final model is the final state's parameters, or with ``eval.final_average_last`` N > 1 the
    mean of the newest N scheduled checkpoints (the paper averages the last 5 or 20; fewer are averaged,
    and the count reported, when the run saved fewer). A save forced by a preemption is not averaged, so
    a run stopped and resumed averages what an uninterrupted one does, as evaluate.py does.
    """
    run = trainer.run
    final = {"step": step, "train_seconds": time.time() - started}
    params = state.params
    saved = ckpt.averageable_steps(step)
    if run.eval.final_average_last > 1 and len(saved) > 1:
        chosen = saved[-run.eval.final_average_last:]
        params = average_checkpoints(ckpt.directory, abstract_state(state), chosen)
        final["averaged_checkpoints"] = len(chosen)
        final["averaged_steps"] = chosen
    with jax.set_mesh(trainer.mesh), nn.logical_axis_rules(trainer.rules):
        final.update(evaluate_dev(trainer, params))
    split = run.eval.final_eval_split
    if split and jax.process_count() == 1:
        final[f"{split}_ppl"] = scoring.perplexity(params, run.model, trainer.final_batches)["ppl"]
        report = trainer.task.final_report(params, run.model, trainer.tokenizer, run.data, run.eval,
                                           trainer.final_batches, split=split, run_name=run.name)
        final = merge_final_report(final, report)
    return final


def merge_final_report(final: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``final`` updated with the final report's numbers. On the dev split the report (the final search)
    and the dev scores of the last evaluation (greedy) share names: those are kept as ``<name>_greedy``."""
    return {**final, **{f"{key}_greedy": final[key] for key in report if key in final}, **report}


def _mfu_above_one(mfu: float, trainer: Trainer) -> str:
    """Why the MFU reads above 1 (its denominator is below what the step did), and how to set it."""
    configured = trainer.run.loop.peak_tflops_per_device
    measured = f"{trainer.peak_flops / 1e12:.3g} TFLOP/s"
    why = (f"config.peak_tflops_per_device={configured:g} is below what the train step did" if configured
           else f"the matmul peak measured at start-up ({measured}) is below what the train step did, as "
                "when other work shared the machine while it was measured")
    return (f"MFU {mfu:.2f} is above 1: {why}. Set config.peak_tflops_per_device to this device's peak "
            "(TFLOP/s; python -m transformer_jax.benchmarks measures it, on a quiet machine) for a true MFU.")


def _say(is_main: bool, message: str) -> None:
    """``message`` on stdout from process 0, on a line of its own below the progress bar."""
    if is_main:
        errors.print_line(message)


def _check_and_summarize(sums: dict, ckpt: Checkpointer) -> dict[str, float]:
    """Host sync: raises on a non-finite loss (naming the step), else returns per-token metrics."""
    bad_step = int(jax.device_get(sums["bad_step"]))
    if bad_step != steps.NO_BAD_STEP:
        raise NonFiniteStateError(
            f"non-finite training loss at step {bad_step}; stopping. {ckpt.last_good_message()} Lower the "
            "learning rate (train.learning_rate_scale) or check the data, then run again to resume from it.")
    return loss.summarize({k: v for k, v in sums.items() if k != "bad_step"})
